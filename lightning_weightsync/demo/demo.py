"""`lightning-weightsync demo`: a real trainer and a real rollout daemon on one CPU machine, verified.

1. start `lightning-weightsync rollout` (module sink, the tiny LM from
   `lightning_weightsync.demo.tiny_lm:build_model`) as a subprocess;
2. run the tiny recipe as a subprocess: 2 CPU processes, FSDP2 over gloo, syncing after every
   optimizer step (plus version 0 at start) through a 32 KiB bucket, smaller than the 64 KiB
   embedding and LM head, so those are sent in chunks; it writes its final full weights;
3. print one row per version as the daemon recorded it (bytes, buckets, chunked tensors, seconds, GB/s);
4. stop the daemon with SIGTERM; it writes what its module holds (`--dump-on-exit`); compare that
   with the trainer's final weights: same names, dtypes, shapes and bytes, and the version the
   daemon holds is the trainer's last synced version. Exit code 1 if anything differs.

The comparison is between two files written by two different processes from their live tensors
(the rollout module's parameters, the trainer's gathered FSDP parameters), nothing shared.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..transport.process import free_port, process_group

BUCKET_MB = 0.03125  # 32 KiB
FACTORY = "lightning_weightsync.demo.tiny_lm:build_model"


@contextlib.contextmanager
def _process(cmd: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A subprocess in its own process group, output to `log`, always reaped (killed if still running)."""
    with open(log, "wb") as out, process_group(cmd, stdout=out, stderr=subprocess.STDOUT) as proc:
        yield proc


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"


