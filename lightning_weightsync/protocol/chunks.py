"""Split tensors into bucket-sized byte chunks and merge them back, bitwise.

The split also plans the bucket layout: it assigns each chunk its byte `offset` in the bucket,
filling every bucket to the last byte (a tensor that does not fit in what is left of a bucket is
cut at the bucket boundary, not pushed whole into the next one), or to `MAX_BUCKET_ENTRIES` chunks.
The sender therefore only copies `chunk -> bucket[offset:offset + chunk_size]` and starts a new
bucket when the offset goes back to the start (or the count is reached); nothing about the layout is
decided twice.

Chunk lifetime: a chunk yielded by `split_weight_chunks` is a uint8 *view* of the caller's tensor
(or of a contiguous copy of it when the tensor is not contiguous). It is valid until the consumer
asks the iterator for the next item; the next `(name, tensor)` pair is only pulled from the
caller's iterable after every chunk of the current tensor has been consumed, so a producer may
reuse or free its tensor as soon as it yields the next one.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch

from ..errors import ConfigError, ProtocolError
from .boxes import Box, box_of, byte_pieces, local_of, local_range, place
from .dtypes import itemsize

T = TypeVar("T")
MAX_BUCKET_ENTRIES = 4096
"""Chunks in one bucket at most. Bytes alone do not bound a bucket's metadata: an empty tensor is a chunk
of 0 bytes, so a stream of them would make one bucket's metadata (and the largest legal control message,
`protocol.messages.MAX_FRAME_TO_RECEIVER`) unbounded. The split starts a new bucket after this many; real
streams (hundreds of tensors per bucket at most) never reach it."""
NamedTensors = (
    Iterable[tuple[str, "torch.Tensor | TensorShard"]] | AsyncIterable[tuple[str, "torch.Tensor | TensorShard"]]
)
Chunks = Iterable[tuple["TensorMeta", torch.Tensor]] | AsyncIterable[tuple["TensorMeta", torch.Tensor]]


@dataclass(frozen=True)
class TensorMeta:
    """Where one byte range of one tensor goes.

    `chunk_offset`/`chunk_size` are bytes within the whole tensor; `offset` is the position of
    the chunk in its bucket (set by the split/sender, `None` for chunks not yet placed).
    With a `box` (a receiver that declared the part of the tensor it holds: protocol/boxes.py), the stream
    carries that box's local tensor only: `chunk_offset`/`chunk_size`, `numel` and `nbytes` are of it, and
    `shape` stays the whole tensor's, so a name means one tensor wherever it goes.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunk_offset: int
    chunk_size: int
    offset: int | None = None
    box: Box | None = None

    @property
    def form(self) -> str:
        """What the stream carries of the tensor, for errors: `torch.float32[8, 4]`, and its box if any."""
        box = "" if self.box is None else f" box at {list(self.box.offsets)} of sizes {list(self.box.sizes)}"
        return f"{self.dtype}{list(self.shape)}{box}"

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of the tensor the stream carries: the box's local tensor, or the whole."""
        return self.shape if self.box is None else self.box.sizes

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)

    @property
    def is_first(self) -> bool:
        return self.chunk_offset == 0

    @property
    def is_last(self) -> bool:
        return self.chunk_offset + self.chunk_size == self.nbytes


