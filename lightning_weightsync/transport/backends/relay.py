"""One bucket along a group's chains (`transport.fanout=chain`, `protocol/relay.py`), with point-to-point sends and
receives of a torch process group: the sender sends each piece to the heads of its chains, a receiver posts a
receive for every piece of the bucket at once and forwards each to the ranks it feeds as soon as it is complete.

Memory stays the slots': a piece is forwarded from where it landed (the slot, or the destination of a direct
bucket), and the bucket counts as complete here only once every forward of it is, so the slot is not refilled (nor a
destination written by the consumer) while a forward still reads it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ...protocol.relay import downstream, tag

logger = logging.getLogger(__name__)


class RelayCounters:
    """Bytes this rank forwarded (a receiver in the middle of a chain) or sent to chain heads (the sender). One
    data-plane thread adds (the sender's issuing thread, a receiver's waiting one); the event loop takes."""

    def __init__(self) -> None:
        self.forwarded = 0
        self._taken = 0
        self.lost: set[int] = set()  # ranks a forward to failed in this group (cleared when the group is rebuilt)

    def lose(self, rank: int, why: BaseException) -> None:
        if rank not in self.lost:
            self.lost.add(rank)
            logger.warning("forwarding to rank %d of the chain failed (%s); this rank keeps what it received", rank,
                           str(why)[:300])  # fmt: skip

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
        live = [dst for dst in feeds if dst not in counters.lost]
        for i, (p, received) in enumerate(zip(pieces, receives, strict=True)):
            received.wait()
            _send(pg, p, live, tag(bucket_index, i), sends, counters)
        # nothing of this bucket still reads the slot once this returns (after a failure the group is given up,
        # and with it whatever its sends still read)
        for dst, work in sends:
            try:
                work.wait()
            except RuntimeError as exc:
                counters.lose(dst, exc)
        counters.forwarded += data.nbytes * len([dst for dst in feeds if dst not in counters.lost])

    return forward


def _send(pg: Any, piece: torch.Tensor, feeds: list[int], piece_tag: int, sends: list[Any], counters: RelayCounters
          ) -> None:  # fmt: skip
    """One piece on to `feeds`; a rank whose send fails (it died) is dropped from `feeds`, this bucket's. What this
    rank received stays good: a chain cut behind it fails the ranks behind the cut, not this one (the sender
    aborts them; `SenderSteps.cut_off`)."""
    for dst in list(feeds):
        try:
            sends.append((dst, pg.send([piece], dst, piece_tag)))
        except RuntimeError as exc:
            counters.lose(dst, exc)
            feeds.remove(dst)


def _wait_all(works: list[Any]) -> None:
    for work in works:
        work.wait()


__all__ = ["RelayCounters", "start_relay"]
