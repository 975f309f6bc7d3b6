"""End-to-end throughput benchmark on loopback: real processes, real ZeroMQ, real gloo groups.

Each figure against a baseline measured in the same run, in the same processes:
- throughput: `WeightSender.send_weights` of a model-shaped stream (Qwen3-8B's 399 tensors with every
  dimension divided by `scale`: 977 MiB at scale 4, the real mix of one huge embedding, large MLP and
  small norm tensors) at 16, 64 and 256 MiB buckets, the receiver merging `into=` preallocated
  destinations (what the module sink's streaming apply does) or assembling tensors itself, vs a raw gloo
  broadcast of the same total bytes in bucket-sized pieces (no packing, no metadata, no merging).
  Goal: ratio >= 0.9 with `into=` at 64 MiB. Peak extra RSS per side vs the budget (sender: 2 buckets;
  receiver: 2 buckets, + the largest tensor without `into=`; + 16 MiB slack for the interpreter).
- receivers: the same at 64 MiB with 1, 2, 3 receivers (all on this machine's cores).
- growth: seconds per GiB for 1/8, 1/4, 1/2 and all of the Qwen3-8B tensors, and for the
  Qwen3-30B-A3B shape (fused 3-D experts), so a user can extrapolate to their model.
- small tensors: the engine vs one broadcast per tensor (TRL style) on loopback; over a link with real
  latency see `python -m lightning_weightsync.bench.latency` (network namespaces).

The engine's time is taken from versions after the first (the group is formed and reused), and
includes metadata, acks and merging. Best of `repeats`. Every run also checks what it moved, bitwise.

    python -m lightning_weightsync.bench.throughput [--json] [--sections throughput growth] [--scale 4]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
from torch._C._distributed_c10d import TCPStore  # its stub home: mypy sees no public torch.distributed.X
from torch.distributed.distributed_c10d import PrefixStore

from ..transport.process import free_port
from . import CaseProgress

MiB = 1024 * 1024
GOAL_THROUGHPUT = 0.9
GOAL_SMALL_SPEEDUP = 3.0
SLACK_BYTES = 16 * MiB  # interpreter, sockets, allocator rounding: not data
SIZES: dict[str, dict[str, Any]] = {
    "small": {"scale": 16, "moe_scale": 16, "bucket_mbs": (64,), "receivers": (1, 2), "fractions": (0.5,),
              "repeats": 1},
    "default": {},
}  # fmt: skip
"""`lightning-weightsync bench --size`: run() keyword arguments (default: the documented figures)."""
ESTIMATE_S = {"small": 71.0, "default": 610.0}
"""Seconds each size took on the 2-core development machine (printed before the run starts)."""


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


def _model_stream(scale: int, model: str = "qwen3-8b", fraction: float = 1.0) -> list[tuple[str, torch.Tensor]]:
    """The model's tensors with every dimension divided by `scale`; `fraction` keeps that share of the
    tensors in inventory order (embedding first, then whole layers), so bytes grow like a deeper model."""
    from .inventory import inventories, model_stream

    count = max(1, round(len(inventories()[model]) * fraction))
    return list(model_stream(model, scale=scale, max_tensors=count, extras=False))


def _cfg(
    port: int,
    bucket_mb: float,
    receivers: int,
    direct_min_mb: float | None = None,
    auth: bool = False,
    layout_once: bool | None = None,
) -> Any:
    from ..config import load_config

    direct = [] if direct_min_mb is None else [f"transport.direct_min_mb={direct_min_mb}"]
    token = ["transport.auth_token=bench-token-not-a-secret"] if auth else []
    layout = [] if layout_once is None else [f"transport.layout_once={str(layout_once).lower()}"]
    return load_config(
        overrides=[
            *direct,
            *token,
            *layout,
            f"transport.port={port}",
            f"transport.bucket_size_mb={bucket_mb}",
            "transport.timeout_s=120",
            "transport.heartbeat_interval_s=0.2",
            f"trainer.min_receivers={receivers}",
        ]
    )


def raw_group(rank: int, world: int, store_port: int) -> Any:
    """A bare gloo group over its own store: the raw broadcast every engine number is measured against
    (here and in `stall.py`)."""
    store = TCPStore("127.0.0.1", store_port, is_master=rank == 0, timeout=timedelta(seconds=120))
    return dist.ProcessGroupGloo(PrefixStore("raw", store), rank, world, timedelta(seconds=120))


class _Best:
    """Best-of-N wall time of a repeated transfer, with this process's CPU seconds (all threads: the
    collective's own threads included) during that best repeat."""

    def __init__(self) -> None:
        self.seconds = float("inf")
        self.cpu_s = 0.0

    def time(self, fn: Any) -> None:
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if wall < self.seconds:
            self.seconds, self.cpu_s = wall, cpu


