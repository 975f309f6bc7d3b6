"""A SIGTERM or SIGINT on any trainer rank in the middle of a sync ends the sync on every rank within
seconds, and the signal then meets the handler it would have met just after it (issue 25 item 2).

Real runs, 2 CPU processes over gloo, no rollout running, so every sync waits: global rank 0 in the
sender (for `trainer.min_receivers=1` receivers, up to `transport.timeout_s=60`), the other rank inside
FSDP2's all-gather or the outcome all-reduce. The signal goes to one rank once the sender says it waits.
Before: Lightning's SIGTERM handler ran a `dist.broadcast` inside the sender's event loop on rank 0 while
rank 1 sat in an all-gather (a hang only SIGKILL ended), and a signal to rank 1 was never seen at all
(its main thread was inside a collective), so rank 0 waited out the timeout.

Lightning (`demo/tiny_lm.py`: ModelParallelStrategy = FSDP2, and DDP): SIGTERM becomes Lightning's
own graceful stop on every rank. torchrun + Accelerate (`recipes/accelerate_tiny.py`): the signal's
default action ends every rank at the same point and torchrun reports it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.support.mp import LOAD_SLACK_S, PYTHON, free_port, popen

pytest.importorskip("lightning.pytorch")
pytest.importorskip("accelerate")

REPO = Path(__file__).resolve().parents[2]
MID_SYNC = "waiting"  # the sender's line once it waited transport.liveness_s for receivers: mid-sync everywhere
TIMEOUT_S = 60  # transport.timeout_s: a sync that is not ended by the signal lasts at least this
COMMON = [f"transport.timeout_s={TIMEOUT_S}", "transport.liveness_s=1", "trainer.min_receivers=1", "recipe.steps=2"]


def _lightning(strategy: str, port: int, tmp: Path, *extra: str) -> list[str]:
    return [
        PYTHON, "-m", "lightning_weightsync.demo.tiny_lm", "--config", str(REPO / "recipes" / "tiny_lm_cpu.yaml"),
        f"transport.port={port}", f"recipe.strategy={strategy}", f"recipe.output_dir={tmp / 'runs'}", *COMMON,
        *extra,
    ]  # fmt: skip


def _torchrun(by_hand: bool, port: int, tmp: Path) -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    recipe = REPO / "recipes" / "accelerate_tiny.py"
    return [
        *([str(exe)] if exe.exists() else [PYTHON, "-m", "torch.distributed.run"]),
        "--standalone", "--nproc-per-node", "2", str(recipe), "--config", str(recipe.with_suffix(".yaml")),
        f"transport.port={port}", f"recipe.fsdp2_by_hand={str(by_hand).lower()}", *COMMON,
    ]  # fmt: skip


def _rank_pid(root: int, rank: int) -> int:
    """The process of global `rank`: torchrun's workers carry RANK, Lightning's spawned ranks LOCAL_RANK;
    Lightning's rank 0 is the process we started."""
    tree = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    for proc in tree:
        env = proc.environ()
        if env.get("RANK", env.get("LOCAL_RANK")) == str(rank):
            return proc.pid
    assert rank == 0, f"no process of rank {rank} in {[p.cmdline()[:3] for p in tree]}"
    return root


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signal_mid_sync(cmd: list[str], rank: int, signum: int, tmp: Path) -> tuple[str, float, int | None]:
    """Run `cmd`, send `signum` to `rank` mid-sync; (output, seconds from the signal to the exit, exit code)."""
    lines: list[str] = []
    env = {"PYTHONPATH": str(REPO)}
    # SIGINT at its default disposition in the child, whatever the test runner's: a runner that ignores it (started
    # in the background by a shell, or a worker that does) passes SIG_IGN on, and Python then installs no
    # KeyboardInterrupt handler, so the handed-on SIGINT would be ignored
    with popen(cmd, cwd=str(tmp), env=env, preexec_fn=_sigint_default) as proc:
        assert proc.stdout is not None
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
        reader.start()
        deadline = time.monotonic() + 150
        while not any(MID_SYNC in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-4000:]
            time.sleep(0.1)
        os.kill(_rank_pid(proc.pid, rank), signum)
        sent = time.monotonic()
        try:
            proc.wait(timeout=TIMEOUT_S)
        except Exception:
            raise AssertionError(f"still running {TIMEOUT_S}s after the signal:\n{''.join(lines)[-4000:]}") from None
        elapsed = time.monotonic() - sent
        reader.join(10)
    return "".join(lines), elapsed, proc.returncode


