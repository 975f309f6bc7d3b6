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
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..errors import ProtocolError
from ..protocol.boxes import Box, check_boxes, take
from ..protocol.chunks import TensorShard, as_bytes
from ..protocol.dtypes import itemsize
from ..protocol.layout import Layout
from ..transport.backends import NUM_SLOTS, Backend
from ..transport.control import Peer
from ..transport.executor import SerialExecutor

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


@dataclass
class Lane:
    """One lane's data plane, kept from version to version while its receivers keep their declaration."""

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


@dataclass
class LaneVersion:
    """One version on one lane: the receivers in it and what it takes of each tensor."""

    lane: Lane
    peers: list[Peer]
    view: LaneView

    @property
    def whole(self) -> bool:
        return self.lane.key == WHOLE


__all__ = ["MIN_LANE_BUCKET", "WHOLE", "Lane", "LaneVersion", "LaneView", "lane_bucket_size"]