def _done(pg: Any) -> None:
    pg.broadcast(torch.zeros(1), 0).wait()  # every rank finished


def _raw_broadcast_seconds(pg: Any, stream: list[tuple[str, torch.Tensor]], bucket: int, repeats: int) -> float:
    return raw_bytes_seconds(pg, sum(t.numel() * t.element_size() for _, t in stream), bucket, repeats)


def raw_bytes_seconds(pg: Any, total: int, bucket: int, repeats: int) -> float:
    """The baseline: best-of-`repeats` time of a plain broadcast of `total` bytes in `bucket`-byte pieces
    of one reused buffer (no packing, no metadata, no merging), until every rank finished."""
    return _raw_best(pg, total, bucket, repeats).seconds


def _raw_best(pg: Any, total: int, bucket: int, repeats: int) -> _Best:
    buf = torch.empty(bucket, dtype=torch.uint8)
    best = _Best()

    def once() -> None:
        for start in range(0, total, bucket):
            pg.broadcast(buf[: min(bucket, total - start)], 0).wait()
        _done(pg)

    for _ in range(repeats):
        best.time(once)
    return best


def _raw_model_memory_best(pg: Any, total: int, bucket: int, repeats: int) -> _Best:
    """The transport's limit for moving a model: the same bucket-sized broadcasts as the raw baseline,
    but over a flat buffer as large as the model (its pages touched), so every byte comes from and goes
    to memory of its own, as a real transfer's do. The gap to the reused buffer is memory, not the engine."""
    flat = torch.ones(total, dtype=torch.uint8)
    best = _Best()

    def once() -> None:
        for start in range(0, total, bucket):
            pg.broadcast(flat[start : start + bucket], 0).wait()
        _done(pg)

    for _ in range(repeats):
        best.time(once)
    return best


def _per_tensor_best(pg: Any, tensors: list[torch.Tensor], repeats: int) -> _Best:
    """What TRL does: one in-place broadcast per tensor, each waited for, from where it is (sender) into
    where it goes (receivers)."""
    best = _Best()

    def once() -> None:
        for tensor in tensors:
            pg.broadcast(tensor, 0).wait()
        _done(pg)

    for _ in range(repeats):
        best.time(once)
    return best


def _per_tensor_seconds(pg: Any, stream: list[tuple[str, torch.Tensor]], repeats: int) -> float:
    return _per_tensor_best(pg, [t for _, t in stream], repeats).seconds


def _pack_loop_best(pg: Any, tensors: list[torch.Tensor], bucket: int, sender: bool, repeats: int) -> _Best:
    """What verl does: pack tensors into one bucket (cut at its boundary), broadcast it, unpack into the
    destinations, synchronously, bucket after bucket. Both sides derive the layout from the shapes."""
    from ..protocol.chunks import as_bytes

    buf = torch.empty(bucket, dtype=torch.uint8)
    views = [as_bytes(t) for t in tensors]
    layout: list[list[tuple[int, int, int, int]]] = [[]]  # per bucket: (tensor, start, size, bucket offset)
    fill = 0
    for index, view in enumerate(views):
        start = 0
        while start < view.numel() or (start == 0 and view.numel() == 0):
            if fill == bucket:
                layout.append([])
                fill = 0
            size = min(view.numel() - start, bucket - fill)
            layout[-1].append((index, start, size, fill))
            fill, start = fill + size, start + size
            if size == 0:
                break
    best = _Best()

    def once() -> None:
        for entries in layout:
            nbytes = max((off + size for _, _, size, off in entries), default=0)
            if sender:
                for index, start, size, off in entries:
                    buf[off : off + size].copy_(views[index][start : start + size])
            pg.broadcast(buf[:nbytes], 0).wait()
            if not sender:
                for index, start, size, off in entries:
                    views[index][start : start + size].copy_(buf[off : off + size])
        _done(pg)

    for _ in range(repeats):
        best.time(once)
    return best


