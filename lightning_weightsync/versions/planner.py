"""The sender's bucket planner: one version's tensor stream turned into the steps that put it on the wire.

    for each tensor (after the transforms: its fingerprint, its delta payload):
        for each chunk of it (protocol.chunks.BucketLayout: offsets, bucket boundaries):
            Flush(the packed bucket)   when the chunk cannot join it: the layout starts a new bucket (its offset
                                       goes back, or MAX_BUCKET_ENTRIES chunks), or a direct chunk comes while
                                       the packed bucket holds part of a tensor, or is followed by a packed
                                       chunk of its own tensor (a receiver merges one tensor at a time)
            Flush(a direct bucket)     a chunk that goes alone (transport.direct_min_mb, or a full bucket), sent
                                       from the caller's tensor: no slot, no copy
            Pack(slot, offset, data)   otherwise: the chunk is copied into the packed bucket's slot
    finish(): Flush(the last packed bucket, is_last), empty when the version ended on a direct bucket

It is the mirror of the receiver's `BucketPipeline` (versions/pipeline.py), without its waits: a pure object
(no sockets, no backend, no event loop), so the layout and every rule above are tested on their own
(tests/unit/test_planner.py), and a lane's `LaneStream` (lanes.py) only executes the steps: copy into the slot,
publish the metadata, broadcast, and wait for the other slot before packing into it. Packed buckets take
the slots in turn (bucket k of the packed ones in slot k % NUM_SLOTS); a Flush names the slot it read.

What rides along with a tensor (its fingerprint, transport.verify; its delta payload, transport.delta) is
added by transforms (`Transform`: `Outgoing -> Outgoing`, applied in order as each tensor is added), not by
branches in the loop: the planner copies what an `Outgoing` says onto every entry of the tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ..protocol.chunks import MAX_BUCKET_ENTRIES, BucketLayout, TensorMeta, TensorShard, chunk_goes_alone
from ..protocol.dtypes import dtype_name
from ..protocol.fingerprint import NO_FINGERPRINT
from ..protocol.messages import Entry
from ..transport.backends import NO_SLOT, next_slot


@dataclass(frozen=True)
class Outgoing:
    """One tensor as the planner takes it, with what the transforms noted about it.

    `tensor` holds the bytes that go out: a delta payload where `delta_size >= 0`, and then the entries
    describe the tensor it rebuilds (`rebuilds`: its shape and dtype), not the payload."""

    name: str
    tensor: torch.Tensor | TensorShard
    fingerprint: int = NO_FINGERPRINT  # transport.verify: carried by every entry of the tensor
    delta_size: int = -1  # transport.delta: payload bytes, -1 where the tensor goes whole
    rebuilds: tuple[tuple[int, ...], torch.dtype] | None = None
    delta_range: tuple[int, int] | None = None  # a shard's delta: (byte start, bytes) of the tensor it rebuilds

    def entry(self, meta: TensorMeta) -> Entry:
        """The wire entry of one chunk of this tensor."""
        if self.rebuilds is None:
            return Entry.from_meta(meta)
        assert meta.offset is not None
        shape, dtype = self.rebuilds
        return Entry(meta.name, list(shape), dtype_name(dtype), meta.chunk_offset, meta.chunk_size, meta.offset)


Transform = Callable[[Outgoing], Outgoing]
"""A stage on the stream: what it adds to (or swaps in) a tensor before it is planned, in the order given."""


@dataclass(frozen=True)
class Pack:
    """Copy the uint8 chunk `data` into bucket slot `slot` at byte `offset`."""

    slot: int
    offset: int
    data: torch.Tensor


@dataclass(frozen=True)
class Flush:
    """Bucket `index` is complete: publish its metadata, then broadcast its `nbytes` from `slot`, or from
    `data` for a direct bucket (`slot == NO_SLOT`: one chunk, straight from the caller's tensor)."""

    index: int
    slot: int
    nbytes: int
    entries: list[Entry]
    fingerprints: list[int]  # one per entry, or [] where no entry carries one (the wire's "none")
    deltas: list[int]  # one per entry (payload bytes, -1: whole), or [] where no entry is a delta
    is_last: bool = False
    data: torch.Tensor | None = None
    delta_ranges: list[tuple[int, int]] = field(default_factory=list)  # per entry where a shard is a delta, else []

    @property
    def direct(self) -> bool:
        return self.slot == NO_SLOT


Step = Pack | Flush


def _nbytes(tensor: torch.Tensor | TensorShard) -> int:
    """The bytes this sender sends of `tensor` (a shard's own, not the whole tensor's)."""
    data = tensor.data if isinstance(tensor, TensorShard) else tensor
    return data.numel() * data.element_size()


@dataclass
class PlanCounts:
    """What the plan so far carries (the figures `SendStats` reports)."""

    nbytes: int = 0  # chunk bytes (payload bytes for deltas), not bucket padding
    tensors: int = 0
    chunked_tensors: int = 0  # tensors cut into more than one chunk
    buckets: int = 0  # buckets with at least one entry (an empty terminator is not one)
    direct_buckets: int = 0


@dataclass
class _OpenBucket:
    """The packed bucket being filled."""

    entries: list[Entry] = field(default_factory=list)
    fingerprints: list[int] = field(default_factory=list)
    deltas: list[int] = field(default_factory=list)
    delta_ranges: list[tuple[int, int]] = field(default_factory=list)
    fill: int = 0  # end of the last chunk packed
    whole: bool = True  # every chunk packed so far is a whole tensor

    def add(self, item: Outgoing, meta: TensorMeta, entry: Entry) -> None:
        assert meta.offset is not None
        self.whole = (self.whole or not self.entries) and meta.is_first and meta.is_last
        self.entries.append(entry)
        self.fingerprints.append(item.fingerprint)
        self.deltas.append(item.delta_size)
        self.delta_ranges.append(item.delta_range or (0, 0))
        self.fill = meta.offset + meta.chunk_size

    def ends_before(self, meta: TensorMeta, direct: bool, tail_packed: bool = False) -> bool:
        """Whether this bucket must go out before `meta`'s chunk is planned. A packed chunk: when the layout
        starts a new bucket (the offset goes back, or the entry cap: empty tensors do not move the offset).
        A direct chunk goes out around it while it holds whole tensors only, and while the direct chunk's own
        tensor has no packed chunk after it (`tail_packed`): a receiver merges one tensor at a time, so no
        other tensor may come between the chunks of one."""
        if not self.entries:
            return False
        if direct:
            return not self.whole or tail_packed
        assert meta.offset is not None
        return meta.offset < self.fill or len(self.entries) >= MAX_BUCKET_ENTRIES


class BucketPlanner:
    """Plans one version: `add` each tensor (in stream order), execute the steps it yields in order (a step
    may depend on the ones before it having run: a Pack reuses the slot the previous Flush waited for), then
    execute `finish()`.

    Args:
        bucket_size: bytes per bucket (transport.bucket_size_mb).
        direct_min: tensors of at least this many bytes go direct (transport.direct_min_mb; None: only
            chunks that fill a whole bucket).
        direct_device: where a chunk must live to be broadcast from the caller's tensor (the backend's
            device); None where the backend cannot send a caller's tensor (everything is packed).
        transforms: applied to each tensor before it is planned (fingerprints, then deltas).
    """

    def __init__(
        self,
        bucket_size: int,
        *,
        direct_min: int | None = None,
        direct_device: torch.device | None = None,
        transforms: Sequence[Transform] = (),
    ) -> None:
        self.bucket_size = bucket_size
        self.direct_min = direct_min
        self.direct_device = direct_device
        self.transforms = tuple(transforms)
        self.counts = PlanCounts()
        self._layout = BucketLayout(bucket_size, direct_min if direct_device is not None else None)
        self._open = _OpenBucket()
        self._slot = 0  # the slot the open packed bucket is filled in
        self._index = 0  # the next bucket's index (packed and direct buckets share one sequence)

    def add(self, name: str, tensor: torch.Tensor | TensorShard) -> Iterator[Step]:
        """The steps that put one tensor's chunks on the wire (the open packed bucket may stay open)."""
        item = Outgoing(name, tensor)
        for transform in self.transforms:
            item = transform(item)
        left = _nbytes(item.tensor)  # of this tensor's bytes, not yet planned
        for meta, data in self._layout.chunks(item.name, item.tensor):
            left -= meta.chunk_size
            direct = self._goes_direct(meta, data)
            if self._open.ends_before(meta, direct, direct and self._tail_packed(meta, left)):
                yield self._flush(is_last=False)
            self._count(meta)
            entry = item.entry(meta)
            if direct:
                ranges = [item.delta_range or (0, 0)]
                yield self._bucket(
                    NO_SLOT, meta.chunk_size, [entry], [item.fingerprint], [item.delta_size], data, ranges=ranges
                )
                self.counts.direct_buckets += 1
                continue
            if meta.chunk_size:
                assert meta.offset is not None
                yield Pack(self._slot, meta.offset, data)
            self._open.add(item, meta, entry)

    def finish(self) -> Flush:
        """The last bucket: what is packed (nothing, after a direct bucket: an empty terminator)."""
        return self._flush(is_last=True)

    def _goes_direct(self, meta: TensorMeta, data: torch.Tensor) -> bool:
        """A chunk the layout put alone in a bucket, broadcast from where it is (which must be the device)."""
        return (
            self.direct_device is not None
            and meta.chunk_size > 0
            and data.device == self.direct_device
            and chunk_goes_alone(meta, self.bucket_size, self.direct_min)
        )

    def _tail_packed(self, meta: TensorMeta, left: int) -> bool:
        """Whether a direct chunk is followed by a packed chunk of its tensor. Then the open packed bucket goes
        out first, even if it holds whole tensors only: published after this chunk, it would put other tensors
        between this tensor's chunks (and its tail, when the open bucket ends at offset 0, would join it behind
        them). Only a chunk sent alone because it fills a bucket (not by `direct_min`) has such a tail: the
        tensor's last `left` bytes, packed unless they fill whole buckets too."""
        by_size = self.direct_min is not None and meta.nbytes >= self.direct_min > 0
        return not by_size and left % self.bucket_size != 0

    def _count(self, meta: TensorMeta) -> None:
        self.counts.nbytes += meta.chunk_size
        if meta.is_first:
            self.counts.tensors += 1
            self.counts.chunked_tensors += not meta.is_last

    def _flush(self, is_last: bool) -> Flush:
        """The open packed bucket, out of its slot; the next one is filled in the other slot."""
        bucket, self._open = self._open, _OpenBucket()
        step = self._bucket(
            self._slot, bucket.fill, bucket.entries, bucket.fingerprints, bucket.deltas, None, is_last,
            ranges=bucket.delta_ranges,
        )  # fmt: skip
        self._slot = next_slot(self._slot)
        return step

    def _bucket(
        self,
        slot: int,
        nbytes: int,
        entries: list[Entry],
        fingerprints: list[int],
        deltas: list[int],
        data: torch.Tensor | None,
        is_last: bool = False,
        ranges: list[tuple[int, int]] | None = None,
    ) -> Flush:
        index, self._index = self._index, self._index + 1
        self.counts.buckets += bool(entries)
        return Flush(
            index,
            slot,
            nbytes,
            entries,
            fingerprints if any(p != NO_FINGERPRINT for p in fingerprints) else [],
            deltas if any(size >= 0 for size in deltas) else [],
            is_last,
            data,
            ranges if ranges and any(r != (0, 0) for r in ranges) else [],
        )


__all__ = ["BucketPlanner", "Flush", "Outgoing", "Pack", "PlanCounts", "Step", "Transform"]
