"""`BucketMeta.delta_ranges` (sharded send mode's deltas, `versions/delta.py`): a receiver refuses a range
that would put a payload's elements anywhere but inside its tensor, in whole elements, before any byte is
written; and a shard's payload rebuilds exactly its range of the tensor, bitwise."""

from __future__ import annotations

import pytest
import torch

from lightning_weightsync.errors import ProtocolError
from lightning_weightsync.protocol.chunks import TensorMeta
from lightning_weightsync.protocol.messages import BucketMeta, Entry, validate
from lightning_weightsync.versions.delta import apply_range_delta, encode

_E = Entry("w", [16], "float32", 0, 20, 0)  # a 20-byte chunk of a payload for the 64-byte tensor "w"


def _bucket(ranges: list[tuple[int, int]], deltas: list[int] | None = None, base: int = 0) -> BucketMeta:
    entries = [_E] * len(deltas or [20])
    return BucketMeta(1, 0, True, 20, entries, deltas=deltas or [20], delta_base=base, delta_ranges=ranges)


def test_a_shard_delta_range_inside_its_tensor_is_legal() -> None:
    validate(_bucket([(32, 32)]))
    validate(_bucket([(0, 0), (8, 24)], deltas=[-1, 20]))


@pytest.mark.parametrize(
    ("ranges", "deltas"),
    [
        ([(48, 32)], None),  # past the tensor's 64 bytes
        ([(-4, 32)], None),  # before it
        ([(2, 32)], None),  # not on an element boundary
        ([(0, 30)], None),  # not whole elements
        ([(0, 20)], None),  # no larger than its payload: a delta is only sent when smaller
        ([(0, 32), (0, 32)], None),  # not one per entry
        ([(4, 8)], [-1]),  # a whole entry naming a range
    ],
    ids=["past-end", "negative", "unaligned-start", "partial-element", "not-larger", "count", "whole-with-range"],
)
def test_a_malformed_delta_range_is_refused_by_validation(
    ranges: list[tuple[int, int]], deltas: list[int] | None
) -> None:
    with pytest.raises(ProtocolError, match="delta range"):
        validate(_bucket(ranges, deltas))


def test_ranges_without_deltas_are_refused() -> None:
    msg = BucketMeta(1, 0, True, 20, [Entry("w", [16], "float32", 0, 20, 0)], delta_ranges=[(0, 32)])
    with pytest.raises(ProtocolError, match="delta ranges"):
        validate(msg)


def test_a_shard_payload_rebuilds_exactly_its_range() -> None:
    old = torch.randn(64, 8)
    new = old.clone()
    new[40, 3] = 7.0
    start, size = 32 * 8 * 4, 32 * 8 * 4  # rows 32..63: one sender's shard
    payload = encode(new[32:].contiguous(), old[32:].contiguous(), size)
    assert payload is not None
    dest = torch.zeros_like(old)
    meta = TensorMeta("w", (64, 8), torch.float32, 0, old.numel() * 4)
    apply_range_delta(payload, meta, start, size, old, dest.view(-1).view(torch.uint8)[start : start + size])
    assert torch.equal(dest[32:], new[32:]) and torch.equal(dest[:32], torch.zeros(32, 8))
