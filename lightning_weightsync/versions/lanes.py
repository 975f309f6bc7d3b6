"""Lanes: each receiver gets only the slices it holds, and receivers that hold the same share one broadcast.

A tensor-parallel rollout declares the box of each tensor its rank holds (protocol/declare.py). The sender
groups the receivers of a version by what they declared: every receiver with the same declaration (the same
TP rank of several servers, or all that declared nothing) is one *lane*, with a data-plane group, bucket
slots, a planner and an executor thread of its own. The version's source is pulled once; each tensor goes to
every lane as that lane's part of it (`LaneView.part`):

    whole lane (declared nothing)        the tensor, as before
    a lane holding box B of the tensor   B's local tensor (gather mode: a view, or a copy where B is not
                                         contiguous in the whole), or, from a flat-range holder (sharded
                                         mode: this rank's FSDP shard), `boxes.take`: the part of B in that
                                         range, which is one byte range of B's local tensor; nothing where
                                         they do not meet

so no byte crosses a link twice to one receiver, and adding servers adds no bytes to a trainer rank's link
(they join the lanes of their TP ranks). The chunks of a lane's part carry its box on the wire (`Entry.box`);
a receiver lands them in its local tensor and checks it was sent its own box (protocol/chunks.py `Landing`).

Memory: the whole lane keeps `transport.bucket_size_mb` slots; the lanes of boxes share one more such budget
(each `bucket_size / lanes`), so a sender never holds more than twice today's slots, however many TP ranks.
A lane of boxes sends whole tensors (no delta: `transport.delta` applies to the whole lane) and keeps a
held layout of its own (`transport.layout_once`).

Here: what a lane takes of each tensor (`LaneView`), its data plane kept from version to version (`Lane`:
backend, slots, executor thread, held layout, the broadcasts in flight) and one version's stream on it
(`LaneStream`: its planner, its `Wire`). Which receivers share a lane is `sender_lanes.py`'s; the receiving
side of a lane is `receiver_lane.py`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..errors import PeerError, ProtocolError, WeightSyncError, WeightSyncTimeout
from ..protocol.boxes import Box, check_boxes, take
from ..protocol.chunks import TensorShard, as_bytes
from ..protocol.dtypes import itemsize
from ..protocol.layout import Layout
from ..transport.backends import NUM_SLOTS, Backend, next_slot
from ..transport.control import Peer
from ..transport.executor import SerialExecutor, forget
from .planner import BucketPlanner, Flush, Pack
from .stats import SendStats
from .steps import SenderSteps
from .wire import Wire

WHOLE = ""  # the key of the lane of receivers that declared nothing
MIN_LANE_BUCKET = 1 << 20  # a lane of boxes never gets slots smaller than this (or the bucket, if smaller)
LANE_ALIGN = 4096


def lane_bucket_size(bucket_size: int, box_lanes: int) -> int:
    """Each lane of boxes' slot size: `bucket_size` shared by `box_lanes` lanes, page-aligned, bounded below."""
    share = (bucket_size // max(box_lanes, 1)) // LANE_ALIGN * LANE_ALIGN
    return max(share, min(MIN_LANE_BUCKET, bucket_size))


@dataclass(frozen=True)
class LaneView:
    """What one lane takes of each tensor: its box where it declared one, else the whole tensor."""

    boxes: Mapping[str, Box]

    def part(self, name: str, tensor: torch.Tensor | TensorShard) -> torch.Tensor | TensorShard | None:
        """The lane's part of `tensor`, or None where it holds none of what this sender sends of it."""
        box = self.boxes.get(name)
        if box is None:
            return tensor
        shape = tensor.shape if isinstance(tensor, TensorShard) else tuple(tensor.shape)
        try:
            check_boxes(name, shape, [box])  # checked at Ready against the last version: the model may have changed
        except ProtocolError as exc:
            raise ProtocolError(f"{exc}: the tensor changed shape since the receiver declared its box") from None
        if isinstance(tensor, TensorShard):
            if tensor.box is not None:
                raise ProtocolError(f"{name!r}: a shard of a box cannot be cut into another box")
            first, data = take(as_bytes(tensor.data), box, shape, itemsize(tensor.dtype), tensor.byte_offset)
            if data.numel() == 0:
                return None
            return TensorShard(shape, tensor.dtype, first, data, box)
        local = box.of(tensor.detach())
        return TensorShard(shape, tensor.dtype, 0, local if local.is_contiguous() else local.contiguous(), box)


@dataclass(frozen=True)
class Broadcasts:
    """How a lane waits for its broadcasts in one version: bounded by transport.timeout_s, and a member that is
    gone ends the wait at once (the steps answer late rendezvous requests meanwhile)."""

    steps: SenderSteps
    timeout_s: float
    version: int

    async def done(self, future: asyncio.Future[None] | None, index: int) -> None:
        if future is None:
            return
        try:
            await self._wait(future, index)
        except BaseException:
            # given up while still running (a member gone, the timeout): its own failure, when the transfer's
            # timeout ends it, is nobody's news; left unconsumed it would be logged from some later garbage
            # collection ("Future exception was never retrieved")
            forget(future)
            raise

    async def _wait(self, future: asyncio.Future[None], index: int) -> None:
        version, steps = self.version, self.steps
        try:
            await steps.while_connected(future, self.timeout_s, f"version {version}: broadcast of bucket {index}")
        except asyncio.TimeoutError:
            who = await steps.laggards(version)
            raise WeightSyncTimeout(
                f"version {version}: broadcast of bucket {index} not complete within transport.timeout_s="
                f"{self.timeout_s}s; {who}"
            ) from None
        except WeightSyncError:
            raise
        except Exception as exc:
            who = await steps.laggards(version)
            raise PeerError(f"version {version}: broadcast of bucket {index} failed ({exc}); {who}") from exc


@dataclass
class Lane:
    """One lane's data plane, kept from version to version while its receivers keep their declaration: its
    backend (the group and the two slots), its executor thread, the layout it streamed last, and one version's
    broadcasts in flight."""

    key: str  # the declaration's digest (WHOLE: none)
    backend: Backend
    executor: SerialExecutor
    members: tuple[tuple[str, int], ...] = ()  # the group it formed last (identity, pid)
    generation: int = -1  # that group's generation (numbered by the sender: unique over its lanes)
    layout: Layout | None = None  # the layout of the last version it streamed whole (transport.layout_once)
    # one version's broadcasts: per slot, the one that last read it, and direct ones, oldest first
    pending: list[tuple[asyncio.Future[None], int] | None] = field(default_factory=lambda: [None] * NUM_SLOTS)
    direct: deque[tuple[asyncio.Future[None], int]] = field(default_factory=deque)

    def reset(self) -> None:
        self.pending = [None] * NUM_SLOTS
        self.direct = deque()

    def futures(self) -> list[asyncio.Future[None]]:
        return [*(p[0] for p in self.pending if p is not None), *(f for f, _ in self.direct)]

    async def flush(self, step: Flush, wire: Wire, waits: Broadcasts) -> None:
        """A planned bucket out: its metadata to the lane's receivers, then its broadcast onto the lane's
        data-plane thread (from its slot, or from the caller's tensor for a direct bucket). A packed bucket's
        slot is the next but one to pack: wait until the other slot's last broadcast is complete."""
        backend = self.backend
        backend.fence(step.slot)
        await waits.steps.publish(wire.peers, wire.meta(step))
        future = None if step.direct else backend.loop_broadcast(step.slot, step.nbytes, step.index)
        if future is None:  # the backend moves it on the data-plane thread
            future = self.executor.submit_started(
                backend.start_broadcast, step.slot, step.nbytes, step.index, step.data
            )
        if step.direct:
            self.direct.append((future, step.index))
            await self.settle_direct(wire.direct_in_flight, waits)
            return
        self.pending[step.slot] = (future, step.index)
        if not step.is_last:
            await self.complete(next_slot(step.slot), waits)

    async def settle_direct(self, keep: int, waits: Broadcasts) -> None:
        """Wait for the lane's oldest direct broadcasts until at most `keep` are queued or running."""
        while len(self.direct) > keep:
            future, index = self.direct.popleft()
            await waits.done(future, index)

    async def complete(self, slot: int, waits: Broadcasts) -> None:
        """Wait until the broadcast that last used `slot` is complete on this rank."""
        pending, self.pending[slot] = self.pending[slot], None
        if pending is not None:
            await waits.done(pending[0], pending[1])

    async def settle(self, waits: Broadcasts) -> None:
        """Every broadcast of the version complete (after a failure of the caller's: the group is fine)."""
        await self.settle_direct(0, waits)
        for slot in range(NUM_SLOTS):
            await self.complete(slot, waits)

    def forget(self) -> None:
        """The version's broadcasts given up: their outcome is nobody's news."""
        for future in self.futures():
            forget(future)
        self.reset()

    def close(self) -> None:
        self.backend.close()
        self.executor.shutdown()


@dataclass
class LaneVersion:
    """One version on one lane: the receivers in it and what it takes of each tensor."""

    lane: Lane
    peers: list[Peer]
    view: LaneView

    @property
    def whole(self) -> bool:
        return self.lane.key == WHOLE


@dataclass
class LaneStream:
    """One version's stream on one lane: its part of each tensor (`LaneView`), planned (its own planner and
    slots), packed, described (`Wire`) and broadcast."""

    lane: Lane
    view: LaneView
    planner: BucketPlanner
    wire: Wire
    waits: Broadcasts

    async def add(self, name: str, tensor: torch.Tensor | TensorShard, stable: bool) -> None:
        """The lane's part of one tensor of the source; unless `stable`, its broadcasts complete before the
        caller may reuse the tensor's memory (the next one is pulled)."""
        part = self.view.part(name, tensor)
        if part is None:
            return
        for step in self.planner.add(name, part):
            if isinstance(step, Pack):
                self.lane.backend.pack(step.slot, step.offset, step.data)
            else:
                await self.lane.flush(step, self.wire, self.waits)
        if not stable:
            await self.lane.settle_direct(0, self.waits)

    async def finish(self, stats: SendStats) -> None:
        """The last bucket out (after a direct bucket: an empty terminator, no broadcast), every broadcast
        complete, and what the version leaves: the layout every peer will hold, the counts."""
        lane, wire = self.lane, self.wire
        last = self.planner.finish()
        await lane.flush(last, wire, self.waits)
        await lane.settle_direct(0, self.waits)
        for slot in (next_slot(last.slot), last.slot):  # oldest broadcast first
            await lane.complete(slot, self.waits)
        if wire.recorder is not None:  # streamed whole: what every peer that takes it will hold
            lane.layout = wire.recorder.finish()
            stats.layout_buckets += wire.recorder.same  # 0 without a held layout
        counts = self.planner.counts
        stats.nbytes += counts.nbytes
        stats.num_tensors = max(stats.num_tensors, counts.tensors)
        stats.num_chunked_tensors += counts.chunked_tensors
        stats.num_buckets += counts.buckets
        stats.direct_buckets += counts.direct_buckets
        stats.relayed_bytes += lane.backend.relayed.take()


__all__ = [
    "MIN_LANE_BUCKET", "WHOLE", "Broadcasts", "Lane", "LaneStream", "LaneVersion", "LaneView", "lane_bucket_size",
]  # fmt: skip