@dataclass(frozen=True)
class TensorShard:
    """A contiguous byte range of a tensor that one sender owns (sharded send mode: an FSDP2 `Shard(0)`
    local shard, a slice of an FSDP1 flat parameter). `shape` and `dtype` are the whole tensor's;
    `byte_offset` is where `data`'s bytes start in it. Its chunks carry offsets into the whole tensor, so
    a receiver places them straight where they belong, whichever sender they came from.
    With a `box`, the bytes are of that box's local tensor (a lane's part: `versions/lanes.py`), and
    `byte_offset` counts in it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    byte_offset: int
    data: torch.Tensor
    box: Box | None = None

    def __post_init__(self) -> None:
        held = self.shape if self.box is None else self.box.sizes
        whole = math.prod(held) * itemsize(self.dtype)
        size = self.data.numel() * self.data.element_size()
        if self.byte_offset < 0 or self.byte_offset + size > whole:
            raise ValueError(f"shard [{self.byte_offset}, +{size}) is outside the tensor's {whole} bytes")


async def aiter_any(items: Iterable[T] | AsyncIterable[T]) -> AsyncIterator[T]:
    """Iterate a sync or async iterable uniformly."""
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of `tensor`'s bytes (a copy only when it is not contiguous). Called for every tensor on
    both sides every version: `view` where it can (three dispatches, not four: ~2 us, not ~3.3, on CPU)."""
    flat = tensor.detach()
    flat = flat.view(-1) if flat.is_contiguous() else flat.contiguous().view(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


async def split_weight_chunks(
    weights: NamedTensors, bucket_size: int, *, alone_from: int | None = None
) -> AsyncIterator[tuple[TensorMeta, torch.Tensor]]:
    """Yield `(meta, uint8 view)` chunks of at most `bucket_size` bytes, packed back to back.

    Every tensor yields at least one chunk; an empty tensor yields one chunk of size 0. With
    `alone_from`, every chunk of a tensor of at least that many bytes gets a bucket of its own
    (offset 0, nothing packed with it): a transport can then broadcast it straight from the tensor
    and receive it straight into its destination, with no pack or merge copy. Only the smaller
    tensors are packed, back to back across the large ones (the packed bucket is not cut short by a
    large tensor; the sender publishes it once it is full). `chunk_goes_alone` says which chunks go alone.
    """
    if bucket_size < 1:
        raise ConfigError(f"bucket_size={bucket_size} must be >= 1 byte (transport.bucket_size_mb)")
    plan = BucketLayout(bucket_size, alone_from)
    # Two loops instead of `aiter_any`: one async-generator layer less per tensor on the hot path.
    if isinstance(weights, AsyncIterable):
        async for name, tensor in weights:
            for chunk in plan.chunks(name, tensor):
                yield chunk
    else:
        for name, tensor in weights:
            for chunk in plan.chunks(name, tensor):
                yield chunk


def place_chunk(dest: torch.Tensor, data: torch.Tensor) -> None:
    """Copy a chunk into its destination, unless the transport already received it there (a
    receiver may broadcast a full-bucket chunk straight into the destination tensor)."""
    if dest.data_ptr() != data.data_ptr() or dest.device != data.device:
        dest.copy_(data)


def chunk_goes_alone(meta: TensorMeta, bucket_size: int, alone_from: int | None) -> bool:
    """Whether `split_weight_chunks(..., alone_from=...)` gave this chunk a bucket of its own: every
    chunk of a large tensor, and any chunk that fills a whole bucket."""
    return meta.offset == 0 and (
        meta.chunk_size == bucket_size or (alone_from is not None and meta.nbytes >= alone_from > 0)
    )


class BucketLayout:
    """Assigns chunks their bucket offsets; `filled` (and `count`) carry over from one tensor to the next.

    The synchronous core of `split_weight_chunks`, one tensor at a time (`chunks`): the sender's bucket
    planner (`versions/planner.py`) drives it directly, so the layout is decided here and only here."""

    __slots__ = ("alone_from", "bucket_size", "count", "filled")

    def __init__(self, bucket_size: int, alone_from: int | None = None) -> None:
        self.bucket_size = bucket_size
        self.alone_from = alone_from if alone_from is not None and alone_from > 0 else None
        self.filled = 0  # bytes already planned into the current bucket
        self.count = 0  # chunks already planned into the current bucket

    def _start(self) -> int:
        """Where the next packed chunk goes: on in the current bucket, or at 0 in a new one when the
        current one is full (bytes or MAX_BUCKET_ENTRIES chunks)."""
        if self.filled == self.bucket_size or self.count >= MAX_BUCKET_ENTRIES:
            self.filled = self.count = 0
        self.count += 1
        return self.filled

    def chunks(self, name: str, tensor: torch.Tensor | TensorShard) -> Iterator[tuple[TensorMeta, torch.Tensor]]:
        base = 0  # where these bytes start in the whole tensor (a shard's offset)
        if isinstance(tensor, TensorShard):
            base, data, shape, dtype = tensor.byte_offset, as_bytes(tensor.data), tensor.shape, tensor.dtype
            box = tensor.box
        elif isinstance(tensor, torch.Tensor):
            data, shape, dtype, box = as_bytes(tensor), tuple(tensor.shape), tensor.dtype, None
        else:
            raise TypeError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        nbytes = data.numel()
        if base or box is not None:
            held = math.prod(shape if box is None else box.sizes) * itemsize(dtype)
            yield from (
                (TensorMeta(m.name, m.shape, m.dtype, m.chunk_offset + base, m.chunk_size, m.offset, box), d)
                for m, d in self._chunks(name, data, shape, dtype, nbytes, held)
            )
        else:
            yield from self._chunks(name, data, shape, dtype, nbytes, nbytes)

    def _chunks(
        self, name: str, data: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int, whole: int
    ) -> Iterator[tuple[TensorMeta, torch.Tensor]]:
        """`nbytes` of `data` from a tensor of `whole` bytes (more for a shard: large tensors go alone by
        their whole size, the rule `chunk_goes_alone` reads from the metadata)."""
        bucket_size = self.bucket_size
        if self.alone_from is not None and whole >= self.alone_from:
            # a bucket per chunk, each at offset 0; the packed bucket around them goes on filling where it
            # was, so small tensors before and after a large one share a bucket (and a broadcast)
            for chunk_offset in range(0, nbytes, bucket_size):
                size = min(bucket_size, nbytes - chunk_offset)
                yield TensorMeta(name, shape, dtype, chunk_offset, size, 0), data[chunk_offset : chunk_offset + size]
            return
        filled = self._start()
        if nbytes <= bucket_size - filled:  # fits whole (the common case): no slicing
            self.filled = filled + nbytes
            yield TensorMeta(name, shape, dtype, 0, nbytes, filled), data
            return
        chunk_offset = 0
        while True:
            size = min(nbytes - chunk_offset, bucket_size - filled)
            self.filled = filled + size
            yield TensorMeta(name, shape, dtype, chunk_offset, size, filled), data[chunk_offset : chunk_offset + size]
            chunk_offset += size
            if chunk_offset >= nbytes:
                break
            filled = self._start()


class Landing:
    """Where a tensor's bytes land: `into()`'s destination, or the box of it this rank holds (a tensor-parallel
    rollout's DTensor, or a plain tensor shaped like the box a sender sent). `held` is the bytes kept: the whole
    tensor's, or the box's local tensor's. A chunk of the whole tensor into a box: every byte passes, only the
    box's are kept (`boxes.place`, a few strided copies per chunk); a chunk of the box alone (`meta.box`: the
    receiver declared it) is bytes of the local tensor, in order, and lands as a plain tensor's do.
    `write(meta, offset, chunk)`: bytes [offset, +len) of what `meta`'s stream carries."""

    __slots__ = ("box", "dest", "held", "local", "shape")

    def __init__(self, meta: TensorMeta, dest: torch.Tensor) -> None:
        self.dest, self.shape = dest, meta.shape
        self.box = box_of(dest)
        if self.box is None and meta.box is None:
            check_destination(meta, dest)
            self.local = dest
        elif self.box is None:  # a plain tensor for a box the sender sent: the consumer keeps the slice itself
            assert meta.box is not None
            self.box, self.local = meta.box, _box_tensor(meta, meta.box, dest)
        else:
            if dest.dtype != meta.dtype or tuple(dest.shape) != meta.shape:
                raise ProtocolError(
                    f"DTensor destination for {meta.name!r} is {dest.dtype}{list(dest.shape)}, "
                    f"but the stream carries {meta.form}"
                )
            self.local = local_of(dest)
            if tuple(self.local.shape) != self.box.sizes or not self.local.is_contiguous():
                raise ProtocolError(
                    f"DTensor destination for {meta.name!r}: its local tensor is not its contiguous box"
                )
        self.held = as_bytes(self.local)
        self.fits(meta)

    @property
    def whole_bytes(self) -> torch.Tensor | None:
        """The destination's bytes where it holds the whole tensor (None: a box of it)."""
        return self.held if self.box is None else None

    def fits(self, meta: TensorMeta) -> None:
        """A chunk of a box lands only in a destination that holds exactly that box."""
        if meta.box is not None and meta.box != self.box:
            held = (
                "the whole tensor"
                if self.box is None
                else f"box at {list(self.box.offsets)} of sizes " + str(list(self.box.sizes))
            )
            raise ProtocolError(f"{meta.name!r}: the sender sent {meta.form}, but the destination holds {held}")

    def local_range(self, meta: TensorMeta) -> tuple[int, int]:
        """The bytes of `held` that `meta`'s chunk fills."""
        start, end = meta.chunk_offset, meta.chunk_offset + meta.chunk_size
        if meta.box is not None or self.box is None:
            return start, end
        width = itemsize(meta.dtype)
        return local_range(self.shape, width, self.box, byte_pieces(self.shape, width, self.box, start, end))

    def write(self, meta: TensorMeta, offset: int, data: torch.Tensor) -> None:
        if meta.box is not None or self.box is None:
            held = self.held
            whole = offset == 0 and data.numel() == held.numel()
            place_chunk(held if whole else held[offset : offset + data.numel()], data)
        else:
            place(self.local, self.box, self.shape, offset, data)


def _box_tensor(meta: TensorMeta, box: Box, dest: torch.Tensor) -> torch.Tensor:
    """A plain destination of a box the sender sent: shaped like the box, of the tensor's dtype, contiguous."""
    if not isinstance(dest, torch.Tensor) or dest.dtype != meta.dtype or tuple(dest.shape) != box.sizes:
        what = f"{dest.dtype}{list(dest.shape)}" if isinstance(dest, torch.Tensor) else type(dest).__name__
        raise ProtocolError(
            f"{meta.name!r}: the sender sent {meta.form}, but the destination is {what}: a DTensor holding "
            "that box, or a tensor of the box's sizes"
        )
    if not dest.is_contiguous():
        raise ProtocolError(f"destination for {meta.name!r}'s box must be contiguous")
    return dest


class _Assembly:
    """One tensor being merged: its destination bytes and the next byte expected."""

    __slots__ = ("landing", "meta", "next_offset")

    def __init__(self, meta: TensorMeta, landing: Landing, next_offset: int) -> None:
        self.meta = meta
        self.landing = landing
        self.next_offset = next_offset


def check_destination(meta: TensorMeta, dest: torch.Tensor) -> None:
    """Refuse a destination `into()` returned that cannot hold `meta`'s tensor, before a byte lands in it
    (the merger here and the tiler in `tiling.py` take destinations alike)."""
    if not isinstance(dest, torch.Tensor):
        raise ProtocolError(f"into() returned {type(dest).__name__} for {meta.name!r}, not a Tensor")
    if dest.dtype != meta.dtype or tuple(dest.shape) != meta.shape:
        raise ProtocolError(
            f"destination for {meta.name!r} is {dest.dtype}{list(dest.shape)}, "
            f"but the stream carries {meta.dtype}{list(meta.shape)}"
        )
    if not dest.is_contiguous():  # as_bytes would copy, and the chunks would land in the copy
        raise ProtocolError(f"destination for {meta.name!r} must be contiguous")


class _Merger:
    """The merge state machine, one chunk at a time; `push` returns a tensor once it is complete."""

    __slots__ = ("bucket_size", "current", "device", "into", "seen")

    def __init__(
        self,
        bucket_size: int,
        into: Callable[[TensorMeta], torch.Tensor | None] | None,
        device: torch.device | str | None,
    ) -> None:
        self.bucket_size = bucket_size
        self.into = into
        self.device = device
        self.current: _Assembly | None = None
        self.seen: set[str] = set()

    def push(self, meta: TensorMeta, data: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        size, offset = meta.chunk_size, meta.chunk_offset
        if size != data.numel() or data.dtype != torch.uint8:
            raise ProtocolError(
                f"chunk of {meta.name!r} declares {size} bytes but carries {data.numel()} {data.dtype} elements"
            )
        if size > self.bucket_size:
            raise ProtocolError(f"chunk of {meta.name!r} is {size} bytes > bucket_size {self.bucket_size}")
        nbytes = meta.nbytes
        if offset < 0 or offset + size > nbytes:
            raise ProtocolError(f"chunk [{offset}, +{size}) of {meta.name!r} is outside its {nbytes} bytes")
        current = self.current
        if current is None:
            return self._first(meta, data)
        if meta.name != current.meta.name:
            raise ProtocolError(
                f"stream moved to {meta.name!r} while {current.meta.name!r} was incomplete "
                f"({current.next_offset}/{current.meta.nbytes} bytes)"
            )
        if meta.shape != current.meta.shape or meta.dtype != current.meta.dtype or meta.box != current.meta.box:
            raise ProtocolError(f"{meta.name!r} changed from {current.meta.form} to {meta.form} mid-tensor")
        if offset != current.next_offset:
            kind = "gap" if offset > current.next_offset else "overlap"
            raise ProtocolError(
                f"{kind} in {meta.name!r}: chunk starts at byte {offset}, expected {current.next_offset}"
            )
        end = offset + size
        if size:
            current.landing.write(meta, offset, data)
        current.next_offset = end
        if end == nbytes:
            self.current = None
            return meta.name, current.landing.dest
        return None

    def _first(self, meta: TensorMeta, data: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        name, size = meta.name, meta.chunk_size
        if name in self.seen:
            raise ProtocolError(f"tensor {name!r} appears twice in one version")
        if meta.chunk_offset != 0:
            raise ProtocolError(
                f"first chunk of {name!r} starts at byte {meta.chunk_offset}, expected 0 (chunk lost or out of order)"
            )
        dest = self.into(meta) if self.into is not None else None
        if dest is None:
            dest = torch.empty(meta.local_shape, dtype=meta.dtype, device=self.device)
        landing = Landing(meta, dest)
        self.seen.add(name)
        if size:
            landing.write(meta, 0, data)
        if size == meta.nbytes:  # the whole tensor in one chunk (the common case)
            return name, dest
        self.current = _Assembly(meta, landing, size)
        return None

    def finish(self) -> None:
        current = self.current
        if current is not None:
            raise ProtocolError(
                f"stream ended mid-tensor: {current.meta.name!r} has {current.next_offset} of "
                f"{current.meta.nbytes} bytes"
            )


async def merge_weight_chunks(
    chunks: Chunks,
    bucket_size: int,
    *,
    into: Callable[[TensorMeta], torch.Tensor | None] | None = None,
    device: torch.device | str | None = None,
) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """Reassemble chunks into whole tensors, yielding each `(name, tensor)` once it is complete.

    With `into(meta)` returning a tensor, chunks are copied straight into it (no staging copy of
    the whole weight) and that tensor is yielded; returning `None` falls back to a fresh tensor.
    Yielded tensors never alias the chunk buffers, so the caller may reuse those at once.
    Any gap, overlap, reorder, shape/dtype change mid-tensor, duplicate name or early end raises
    `ProtocolError`.
    """
    merger = _Merger(bucket_size, into, device)
    if isinstance(chunks, AsyncIterable):
        async for meta, data in chunks:
            done = merger.push(meta, data)
            if done is not None:
                yield done
    else:
        for meta, data in chunks:
            done = merger.push(meta, data)
            if done is not None:
                yield done
    merger.finish()