def _worker(role: int, world: int, ports: dict[str, int], case: dict[str, Any], out: Any) -> None:
    try:
        out.put((role, True, _run_case(role, world, ports, case)))
    except BaseException:
        out.put((role, False, traceback.format_exc()))


def _run_case(role: int, world: int, ports: dict[str, int], case: dict[str, Any]) -> dict[str, Any]:
    """One process of a case (role 0 sends): the peer loops over a raw group first, then the engine."""
    torch.set_num_threads(1)
    stream = _model_stream(case["scale"], case.get("model", "qwen3-8b"), case.get("fraction", 1.0))
    pg = raw_group(role, world, ports["store"])
    cfg = _cfg(
        ports["control"], case["bucket_mb"], world - 1, case.get("direct_min_mb"), case.get("auth", False),
        case.get("layout_once"),
    )  # fmt: skip
    expected = dict(stream)
    # destinations are touched before we measure: their pages are the model's, not the transfer's
    dest = {n: torch.zeros_like(t) for n, t in stream} if role > 0 else {}
    result = _peer_baselines(pg, case, role, stream, dest)
    _done(pg)  # all processes set up before the engine phase
    if role == 0:
        result.update(asyncio.run(_engine_send(cfg, stream, case["repeats"])))
    else:
        into = case.get("into", True)
        result.update(asyncio.run(_engine_receive(cfg, role, case["repeats"], into, dest, expected)))
    return result


