"""Chunk protocol microbenchmark: split+pack and merge throughput as a ratio of plain torch memcpy.

What is measured, per tensor size (a stream of equal tensors, `total` bytes in all):
- memcpy: `bucket[a:b].copy_(src)` over the exact same (destination, source) byte ranges the split
  plans, precomputed, so it is the floor of what any packer must do;
- split+pack: `split_weight_chunks(weights, bucket_size)` and, for each chunk, the sender's
  `bucket[offset:offset + size].copy_(chunk)`;
- merge into=: `merge_weight_chunks(chunks, bucket_size, into=...)` over chunk views of a received
  bucket, writing into preallocated destinations (what the module sink does); its memcpy baseline
  copies the same bucket ranges into the same destinations;
- merge fresh: the same without `into=`, so each tensor is freshly allocated; this includes the
  allocator and first-touch page faults that `into=` exists to avoid, and is reported, not judged.

Baseline and subject run interleaved in one process, best of `repeats` runs each; ratios are
baseline_seconds / subject_seconds (1.0 = as fast as memcpy). Goal: >= 0.8 for tensors of 4 MiB+.

    python -m lightning_weightsync.bench.chunking [--json] [--bucket-mb 32] [--total-mb 256] [--device cuda]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..protocol.chunks import TensorMeta, merge_weight_chunks, split_weight_chunks

KiB = 1024
MiB = 1024 * KiB
DEFAULT_SIZES = (64 * KiB, 1 * MiB, 4 * MiB, 64 * MiB)
DEFAULT_BUCKET_SIZE = 32 * MiB
DEFAULT_TOTAL_BYTES = 256 * MiB
GOAL_RATIO = 0.8
GOAL_MIN_TENSOR_SIZE = 4 * MiB
SIZES: dict[str, dict[str, Any]] = {"small": {"total_bytes": 64 * MiB, "repeats": 2}, "default": {}}
"""`lightning-weightsync bench --size`: run() keyword arguments (default: the documented figures)."""
ESTIMATE_S = {"small": 10.0, "default": 140.0}
"""Seconds each size took on the 2-core development machine (printed before the run starts)."""


def _fmt_size(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fns: dict[str, Callable[[], None]], repeats: int, device: torch.device) -> dict[str, float]:
    """Run each function once to warm up, then `repeats` rounds, interleaved so drift hits all alike.

    The best (minimum) time of each is kept: on a shared machine, interference only ever adds time.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rnd in range(repeats + 1):
        for name, fn in fns.items():
            _synchronize(device)
            start = time.perf_counter()
            fn()
            _synchronize(device)
            if rnd:
                times[name].append(time.perf_counter() - start)
    return {name: min(ts) for name, ts in times.items()}


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def bench_one_size(
    tensor_size: int,
    *,
    bucket_size: int,
    total_bytes: int,
    repeats: int,
    device: torch.device,
    loop: asyncio.AbstractEventLoop,
) -> dict[str, Any]:
    """Measure one tensor size; returns seconds, GB/s and ratios for each path."""
    named = _stream(tensor_size, total_bytes, device)
    send_bucket = torch.zeros(bucket_size, dtype=torch.uint8, device=device)
    recv_bucket = torch.ones(bucket_size, dtype=torch.uint8, device=device)
    metas = _plan(named, bucket_size, loop)
    dests = {name: torch.empty_like(t) for name, t in named}
    paths = {
        **_pack_paths(named, metas, send_bucket, bucket_size, loop),
        **_merge_paths(metas, recv_bucket, dests, bucket_size, device, loop),
    }
    seconds = _best_seconds(paths, repeats, device)
    _check_the_work(paths, metas, named, send_bucket, dests)
    return _row(tensor_size, named, metas, seconds)


