"""What `transport.layout_once` saves, per bucket and per side, on the metadata path alone.

End to end (`bench.throughput --sections layout`) a bucket's CPU is mostly its copies and the per-tensor Python
around them, and on a shared two-core machine the run-to-run noise of that (10-15 %) hides what the layout
changes. This measures the part the knob changes, with the library's own functions, best of many repeats:

    sender:   the bucket's metadata (the held layout compared and recorded, or the entries listed) and its seal
    receiver: unseal (decode + validate), expand from the held layout, record, and the entries as TensorMetas

for every bucket of one version of a model stream, with the knob off (every entry listed) and on (every
bucket named by the held layout: a version cut like the last one).

    python -m lightning_weightsync.bench.layout [--scale 64] [--bucket-mb 1 0.25] [--json]
"""

from __future__ import annotations

import argparse
import json
import timeit
from typing import Any

import torch

from ..protocol.layout import Layout, LayoutRecorder, no_layout
from ..protocol.messages import BucketMeta, Seal, seal, unseal
from ..versions.planner import BucketPlanner, Flush
from .inventory import model_stream

MiB = 1 << 20
KEY = b"layout-bench-key-0123456789abcdef"


def _flushes(scale: int, bucket_mb: float) -> list[Flush]:
    """One version's buckets, planned as the sender plans them (no direct sends: every bucket is metadata)."""
    planner = BucketPlanner(int(bucket_mb * MiB))
    steps: list[Flush] = []
    for name, tensor in model_stream("qwen3-8b", scale=scale, extras=False):
        steps += [s for s in planner.add(name, tensor) if isinstance(s, Flush)]
    steps.append(planner.finish())
    return steps


def _send(flushes: list[Flush], held: Layout | None, once: bool) -> tuple[list[list[bytes]], Layout | None]:
    recorder = LayoutRecorder() if once else None
    frames = []
    for i, step in enumerate(flushes):
        entries, layout = step.entries, ""
        if recorder is not None and recorder.add(step.nbytes, step.is_last, step.entries, held) and held is not None:
            entries, layout = [], held.digest
        meta = BucketMeta(1, step.index, step.is_last, step.nbytes, entries, layout=layout)
        frames.append(seal(meta, KEY, Seal("s", "sender", i, False)))
    return frames, recorder.finish() if recorder is not None else None


def _receive(frames: list[list[bytes]], held: Layout | None, once: bool) -> int:
    recorder = LayoutRecorder() if once else None
    expand = held.expand if held is not None else no_layout
    count = 0
    for f in frames:
        msg, _ = unseal(f, KEY, to_sender=False, bucket_size=1 << 40)
        assert isinstance(msg, BucketMeta)
        named = bool(msg.layout)
        meta = expand(msg)
        if recorder is not None:
            recorder.add(meta.nbytes, meta.is_last, meta.entries, held)
        metas = held.buckets[meta.bucket_index].metas if named and held is not None else None
        count += len(metas if metas is not None else [e.to_meta() for e in meta.entries])
    return count


def _best(run: Any, number: int, repeat: int) -> float:
    """Seconds per call, the best of `repeat` rounds of `number` calls (the least disturbed)."""
    return min(timeit.repeat(run, number=number, repeat=repeat)) / number


def measure(scale: int, bucket_mb: float, number: int = 20, repeat: int = 7) -> dict[str, Any]:
    torch.manual_seed(0)
    flushes = _flushes(scale, bucket_mb)
    entries = sum(len(s.entries) for s in flushes)
    _, held = _send(flushes, None, True)  # the version before: what both ends hold
    row: dict[str, Any] = {"scale": scale, "bucket_mb": bucket_mb, "buckets": len(flushes), "entries": entries}
    for once in (False, True):
        have = held if once else None
        frames, _ = _send(flushes, have, once)
        assert _receive(frames, have, once) == entries  # every entry arrives, either way
        per_bucket = 1e3 / len(flushes)
        send = _best(lambda h=have, o=once: _send(flushes, h, o), number, repeat)
        recv = _best(lambda f=frames, h=have, o=once: _receive(f, h, o), number, repeat)
        arm = "on" if once else "off"
        row[f"sender_ms_per_bucket_{arm}"] = send * per_bucket
        row[f"receiver_ms_per_bucket_{arm}"] = recv * per_bucket
        row[f"frame_bytes_per_bucket_{arm}"] = sum(len(f[2]) for f in frames) / len(flushes)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=int, default=64)
    p.add_argument("--bucket-mb", type=float, nargs="+", default=[1.0, 0.25])
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    rows = [measure(a.scale, mb) for mb in a.bucket_mb]
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        print(describe(r))
    return 0


def describe(r: dict[str, Any]) -> str:
    """One `measure` row as a line: off -> on, per bucket, each side, and the bucket's metadata frame."""
    return (
        f"layout once, metadata path, {r['bucket_mb']:g} MiB buckets ({r['entries'] / r['buckets']:.0f} entries "
        f"each, {r['buckets']} buckets): sender {r['sender_ms_per_bucket_off']:.3f} -> "
        f"{r['sender_ms_per_bucket_on']:.3f} ms/bucket "
        f"({r['sender_ms_per_bucket_on'] / r['sender_ms_per_bucket_off']:.2f}x); receiver "
        f"{r['receiver_ms_per_bucket_off']:.3f} -> {r['receiver_ms_per_bucket_on']:.3f} ms/bucket "
        f"({r['receiver_ms_per_bucket_on'] / r['receiver_ms_per_bucket_off']:.2f}x); frame "
        f"{r['frame_bytes_per_bucket_off']:.0f} -> {r['frame_bytes_per_bucket_on']:.0f} bytes"
    )


if __name__ == "__main__":
    raise SystemExit(main())
