"""End-to-end engine benchmark on loopback: real processes, real ZeroMQ, real gloo groups.

Three measurements, each against a baseline measured in the same run, in the same processes:
1. throughput: `WeightSender.send_weights` of a model-shaped stream (Qwen3-8B's 399 tensors with
   every dimension divided by `scale`: 1 GB at scale 4, the real mix of one huge embedding, large MLP
   and small norm tensors) through `bucket_mb` buckets, receivers merging `into=` preallocated
   destinations, vs a raw gloo broadcast of the same total bytes in bucket-sized pieces (no
   packing, no metadata, no merging). Goal: ratio >= 0.9 at 64 MiB+ buckets.
2. small tensors: the engine vs one broadcast per tensor (what TRL's per-parameter sync does) on a
   model of many small tensors (Qwen3-8B names and shapes, scaled down). Goal: >= 3x faster.
3. memory: peak RSS growth of sender and receiver during a version, against the design budget
   (sender: 2 buckets; receiver: 2 buckets, + the largest tensor when there is no destination).

The engine's time is taken from a version after the first (the group is formed and reused), and
includes metadata, acks and merging. Best of `repeats`.

    python -m lightning_weightsync.bench.engine [--json] [--receivers 1] [--scale 4] [--bucket-mb 64 256]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import queue as queue_mod
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

import psutil
import torch
import torch.distributed as dist

from ..transport.process import free_port

MiB = 1024 * 1024
GOAL_THROUGHPUT = 0.9
GOAL_SMALL_SPEEDUP = 3.0
SLACK_BYTES = 16 * MiB  # interpreter, sockets, allocator rounding: not data


class _RssPeak:
    """Samples this process's RSS every millisecond on a thread; `extra` is the peak growth over
    the RSS at `__enter__` (ru_maxrss would hide growth below an earlier, unrelated peak)."""

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self.extra = 0

    def __enter__(self) -> _RssPeak:
        self._base = self._proc.memory_info().rss
        self._peak = self._base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self._peak = max(self._peak, self._proc.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, self._proc.memory_info().rss)
        self.extra = self._peak - self._base


def _model_stream(scale: int) -> list[tuple[str, torch.Tensor]]:
    from ..examples.inventory import model_stream

    return list(model_stream("qwen3-8b", scale=scale, extras=False))


def _cfg(port: int, bucket_mb: float, receivers: int) -> Any:
    from ..config import load_config

    return load_config(
        overrides=[
            f"transport.port={port}",
            f"transport.bucket_size_mb={bucket_mb}",
            "transport.timeout_s=120",
            "transport.heartbeat_interval_s=0.2",
            f"trainer.min_receivers={receivers}",
        ]
    )


def _raw_group(rank: int, world: int, store_port: int) -> Any:
    store = dist.TCPStore("127.0.0.1", store_port, is_master=rank == 0, timeout=timedelta(seconds=120))
    return dist.ProcessGroupGloo(dist.PrefixStore("raw", store), rank, world, timedelta(seconds=120))


def _raw_broadcast_seconds(pg: Any, stream: list[tuple[str, torch.Tensor]], bucket: int, repeats: int) -> float:
    total = sum(t.numel() * t.element_size() for _, t in stream)
    buf = torch.empty(bucket, dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for start in range(0, total, bucket):
            pg.broadcast(buf[: min(bucket, total - start)], 0).wait()
        pg.broadcast(torch.zeros(1), 0).wait()  # everyone finished
        best = min(best, time.perf_counter() - t0)
    return best


def _per_tensor_seconds(pg: Any, stream: list[tuple[str, torch.Tensor]], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _, tensor in stream:
            pg.broadcast(tensor, 0).wait()
        pg.broadcast(torch.zeros(1), 0).wait()
        best = min(best, time.perf_counter() - t0)
    return best


def _worker(role: int, world: int, ports: dict[str, int], case: dict[str, Any], out: Any) -> None:
    try:
        out.put((role, True, _run_case(role, world, ports, case)))
    except BaseException:
        out.put((role, False, traceback.format_exc()))


def _run_case(role: int, world: int, ports: dict[str, int], case: dict[str, Any]) -> dict[str, Any]:
    from ..engine.receiver import WeightReceiver
    from ..engine.sender import WeightSender

    torch.set_num_threads(1)
    stream = _model_stream(case["scale"])
    bucket = int(case["bucket_mb"] * MiB)
    repeats = case["repeats"]
    pg = _raw_group(role, world, ports["store"])
    baseline = (
        _per_tensor_seconds(pg, stream, repeats)
        if case["kind"] == "small"
        else _raw_broadcast_seconds(pg, stream, bucket, repeats)
    )
    cfg = _cfg(ports["control"], case["bucket_mb"], world - 1)
    result: dict[str, Any] = {"baseline_s": baseline}

    async def send() -> None:
        async with WeightSender(cfg) as sender:
            times = []
            for version in range(repeats + 1):
                with _RssPeak() as rss:
                    stats = await sender.send_weights(stream, version=version)
                times.append(stats.seconds)
                result["peak_extra_bytes"] = max(result.get("peak_extra_bytes", 0), rss.extra)
            result["engine_s"] = min(times[1:])
            result["nbytes"] = stats.nbytes
            result["buckets"] = stats.num_buckets
            result["direct_buckets"] = stats.direct_buckets

    async def receive() -> None:
        dest = {n: torch.zeros_like(t) for n, t in stream}  # touched: their pages count before we measure
        async with WeightReceiver(cfg, identity=f"bench-{role}") as receiver:
            for _ in range(repeats + 1):
                with _RssPeak() as rss:
                    async for _name, _t in receiver.receive_weights(into=lambda m: dest[m.name]):
                        pass
                result["peak_extra_bytes"] = max(result.get("peak_extra_bytes", 0), rss.extra)
        for name, t in stream:  # the benchmark also checks what it moved
            assert torch.equal(dest[name], t), name

    pg.broadcast(torch.zeros(1), 0).wait()  # all processes set up before the engine phase
    asyncio.run(send() if role == 0 else receive())
    return result


def _run_processes(world: int, case: dict[str, Any], timeout_s: float = 600) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ports = {"store": free_port(), "control": free_port()}
    procs = [ctx.Process(target=_worker, args=(r, world, ports, case, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world:
            try:
                role, ok, value = out.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue_mod.Empty:
                raise RuntimeError(f"benchmark case {case} timed out after {timeout_s}s") from None
            if not ok:
                raise RuntimeError(f"benchmark worker {role} failed:\n{value}")
            results[role] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


def run(
    json_out: bool = False,
    *,
    receivers: int = 1,
    scale: int = 4,
    bucket_mbs: tuple[float, ...] = (64, 256),
    repeats: int = 3,
) -> dict[str, Any]:
    world = receivers + 1
    report: dict[str, Any] = {"receivers": receivers, "throughput": [], "small_tensors": None, "memory": []}
    for bucket_mb in bucket_mbs:
        case = {"kind": "model", "scale": scale, "bucket_mb": bucket_mb}
        sender, *recvs = _run_processes(world, {**case, "repeats": repeats})
        nbytes = sender["nbytes"]
        row = {
            "bucket_mb": bucket_mb,
            "total_mb": nbytes / MiB,
            "buckets": sender["buckets"],
            "direct_buckets": sender["direct_buckets"],
            "engine_GBps": nbytes / sender["engine_s"] / 1e9,
            "raw_gloo_GBps": nbytes / sender["baseline_s"] / 1e9,
            "ratio": sender["baseline_s"] / sender["engine_s"],
            "goal": GOAL_THROUGHPUT,
        }
        report["throughput"].append(row)
        budget = 2 * bucket_mb * MiB + SLACK_BYTES
        report["memory"].append(
            {
                "bucket_mb": bucket_mb,
                "sender_extra_mb": sender["peak_extra_bytes"] / MiB,
                "receiver_extra_mb": max(r["peak_extra_bytes"] for r in recvs) / MiB,
                "budget_mb": budget / MiB,
                "within_budget": max([sender["peak_extra_bytes"]] + [r["peak_extra_bytes"] for r in recvs]) <= budget,
            }
        )
    small = _run_processes(world, {"kind": "small", "scale": 64, "bucket_mb": 64, "repeats": repeats})[0]
    report["small_tensors"] = {
        "tensors": len(_model_stream(64)),
        "total_mb": small["nbytes"] / MiB,
        "engine_s": small["engine_s"],
        "per_tensor_broadcast_s": small["baseline_s"],
        "speedup": small["baseline_s"] / small["engine_s"],
        "goal": GOAL_SMALL_SPEEDUP,
    }
    if json_out:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return report


def _print(report: dict[str, Any]) -> None:
    print(f"engine benchmark, loopback gloo, {report['receivers']} receiver(s)")
    print(
        f"{'bucket MiB':>10} {'MiB':>6} {'buckets':>8} {'direct':>7} {'engine GB/s':>12} {'raw gloo GB/s':>14} "
        f"{'ratio':>6} {'goal':>5}"
    )
    for r in report["throughput"]:
        print(
            f"{r['bucket_mb']:>10g} {r['total_mb']:>6.0f} {r['buckets']:>8} {r['direct_buckets']:>7} "
            f"{r['engine_GBps']:>12.2f} {r['raw_gloo_GBps']:>14.2f} {r['ratio']:>6.2f} {r['goal']:>5}"
        )
    s = report["small_tensors"]
    print(
        f"small tensors: {s['tensors']} tensors, {s['total_mb']:.1f} MiB: engine {s['engine_s'] * 1e3:.1f} ms vs "
        f"per-tensor broadcast {s['per_tensor_broadcast_s'] * 1e3:.1f} ms -> {s['speedup']:.1f}x (goal {s['goal']}x)"
    )
    for m in report["memory"]:
        print(
            f"memory, bucket {m['bucket_mb']:g} MiB: sender +{m['sender_extra_mb']:.0f} MiB, receiver "
            f"+{m['receiver_extra_mb']:.0f} MiB, budget {m['budget_mb']:.0f} MiB (2 buckets + 16 MiB): "
            f"{'within' if m['within_budget'] else 'OVER'}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--receivers", type=int, default=1)
    p.add_argument("--scale", type=int, default=4, help="divide every Qwen3-8B dimension by this")
    p.add_argument("--bucket-mb", type=float, nargs="+", default=[64, 256])
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    run(
        a.json,
        receivers=a.receivers,
        scale=a.scale,
        bucket_mbs=tuple(a.bucket_mb),
        repeats=a.repeats,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