def _peer_baselines(
    pg: Any, case: dict[str, Any], role: int, stream: list[tuple[str, torch.Tensor]], dest: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """The baselines over the raw group: per tensor only for the small case, else the raw broadcast (a reused
    and a model-sized buffer), per tensor and the pack loop; the receivers check, then zero, what arrived."""
    bucket = int(case["bucket_mb"] * MiB)
    repeats = case["repeats"]
    # the peers move the same tensors: from the stream (sender) into the destinations (receivers)
    tensors = [t for _, t in stream] if role == 0 else [dest[n] for n, _ in stream]
    if case["kind"] == "small":
        return {"baseline_s": _per_tensor_best(pg, tensors, repeats).seconds}
    total = sum(t.numel() * t.element_size() for _, t in stream)
    raw = _raw_best(pg, total, bucket, repeats)
    raw_model = _raw_model_memory_best(pg, total, bucket, repeats)
    per_tensor = _per_tensor_best(pg, tensors, repeats)
    pack_loop = _pack_loop_best(pg, tensors, bucket, role == 0, repeats)
    result = dict(
        baseline_s=raw.seconds, raw_cpu_s=raw.cpu_s, raw_model_s=raw_model.seconds, per_tensor_s=per_tensor.seconds,
        per_tensor_cpu_s=per_tensor.cpu_s, pack_loop_s=pack_loop.seconds, pack_loop_cpu_s=pack_loop.cpu_s,
    )  # fmt: skip
    if role > 0:  # the peer loops moved the right bytes (then the engine has to do it again)
        expected = dict(stream)
        for name, t in dest.items():
            assert torch.equal(t.view(torch.uint8), expected[name].view(torch.uint8)), name
            t.zero_()
    return result


async def _engine_send(cfg: Any, stream: list[tuple[str, torch.Tensor]], repeats: int) -> dict[str, Any]:
    """The sender's versions: best-of-`repeats` after the group-forming version 0, then one for memory."""
    from ..versions.sender import WeightSender

    engine = _Best()
    async with WeightSender(cfg) as sender:
        # version 0 forms the group; the last one is sampled for memory (the sampler thread takes CPU and
        # the GIL, so the timed versions run without it)
        for version in range(repeats + 2):
            t0, c0 = time.perf_counter(), time.process_time()
            with _RssPeak() if version == repeats + 1 else contextlib.nullcontext() as rss:
                stats = await sender.send_weights(stream, version=version)  # public API, no flag: a list is stable
            if 0 < version <= repeats:
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                if wall < engine.seconds:
                    engine.seconds, engine.cpu_s = wall, cpu
        assert rss is not None  # the last version ran under _RssPeak
        return {
            "peak_extra_bytes": rss.extra,
            "engine_s": engine.seconds,
            "engine_cpu_s": engine.cpu_s,
            "nbytes": stats.nbytes,
            "largest_bytes": max(t.numel() * t.element_size() for _, t in stream),
            "buckets": stats.num_buckets,
            "tensors": stats.num_tensors,
            "direct_buckets": stats.direct_buckets,
        }


async def _engine_receive(
    cfg: Any,
    role: int,
    repeats: int,
    into: bool,
    dest: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
) -> dict[str, Any]:
    """A receiver's versions, merged `into=` `dest` or assembled by the receiver; every byte checked."""
    from ..versions.receiver import WeightReceiver

    engine = _Best()
    async with WeightReceiver(cfg, identity=f"bench-{role}") as receiver:
        for version in range(repeats + 2):
            c0 = time.process_time()
            with _RssPeak() if version == repeats + 1 else contextlib.nullcontext() as rss:
                if into:
                    async for _name, _t in receiver.receive_weights(into=lambda m: dest[m.name]):
                        pass
                else:  # the receiver assembles each tensor itself; the consumer drops it at once
                    async for name, t in receiver.receive_weights():
                        if version == 0:  # the untimed warm-up version is checked bitwise
                            assert torch.equal(t.view(torch.uint8), expected[name].view(torch.uint8)), name
            cpu = time.process_time() - c0
            if 0 < version <= repeats and receiver.last_stats is not None:
                wall = receiver.last_stats.seconds
                if wall < engine.seconds:
                    engine.seconds, engine.cpu_s = wall, cpu
        assert rss is not None  # the last version ran under _RssPeak
        result: dict[str, Any] = {"peak_extra_bytes": rss.extra}
    result["engine_cpu_s"] = engine.cpu_s
    if into:  # the benchmark also checks what it moved, bitwise
        for name, t in dest.items():
            assert torch.equal(t.view(torch.uint8), expected[name].view(torch.uint8)), name
    return result


def _run_processes(world: int, case: dict[str, Any], timeout_s: float = 600) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ports = {"store": free_port(), "control": free_port()}
    procs = [ctx.Process(target=_worker, args=(r, world, ports, case, out), daemon=True) for r in range(world)]
    results = collect_workers(procs, out, timeout_s, f"benchmark case {case}")
    return [results[r] for r in range(world)]


def collect_workers(procs: list[Any], out: Any, timeout_s: float, what: str, join_s: float = 5) -> dict[int, Any]:
    """Start `procs`, gather one `(role, ok, value)` from each on `out` within `timeout_s` (a worker's
    traceback or the timeout raises, naming `what`), and always reap them (killed if still alive)."""
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < len(procs):
            try:
                role, ok, value = out.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue_mod.Empty:
                raise RuntimeError(f"{what} timed out after {timeout_s}s") from None
            if not ok:
                raise RuntimeError(f"benchmark worker {role} failed:\n{value}")
            results[role] = value
    finally:
        for p in procs:
            p.join(timeout=join_s)
            if p.is_alive():
                p.kill()
    return results


def _case(world: int, repeats: int, **case: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    sender, *receivers = _run_processes(world, {"repeats": repeats, **case})
    return sender, receivers


def _throughput_row(case: dict[str, Any], sender: dict[str, Any], receivers: list[dict[str, Any]]) -> dict[str, Any]:
    nbytes = sender["nbytes"]
    gib = nbytes / 2**30
    bucket = case["bucket_mb"] * MiB
    largest = sender.get("largest_bytes", 0)
    budget_receiver = 2 * bucket + (0 if case.get("into", True) else largest) + SLACK_BYTES
    engine_s = sender["engine_s"]
    row: dict[str, Any] = {
        **{
            k: case[k]
            for k in ("bucket_mb", "into", "model", "scale", "fraction", "direct_min_mb", "layout_once")
            if k in case
        },
        "auth": bool(case.get("auth", False)),
        "receivers": len(receivers),
        "total_mb": nbytes / MiB,
        "buckets": sender["buckets"],
        "tensors": sender.get("tensors", 0),
        "direct_buckets": sender["direct_buckets"],
        "engine_s": engine_s,
        "raw_s": sender["baseline_s"],
        "engine_s_per_GiB": engine_s / gib,
        "raw_s_per_GiB": sender["baseline_s"] / gib,
        "ratio": sender["baseline_s"] / engine_s,
        "sender_extra_mb": sender["peak_extra_bytes"] / MiB,
        "receiver_extra_mb": max(r["peak_extra_bytes"] for r in receivers) / MiB,
        "sender_budget_mb": (2 * bucket + SLACK_BYTES) / MiB,
        "receiver_budget_mb": budget_receiver / MiB,
    }
    # GB/s of every path, and the CPU seconds per GiB each side spent on it (the busiest receiver)
    for path, key in (
        ("engine", "engine"),
        ("raw", "baseline"),
        ("per_tensor", "per_tensor"),
        ("pack_loop", "pack_loop"),
    ):
        seconds = sender.get(f"{key}_s")
        if seconds is None:
            continue
        row[f"{path}_GBps"] = nbytes / seconds / 1e9
        cpu_key = "raw_cpu_s" if path == "raw" else f"{key}_cpu_s"
        if cpu_key in sender:
            row[f"{path}_sender_cpu_s_per_GiB"] = sender[cpu_key] / gib
            row[f"{path}_receiver_cpu_s_per_GiB"] = max(r[cpu_key] for r in receivers) / gib
    if "engine_cpu_s" in sender and sender["buckets"]:  # what one bucket costs the sender's CPU (pack, metadata, waits)
        row["engine_sender_cpu_ms_per_bucket"] = sender["engine_cpu_s"] / sender["buckets"] * 1e3
        if all("engine_cpu_s" in r for r in receivers):  # the same for the busiest receiver (unpack, metadata, waits)
            busiest = max(r["engine_cpu_s"] for r in receivers)
            row["engine_receiver_cpu_ms_per_bucket"] = busiest / sender["buckets"] * 1e3
    # the engine against each peer loop, measured in the same processes in the same run
    if "raw_model_s" in sender:  # the same broadcasts over the model's own memory: the limit for real bytes
        row["raw_model_GBps"] = nbytes / sender["raw_model_s"] / 1e9
        row["ratio_vs_raw_model"] = sender["raw_model_s"] / engine_s
    if "per_tensor_s" in sender:
        row["ratio_vs_per_tensor"] = sender["per_tensor_s"] / engine_s
        row["ratio_vs_pack_loop"] = sender["pack_loop_s"] / engine_s
        row["ratio_vs_best_peer"] = min(sender["per_tensor_s"], sender["pack_loop_s"]) / engine_s
    return row


def run(
    json_out: bool = False,
    *,
    scale: int = 4,
    bucket_mbs: tuple[float, ...] = (16, 64, 256),
    receivers: tuple[int, ...] = (1, 2, 3),
    fractions: tuple[float, ...] = (0.125, 0.25, 0.5),
    moe_scale: int = 4,
    repeats: int = 3,
    sections: tuple[str, ...] = ("throughput", "receivers", "auth", "growth", "small_tensors"),
    direct_min_mbs: tuple[float, ...] = (0.0, 0.25, 1.0, 4.0),
) -> dict[str, Any]:
    """Every section against a baseline measured in the same run, in the same processes:
    throughput (with and without `into=` destinations, per bucket size: ratio to a raw gloo broadcast
    of the same bytes; peak extra memory per side vs the documented budget), receivers (1..3 at 64 MiB),
    growth (seconds per GiB as the model grows, and for the fused-expert MoE shape), small tensors
    (the engine vs one broadcast per tensor, on loopback: see `bench.latency` for a real link)."""
    report: dict[str, Any] = {"goal_ratio": GOAL_THROUGHPUT, "goal_small_speedup": GOAL_SMALL_SPEEDUP}
    plan = _plan(sections, scale, bucket_mbs, receivers, fractions, moe_scale, direct_min_mbs)
    if "layout" in sections:  # the metadata path alone, in-process: what the knob changes, without the copies' noise
        from .layout import measure

        report["layout_metadata"] = [measure(64, mb) for mb in (0.25, 1.0)]
    _run_plan(plan, repeats, report)
    if json_out:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return report


def _plan(
    sections: tuple[str, ...],
    scale: int,
    bucket_mbs: tuple[float, ...],
    receivers: tuple[int, ...],
    fractions: tuple[float, ...],
    moe_scale: int,
    direct_min_mbs: tuple[float, ...],
) -> list[tuple[str, int, dict[str, Any]]]:
    """Every case of the chosen sections as (section, processes, case), in the order they run."""
    plan: list[tuple[str, int, dict[str, Any]]] = []
    if "throughput" in sections:
        plan += [
            ("throughput", 2, {"kind": "model", "scale": scale, "bucket_mb": bucket_mb, "into": into})
            for bucket_mb in bucket_mbs
            for into in (True, False)
        ]
    if "auth" in sections:  # the cost of CURVE + signing, next to the same case without a token
        plan += [
            ("auth", 2, {"kind": "model", "scale": scale, "bucket_mb": 64, "into": True, "auth": auth})
            for auth in (False, True)
        ]
    if "direct_min" in sections:  # how transport.direct_min_mb's default was chosen
        plan += [
            ("direct_min", 2, {"kind": "model", "scale": scale, "bucket_mb": 64, "into": True, "direct_min_mb": mb})
            for mb in direct_min_mbs
        ]
    if "receivers" in sections:
        plan += [
            ("receivers", n + 1, {"kind": "model", "scale": scale, "bucket_mb": 64, "into": True}) for n in receivers
        ]
    if "growth" in sections:
        shapes = [("qwen3-8b", scale, f) for f in (*fractions, 1.0)] + [("qwen3-30b-a3b", moe_scale, 1.0)]
        plan += [
            ("growth", 2, {"kind": "model", "model": model, "scale": s, "fraction": f, "bucket_mb": 64})
            for model, s, f in shapes
        ]
    if "layout" in sections:  # transport.layout_once off, then on: many small tensors, so many entries per bucket
        plan += [
            ("layout", 2, {"kind": "model", "scale": 64, "bucket_mb": bucket_mb, "into": True, "layout_once": once})
            for bucket_mb in (0.25, 1.0)
            for once in (False, True)
        ]
    if "small_tensors" in sections:
        plan.append(("small_tensors", 2, {"kind": "small", "scale": 64, "bucket_mb": 64}))
    return plan


def _run_plan(plan: list[tuple[str, int, dict[str, Any]]], repeats: int, report: dict[str, Any]) -> None:
    """Run every case with its progress line; its row goes into `report` under its section."""
    progress = CaseProgress("engine", len(plan))
    for section, world, case in plan:
        label = f"{section}: " + ", ".join(f"{k}={v}" for k, v in case.items() if k != "kind")
        with progress.case(f"{label}, {world - 1} receiver(s)"):
            sender, receivers_out = _case(world, repeats, **case)
        if section != "small_tensors":
            report.setdefault(section, []).append(_throughput_row(case, sender, receivers_out))
            continue
        report["small_tensors"] = {
            "tensors": len(_model_stream(64)),
            "total_mb": sender["nbytes"] / MiB,
            "engine_s": sender["engine_s"],
            "per_tensor_broadcast_s": sender["baseline_s"],
            "speedup": sender["baseline_s"] / sender["engine_s"],
            "link": "loopback (no latency: see `python -m lightning_weightsync.bench.latency` for a real link)",
        }


def _print(report: dict[str, Any]) -> None:
    head = (
        f"{'model':>14} {'scale':>5} {'frac':>5} {'bucket':>6} {'into':>4} {'auth':>4} {'recv':>4} {'MiB':>5} "
        f"{'direct':>6} | {'GB/s: engine':>12} {'raw':>5} {'model':>5} {'tensor':>6} {'pack':>5} | {'engine/raw':>10} "
        f"{'/model':>6} {'/best peer':>10} | {'CPU s/GiB send':>14} {'(raw)':>5} {'recv':>5} {'(raw)':>5} "
        f"{'send ms/bucket':>14} {'recv':>6} | "
        f"{'+MiB s/r':>9} {'budget s/r':>10}"
    )
    for section in ("throughput", "receivers", "auth", "direct_min", "layout", "growth"):
        if section not in report:
            continue
        print(
            f"== {section} (loopback gloo, same processes and run; raw = one reused buffer broadcast in bucket-sized "
            f"pieces, model = the same over a model-sized buffer, tensor = one in-place broadcast per tensor, "
            f"pack = synchronous pack/broadcast/unpack; "
            f"goal engine/raw >= {report['goal_ratio']})"
        )
        print(head + {"direct_min": "  direct_min_mb", "layout": "  layout_once"}.get(section, ""))
        for r in report[section]:
            best_peer = r.get("ratio_vs_best_peer")
            print(
                f"{r.get('model', 'qwen3-8b'):>14} {r['scale']:>5} {r.get('fraction', 1.0):>5.3g} "
                f"{r['bucket_mb']:>6g} {'yes' if r.get('into', True) else 'no':>4} {'yes' if r['auth'] else 'no':>4} "
                f"{r['receivers']:>4} {r['total_mb']:>5.0f} {r['direct_buckets']:>6} | "
                f"{r['engine_GBps']:>12.2f} {r['raw_GBps']:>5.2f} {r.get('raw_model_GBps', 0):>5.2f} "
                f"{r.get('per_tensor_GBps', 0):>6.2f} {r.get('pack_loop_GBps', 0):>5.2f} | {r['ratio']:>10.2f} "
                f"{r.get('ratio_vs_raw_model', float('nan')):>6.2f} "
                f"{best_peer if best_peer is not None else float('nan'):>10.2f} | "
                f"{r.get('engine_sender_cpu_s_per_GiB', 0):>14.3f} {r.get('raw_sender_cpu_s_per_GiB', 0):>5.3f} "
                f"{r.get('engine_receiver_cpu_s_per_GiB', 0):>5.3f} {r.get('raw_receiver_cpu_s_per_GiB', 0):>5.3f} "
                f"{r.get('engine_sender_cpu_ms_per_bucket', 0):>14.3f} "
                f"{r.get('engine_receiver_cpu_ms_per_bucket', 0):>6.3f} | "
                f"{r['sender_extra_mb']:>4.0f}/{r['receiver_extra_mb']:<4.0f} "
                f"{r['sender_budget_mb']:>5.0f}/{r['receiver_budget_mb']:<5.0f}"
                + (f"  {r['direct_min_mb']:g}" if "direct_min_mb" in r else "")
                + (f"  {'on' if r['layout_once'] else 'off'}" if "layout_once" in r else "")
            )
    for line in layout_summary(report.get("layout", [])):
        print(line)
    if report.get("layout_metadata"):
        from .layout import describe

        for row in report["layout_metadata"]:
            print("== " + describe(row))
    s = report.get("small_tensors")
    if s:
        print(
            f"== small tensors: {s['tensors']} tensors, {s['total_mb']:.1f} MiB: engine "
            f"{s['engine_s'] * 1e3:.1f} ms vs per-tensor broadcast {s['per_tensor_broadcast_s'] * 1e3:.1f} ms "
            f"-> {s['speedup']:.1f}x on {s['link']}"
        )


def layout_summary(rows: list[dict[str, Any]]) -> list[str]:
    """Per bucket size: what `transport.layout_once` saves each side's CPU per bucket, from the same run."""
    lines = []
    for bucket_mb in sorted({r["bucket_mb"] for r in rows}):
        pair = {r["layout_once"]: r for r in rows if r["bucket_mb"] == bucket_mb}
        if set(pair) != {False, True}:
            continue
        parts = []
        for side in ("sender", "receiver"):
            key = f"engine_{side}_cpu_ms_per_bucket"
            off, on = pair[False].get(key), pair[True].get(key)
            if off and on:
                parts.append(f"{side} {off:.3f} -> {on:.3f} ms/bucket ({on / off:.2f}x)")
        entries = pair[True].get("tensors", 0) / max(1, pair[True]["buckets"])
        lines.append(
            f"== layout once, {bucket_mb:g} MiB buckets (~{entries:.0f} entries each): "
            + "; ".join(parts)
            + f"; GB/s {pair[False]['engine_GBps']:.2f} -> {pair[True]['engine_GBps']:.2f}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--receivers", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--scale", type=int, default=4, help="divide every Qwen3-8B dimension by this")
    p.add_argument("--moe-scale", type=int, default=4, help="divide every Qwen3-30B-A3B dimension by this")
    p.add_argument("--bucket-mb", type=float, nargs="+", default=[16, 64, 256])
    p.add_argument("--fractions", type=float, nargs="+", default=[0.125, 0.25, 0.5])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--sections",
        nargs="+",
        default=["throughput", "receivers", "auth", "growth", "small_tensors"],
        help=(
            "throughput receivers auth growth small_tensors; also: direct_min (the transport.direct_min_mb sweep), "
            "layout (transport.layout_once off vs on)"
        ),
    )
    p.add_argument("--direct-min-mb", type=float, nargs="+", default=[0.0, 0.25, 1.0, 4.0])
    a = p.parse_args(argv)
    run(
        a.json,
        receivers=tuple(a.receivers),
        scale=a.scale,
        moe_scale=a.moe_scale,
        bucket_mbs=tuple(a.bucket_mb),
        fractions=tuple(a.fractions),
        repeats=a.repeats,
        sections=tuple(a.sections),
        direct_min_mbs=tuple(a.direct_min_mb),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
