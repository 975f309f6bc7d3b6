"""Chains (`transport.fanout=chain`): who feeds whom inside one group, as the sender plans it and every rank checks it.

A group's relay is `upstream`, one entry a rank: `upstream[r]` is the rank that rank `r` receives each bucket
from (`-1` for the sender, rank 0). Rank 0 feeds the head of every chain; each receiver forwards what it receives to
the ranks whose upstream it is. Bytes move in pieces of `piece` bytes: a receiver passes piece i on as soon as it
has it, so a chain of K receivers takes about S/B + (K - 1) x piece/B, not K x S/B (a star) or
ceil(log2(K + 1)) x S/B (gloo's binomial tree). An empty `upstream` means the backend's own broadcast.

The relay arrives in a plan from the network: `check_relay` refuses one that is not a tree rooted at the sender
(a cycle would wait forever, an out-of-range rank would fail inside the collective library) or whose pieces
would overflow the tags that tell them apart.
"""

from __future__ import annotations

from ..errors import ProtocolError

MAX_PIECES = 1 << 16  # pieces in one bucket: a piece's tag is (bucket, piece), 16 bits each side
TAG_BUCKETS = (1 << 31) // MAX_PIECES  # buckets in flight are told apart modulo this (tags are 31-bit)
MIN_PIECE = 4096


def chains(receivers: int, max_length: int) -> list[int]:
    """The upstream of ranks 0..receivers: ceil(receivers / max_length) chains of near-equal length (0: one
    chain), consecutive ranks each, every chain's head fed by rank 0."""
    count = 1 if max_length <= 0 or receivers == 0 else -(-receivers // max_length)
    base, extra = divmod(receivers, count)
    upstream = [-1]
    for chain in range(count):
        length = base + (chain < extra)
        for position in range(length):
            upstream.append(0 if position == 0 else len(upstream) - 1)
    return upstream


def piece_size(upstream: list[int], bucket_size: int, piece: int) -> int:
    """The piece a group moves: `piece` where some receiver forwards, else the whole bucket (nothing is passed on,
    so cutting it would only cost calls). At least what keeps a bucket under `MAX_PIECES` pieces."""
    forwards = any(up > 0 for up in upstream)
    if not forwards:
        return max(bucket_size, 1)
    return max(piece, MIN_PIECE, -(-bucket_size // MAX_PIECES))


def downstream(upstream: list[int], rank: int) -> list[int]:
    """The ranks `rank` forwards each piece to."""
    return [r for r, up in enumerate(upstream) if up == rank and r != rank]


def check_relay(upstream: list[int], piece: int, world_size: int, bucket_size: int) -> None:
    """Refuse a relay that is not a tree over the group's ranks rooted at the sender, or pieces that do not fit the
    tags. Raises `ProtocolError` naming what is wrong."""
    if not upstream:
        return
    if len(upstream) != world_size:
        raise ProtocolError(f"the relay names {len(upstream)} ranks; the group has {world_size}")
    if upstream[0] != -1:
        raise ProtocolError(f"the relay feeds the sender (rank 0) from rank {upstream[0]}; it feeds nobody")
    for rank, up in enumerate(upstream[1:], start=1):
        if not 0 <= up < world_size or up == rank:
            raise ProtocolError(f"the relay feeds rank {rank} from rank {up}, not another rank of the group")
    for rank in range(1, world_size):  # every rank reaches the sender: no cycle
        seen, at = 0, rank
        while at != 0:
            at, seen = upstream[at], seen + 1
            if seen >= world_size:
                raise ProtocolError(f"the relay's chain through rank {rank} never reaches the sender (a cycle)")
    if piece < min(MIN_PIECE, bucket_size) or -(-bucket_size // piece) > MAX_PIECES:
        raise ProtocolError(
            f"the relay's piece of {piece} bytes is under {MIN_PIECE} or cuts a {bucket_size}-byte bucket into more "
            f"than {MAX_PIECES} pieces"
        )


def tag(bucket_index: int, piece_index: int) -> int:
    """The tag of one piece of one bucket: pieces of buckets in flight together never share one."""
    return (bucket_index % TAG_BUCKETS) * MAX_PIECES + piece_index


__all__ = ["MAX_PIECES", "MIN_PIECE", "chains", "check_relay", "downstream", "piece_size", "tag"]
