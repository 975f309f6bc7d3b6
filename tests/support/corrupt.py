"""A test-only corrupting peer: a `WeightSender` whose data plane flips one byte of one bucket on the wire.

The flip happens after the sender fingerprinted the tensors and packed the bucket (in the slot for a
packed bucket: the shared segment itself with shm; in a copy of the caller's tensor for a direct one, so
the trainer's weights are untouched): exactly what a bad NIC, a torn DMA or
a stale shared-memory read would deliver. `transport.verify` must catch it; with verify off it lands.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_weightsync import WeightSender
from lightning_weightsync.transport.backends import NO_SLOT, Backend


def corrupt_backend(backend: Backend, *, bucket_index: Callable[[], int], byte: int) -> Backend:
    """Make `backend` flip byte `byte` of bucket `bucket_index()` of every version, before any receiver can
    read it: a packed bucket in its slot when the sender fences it (just before its metadata leaves: a shm
    receiver reads the slot as soon as the metadata is there), a direct one in a copy of the caller's tensor
    handed to its broadcast. The sender fences every bucket once, in order, so the fences count the buckets."""
    fence, start = backend.fence, backend.start_broadcast
    seen = {"version": -1, "index": 0}

    def next_index() -> int:
        if seen["version"] != backend.version:
            seen["version"], seen["index"] = backend.version, 0
        seen["index"] += 1
        return seen["index"] - 1

    def fence_and_flip(slot: int) -> None:
        if next_index() == bucket_index() and slot != NO_SLOT:
            backend.buckets[slot][byte] ^= 0x5A
        fence(slot)

    def start_broadcast(
        slot: int, nbytes: int, index: int, buffer: torch.Tensor | None = None
    ) -> Callable[[], None] | None:
        if index == bucket_index() and buffer is not None and nbytes > 0:
            buffer = buffer.clone()  # the trainer's tensor stays as it is; the copy lives until the send is done
            buffer[byte % nbytes] ^= 0x5A
        return start(slot, nbytes, index, buffer)

    backend.fence = fence_and_flip  # type: ignore[method-assign]
    backend.start_broadcast = start_broadcast  # type: ignore[method-assign]
    return backend


class CorruptingSender(WeightSender):
    """A `WeightSender` whose backend is wrapped by `corrupt_backend` (`bucket_index` may change between
    versions; -1: none is corrupted)."""

    def __init__(self, cfg: Any, *, bucket_index: int = 0, byte: int = 7) -> None:
        super().__init__(cfg)
        self.bucket_index, self.byte = bucket_index, byte

    def _new_backend(self, name: str, **kwargs: Any) -> Backend:
        backend = super()._new_backend(name, **kwargs)
        return corrupt_backend(backend, bucket_index=lambda: self.bucket_index, byte=self.byte)
