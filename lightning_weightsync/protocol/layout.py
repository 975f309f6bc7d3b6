"""Layout once: a bucket's layout (its entries: names, shapes, dtypes, offsets) travels once, not every version.

For a model whose tensors keep their shapes, every version is cut into the same buckets, so re-sending each
bucket's entries is wasted work on both ends: the sender encodes them, and the receiver decodes and validates
every entry again (about 2 us an entry: a 512-entry bucket is a millisecond of the receiver's CPU). Both ends
instead keep the layout of the last version they streamed whole (`Layout`: each bucket's nbytes, is_last and
entries), named by a digest both compute the same way (`LayoutRecorder`: BLAKE2b over each bucket's msgpack
encoding, in order). The receiver says the digest it holds in `Ready.layout`; when every member of a version
holds the sender's, a bucket the planner cut exactly as before goes as `BucketMeta(entries=[], layout=digest)`,
and the receiver takes its entries from what it holds (`Layout.expand`). A bucket cut differently goes whole,
so a version may mix both.

Safety (see docs/security.md): the held entries are entries that passed `validate_bucket` when they arrived;
an expanded bucket must name the digest this receiver holds, an index inside it, and the same nbytes and
is_last as the held bucket, or the version fails (`ProtocolError`: nothing of it is committed). What a version
says of each entry (fingerprints, deltas) is validated against the expanded entries by the same functions
as for a bucket that carried them. A receiver that holds no layout (new, restarted, or after a failed
version) says "", and the sender sends every entry.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property

import msgspec

from ..errors import ProtocolError
from .chunks import TensorMeta
from .messages import LAYOUT_DIGEST_LEN, BucketMeta, Entry, validate_per_entry

_encoder = msgspec.msgpack.Encoder()


@dataclass(frozen=True)
class BucketShape:
    """One bucket of a layout, and the bytes its digest is computed over."""

    nbytes: int
    is_last: bool
    entries: list[Entry]
    encoded: bytes

    def same(self, nbytes: int, is_last: bool, entries: list[Entry]) -> bool:
        return self.nbytes == nbytes and self.is_last == is_last and self.entries == entries

    @cached_property
    def metas(self) -> tuple[TensorMeta, ...]:
        """The entries as a receiver merges them, made once per layout, not once per version."""
        return tuple(entry.to_meta() for entry in self.entries)


@dataclass(frozen=True)
class Layout:
    """The buckets of a version streamed whole, in order, named by `digest`."""

    digest: str
    buckets: tuple[BucketShape, ...]

    def reference(self, index: int, nbytes: int, is_last: bool, entries: list[Entry]) -> bool:
        """Whether bucket `index`, cut as given, is this layout's bucket (then it may go as a reference)."""
        return index < len(self.buckets) and self.buckets[index].same(nbytes, is_last, entries)

    def expand(self, meta: BucketMeta) -> BucketMeta:
        """`meta` with its entries: as it came, or from this layout when it names it (checked: see the module)."""
        if not meta.layout:
            return meta
        if meta.layout != self.digest:
            raise ProtocolError(
                f"version {meta.version}: bucket {meta.bucket_index} names layout {meta.layout}, but this receiver "
                f"holds {self.digest}"
            )
        held = self.buckets[meta.bucket_index] if meta.bucket_index < len(self.buckets) else None
        if held is None or (held.nbytes, held.is_last) != (meta.nbytes, meta.is_last):
            raise ProtocolError(
                f"version {meta.version}: bucket {meta.bucket_index} ({meta.nbytes} bytes, is_last={meta.is_last}) "
                f"is not bucket {meta.bucket_index} of the held layout {self.digest} ({len(self.buckets)} buckets)"
            )
        expanded = msgspec.structs.replace(meta, entries=held.entries, layout="")
        validate_per_entry(expanded)
        return expanded


def no_layout(meta: BucketMeta) -> BucketMeta:
    """`Layout.expand` for a receiver that holds none: a bucket that names a layout fails the version."""
    if meta.layout:
        raise ProtocolError(
            f"version {meta.version}: bucket {meta.bucket_index} names layout {meta.layout}, but this receiver holds "
            "none (it said so in Ready)"
        )
    return meta


@dataclass
class LayoutRecorder:
    """Records a version's buckets as they are streamed; `finish()` names the layout once the last one is in."""

    buckets: list[BucketShape] = field(default_factory=list)
    same: int = 0  # buckets that were the held layout's (the sender named them by its digest)

    def add(self, nbytes: int, is_last: bool, entries: list[Entry], held: Layout | None = None) -> bool:
        """Record the next bucket; True when it is `held`'s bucket of the same index (the sender may name it)."""
        index = len(self.buckets)
        same = held is not None and held.reference(index, nbytes, is_last, entries)
        if same:
            assert held is not None
            self.buckets.append(held.buckets[index])  # its encoding too: nothing to encode again
            self.same += 1
        else:
            encoded = _encoder.encode((nbytes, is_last, entries))
            self.buckets.append(BucketShape(nbytes, is_last, list(entries), encoded))
        return same

    def finish(self) -> Layout | None:
        """The layout, or None when the version did not reach its last bucket."""
        if not self.buckets or not self.buckets[-1].is_last:
            return None
        digest = hashlib.blake2b(digest_size=LAYOUT_DIGEST_LEN // 2)
        for bucket in self.buckets:
            digest.update(len(bucket.encoded).to_bytes(8, "big"))
            digest.update(bucket.encoded)
        return Layout(digest.hexdigest(), tuple(self.buckets))


__all__ = ["BucketShape", "Layout", "LayoutRecorder", "no_layout"]
