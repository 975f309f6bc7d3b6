"""One bucket along a group's chains (`transport.fanout=chain`, `protocol/relay.py`), with point-to-point sends and
receives of a torch process group: the sender sends each piece to the heads of its chains, a receiver posts a
receive for every piece of the bucket at once and forwards each to the ranks it feeds as soon as it is complete.

Memory stays the slots': a piece is forwarded from where it landed (the slot, or the destination of a direct
bucket), and the bucket counts as complete here only once every forward of it is, so the slot is not refilled (nor a
destination written by the consumer) while a forward still reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...protocol.relay import downstream, tag


class RelayCounters:
    """Bytes this rank forwarded (a receiver in the middle of a chain) or sent to chain heads (the sender). One
    data-plane thread adds (the sender's issuing thread, a receiver's waiting one); the event loop takes."""

    def __init__(self) -> None:
        self.forwarded = 0
        self._taken = 0

    def take(self) -> int:
        """The bytes added since the last take."""
        now = self.forwarded
        new, self._taken = now - self._taken, now
        return new


def start_relay(
    pg: Any, data: torch.Tensor, bucket_index: int, rank: int, upstream: list[int], piece: int, counters: RelayCounters
) -> Callable[[], None]:
    """Start moving `data` (one bucket, 1-D) along the relay; returns the wait for it on this rank."""
    flat = data.reshape(-1)  # a view: buckets and direct chunks are contiguous
    pieces = list(torch.split(flat if flat.dtype == torch.uint8 else flat.view(torch.uint8), piece))
    feeds = downstream(upstream, rank)
    if rank == 0:
        sends = [pg.send([p], dst, tag(bucket_index, i)) for i, p in enumerate(pieces) for dst in feeds]
        counters.forwarded += data.nbytes * len(feeds)
        return lambda: _wait_all(sends)
    source = upstream[rank]
    receives = [pg.recv([p], source, tag(bucket_index, i)) for i, p in enumerate(pieces)]

    def forward() -> None:
        sends: list[Any] = []
        for i, (p, received) in enumerate(zip(pieces, receives, strict=True)):
            received.wait()
            sends += [pg.send([p], dst, tag(bucket_index, i)) for dst in feeds]
        # nothing of this bucket still reads the slot once this returns (after a failure the group is given up,
        # and with it whatever its sends still read)
        _wait_all(sends)
        counters.forwarded += data.nbytes * len(feeds)

    return forward


def _wait_all(works: list[Any]) -> None:
    for work in works:
        work.wait()


__all__ = ["RelayCounters", "start_relay"]
