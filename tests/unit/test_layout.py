"""Layout once (protocol/layout.py): the digest both ends compute, and what a receiver does with a bucket that
names a layout: takes the held entries, or fails the version when the reference is not one it can honour."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

from lightning_weightsync import WeightReceiver, WeightSender
from lightning_weightsync.errors import ProtocolError
from lightning_weightsync.protocol.layout import Layout, LayoutRecorder, no_layout
from lightning_weightsync.protocol.messages import BucketMeta, Entry, Ready, decode, encode, validate
from tests.support.transfer import assert_bitwise, engine_cfg, receive_once, with_timeout

BUCKETS = [
    (96, False, [Entry("a", [4, 4], "float32", 0, 64, 0), Entry("b", [8], "float32", 0, 32, 64)]),
    (64, False, [Entry("c", [16, 16], "bfloat16", 0, 64, 0)]),
    (8, True, [Entry("c", [16, 16], "bfloat16", 64, 8, 0)]),
]


def _layout(buckets=BUCKETS, held: Layout | None = None) -> Layout:
    recorder = LayoutRecorder()
    for nbytes, is_last, entries in buckets:
        recorder.add(nbytes, is_last, entries, held)
    layout = recorder.finish()
    assert layout is not None
    return layout


def _ref(layout: Layout, index: int, **kw) -> BucketMeta:
    nbytes, is_last, _ = BUCKETS[index]
    fields = {"nbytes": nbytes, "is_last": is_last, **kw}
    return BucketMeta(3, index, fields.pop("is_last"), fields.pop("nbytes"), [], layout=layout.digest, **fields)


def test_the_digest_is_of_every_entry_field_and_bucket_boundary() -> None:
    base = _layout()
    assert base.digest == _layout().digest  # deterministic: both ends compute it apart
    assert _layout(held=base).digest == base.digest  # buckets taken from the held layout: the same digest
    changed = [
        [(96, False, [Entry("a", [4, 4], "float32", 0, 64, 0), Entry("B", [8], "float32", 0, 32, 64)]), *BUCKETS[1:]],
        [(96, False, [Entry("a", [16], "float32", 0, 64, 0), Entry("b", [8], "float32", 0, 32, 64)]), *BUCKETS[1:]],
        [(96, False, [Entry("a", [4, 4], "int32", 0, 64, 0), Entry("b", [8], "float32", 0, 32, 64)]), *BUCKETS[1:]],
        [(96, False, [Entry("a", [4, 4], "float32", 0, 64, 0), Entry("b", [8], "float32", 0, 32, 60)]), *BUCKETS[1:]],
        [(100, False, BUCKETS[0][2]), *BUCKETS[1:]],
        [*BUCKETS[:2], (8, False, BUCKETS[2][2]), (0, True, [])],
    ]
    digests = {_layout(buckets).digest for buckets in changed}
    assert base.digest not in digests and len(digests) == len(changed)


def test_a_version_that_did_not_reach_its_last_bucket_names_no_layout() -> None:
    recorder = LayoutRecorder()
    for nbytes, is_last, entries in BUCKETS[:2]:
        recorder.add(nbytes, is_last, entries)
    assert recorder.finish() is None


def test_the_recorder_counts_the_buckets_the_held_layout_stands_for() -> None:
    held = _layout()
    recorder = LayoutRecorder()
    assert recorder.add(*BUCKETS[0], held) is True
    assert recorder.add(64, False, [Entry("c", [16, 16], "bfloat16", 0, 60, 0)], held) is False  # cut otherwise
    assert recorder.add(*BUCKETS[2], held) is True
    assert recorder.same == 2


def test_a_bucket_that_was_last_and_no_longer_is_or_the_reverse_is_not_the_held_bucket() -> None:
    """Same size, same entries, is_last flipped: not a reference (the receiver's held bucket says otherwise)."""
    held = _layout([(96, True, BUCKETS[0][2])])  # the version was this one bucket
    assert held.reference(0, 96, True, BUCKETS[0][2])
    assert not held.reference(0, 96, False, BUCKETS[0][2])  # now a bucket follows it
    recorder = LayoutRecorder()
    assert recorder.add(96, False, BUCKETS[0][2], held) is False
    longer = _layout(BUCKETS)  # bucket 0 was not last; now it is
    assert not longer.reference(0, 96, True, BUCKETS[0][2]) and recorder.add(96, True, BUCKETS[0][2], longer) is False
    assert recorder.same == 0


async def test_a_version_whose_first_bucket_stops_or_starts_being_the_last_lists_its_entries_end_to_end() -> None:
    """A sender and a receiver (gloo, in process): version 1 is one full bucket (two tensors, 8 KiB each, a
    16 KiB bucket); version 2 adds a tensor, so bucket 0 is cut the same but is no longer the last; version 3
    drops it again. A sender that named bucket 0 by the held layout would fail each of 2 and 3 on the
    receiver (its held bucket's is_last differs); version 4, cut as version 3, is named by reference."""
    a, b = torch.arange(2048, dtype=torch.float32), torch.ones(2048)
    versions = {
        1: [("a", a), ("b", b)],
        2: [("a", a + 1), ("b", b + 1), ("c", torch.zeros(10))],
        3: [("a", a + 2), ("b", b + 2)],
        4: [("a", a + 3), ("b", b + 3)],
    }
    async with WeightSender(engine_cfg(0, bucket_size_mb=1 / 64)) as sender:
        receiver = WeightReceiver(engine_cfg(sender.port, bucket_size_mb=1 / 64), identity="r0")
        async with receiver:
            for version, weights in versions.items():
                got, stats = await with_timeout(
                    asyncio.gather(receive_once(receiver), sender.send_weights(weights, version=version)), 30
                )
                assert not stats.failed, (version, stats.failed)
                assert_bitwise(got, weights)
                assert stats.layout_buckets == receiver.last_stats.layout_buckets == (version == 4), version


def test_expand_takes_the_held_entries_and_checks_what_the_version_says_of_them() -> None:
    held = _layout()
    wire = decode(encode(_ref(held, 0, fingerprints=[7, 9])))  # through the wire's own validation
    assert isinstance(wire, BucketMeta) and wire.entries == []
    expanded = held.expand(wire)
    assert expanded.entries == BUCKETS[0][2] and expanded.layout == "" and expanded.fingerprints == [7, 9]
    with pytest.raises(ProtocolError, match="3 fingerprints for 2 entries"):
        held.expand(_ref(held, 0, fingerprints=[1, 2, 3]))
    with pytest.raises(ProtocolError, match="delta sizes"):
        held.expand(_ref(held, 0, deltas=[-1]))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"layout": "0" * 32}, "holds"),  # a digest this receiver does not hold
        ({"bucket_index": 3}, "not bucket 3 of the held layout"),  # past its last bucket
        ({"nbytes": 95}, "not bucket 0"),  # a size the held bucket does not have
        ({"is_last": True}, "not bucket 0"),
    ],
)
def test_a_reference_the_receiver_cannot_honour_fails_the_version(change: dict, match: str) -> None:
    held = _layout()
    meta = msgspec.structs.replace(_ref(held, 0), **change)
    with pytest.raises(ProtocolError, match=match):
        held.expand(meta)


def test_a_receiver_that_holds_no_layout_fails_a_reference_and_takes_a_full_bucket() -> None:
    held = _layout()
    with pytest.raises(ProtocolError, match="holds none"):
        no_layout(_ref(held, 1))
    full = BucketMeta(3, 1, False, 64, BUCKETS[1][2])
    assert no_layout(full) is full and held.expand(full) is full


@pytest.mark.parametrize(
    "msg",
    [
        BucketMeta(1, 0, True, 64, BUCKETS[1][2], layout="a" * 32),  # names a layout and lists entries
        BucketMeta(1, 0, True, 64, [], layout="A" * 32),  # not lower-case hex
        BucketMeta(1, 0, True, 64, [], layout="ab"),  # not a digest's length
        Ready("r", 1, layout="x" * 32),
    ],
)
def test_a_malformed_layout_field_is_rejected(msg) -> None:
    with pytest.raises(ProtocolError, match="layout"):
        validate(msg)
