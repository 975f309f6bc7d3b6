"""A relay (transport.fanout=chain) as planned by the sender and checked by every receiver before it joins."""

from __future__ import annotations

import pytest

from lightning_weightsync.errors import ProtocolError
from lightning_weightsync.protocol.relay import MAX_PIECES, MIN_PIECE, chains, check_relay, downstream, piece_size, tag


@pytest.mark.parametrize(
    ("receivers", "cap", "upstream"),
    [
        (0, 16, [-1]),
        (1, 16, [-1, 0]),
        (4, 0, [-1, 0, 1, 2, 3]),  # one chain
        (4, 2, [-1, 0, 1, 0, 3]),  # two of two
        (5, 2, [-1, 0, 1, 0, 3, 0]),  # 2, 2, 1: near-equal lengths
        (3, 1, [-1, 0, 0, 0]),  # a cap of one is a star
    ],
)
def test_chains_split_receivers_into_near_equal_chains_fed_by_the_sender(receivers, cap, upstream):
    got = chains(receivers, cap)
    assert got == upstream
    check_relay(got, MIN_PIECE, receivers + 1, 1 << 20)  # what the sender plans, every receiver accepts
    chain_count = 0 if receivers == 0 else 1 if cap == 0 else -(-receivers // cap)
    assert len(downstream(got, 0)) == chain_count


def test_every_receiver_is_fed_exactly_once_and_reaches_the_sender():
    for receivers in range(1, 40):
        for cap in (0, 1, 3, 16):
            upstream = chains(receivers, cap)
            fed = sorted(r for rank in range(receivers + 1) for r in downstream(upstream, rank))
            assert fed == list(range(1, receivers + 1))
            lengths = [1 + sum(1 for _ in _walk(upstream, head)) for head in downstream(upstream, 0)]
            assert max(lengths) - min(lengths) <= 1 and (cap == 0 or max(lengths) <= cap)


def _walk(upstream, rank):
    while (after := downstream(upstream, rank)):
        rank = after[0]
        yield rank


def test_pieces_cut_only_where_someone_forwards():
    assert piece_size([-1, 0, 0], 1 << 20, 4096) == 1 << 20  # a star of two: nothing is passed on
    assert piece_size([-1, 0, 1], 1 << 20, 4096) == 4096
    assert piece_size([-1, 0, 1], 1 << 30, 4096) == (1 << 30) // MAX_PIECES  # tags hold at most MAX_PIECES a bucket
    assert piece_size([-1, 0, 1], 1 << 20, 1) == MIN_PIECE


@pytest.mark.parametrize(
    ("upstream", "piece", "match"),
    [
        ([-1, 0], 4096, "names 2 ranks; the group has 3"),
        ([0, 0, 1], 4096, "feeds the sender"),
        ([-1, 0, 7], 4096, "feeds rank 2 from rank 7"),
        ([-1, 0, 2], 4096, "feeds rank 2 from rank 2"),
        ([-1, 2, 1], 4096, "never reaches the sender"),
        ([-1, 0, -1], 4096, "feeds rank 2 from rank -1"),
        ([-1, 0, 1], 16, "piece of 16 bytes"),
        ([-1, 0, 1], 4096, "more than"),  # the bucket below is 2**30: 262144 pieces
    ],
)
def test_a_relay_that_is_not_a_tree_rooted_at_the_sender_is_refused(upstream, piece, match):
    bucket = 1 << 30 if match == "more than" else 1 << 20
    with pytest.raises(ProtocolError, match=match):
        check_relay(upstream, piece, 3, bucket)


def test_no_relay_is_the_backends_broadcast_and_tags_never_collide_in_flight():
    check_relay([], 0, 5, 1 << 20)
    in_flight = {tag(b, p) for b in range(1000, 1064) for p in range(64)}
    assert len(in_flight) == 64 * 64 and max(in_flight) < 1 << 31
