"""Shared pieces of the engine tests: configs on free ports, and in-process sender/receiver runs."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import torch

from lightning_weightsync import WeightReceiver, load_config
from lightning_weightsync.bench.inventory import model_stream
from lightning_weightsync.protocol.chunks import as_bytes


def engine_cfg(port: int, *, backend: str = "gloo", bucket_size_mb: float = 0.0625, **extra: Any):
    overrides = [
        f"transport.port={port}",
        f"transport.backend={backend}",
        f"transport.bucket_size_mb={bucket_size_mb}",
        "transport.timeout_s=20",
        "transport.ready_timeout_s=3",
        "transport.heartbeat_interval_s=0.2",
    ]
    overrides += [f"{k.replace('__', '.')}={'null' if v is None else v}" for k, v in extra.items()]
    return load_config(overrides=overrides)


def assert_bitwise(got: dict[str, torch.Tensor], expected: list[tuple[str, torch.Tensor]]) -> None:
    assert list(got) == [n for n, _ in expected], "names or order differ"
    for name, tensor in expected:
        g = got[name]
        assert g.dtype == tensor.dtype and g.shape == tensor.shape, (name, g.dtype, g.shape, tensor.dtype, tensor.shape)
        assert torch.equal(as_bytes(g), as_bytes(tensor)), f"{name}: bytes differ"


async def receive_once(receiver: WeightReceiver, **kwargs: Any) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() async for name, tensor in receiver.receive_weights(**kwargs)}


def stream_nbytes(stream: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in stream)


def largest(stream: list[tuple[str, torch.Tensor]]) -> int:
    return max((math.prod(t.shape) * t.element_size() for _, t in stream), default=0)


def stream(version: int, **kwargs: Any) -> list[tuple[str, torch.Tensor]]:
    kwargs.setdefault("scale", 128)
    kwargs.setdefault("max_tensors", 40)
    return list(model_stream(version=version, **kwargs))


async def with_timeout(coro: Any, timeout_s: float = 60) -> Any:
    return await asyncio.wait_for(coro, timeout_s)


def expected_layout(
    weights: list[tuple[str, torch.Tensor]], bucket_size: int, alone_from: int | None, *, direct_ok: bool | None = None
) -> tuple[int, int]:
    """(buckets, chunked tensors) the sender must report, derived from the packing rule by plain
    arithmetic (not by running the splitter it checks): small tensors are packed back to back and cut
    at bucket boundaries, across the large ones; a tensor of at least `alone_from` bytes gets whole
    buckets of its own; a chunk that starts below the previous packed chunk's end starts a new bucket;
    a packed bucket holding part of a tensor goes out before the next chunk sent alone, and so does any
    packed bucket before a chunk sent alone whose tensor's tail is packed.
    `direct_ok` (default: `alone_from` is given): a chunk that fills a whole bucket is sent alone too."""
    direct_ok = alone_from is not None if direct_ok is None else direct_ok
    buckets, chunked = 0, 0
    plan_fill = 0  # where the split places the next packed chunk
    open_chunks, open_end, open_whole = 0, 0, True  # the packed bucket being filled
    for _, tensor in weights:
        n = tensor.numel() * tensor.element_size()
        if alone_from is not None and 0 < alone_from <= n:
            count = -(-n // bucket_size)
            if open_chunks and not open_whole:
                buckets, open_chunks, open_end = buckets + 1, 0, 0
            buckets += count
            chunked += count > 1
            continue
        chunks, start, left = [], (0 if plan_fill == bucket_size else plan_fill), n
        while True:
            size = min(left, bucket_size - start)
            chunks.append((start, size))
            left -= size
            plan_fill = start + size
            start = start + size if start + size < bucket_size else 0
            if left <= 0:
                break
        chunked += len(chunks) > 1
        left = n
        for offset, size in chunks:
            left -= size
            full_alone = direct_ok and offset == 0 and size == bucket_size  # fills a bucket: sent direct, alone
            # ... and when the tensor's tail after it is packed, the open bucket goes out before it
            tail_packed = full_alone and left % bucket_size != 0
            if open_chunks and (not open_whole or tail_packed if full_alone else offset < open_end):
                buckets, open_chunks, open_end = buckets + 1, 0, 0
            if full_alone:
                buckets += 1
            else:
                open_whole = (open_whole or not open_chunks) and len(chunks) == 1
                open_chunks, open_end = open_chunks + 1, offset + size
    return buckets + (open_chunks > 0), chunked


def _nixl_missing() -> str | None:
    """Why the nixl backend cannot run here (None: it can); tests skip with this reason."""
    from lightning_weightsync.errors import BackendUnavailable
    from lightning_weightsync.transport.backends.nixl import import_nixl

    try:
        import_nixl()
    except BackendUnavailable:  # pragma: no cover - CI installs the extra
        return "needs NIXL: pip install 'lightning-weightsync[nixl]' (./dev setup installs it)"
    return None


NIXL_MISSING = _nixl_missing()
