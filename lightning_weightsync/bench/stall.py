"""Trainer stall: how long a 2-rank FSDP2 Lightning run is blocked per sync, against a raw broadcast,
and in sharded send mode (every rank sends its own shards) against the gather mode.

The training loop is blocked for the whole `WeightSyncCallback` sync: every rank gathers (FSDP2
all-gathers one full tensor at a time), rank 0 sends, all ranks agree on the outcome. The callback
logs that as `weightsync/stall_seconds` (its `SyncDriver` times it on every rank; every rank leaves
at the same agreement all-reduce). This benchmark runs the tiny LM recipe at a size where the bytes
matter (2 CPU processes, `ModelParallelStrategy`, gloo) into a real rollout daemon (module sink), reads
the stall per version from the CSV log, and compares it with a raw gloo broadcast of the same bytes
between two processes measured in the same run: stall / raw says what the gather, the agreement and
the engine cost on top of moving the bytes.

    python -m lightning_weightsync.bench.stall [--json] [--dim 512] [--layers 8] [--steps 4]

`--overlap` compares, in one pair of processes on the same model and rollout, a blocking sync with
`trainer.overlap` (gather and sharded) and with no sync at all: the stall a sync, the time of N steps
and how much slower a step computes while a background send runs (`run_overlap`).

    python -m lightning_weightsync.bench.stall --overlap [--steps 6]
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import multiprocessing as mp
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ..transport.process import free_port, process_group

MiB = 1 << 20
SIZES: dict[str, dict[str, Any]] = {"small": {"dim": 256, "layers": 4, "steps": 2}, "default": {}}
"""`lightning-weightsync bench --size`: run() keyword arguments (default: the documented figures)."""
ESTIMATE_S = {"small": 32.0, "default": 38.0}
"""Seconds each size took on the 2-core development machine (printed before the run starts)."""


def _raw_worker(rank: int, store_port: int, nbytes: int, bucket: int, repeats: int, out: Any) -> None:
    from .throughput import raw_bytes_seconds, raw_group

    torch.set_num_threads(1)
    seconds = raw_bytes_seconds(raw_group(rank, 2, store_port), nbytes, bucket, repeats)
    if rank == 0:
        out.put(seconds)


def raw_broadcast_seconds(nbytes: int, bucket: int, repeats: int = 3, timeout_s: float = 300) -> float:
    """Best-of time of a plain gloo broadcast of `nbytes` in `bucket`-byte pieces, rank 0 -> rank 1."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_raw_worker, args=(r, port, nbytes, bucket, repeats, out), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        return float(out.get(timeout=timeout_s))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def _train(work: Path, common: list[str], steps: int, model_arg: str, *extra: str) -> list[dict[str, str]]:
    """One tiny-LM training run (2 processes, FSDP2); its `weightsync/*` rows from the CSV log."""
    out = work / f"runs{len(list(work.glob('runs*')))}"
    # no --config: the recipe's defaults are recipes/tiny_lm_cpu.yaml's values, and an installed package has no recipes/
    train = subprocess.run(
        [sys.executable, "-m", "lightning_weightsync.demo.tiny_lm", *common, *extra,
         f"recipe.steps={steps}", f"recipe.output_dir={out}", f"recipe.model={model_arg}",
         "recipe.seq_len=32", "recipe.batch_size=2"],
        capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    if train.returncode != 0:
        raise RuntimeError(f"the training run failed:\n{train.stdout[-2000:]}\n{train.stderr[-4000:]}")
    (metrics_csv,) = sorted(out.rglob("metrics.csv"))
    rows = [r for r in csv.DictReader(metrics_csv.open()) if r.get("weightsync/stall_seconds")]
    if not rows:
        raise RuntimeError("no weightsync/stall_seconds in the training log")
    return rows


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _model_arg(model: dict[str, Any]) -> str:
    """The tiny LM's shape as one override value (`recipe.model=` and `rollout.sink.options=`)."""
    return "{" + ", ".join(f"{k}: {v}" for k, v in model.items()) + "}"


def _transport(port: int, bucket_mb: float) -> list[str]:
    """The transport overrides the trainer and the rollout daemon share."""
    return [f"transport.port={port}", f"transport.bucket_size_mb={bucket_mb}", "transport.timeout_s=120"]


def _daemon_cmd(transport: list[str], model_arg: str) -> list[str]:
    """The rollout daemon: the tiny LM in a module sink, applied while it streams in."""
    return [
        sys.executable, "-m", "lightning_weightsync.cli", "rollout", *transport, "rollout.progress=false",
        "rollout.sink.factory=lightning_weightsync.demo.tiny_lm:build_model",
        f"rollout.sink.options={model_arg}", "rollout.apply=streaming",
    ]  # fmt: skip


def run(
    json_out: bool = False, *, dim: int = 512, layers: int = 8, steps: int = 4, bucket_mb: float = 16.0
) -> dict[str, Any]:
    """Two runs of the same training: with a rollout (the real stall) and with none (`min_receivers=0`:
    every rank still gathers, nothing is sent: the gather's own share of the stall)."""
    model = {"dim": dim, "n_layers": layers, "vocab_size": 8192, "n_heads": 8, "max_seq_len": 64}
    gather_rows, rows, sharded_rows, applied = _stall_runs(model, steps, bucket_mb)
    report = _stall_report(model, bucket_mb, rows, gather_rows, sharded_rows, applied)
    if json_out:
        print(json.dumps(report, indent=2))
    else:
        _print_stall(report, bucket_mb)
    return report


def _stall_runs(
    model: dict[str, Any], steps: int, bucket_mb: float
) -> tuple[list[dict[str, str]], list[dict[str, str]], list[dict[str, str]], list[float]]:
    """The three trainings (no rollout, gather mode, sharded mode; the last two into one daemon) and the
    daemon's own receive seconds per version."""
    model_arg = _model_arg(model)
    with tempfile.TemporaryDirectory(prefix="lws-stall-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        gather_rows = _train(work, _transport(free_port(), bucket_mb), steps, model_arg, "trainer.min_receivers=0")
        common = _transport(free_port(), bucket_mb)
        daemon_log = (work / "daemon.log").open("w")
        stack.enter_context(daemon_log)
        stack.enter_context(process_group(_daemon_cmd(common, model_arg), stdout=daemon_log, stderr=subprocess.STDOUT))
        rows = _train(work, common, steps, model_arg)
        # the same, every rank sending its own shards (trainer.send_mode=sharded: no all-gather at all)
        sharded_rows = _train(work, common, steps, model_arg, "trainer.send_mode=sharded")
        daemon_log.flush()
        # the rollout's own view: seconds from its first bucket to its commit, per version
        applied = [float(m) for m in re.findall(r"applied: .*? in ([0-9.]+) s", (work / "daemon.log").read_text())]
    return gather_rows, rows, sharded_rows, applied


def _stall_report(
    model: dict[str, Any],
    bucket_mb: float,
    rows: list[dict[str, str]],
    gather_rows: list[dict[str, str]],
    sharded_rows: list[dict[str, str]],
    applied: list[float],
) -> dict[str, Any]:
    """The stalls per version and their medians, against a raw broadcast of the model's bytes measured now."""
    nbytes = sum(p.numel() * p.element_size() for p in _model_params(model))
    stalls = [float(r["weightsync/stall_seconds"]) for r in rows]
    gather_only = [float(r["weightsync/stall_seconds"]) for r in gather_rows]
    sharded = [float(r["weightsync/stall_seconds"]) for r in sharded_rows]
    raw = raw_broadcast_seconds(nbytes, int(bucket_mb * MiB))
    steady = stalls[1:] or stalls  # version 0 forms the group
    return {
        "model_mb": nbytes / MiB,
        "versions": len(stalls),
        "stall_s": stalls,
        "gather_only_stall_s": gather_only,
        "send_s": [float(r["weightsync/seconds"]) for r in rows],
        "rollout_receive_s": applied,
        "raw_broadcast_s": raw,
        "median_stall_s": _median(steady),
        "median_gather_only_s": _median(gather_only[1:] or gather_only),
        "stall_over_raw": _median(steady) / raw,
        "sharded_stall_s": sharded,
        "median_sharded_stall_s": _median(sharded[1:] or sharded),
        "sharded_over_gather": _median(sharded[1:] or sharded) / _median(steady),
    }


def _print_stall(report: dict[str, Any], bucket_mb: float) -> None:
    """`run`'s human-readable summary."""
    raw, applied = report["raw_broadcast_s"], report["rollout_receive_s"]
    print(
        f"trainer stall, 2-rank FSDP2 (gloo) tiny LM of {report['model_mb']:.0f} MiB, {bucket_mb:g} MiB buckets:\n"
        f"  median stall per sync {report['median_stall_s'] * 1e3:.0f} ms; the same training with no rollout "
        f"(gather only) {report['median_gather_only_s'] * 1e3:.0f} ms\n"
        f"  raw gloo broadcast of the same bytes {raw * 1e3:.0f} ms; stall / raw = "
        f"{report['stall_over_raw']:.1f}x\n"
        f"  trainer.send_mode=sharded (every rank sends its shards, no all-gather): median stall "
        f"{report['median_sharded_stall_s'] * 1e3:.0f} ms = {report['sharded_over_gather']:.2f} x the gather mode's"
    )
    if applied:
        print(f"  the rollout's receive (first bucket to commit), median: {_median(applied) * 1e3:.0f} ms")


OVERLAP_MODES = ("no sync", "blocking", "overlap sync gather", "overlap", "overlap sharded")
"""`--overlap`: the same training loop, the same model and rollout, in this order in one pair of processes.
"overlap sync gather" is gather mode with `trainer.overlap_gather=sync` (the all-gathers at the sync point),
"overlap" gather mode with the default background gather."""


def _overlap_worker(rank: int, world: int, store_port: int, port: int, run: dict[str, Any], out: Any) -> None:
    """One trainer rank: FSDP2 tiny LM, a plain loop (forward, backward, AdamW step, then the sync the
    Lightning callback would run, through the same `SyncDriver`), timed per step for every mode. On a GPU
    (`run["device"] == "cuda"`) the loop trains on `cuda:<rank>` over NCCL and each step's compute is
    synchronized before its clock stops, so a step's time is its kernels', not their launch."""
    import torch.distributed as dist

    device, net, opt, batch = _overlap_setup(rank, world, store_port, run)
    report: dict[str, Any] = {}
    for index, mode in enumerate(run["modes"]):
        base = 1000 * index  # versions keep increasing from mode to mode
        driver = _overlap_driver(mode, base, rank, port, run, device, net)
        report[mode] = _overlap_steps(net, opt, batch, driver, base, run, device)
    if rank == 0:
        out.put(report)
    dist.destroy_process_group()


def _overlap_setup(rank: int, world: int, store_port: int, run: dict[str, Any]) -> tuple[torch.device, Any, Any, Any]:
    """This rank's device, its process group, the FSDP2-sharded tiny LM, its optimizer and its one batch."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch._C._distributed_c10d import TCPStore  # its stub home: mypy sees no public torch.distributed.X
    from torch.distributed.fsdp import fully_shard

    from ..demo.tiny_lm import build_model

    cuda = run["device"] == "cuda"
    device = torch.device(f"cuda:{rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    model = run["model"]
    store = TCPStore("127.0.0.1", store_port, world, is_master=rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world)
    net = build_model(model).to(device)
    for layer in net.layers:
        fully_shard(layer)
    fully_shard(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(rank)
    batch = torch.randint(0, int(model["vocab_size"]), (run["batch"], run["seq"] + 1), generator=gen).to(device)
    return device, net, opt, batch


def _overlap_driver(
    mode: str, base: int, rank: int, port: int, run: dict[str, Any], device: torch.device, net: Any
) -> Any:
    """The mode's `SyncDriver`, started, its untimed first version sent (it forms the data-plane group);
    None for "no sync"."""
    from ..config import load_config
    from ..trainer.driver import SyncDriver

    cfg = load_config(
        overrides=[f"transport.port={port}", f"transport.bucket_size_mb={run['bucket_mb']}",
                   "transport.timeout_s=120",
                   f"trainer.overlap={'overlap' in mode}",
                   f"trainer.overlap_gather={'sync' if 'sync gather' in mode else 'background'}",
                   f"trainer.send_mode={'sharded' if 'sharded' in mode else 'gather'}"]
    )  # fmt: skip
    if mode == "no sync":
        return None
    driver = SyncDriver(cfg, rank=rank, device=device, prefix=None)
    driver.start()
    driver.sync(net, base)  # forms the data-plane group: not timed
    driver.finish(net, None)
    return driver


def _overlap_steps(
    net: Any, opt: Any, batch: Any, driver: Any, base: int, run: dict[str, Any], device: torch.device
) -> dict[str, Any]:
    """`run["steps"]` timed steps of one mode: each step's compute and stall, the snapshot copy, the total."""
    import torch.distributed as dist

    cuda = device.type == "cuda"
    compute, stall, snapshot = [], [], []
    dist.barrier()
    began = time.perf_counter()
    for step in range(1, run["steps"] + 1):
        t0 = time.perf_counter()
        logits = net(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize(device)
        t1 = time.perf_counter()
        if driver is not None:
            driver.sync(net, base + step)
        compute.append(t1 - t0)
        stall.append(time.perf_counter() - t1)
        if driver is not None and driver.overlap is not None:
            snapshot.append(driver.overlap.snapshot_seconds)
    if driver is not None:
        driver.finish(net, None)  # the last version is delivered before the clock stops
    if cuda:
        torch.cuda.synchronize(device)
    total = time.perf_counter() - began
    if driver is not None:
        driver.close()
    return {"compute_s": compute, "stall_s": stall, "total_s": total, "snapshot_s": snapshot}


def run_overlap(
    *,
    dim: int = 512,
    layers: int = 8,
    steps: int = 6,
    bucket_mb: float = 16.0,
    world: int = 2,
    device: str = "cpu",
    modes: tuple[str, ...] = OVERLAP_MODES,
    vocab_size: int = 8192,
    heads: int = 8,
    batch: int = 2,
    seq: int = 32,
    timeout_s: float = 1200,
) -> dict[str, Any]:
    """Blocking against overlap (gather and sharded) and against no sync at all: the same FSDP2 model,
    loop and rollout daemon, in one run. Per mode: the median stall a sync (what the step boundary holds
    training), the total of `steps` steps (the last version delivered), and the median compute time of a
    step (with overlap: while a background send runs; against no sync: what the send steals).
    `world` trainer ranks on `device` ("cpu": gloo; "cuda": one GPU a rank, NCCL for training); the rollout
    is a daemon on the host (module sink, gloo transport: the bytes leave the trainer as over a NIC)."""
    model = {"dim": dim, "n_layers": layers, "vocab_size": vocab_size, "n_heads": heads, "max_seq_len": max(64, seq)}
    run = {"model": model, "steps": steps, "bucket_mb": bucket_mb, "modes": modes, "device": device,
           "batch": batch, "seq": seq}  # fmt: skip
    report = _overlap_processes(run, world, timeout_s)
    return _overlap_summary(report, run, world)


def _overlap_processes(run: dict[str, Any], world: int, timeout_s: float) -> dict[str, Any]:
    """The rollout daemon and `world` `_overlap_worker` ranks; rank 0's per-mode timings (all reaped)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port, store_port = free_port(), free_port()
    with tempfile.TemporaryDirectory(prefix="lws-overlap-") as tmp, contextlib.ExitStack() as stack:
        daemon_log = stack.enter_context((Path(tmp) / "daemon.log").open("w"))
        daemon_cmd = _daemon_cmd(_transport(port, run["bucket_mb"]), _model_arg(run["model"]))
        stack.enter_context(process_group(daemon_cmd, stdout=daemon_log, stderr=subprocess.STDOUT))
        procs = [
            ctx.Process(target=_overlap_worker, args=(r, world, store_port, port, run, queue), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        try:
            report: dict[str, Any] = queue.get(timeout=timeout_s)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    return report


def _overlap_summary(report: dict[str, Any], run: dict[str, Any], world: int) -> dict[str, Any]:
    """Per mode: the medians, the total, the step slowdown against "no sync", the stall against blocking."""
    modes = run["modes"]
    nbytes = sum(p.numel() * p.element_size() for p in _model_params(run["model"]))
    base = report["no sync"]
    out: dict[str, Any] = {
        "model_mb": nbytes / MiB,
        "steps": run["steps"],
        "world": world,
        "device": run["device"],
        "modes": {},
    }
    for mode in modes:
        r = report[mode]
        out["modes"][mode] = {
            "median_stall_s": _median(r["stall_s"]),
            "median_snapshot_s": _median(r["snapshot_s"]) if r["snapshot_s"] else 0.0,
            "total_s": r["total_s"],
            "median_step_compute_s": _median(r["compute_s"]),
            "step_slowdown": _median(r["compute_s"]) / _median(base["compute_s"]),
        }
    blocking = out["modes"]["blocking"]["median_stall_s"]
    for mode in modes[2:]:
        out["modes"][mode]["stall_over_blocking"] = out["modes"][mode]["median_stall_s"] / blocking
    return out


def print_overlap(out: dict[str, Any]) -> None:
    print(
        f"overlap, {out.get('world', 2)}-rank FSDP2 ({out.get('device', 'cpu')}) tiny LM of {out['model_mb']:.0f} MiB, "
        f"{out['steps']} steps, one rollout:\n"
        f"  {'mode':<20} {'stall/sync':>11} {'of it copy':>11} {'x blocking':>11} {'N steps':>9} {'step compute':>13} "
        f"{'x no sync':>10}"
    )
    for mode, m in out["modes"].items():
        ratio = f"{m['stall_over_blocking']:.3f}" if "stall_over_blocking" in m else "-"
        print(
            f"  {mode:<20} {m['median_stall_s'] * 1e3:>9.0f}ms {m['median_snapshot_s'] * 1e3:>9.0f}ms {ratio:>11} "
            f"{m['total_s']:>8.2f}s "
            f"{m['median_step_compute_s'] * 1e3:>11.0f}ms {m['step_slowdown']:>10.2f}"
        )


def _model_params(model: dict[str, Any]) -> list[torch.Tensor]:
    from ..demo.tiny_lm import build_model

    return list(build_model(model).state_dict().values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--bucket-mb", type=float, default=16.0)
    p.add_argument("--overlap", action="store_true", help="blocking vs trainer.overlap vs no sync, in one run")
    a = p.parse_args(argv)
    if a.overlap:
        out = run_overlap(dim=a.dim, layers=a.layers, steps=max(a.steps, 2), bucket_mb=a.bucket_mb)
        if a.json:
            print(json.dumps(out, indent=2))
        else:
            print_overlap(out)
        return 0
    run(a.json, dim=a.dim, layers=a.layers, steps=a.steps, bucket_mb=a.bucket_mb)
    return 0


if __name__ == "__main__":
    sys.exit(main())
