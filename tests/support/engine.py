"""Shared pieces of the engine tests: configs on free ports, and in-process sender/receiver runs."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from lightning_weightsync import WeightReceiver, load_config
from lightning_weightsync.examples.inventory import model_stream
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


def stream(version: int, **kwargs: Any) -> list[tuple[str, torch.Tensor]]:
    kwargs.setdefault("scale", 128)
    kwargs.setdefault("max_tensors", 40)
    return list(model_stream(version=version, **kwargs))


async def with_timeout(coro: Any, timeout_s: float = 60) -> Any:
    return await asyncio.wait_for(coro, timeout_s)


def expected_layout(
    weights: list[tuple[str, torch.Tensor]], bucket_size: int, alone_from: int | None
) -> tuple[int, int]:
    """(buckets, chunked tensors) the sender must report, derived from the packing rule by plain
    arithmetic (not by running the splitter it checks): small tensors are packed back to back and cut
    at bucket boundaries; a tensor of at least `alone_from` bytes gets whole buckets of its own; a
    chunk that starts below the previous chunk's end starts a new bucket."""
    buckets, fill, chunked = 1, 0, 0
    for _, tensor in weights:
        n = tensor.numel() * tensor.element_size()
        alone = alone_from is not None and 0 < alone_from <= n
        if alone:
            chunks = [(0, min(bucket_size, n - c)) for c in range(0, n, bucket_size)]
        else:
            chunks, start, left = [], (0 if fill == bucket_size else fill), n
            while True:
                size = min(left, bucket_size - start)
                chunks.append((start, size))
                left -= size
                start = start + size if start + size < bucket_size else 0
                if left <= 0:
                    break
        chunked += len(chunks) > 1
        for offset, size in chunks:
            if offset < fill:
                buckets += 1
            fill = offset + size
        if alone:
            fill = bucket_size
    return buckets, chunked