def _stream(tensor_size: int, total_bytes: int, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """`total_bytes` of equal tensors of `tensor_size` bytes, named like a checkpoint's layers."""
    num_tensors = max(1, total_bytes // tensor_size)
    # bf16, like real checkpoints; the content does not matter, but every page must be touched.
    tensors = [
        torch.empty(tensor_size // 2, dtype=torch.bfloat16, device=device).fill_(i % 97) for i in range(num_tensors)
    ]
    return [(f"model.layers.{i}.weight", t) for i, t in enumerate(tensors)]


def _plan(named: list[tuple[str, torch.Tensor]], bucket_size: int, loop: asyncio.AbstractEventLoop) -> list[TensorMeta]:
    """The split's chunks, untimed: where each lands in the bucket, for the baselines and the merge."""

    async def plan() -> list[TensorMeta]:
        return [meta async for meta, _ in split_weight_chunks(named, bucket_size)]

    return loop.run_until_complete(plan())


def _pack_paths(
    named: list[tuple[str, torch.Tensor]],
    metas: list[TensorMeta],
    send_bucket: torch.Tensor,
    bucket_size: int,
    loop: asyncio.AbstractEventLoop,
) -> dict[str, Callable[[], None]]:
    """The send side: memcpy over the planned byte ranges (the floor), then split + the sender's copy."""
    sources = {name: _bytes_of(t) for name, t in named}
    pack_pairs = [
        (
            send_bucket[m.offset : m.offset + m.chunk_size],
            sources[m.name][m.chunk_offset : m.chunk_offset + m.chunk_size],
        )
        for m in metas
        if m.offset is not None
    ]

    def memcpy_pack() -> None:
        for dst, src in pack_pairs:
            dst.copy_(src)

    async def _split_pack() -> None:
        async for meta, data in split_weight_chunks(named, bucket_size):
            if meta.chunk_size:
                assert meta.offset is not None  # the split places every chunk it yields
                send_bucket[meta.offset : meta.offset + meta.chunk_size].copy_(data)

    def split_pack() -> None:
        loop.run_until_complete(_split_pack())

    return {"memcpy_pack": memcpy_pack, "split_pack": split_pack}


def _merge_paths(
    metas: list[TensorMeta],
    recv_bucket: torch.Tensor,
    dests: dict[str, torch.Tensor],
    bucket_size: int,
    device: torch.device,
    loop: asyncio.AbstractEventLoop,
) -> dict[str, Callable[[], None]]:
    """The receive side: memcpy of the bucket's ranges into `dests` (the floor), merge into=, merge fresh."""
    # merge: chunk views of the receive bucket, exactly as the receiver hands them over
    chunks = [(m, recv_bucket[m.offset : m.offset + m.chunk_size]) for m in metas if m.offset is not None]
    dest_bytes = {name: _bytes_of(t) for name, t in dests.items()}
    merge_pairs = [(dest_bytes[m.name][m.chunk_offset : m.chunk_offset + m.chunk_size], c) for m, c in chunks]

    def memcpy_merge() -> None:
        for dst, src in merge_pairs:
            dst.copy_(src)

    async def _merge(into: Callable[[TensorMeta], torch.Tensor | None] | None) -> None:
        async for _name, _tensor in merge_weight_chunks(chunks, bucket_size, into=into, device=device):
            pass

    def merge_into() -> None:
        loop.run_until_complete(_merge(lambda meta: dests[meta.name]))

    def merge_fresh() -> None:
        loop.run_until_complete(_merge(None))

    return {"memcpy_merge": memcpy_merge, "merge_into": merge_into, "merge_fresh": merge_fresh}


def _check_the_work(
    paths: dict[str, Callable[[], None]],
    metas: list[TensorMeta],
    named: list[tuple[str, torch.Tensor]],
    send_bucket: torch.Tensor,
    dests: dict[str, torch.Tensor],
) -> None:
    """The benchmark is only meaningful if the subjects did the work: spot-check the last chunk's bytes."""
    paths["split_pack"]()
    last = metas[-1]
    assert last.offset is not None
    source = _bytes_of(dict(named)[last.name])[last.chunk_offset : last.chunk_offset + last.chunk_size]
    assert torch.equal(send_bucket[last.offset : last.offset + last.chunk_size], source)
    paths["merge_into"]()
    assert bool((_bytes_of(dests[last.name])[last.chunk_offset : last.chunk_offset + last.chunk_size] == 1).all())


def _row(
    tensor_size: int, named: list[tuple[str, torch.Tensor]], metas: list[TensorMeta], seconds: dict[str, float]
) -> dict[str, Any]:
    """One size's report row: seconds, GB/s of every path, each subject's ratio to its memcpy baseline."""
    nbytes = sum(t.nbytes for _, t in named)

    def gbps(key: str) -> float:
        return nbytes / seconds[key] / 1e9

    return {
        "tensor_size": tensor_size,
        "num_tensors": len(named),
        "num_chunks": len(metas),
        "nbytes": nbytes,
        "seconds": seconds,
        "memcpy_pack_gbps": gbps("memcpy_pack"),
        "split_pack_gbps": gbps("split_pack"),
        "split_pack_ratio": seconds["memcpy_pack"] / seconds["split_pack"],
        "memcpy_merge_gbps": gbps("memcpy_merge"),
        "merge_into_gbps": gbps("merge_into"),
        "merge_into_ratio": seconds["memcpy_merge"] / seconds["merge_into"],
        "merge_fresh_gbps": gbps("merge_fresh"),
        "merge_fresh_ratio": seconds["memcpy_merge"] / seconds["merge_fresh"],
    }


def run(
    json_out: bool = False,
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    bucket_size: int = DEFAULT_BUCKET_SIZE,
    total_bytes: int = DEFAULT_TOTAL_BYTES,
    repeats: int = 5,
    device: str = "cpu",
) -> dict[str, Any]:
    """Run the benchmark, print a table (or JSON with `json_out`), and return the results."""
    dev = torch.device(device)
    loop = asyncio.new_event_loop()
    try:
        rows = [
            bench_one_size(
                size, bucket_size=bucket_size, total_bytes=total_bytes, repeats=repeats, device=dev, loop=loop
            )
            for size in sizes
        ]
    finally:
        loop.close()
    judged = [r for r in rows if r["tensor_size"] >= GOAL_MIN_TENSOR_SIZE]
    result: dict[str, Any] = {
        "benchmark": "chunking",
        "device": str(dev),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "bucket_size": bucket_size,
        "total_bytes": total_bytes,
        "repeats": repeats,
        "goal": {"ratio": GOAL_RATIO, "min_tensor_size": GOAL_MIN_TENSOR_SIZE},
        "results": rows,
        "meets_goal": all(min(r["split_pack_ratio"], r["merge_into_ratio"]) >= GOAL_RATIO for r in judged),
    }
    if json_out:
        print(json.dumps(result, indent=2))
    else:
        _print_table(result)
    return result


def _print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=(
            f"chunking on {result['device']}: bucket {_fmt_size(result['bucket_size'])}, "
            f"{_fmt_size(result['total_bytes'])} per run, best of {result['repeats']}, "
            f"{result['threads']} threads; GB/s and ratio to memcpy"
        )
    )
    for col in ("tensors", "chunks", "memcpy", "split+pack", "ratio", "merge into=", "ratio", "merge fresh", "ratio"):
        table.add_column(col, justify="right")
    for r in result["results"]:
        judged = r["tensor_size"] >= GOAL_MIN_TENSOR_SIZE

        def ratio(x: float, judged: bool = judged) -> str:
            style = "" if not judged else ("green" if x >= GOAL_RATIO else "red")
            return f"[{style}]{x:.2f}[/]" if style else f"{x:.2f}"

        table.add_row(
            f"{_fmt_size(r['tensor_size'])} x{r['num_tensors']}",
            str(r["num_chunks"]),
            f"{r['memcpy_pack_gbps']:.1f}",
            f"{r['split_pack_gbps']:.1f}",
            ratio(r["split_pack_ratio"]),
            f"{r['merge_into_gbps']:.1f}",
            ratio(r["merge_into_ratio"]),
            f"{r['merge_fresh_gbps']:.1f}",
            f"{r['merge_fresh_ratio']:.2f}",
        )
    console = Console(width=max(100, Console().width))
    console.print(table)
    verdict = "met" if result["meets_goal"] else "NOT met"
    console.print(
        f"goal (split+pack and merge into= >= {GOAL_RATIO} x memcpy for tensors >= "
        f"{_fmt_size(GOAL_MIN_TENSOR_SIZE)}): {verdict}. 'merge fresh' allocates every tensor "
        "(allocator + page faults) and is not judged."
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_SIZE / MiB, help="bucket size in MiB")
    parser.add_argument("--total-mb", type=float, default=DEFAULT_TOTAL_BYTES / MiB, help="bytes per run in MiB")
    parser.add_argument(
        "--sizes-kb",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[s // KiB for s in DEFAULT_SIZES],
        help="comma-separated tensor sizes in KiB",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    args = parser.parse_args(argv)
    result = run(
        args.json,
        sizes=[s * KiB for s in args.sizes_kb],
        bucket_size=int(args.bucket_mb * MiB),
        total_bytes=int(args.total_mb * MiB),
        repeats=args.repeats,
        device=args.device,
    )
    return 0 if result["meets_goal"] else 1


if __name__ == "__main__":
    sys.exit(main())
