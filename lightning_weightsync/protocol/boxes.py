"""A rank's part of a tensor (a box: per-dim offsets and sizes), and the bytes of it a flat byte range holds.

What makes slices cheap: the elements of a box, read in the row-major order of the whole tensor, come in the
same order as in the box's own row-major tensor (its *local* tensor: what a tensor-parallel rank holds). So
the part of a box inside any flat byte range of the whole tensor (a chunk on the wire, an FSDP rank's shard)
is one contiguous byte range of the local tensor. A chunk lands in a box with at most 2 x ndim + 1 strided
copies (the flat range cut into boxes, each intersected with the target box), never an element at a time, and
the receiver's tiling check (protocol/tiling.py) works on the local tensor's byte ranges unchanged.

Everything here works in bytes: a tensor of shape `S` and itemsize `w` is a uint8 tensor of shape `(*S, w)`
and a box `B` the byte box `(*B, [0, w))`, so a chunk cut inside an element (chunks are cut at bucket
boundaries, in bytes) needs no special case.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ProtocolError


@dataclass(frozen=True)
class Box:
    """Per-dim `offsets` into a tensor and `sizes` from there: the part of it one rank holds."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Box:
        return cls((0,) * len(shape), tuple(shape))

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def is_whole(self, shape: Sequence[int]) -> bool:
        return not any(self.offsets) and self.sizes == tuple(shape)

    def intersect(self, other: Box) -> Box | None:
        """The box both hold, or None when they share no element."""
        starts = [max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True)]
        ends = [
            min(a + n, b + m) for a, n, b, m in zip(self.offsets, self.sizes, other.offsets, other.sizes, strict=True)
        ]
        if any(end <= start for start, end in zip(starts, ends, strict=True)):
            return None
        return Box(tuple(starts), tuple(end - start for start, end in zip(starts, ends, strict=True)))

    def within(self, outer: Box) -> Box:
        """This box in the coordinates of `outer`'s local tensor (it must lie inside `outer`)."""
        return Box(tuple(a - b for a, b in zip(self.offsets, outer.offsets, strict=True)), self.sizes)

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The view of `tensor` (shaped like the whole, or like an outer box's local tensor) this box covers."""
        view = tensor
        for dim, (start, size) in enumerate(zip(self.offsets, self.sizes, strict=True)):
            view = view.narrow(dim, start, size)
        return view

    def in_bytes(self, itemsize: int) -> Box:
        return Box((*self.offsets, 0), (*self.sizes, itemsize))


def is_dtensor(tensor: Any) -> bool:
    """Without importing torch.distributed.tensor: a program that never did holds no DTensor."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_of(tensor: Any) -> torch.Tensor:
    """A DTensor's local tensor on this rank (its box of the whole)."""
    local: torch.Tensor = tensor.detach().to_local()  # no autograd: bytes land in it in place
    return local


def box_of(tensor: Any) -> Box | None:
    """The box of its whole tensor a DTensor's local tensor holds on this rank (from its placements and mesh),
    or None for a plain tensor (it is whole). Refused: a placement whose local bytes are not a box of the
    tensor's values (a pending reduction), and a rank outside the DTensor's mesh."""
    if not is_dtensor(tensor):
        return None
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for placement in tensor.placements:
        if not isinstance(placement, (Replicate, Shard)):
            raise ValueError(
                f"a DTensor placed {type(placement).__name__} holds no box of the tensor's values (a pending "
                "reduction): make it Replicate or Shard before receiving into it"
            )
    if tensor.device_mesh.get_coordinate() is None:
        raise ValueError("this rank is not in the DTensor's mesh: it holds none of it")
    sizes, offsets = compute_local_shape_and_global_offset(tuple(tensor.shape), tensor.device_mesh, tensor.placements)
    return Box(tuple(int(o) for o in offsets), tuple(int(s) for s in sizes))


def check_boxes(name: str, shape: Sequence[int], boxes: Sequence[Box]) -> None:
    """What a receiver declares it holds of `name` must be boxes inside the tensor, of its rank, none empty and
    no two overlapping (each element is received once); `ProtocolError` naming the tensor and the box."""
    shape = tuple(shape)
    for box in boxes:
        if len(box.offsets) != len(shape) or len(box.sizes) != len(shape):
            raise ProtocolError(f"{name!r}: a box of rank {len(box.offsets)} for a tensor of shape {list(shape)}")
        for start, size, dim in zip(box.offsets, box.sizes, shape, strict=True):
            if start < 0 or size < 1 or start + size > dim:
                raise ProtocolError(
                    f"{name!r}: box at {list(box.offsets)} of sizes {list(box.sizes)} is empty or outside the "
                    f"tensor's shape {list(shape)}"
                )
    for i, box in enumerate(boxes):
        for other in boxes[i + 1 :]:
            if box.intersect(other) is not None:
                raise ProtocolError(f"{name!r}: boxes at {list(box.offsets)} and {list(other.offsets)} overlap")


def flat_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """The elements [start, stop) of a row-major tensor of `shape`, as at most 2 x ndim - 1 boxes, in order."""
    shape = tuple(shape)
    if start >= stop:
        return []
    if not shape:
        return [Box((), ())]
    row = math.prod(shape[1:])
    first, last = start // row, (stop - 1) // row
    if first == last:
        return [_prepend(first, 1, box) for box in flat_boxes(shape[1:], start - first * row, stop - first * row)]
    boxes: list[Box] = []
    if start % row:
        boxes += [_prepend(first, 1, box) for box in flat_boxes(shape[1:], start % row, row)]
        first += 1
    full_end = stop // row
    if full_end > first:
        boxes.append(Box((first, *(0,) * (len(shape) - 1)), (full_end - first, *shape[1:])))
    if stop % row:
        boxes += [_prepend(full_end, 1, box) for box in flat_boxes(shape[1:], 0, stop % row)]
    return boxes


def _prepend(index: int, size: int, box: Box) -> Box:
    return Box((index, *box.offsets), (size, *box.sizes))


def _linear(offsets: Sequence[int], shape: Sequence[int]) -> int:
    index = 0
    for offset, size in zip(offsets, shape, strict=True):
        index = index * size + offset
    return index


def _strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def byte_pieces(shape: Sequence[int], itemsize: int, box: Box, start: int, stop: int) -> list[Box]:
    """The parts of `box` (of a tensor of `shape`) inside bytes [start, stop) of the whole tensor, as byte
    boxes of the tensor's byte shape, in order: together one contiguous byte range of the box's local tensor."""
    byte_shape, byte_box = (*shape, itemsize), box.in_bytes(itemsize)
    pieces = []
    for part in flat_boxes(byte_shape, start, stop):
        common = part.intersect(byte_box)
        if common is not None:
            pieces.append(common)
    return pieces


def local_range(shape: Sequence[int], itemsize: int, box: Box, pieces: Sequence[Box]) -> tuple[int, int]:
    """The byte range of `box`'s local tensor that `pieces` (from `byte_pieces`) cover."""
    if not pieces:
        return 0, 0
    local_shape = (*box.sizes, itemsize)
    byte_box = box.in_bytes(itemsize)
    first = _linear(pieces[0].within(byte_box).offsets, local_shape)
    return first, first + sum(p.numel for p in pieces)


def place(local: torch.Tensor, box: Box, shape: Sequence[int], start: int, chunk: torch.Tensor) -> int:
    """Copy the bytes of `box` inside `chunk` (uint8: bytes [start, start + len) of the whole tensor of `shape`)
    into `local`, the box's local tensor (contiguous, of the tensor's dtype); returns how many bytes."""
    local_bytes = local_byte_view(local)
    itemsize = local_bytes.shape[-1]
    byte_shape = (*shape, itemsize)
    strides, byte_box, copied = _strides(byte_shape), box.in_bytes(itemsize), 0
    for piece in byte_pieces(shape, itemsize, box, start, start + chunk.numel()):
        at = chunk.storage_offset() + _linear(piece.offsets, byte_shape) - start  # as_strided counts from the storage
        source = chunk.as_strided(piece.sizes, strides, at)
        piece.within(byte_box).of(local_bytes).copy_(source)
        copied += piece.numel
    return copied


def local_byte_view(local: torch.Tensor) -> torch.Tensor:
    """`local` as uint8 of shape (*local.shape, itemsize), sharing its memory (so it must be contiguous)."""
    if not local.is_contiguous():
        raise ValueError("a box's local tensor must be contiguous to receive into it")
    itemsize = local.element_size()
    return local.reshape(-1).view(torch.uint8).view(*local.shape, itemsize)


def take(data: torch.Tensor, box: Box, shape: Sequence[int], itemsize: int, start: int) -> tuple[int, torch.Tensor]:
    """The bytes of `box` inside `data` (uint8: bytes [start, start + len) of the whole tensor of `shape`),
    packed in the box's local order: (their first byte in the box's local tensor, the bytes). `place`'s
    other half: what a sender that holds a flat range sends a receiver that holds `box`."""
    byte_shape = (*shape, itemsize)
    pieces = byte_pieces(shape, itemsize, box, start, start + data.numel())
    first, end = local_range(shape, itemsize, box, pieces)
    out = torch.empty(end - first, dtype=torch.uint8, device=data.device)
    strides, at = _strides(byte_shape), 0
    for piece in pieces:
        source = data.as_strided(
            piece.sizes, strides, data.storage_offset() + _linear(piece.offsets, byte_shape) - start
        )
        out[at : at + piece.numel].view(piece.sizes).copy_(source)
        at += piece.numel
    return first, out


def expand_box(local: torch.Tensor, shape: Sequence[int], box: Box) -> torch.Tensor:
    """A new tensor of the whole `shape`: `local` (the box's local tensor) in `box`, zeros elsewhere. What an
    engine's loader that reads only the box (a tensor-parallel rank's `load_weights`) takes for the whole."""
    whole = torch.zeros(tuple(shape), dtype=local.dtype, device=local.device)
    box.of(whole).copy_(local)
    return whole


__all__ = [
    "Box",
    "box_of",
    "byte_pieces",
    "check_boxes",
    "expand_box",
    "flat_boxes",
    "local_byte_view",
    "local_range",
    "place",
    "take",
]
