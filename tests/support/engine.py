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


def planned_buckets(weights: list[tuple[str, torch.Tensor]], bucket_size: int, alone_from: int | None) -> int:
    """How many buckets the split plans for `weights` (what the sender must report), counted the way
    the sender counts them: a chunk whose offset falls below the current fill starts a new bucket."""
    from lightning_weightsync.protocol.chunks import split_weight_chunks

    async def count() -> int:
        buckets, fill = 1, 0
        async for meta, _ in split_weight_chunks(weights, bucket_size, alone_from=alone_from):
            assert meta.offset is not None
            if meta.offset < fill:
                buckets += 1
            fill = meta.offset + meta.chunk_size
        return buckets

    return asyncio.run(count())
