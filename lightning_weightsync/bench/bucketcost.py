"""What a bucket costs the engine beyond its bytes, per backend this machine can run (gloo and shm, two
processes on this host), each figure against a baseline measured in the same run, in the same processes.

- fixed cost a bucket (fit): the same stream (`total_mb` of equal tensors that never fill a bucket, so every
  byte is packed and merged at every bucket size) sent at several bucket sizes; a least-squares line of the
  seconds a version takes against its bucket count: the slope is what one bucket costs beyond its bytes, the
  intercept the bytes' (and the version's) own cost.
- fixed cost a bucket (tiny): `tiny_tensors` tensors of 3 KiB in 4 KiB buckets (about one a bucket) against
  the same stream in one bucket: the difference a bucket, with next to no bytes to copy.
- per tensor: the tiny stream in one bucket against a version of one tensor (both sides' work on a tensor,
  one after the other: in one bucket nothing overlaps).
- copy: the engine's GB/s at each bucket size, and the bytes' cost from the fit's intercept less a version's
  own (`total_mb` over intercept minus the one-tensor version: each tensor's own cost is still in it), each
  against the same-run baseline:
  one memcpy of the same bytes (shm: the engine's floor is two of them, pack and merge, so 0.5 x) or one raw
  gloo broadcast of them (gloo; its own per-broadcast cost is fitted too, from the same bytes broadcast in
  bucket-sized pieces).

A fixed cost is also given as the bytes the baseline moves in that time, and as a multiple of the time the
baseline takes to move a 1 MiB bucket. Each version's time is the sender's `send_weights` (metadata, acks,
merging all in), best of `versions` after the group-forming one; the receiver checks what arrived, bitwise.

    python -m lightning_weightsync.bench.bucketcost [--json] [--backends gloo shm] [--total-mb 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

import torch

from ..transport.process import free_port
from . import CaseProgress
from .throughput import collect_workers, raw_bytes_seconds, raw_group

KiB = 1024
MiB = 1024 * KiB
# 3/4 of the smallest bucket measured by default: no chunk ever fills a bucket (so none goes direct), and a
# tensor's own cost (~20 us) stays small next to its bytes
TENSOR_BYTES = 768 * KiB
TINY_TENSOR_BYTES = 3 * KiB
TINY_BUCKET_MB = 4 / 1024  # 4 KiB: about one tiny tensor a bucket
ONE_BUCKET_MB = 4.0  # holds the whole tiny stream (up to 1365 tensors of 3 KiB)
BACKENDS = ("gloo", "shm")
SIZES: dict[str, dict[str, Any]] = {
    "small": {"total_mb": 8, "bucket_mbs": (1.0, 8.0), "tiny_tensors": 64, "versions": 3},
    "default": {},
}
"""`lightning-weightsync bench --size`: run() keyword arguments (default: the documented figures)."""
ESTIMATE_S = {"small": 40.0, "default": 150.0}
"""Seconds each size took on the 2-core development machine (printed before the run starts)."""


def _cfg(backend: str, port: int, bucket_mb: float) -> Any:
    from ..config import load_config

    return load_config(
        overrides=[
            f"transport.backend={backend}",
            f"transport.port={port}",
            f"transport.bucket_size_mb={bucket_mb}",
            "transport.timeout_s=120",
            "transport.ready_timeout_s=60",
            "transport.heartbeat_interval_s=0.5",
            "trainer.min_receivers=1",
        ]
    )


def _stream(kind: str, total: int, tiny_tensors: int) -> list[tuple[str, torch.Tensor]]:
    """`bytes`: equal tensors of `TENSOR_BYTES` adding up to about `total`; `tiny`: `tiny_tensors` of 3 KiB;
    `one`: a single tiny tensor. Random bytes from a fixed seed, so both processes build the same ones."""
    size, count = {"bytes": (TENSOR_BYTES, total // TENSOR_BYTES), "tiny": (TINY_TENSOR_BYTES, tiny_tensors),
                   "one": (TINY_TENSOR_BYTES, 1)}[kind]  # fmt: skip
    gen = torch.Generator().manual_seed(len(kind) * 1000 + count)
    return [
        (f"{kind}.{i}.weight", torch.randint(-(2**31), 2**31 - 1, (size // 4,), dtype=torch.int32, generator=gen))
        for i in range(count)
    ]


def stream_bytes(total_mb: float) -> int:
    """The bytes of the `bytes` stream: whole tensors of `TENSOR_BYTES`, at most `total_mb` (at least one)."""
    return max(1, int(total_mb * MiB) // TENSOR_BYTES) * TENSOR_BYTES


def _cases(bucket_mbs: tuple[float, ...]) -> list[tuple[str, float]]:
    """Every engine case of one backend as (stream, bucket_mb), in the order they run."""
    return [("bytes", mb) for mb in bucket_mbs] + [("tiny", TINY_BUCKET_MB), ("tiny", ONE_BUCKET_MB),
                                                   ("one", ONE_BUCKET_MB)]  # fmt: skip


def _best(fn: Any, repeats: int) -> float:
    fn()  # warm-up: pages touched, caches filled
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _memcpy_seconds(total: int, repeats: int) -> float:
    """One `copy_` of `total` bytes between two buffers of this process: the floor of any copy."""
    src, dst = torch.ones(total, dtype=torch.uint8), torch.zeros(total, dtype=torch.uint8)
    return _best(lambda: dst.copy_(src), repeats)


def _worker(role: int, params: dict[str, Any], queues: tuple[Any, Any], out: Any) -> None:
    try:
        out.put((role, True, _run_role(role, params, queues)))
    except BaseException:
        out.put((role, False, traceback.format_exc()))


def _run_role(role: int, params: dict[str, Any], queues: tuple[Any, Any]) -> dict[str, Any]:
    """One process (role 0 sends): per backend its baseline, then every engine case."""
    torch.set_num_threads(1)
    to_receiver, to_sender = queues
    total, repeats = stream_bytes(params["total_mb"]), params["versions"]
    pg = raw_group(role, 2, params["store_port"])
    result: dict[str, Any] = {}
    if role == 0:
        result["memcpy_s"] = _memcpy_seconds(total, repeats)
    # the raw broadcasts of the stream's bytes in bucket-sized pieces, every rank taking part
    result["raw_s"] = {mb: raw_bytes_seconds(pg, total, int(mb * MiB), repeats) for mb in params["bucket_mbs"]}
    for backend in params["backends"]:
        result[backend] = {}
        for kind, mb in _cases(params["bucket_mbs"]):
            stream = _stream(kind, total, params["tiny_tensors"])
            if role == 0:
                row = asyncio.run(_send(backend, mb, stream, repeats, to_receiver, to_sender))
            else:
                row = asyncio.run(_receive(backend, mb, stream, repeats, to_receiver, to_sender))
            result[backend][f"{kind}@{mb:g}"] = row
    return result


def _get(queue: Any, what: str) -> Any:
    try:
        return queue.get(timeout=120)
    except Exception:
        raise RuntimeError(f"bucketcost: no {what} from the other process within 120 s") from None


async def _send(
    backend: str, bucket_mb: float, stream: list[tuple[str, torch.Tensor]], repeats: int, to_receiver: Any,
    to_sender: Any,
) -> dict[str, Any]:  # fmt: skip
    """Version 0 forms the group (untimed); then the best of `repeats` versions."""
    from ..versions.sender import WeightSender

    seconds = []
    async with WeightSender(_cfg(backend, 0, bucket_mb)) as sender:
        to_receiver.put(sender.port)
        for version in range(repeats + 1):
            if version == 1:
                cpu0 = time.process_time()
            t0 = time.perf_counter()
            stats = await sender.send_weights(stream, version=version)
            if version:
                seconds.append(time.perf_counter() - t0)
        cpu = (time.process_time() - cpu0) / repeats
    _get(to_sender, "end of the case")  # the receiver checked its bytes and closed
    return {"seconds": min(seconds), "seconds_all": seconds, "buckets": stats.num_buckets, "cpu_s": cpu,
            "direct_buckets": stats.direct_buckets, "tensors": stats.num_tensors, "nbytes": stats.nbytes}  # fmt: skip


async def _receive(
    backend: str, bucket_mb: float, stream: list[tuple[str, torch.Tensor]], repeats: int, to_receiver: Any,
    to_sender: Any,
) -> dict[str, Any]:  # fmt: skip
    """Into preallocated destinations (the module sink's streaming apply); version 0's bytes are checked."""
    from ..versions.receiver import WeightReceiver

    port = _get(to_receiver, "sender port")
    dest = {name: torch.full_like(t, 0x5A5A5A5A) for name, t in stream}
    seconds = []
    async with WeightReceiver(_cfg(backend, port, bucket_mb), identity="bucketcost") as receiver:
        for version in range(repeats + 1):
            async for _ in receiver.receive_weights(into=lambda m: dest[m.name]):
                pass
            if version == 0:
                wrong = [n for n, t in stream if not torch.equal(dest[n], t)]
                if wrong:
                    raise AssertionError(f"{backend}: {len(wrong)} tensors differ after version 0, e.g. {wrong[0]}")
                cpu0 = time.process_time()
            elif receiver.last_stats is not None:
                seconds.append(receiver.last_stats.seconds)
        cpu = (time.process_time() - cpu0) / repeats
    to_sender.put("done")
    return {"receive_seconds": min(seconds) if seconds else None, "cpu_s": cpu}


def _fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = intercept + slope * x over (x, y) points: (slope, intercept)."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return slope, my - slope * mx


def _cpu_per_bucket(cases: dict[str, Any], tiny: dict[str, Any], tiny_one: dict[str, Any]) -> float:
    """One side's CPU time (every thread of its process) a tiny bucket, beyond the same stream in one bucket."""
    extra = cases[f"tiny@{TINY_BUCKET_MB:g}"]["cpu_s"] - cases[f"tiny@{ONE_BUCKET_MB:g}"]["cpu_s"]
    return extra / max(1, tiny["buckets"] - tiny_one["buckets"])


def _cpu_per_tensor(cases: dict[str, Any], tiny_one: dict[str, Any], one: dict[str, Any]) -> float:
    """One side's CPU time a tensor: the tiny stream in one bucket beyond a one-tensor version."""
    extra = cases[f"tiny@{ONE_BUCKET_MB:g}"]["cpu_s"] - cases[f"one@{ONE_BUCKET_MB:g}"]["cpu_s"]
    return extra / max(1, tiny_one["tensors"] - one["tensors"])


def _cpu_figures(
    sides: dict[str, dict[str, Any]], tiny: dict[str, Any], tiny_one: dict[str, Any], one: dict[str, Any]
) -> dict[str, dict[str, float]]:
    """CPU, not wall time: what each side's process spends a bucket and a tensor, whoever waits for whom."""
    return {
        "cpu_us_per_bucket": {side: _cpu_per_bucket(c, tiny, tiny_one) * 1e6 for side, c in sides.items()},
        "cpu_us_per_tensor": {side: _cpu_per_tensor(c, tiny_one, one) * 1e6 for side, c in sides.items()},
    }


def _backend_row(
    backend: str, sender: dict[str, Any], receiver: dict[str, Any], params: dict[str, Any]
) -> dict[str, Any]:
    """One backend's figures from both processes' measurements; every ratio against this run's baseline."""
    cases, total = sender[backend], stream_bytes(params["total_mb"])
    bucket_mbs = params["bucket_mbs"]
    by_size = [cases[f"bytes@{mb:g}"] for mb in bucket_mbs]
    assert all(c["nbytes"] == total for c in by_size), "the engine moved other bytes than the baseline"
    slope, intercept = _fit([(c["buckets"], c["seconds"]) for c in by_size])
    tiny, tiny_one, one = (
        cases[f"tiny@{TINY_BUCKET_MB:g}"],
        cases[f"tiny@{ONE_BUCKET_MB:g}"],
        cases[f"one@{ONE_BUCKET_MB:g}"],
    )
    tiny_fixed = (tiny["seconds"] - tiny_one["seconds"]) / max(1, tiny["buckets"] - tiny_one["buckets"])
    per_tensor = (tiny_one["seconds"] - one["seconds"]) / max(1, tiny_one["tensors"] - one["tensors"])
    # the baseline: one memcpy of the bytes (shm), one raw broadcast of them (gloo, largest piece measured)
    largest = max(bucket_mbs)
    if backend == "shm":
        baseline, baseline_name = sender["memcpy_s"], "one memcpy"
        base_slope = None
    else:
        baseline, baseline_name = sender["raw_s"][largest], "one raw gloo broadcast"
        pieces = [(-(-total // int(mb * MiB)), sender["raw_s"][mb]) for mb in bucket_mbs]
        base_slope = _fit(pieces)[0]
    base_bps = total / baseline
    copy_s = intercept - one["seconds"]  # the fit's bucket-free part less a version's own cost
    row: dict[str, Any] = {
        "backend": backend,
        "baseline": baseline_name,
        "total_mb": total / MiB,
        "tensors": by_size[0]["tensors"],
        "direct_buckets": sum(c["direct_buckets"] for c in by_size),
        "baseline_s": baseline,
        "baseline_GBps": base_bps / 1e9,
        "memcpy_GBps": total / sender["memcpy_s"] / 1e9,
        "fixed_us_per_bucket_fit": slope * 1e6,
        "fixed_us_per_bucket_tiny": tiny_fixed * 1e6,
        "tiny_buckets": tiny["buckets"],
        **_cpu_figures({"sender": cases, "receiver": receiver[backend]}, tiny, tiny_one, one),
        "per_tensor_us": per_tensor * 1e6,
        "version_ms": one["seconds"] * 1e3,
        "intercept_ms": intercept * 1e3,
        # what the baseline moves in the time of one bucket's fixed cost; that cost against its time for 1 MiB
        "fixed_in_baseline_mib": slope * base_bps / MiB,
        "fixed_vs_baseline_1mib": slope / (MiB / base_bps),
        "copy_GBps": total / copy_s / 1e9 if copy_s > 0 else None,
        "copy_ratio": baseline / copy_s if copy_s > 0 else None,
        "sizes": _size_rows(bucket_mbs, by_size, total, baseline),
    }
    if base_slope is not None:
        row["baseline_fixed_us_per_piece"] = base_slope * 1e6
        row["fixed_vs_baseline_piece"] = slope / base_slope if base_slope > 0 else None
    return row


def _size_rows(
    bucket_mbs: Sequence[float], by_size: list[dict[str, Any]], total: int, baseline: float
) -> list[dict[str, Any]]:
    """Each bucket size's version: its speed, and that speed against this run's baseline."""
    return [
        {
            "bucket_mb": mb,
            "buckets": c["buckets"],
            "seconds": c["seconds"],
            "GBps": total / c["seconds"] / 1e9,
            "ratio": baseline / c["seconds"],
            "us_per_bucket": c["seconds"] / c["buckets"] * 1e6,
        }
        for mb, c in zip(bucket_mbs, by_size, strict=True)
    ]


def run(
    json_out: bool = False,
    *,
    backends: tuple[str, ...] = BACKENDS,
    total_mb: float = 64,
    bucket_mbs: tuple[float, ...] = (1.0, 2.0, 4.0, 16.0, 64.0),
    tiny_tensors: int = 256,
    versions: int = 5,
) -> dict[str, Any]:
    """Per backend: the fixed cost a bucket (fit and tiny), a tensor's and a version's, and the copy cost, each
    against a baseline measured in the same run, in the same two processes."""
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        raise ValueError(f"bucketcost runs backends {BACKENDS} on CPU, not {unknown}: pick from those (--backends)")
    if len(bucket_mbs) < 2 or min(bucket_mbs) * MiB <= TENSOR_BYTES:
        raise ValueError(
            f"bucketcost fits a line through at least 2 bucket sizes, each above {TENSOR_BYTES // KiB} KiB (its "
            f"tensors' size, so none fills a bucket): got {bucket_mbs} (--bucket-mb)"
        )
    params = {"backends": backends, "total_mb": total_mb, "bucket_mbs": tuple(bucket_mbs),
              "tiny_tensors": tiny_tensors, "versions": versions, "store_port": free_port()}  # fmt: skip
    progress = CaseProgress("bucketcost", 1)
    label = f"{', '.join(backends)}: {total_mb:g} MiB at {', '.join(f'{mb:g}' for mb in bucket_mbs)} MiB buckets"
    with progress.case(label):
        ctx = mp.get_context("spawn")
        out, queues = ctx.Queue(), (ctx.Queue(), ctx.Queue())
        procs = [ctx.Process(target=_worker, args=(r, params, queues, out), daemon=True) for r in range(2)]
        results = collect_workers(procs, out, 120 + 60 * len(backends) * len(_cases(bucket_mbs)), "bucketcost")
    sender = results[0]
    report = {
        "params": {k: v for k, v in params.items() if k != "store_port"},
        # the sender's own baselines of this run, which every ratio below divides
        "measured": {"memcpy_s": sender["memcpy_s"], "raw_s": {f"{mb:g}": s for mb, s in sender["raw_s"].items()}},
        "backends": [_backend_row(b, sender, results[1], params) for b in backends],
    }
    if json_out:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return report


def _num(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def _print(report: dict[str, Any]) -> None:
    for r in report["backends"]:
        print(
            f"== {r['backend']}: {r['total_mb']:.0f} MiB in {r['tensors']} tensors, baseline {r['baseline']} "
            f"{r['baseline_GBps']:.2f} GB/s (memcpy {r['memcpy_GBps']:.2f}), same run"
        )
        print(
            f"   fixed cost a bucket: {r['fixed_us_per_bucket_fit']:.0f} us (fit), "
            f"{r['fixed_us_per_bucket_tiny']:.0f} us ({r['tiny_buckets']} tiny buckets) = the baseline moving "
            f"{r['fixed_in_baseline_mib']:.2f} MiB, {r['fixed_vs_baseline_1mib']:.1f} x its time for 1 MiB"
            + (
                f"; raw broadcast {r['baseline_fixed_us_per_piece']:.0f} us a piece "
                f"({_num(r['fixed_vs_baseline_piece'], '.1f')} x)"
                if "baseline_fixed_us_per_piece" in r
                else ""
            )
        )
        cpu, per_tensor = r["cpu_us_per_bucket"], r["cpu_us_per_tensor"]
        print(
            f"   CPU (every thread) a tiny bucket: sender {cpu['sender']:.0f} us, receiver {cpu['receiver']:.0f} us; "
            f"a tensor: sender {per_tensor['sender']:.1f} us, receiver {per_tensor['receiver']:.1f} us"
        )
        print(
            f"   a tensor {r['per_tensor_us']:.0f} us, a version {r['version_ms']:.1f} ms; copy "
            f"{_num(r['copy_GBps'], '.2f')} GB/s = {_num(r['copy_ratio'], '.2f')} x baseline"
        )
        print(f"   {'bucket MiB':>10} {'buckets':>7} {'ms':>8} {'GB/s':>6} {'x base':>6} {'us/bucket':>9}")
        for s in r["sizes"]:
            print(
                f"   {s['bucket_mb']:>10g} {s['buckets']:>7} {s['seconds'] * 1e3:>8.1f} {s['GBps']:>6.2f} "
                f"{s['ratio']:>6.2f} {s['us_per_bucket']:>9.0f}"
            )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--total-mb", type=float, default=64)
    p.add_argument("--bucket-mb", type=float, nargs="+", default=[1.0, 2.0, 4.0, 16.0, 64.0])
    p.add_argument("--tiny-tensors", type=int, default=256)
    p.add_argument("--versions", type=int, default=5, help="timed versions per case (best of)")
    a = p.parse_args(argv)
    run(a.json, backends=tuple(a.backends), total_mb=a.total_mb, bucket_mbs=tuple(a.bucket_mb),
        tiny_tensors=a.tiny_tensors, versions=a.versions)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