def _read_stats(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _print_table(records: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="versions received by the rollout daemon", title_justify="left")
    for column in ("version", "bytes", "buckets", "chunked tensors", "seconds", "GB/s", "outcome"):
        table.add_column(column, justify="right")
    for r in records:
        table.add_row(
            str(r["version"]),
            f"{r['nbytes']:,}",
            str(r["num_buckets"]),
            str(r["num_chunked_tensors"]),
            f"{r['seconds']:.3f}",
            f"{r['bytes_per_second'] / 1e9:.3f}",
            r["outcome"] if r["ok"] else f"{r['outcome']}: {r['error']}",
        )
    Console(highlight=False).print(table)


def verify(held_path: Path, final_path: Path) -> tuple[bool, str]:
    """Bitwise comparison of the rollout's dump and the trainer's final weights."""
    import torch
    from safetensors import safe_open

    with safe_open(str(held_path), "pt") as f:
        held_meta = f.metadata() or {}
        held = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has keys(), not __iter__
    with safe_open(str(final_path), "pt") as f:
        final_meta = f.metadata() or {}
        final = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    problems = []
    if set(held) != set(final):
        problems.append(f"names differ: only rollout {sorted(set(held) - set(final))[:3]}, "
                        f"only trainer {sorted(set(final) - set(held))[:3]}")  # fmt: skip
    for name in sorted(set(held) & set(final)):
        a, b = held[name], final[name]
        if a.dtype != b.dtype or a.shape != b.shape:
            problems.append(f"{name}: rollout {a.dtype}{list(a.shape)} vs trainer {b.dtype}{list(b.shape)}")
        elif not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            problems.append(f"{name}: bytes differ")
    held_version = held_meta.get("version")
    synced = final_meta.get("last_synced_version")
    if held_version != synced:
        problems.append(f"rollout holds version {held_version}, trainer last synced version {synced}")
    if held_meta.get("state") != "complete":
        problems.append(f"rollout sink state is {held_meta.get('state')!r}, not 'complete'")
    if problems:
        return False, "; ".join(problems[:5])
    nbytes = sum(t.numel() * t.element_size() for t in final.values())
    return True, (
        f"rollout holds exactly the trainer's final weights: {len(final)} tensors, {nbytes:,} bytes, "
        f"bitwise equal (torch.equal on bytes, dtypes and shapes), version {held_version}"
    )


def run_demo(steps: int = 4, workdir: str | os.PathLike[str] | None = None, timeout_s: float = 240.0) -> int:
    """Run the demo; returns the process exit code (0 = verified)."""
    own_dir = workdir is None
    root = Path(tempfile.mkdtemp(prefix="lightning-weightsync-demo-")) if own_dir else Path(workdir)  # type: ignore[arg-type]
    root.mkdir(parents=True, exist_ok=True)
    stats, held, final = root / "versions.jsonl", root / "rollout_final.safetensors", root / "trainer_final.safetensors"
    for stale in (stats, held, final):
        stale.unlink(missing_ok=True)
    port = free_port()
    daemon_cmd, train_cmd = _commands(port, steps, root, stats, held, final)
    deadline = time.monotonic() + timeout_s
    started = time.monotonic()
    print(f"lightning-weightsync demo  (files in {root})")
    print(f"[1/4] rollout daemon: module sink ({FACTORY}), control port {port}, bucket {BUCKET_MB * 1024:g} KiB")
    records = _train_beside_the_daemon(daemon_cmd, train_cmd, root, stats, held, steps, deadline, timeout_s)
    if records is None:
        return 1
    print("[4/4] verification (rollout daemon's module vs the trainer's final gathered weights):")
    ok, message = _verify_run(held, final, records, steps)
    print(("  OK: " if ok else "  FAILED: ") + message)
    print(f"done in {time.monotonic() - started:.1f}s")
    if own_dir and ok:
        shutil.rmtree(root, ignore_errors=True)
    elif not ok:
        print(f"logs kept in {root}")
    return 0 if ok else 1


def _commands(port: int, steps: int, root: Path, stats: Path, held: Path, final: Path) -> tuple[list[str], list[str]]:
    """The rollout daemon's command (stats per version, its module dumped on exit) and the training's."""
    transport = [
        f"transport.port={port}",
        f"transport.bucket_size_mb={BUCKET_MB}",
        "transport.timeout_s=60",
        "transport.heartbeat_interval_s=0.5",
    ]
    daemon_cmd = [
        sys.executable, "-m", "lightning_weightsync.cli", "rollout", *transport,
        "rollout.sink.type=module", f"rollout.sink.factory={FACTORY}", "rollout.apply=atomic",
        "rollout.progress=false", "rollout.identity=demo-rollout",
        "--stats-jsonl", str(stats), "--dump-on-exit", str(held),
    ]  # fmt: skip
    train_cmd = [
        sys.executable, "-m", "lightning_weightsync.demo.tiny_lm", *transport,
        f"recipe.steps={steps}", "recipe.devices=2", "recipe.accelerator=cpu", "recipe.strategy=model_parallel",
        f"recipe.save_final={final}", f"recipe.output_dir={root / 'runs'}",
        "trainer.min_receivers=1", "trainer.sync_on_fit_start=true", "trainer.on_failure=raise",
    ]  # fmt: skip
    return daemon_cmd, train_cmd


def _train_beside_the_daemon(
    daemon_cmd: list[str],
    train_cmd: list[str],
    root: Path,
    stats: Path,
    held: Path,
    steps: int,
    deadline: float,
    timeout_s: float,
) -> list[dict[str, Any]] | None:
    """Steps 2 and 3, the daemon running: train, print the versions it recorded, stop it (it dumps its
    module); those records, or None once a failure is printed (both processes reaped either way)."""
    with _process(daemon_cmd, root / "daemon.log") as daemon:
        print(f"[2/4] training: tiny LM, 2 CPU processes, FSDP2 over gloo, {steps} steps, sync after each step")
        with _process(train_cmd, root / "trainer.log") as trainer:
            if not _wait_for_training(trainer, daemon, root, deadline, timeout_s):
                return None
        if trainer.returncode != 0:
            print(f"FAILED: training exited with {trainer.returncode}:\n{_tail(root / 'trainer.log')}")
            return None
        records = _read_stats(stats)
        print(f"[3/4] {len(records)} versions applied by the rollout while training ran:")
        _print_table(records)
        daemon.send_signal(signal.SIGTERM)
        try:
            code = daemon.wait(timeout=max(5.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"FAILED: the rollout daemon did not stop on SIGTERM:\n{_tail(root / 'daemon.log')}")
            return None
        if code != 0 or not held.exists():
            print(f"FAILED: the rollout daemon exited with {code}:\n{_tail(root / 'daemon.log')}")
            return None
    return records


def _wait_for_training(
    trainer: subprocess.Popen[bytes], daemon: subprocess.Popen[bytes], root: Path, deadline: float, timeout_s: float
) -> bool:
    """Poll until training exits; False (printed why) if the daemon died first or the deadline passed."""
    while trainer.poll() is None:
        if daemon.poll() is not None:
            print(f"FAILED: the rollout daemon exited ({daemon.returncode}):\n{_tail(root / 'daemon.log')}")
            return False
        if time.monotonic() > deadline:
            print(f"FAILED: training did not finish within {timeout_s:.0f}s:\n{_tail(root / 'trainer.log')}")
            return False
        time.sleep(0.2)
    return True


def _verify_run(held: Path, final: Path, records: list[dict[str, Any]], steps: int) -> tuple[bool, str]:
    """`verify`, then that every version was applied and the small bucket chunked at least one tensor."""
    ok, message = verify(held, final)
    expected_versions = steps + 1  # version 0 at fit start, then one per step
    applied = [r for r in records if r["ok"]]
    if ok and len(applied) != expected_versions:
        ok, message = False, f"expected {expected_versions} applied versions, the daemon recorded {len(applied)}"
    if ok and not any(r["num_chunked_tensors"] > 0 for r in applied):
        ok, message = False, "no tensor was chunked (the bucket should be smaller than the largest weight)"
    return ok, message


__all__ = ["run_demo", "verify"]