def _stopped_on_both_ranks(out: str, name: str, rank: int) -> None:
    said = f"weight sync of version 0 stopped (not delivered) by {name} on global rank {rank}"
    assert out.count(said) == 2, f"expected once per rank: {said!r}\n{out[-4000:]}"
    fate = "the rollouts were told to abort it and keep the version they held; none applies part of it"
    assert fate in out, out[-4000:]  # what became of the interrupted version (nothing was delivered before it)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "rank"),
    [("model_parallel", 0), ("model_parallel", 1), ("ddp", 1)],
    ids=["fsdp2-r0", "fsdp2-r1", "ddp-r1"],
)
def test_sigterm_mid_sync_under_lightning_stops_every_rank(tmp_path: Path, strategy: str, rank: int) -> None:
    out, elapsed, code = _signal_mid_sync(_lightning(strategy, free_port(), tmp_path), rank, signal.SIGTERM, tmp_path)
    _stopped_on_both_ranks(out, "SIGTERM", rank)
    # Lightning's own stop (SIGTERMException on every rank at the next batch), not a crash or a hang
    assert code == 0 and "Traceback" not in out and "Connection closed" not in out, out[-4000:]
    assert elapsed < TIMEOUT_S / 2, elapsed  # the sync ended at once: it did not wait out transport.timeout_s


@pytest.mark.slow
def test_sigterm_during_a_background_version_stops_every_rank(tmp_path: Path) -> None:
    """`trainer.overlap`: version 0 sends in the background (it waits for a rollout that never comes) while
    training goes on, and the next step boundary waits for it (`overlap_policy=wait`); a SIGTERM to rank 1
    then ends the background send on every rank within seconds, not at transport.timeout_s."""
    cmd = _lightning("model_parallel", free_port(), tmp_path, "trainer.overlap=true")
    out, elapsed, code = _signal_mid_sync(cmd, 1, signal.SIGTERM, tmp_path)
    _stopped_on_both_ranks(out, "SIGTERM", 1)
    assert "background weight sync of version 0" in out, out[-4000:]
    assert code == 0 and "Traceback" not in out and "Connection closed" not in out, out[-4000:]
    assert elapsed < TIMEOUT_S / 2, elapsed


@pytest.mark.slow
def test_sigint_mid_sync_under_lightning_is_a_keyboard_interrupt_on_every_rank(tmp_path: Path) -> None:
    out, elapsed, code = _signal_mid_sync(
        _lightning("model_parallel", free_port(), tmp_path), 1, signal.SIGINT, tmp_path
    )
    # Lightning's own KeyboardInterrupt handling SIGKILLs the other rank as it shuts down, which may be
    # before that rank's line is written: at least one rank says it, and Lightning says what it did
    said = "weight sync of version 0 stopped (not delivered) by SIGINT on global rank 1"
    assert said in out and "Detected KeyboardInterrupt, attempting graceful shutdown" in out, out[-4000:]
    assert code != 0 and elapsed < TIMEOUT_S / 2, (code, elapsed)


@pytest.mark.slow
@pytest.mark.parametrize(("by_hand", "rank"), [(True, 1), (False, 0)], ids=["fsdp2-r1", "accelerate_ddp-r0"])
def test_sigterm_mid_sync_under_torchrun_ends_every_rank(tmp_path: Path, by_hand: bool, rank: int) -> None:
    out, elapsed, code = _signal_mid_sync(_torchrun(by_hand, free_port(), tmp_path), rank, signal.SIGTERM, tmp_path)
    _stopped_on_both_ranks(out, "SIGTERM", rank)
    # both workers met SIGTERM's default action at the same point, after the sync; torchrun says so
    assert code != 0 and out.count("Signal 15 (SIGTERM) received by PID") >= 1, out[-4000:]
    assert elapsed < LOAD_SLACK_S + 10 < TIMEOUT_S, elapsed
