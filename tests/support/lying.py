"""Test-only sharded senders that lie about their part of a version (as `corrupt.py` lies about bytes).

A sharded version is trustworthy only because every receiver checks what the senders claim: that their
byte ranges tile each tensor exactly (no byte sent by nobody), that they agree on what a tensor is (shape
and dtype, not only its byte count), and that only the coordinator lists other senders. Each helper here
makes one real sender process break exactly one of those claims, so a test can show the receiver refuses
the version rather than committing it:

    with_a_hole(shards, name)       this rank's shard of `name` loses its last row: bytes nobody sends
    retyped(shards, name, dtype)    this rank says `name` is `dtype` (same element size, shape and bytes)
    RogueCoordinator(cfg, lie_in)   a secondary sender (index > 0) whose plan lists other senders, as
                                    if it coordinated the version
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator
from typing import Any

import torch

from lightning_weightsync import WeightSender
from lightning_weightsync.protocol.chunks import TensorShard
from lightning_weightsync.protocol.messages import SenderAddress

Item = tuple[str, "TensorShard | torch.Tensor"]


def with_a_hole(shards: Iterable[Item], name: str) -> Iterator[Item]:
    """`shards`, with this rank's shard of `name` one row short (its last row is sent by no rank)."""
    for key, shard in shards:
        if key == name and isinstance(shard, TensorShard) and shard.data.shape[0] > 1:
            shard = TensorShard(shard.shape, shard.dtype, shard.byte_offset, shard.data[:-1])
        yield key, shard


def retyped(shards: Iterable[Item], name: str, dtype: torch.dtype) -> Iterator[Item]:
    """`shards`, with this rank claiming that `name` is a `dtype` tensor: the same shape and byte count (the
    element sizes must match), so only the dtype tells the two senders' tensors apart."""
    for key, shard in shards:
        if key == name and isinstance(shard, TensorShard):
            assert torch.empty((), dtype=dtype).element_size() == shard.data.element_size(), "same bytes only"
            shard = TensorShard(shard.shape, dtype, shard.byte_offset, shard.data.view(dtype))
        yield key, shard


class RogueCoordinator(WeightSender):
    """A secondary sender (its `Sharding.index` > 0) that believes it coordinates: in the versions of
    `lie_in` its plan lists another sender (`listed`, default itself), as only sender 0's may. Its
    buckets still say which sender it is, so only the plan check tells it apart."""

    def __init__(self, cfg: Any, *, lie_in: Container[int], listed: SenderAddress | None = None) -> None:
        super().__init__(cfg)
        self.lie_in, self.listed = lie_in, listed

    async def _join(self, version: int, peers: list[Any], others: list[SenderAddress] | None = None) -> None:
        if version in self.lie_in and not others:
            others = [self.listed or SenderAddress("127.0.0.1", self.port)]
        await super()._join(version, peers, others)
