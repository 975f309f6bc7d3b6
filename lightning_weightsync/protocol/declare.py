"""A receiver's declaration of what it holds of each tensor (its boxes), and how it travels.

A tensor-parallel rollout holds a box of most tensors (protocol/boxes.py). Once it says which, the sender
sends it those bytes only (versions/lanes.py). The declaration is sent once per sender session, in pages:

    receiver (Prepare)   Boxes(digest, page i of n) * a few, then Ready(boxes=digest)
    sender               keeps the pages per receiver (`Declarations`); once all n arrived and the boxes fit
                         the tensors it sends, the plan says `boxes=digest` and the receiver's stream carries
                         its boxes; until then (or when refused: `boxes_refused`), whole tensors, as before

A few pages go with each version (`PAGES_PER_VERSION`), round robin until the plan says the sender took the
declaration, so a lost page (the sender's inbox keeps a bounded queue per connection) is sent again and a
large model's declaration never floods the control plane: a page holds hundreds of tensors
(`BOXES_PAGE_BYTES`), so a dense model's fits in one or two, a large MoE's takes a few versions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec

from ..errors import ProtocolError
from .boxes import Box, check_boxes
from .messages import BOXES_PAGE_BYTES, MAX_BOX_PAGES, MAX_MEMBERS, BoxEntry, Boxes

PAGES_PER_VERSION = 8
_ENTRY_SLACK = 64  # a page's own fields around its entries, in bytes, as msgpack encodes them


def _digest(entries: list[BoxEntry]) -> str:
    return hashlib.blake2b(msgspec.msgpack.encode(entries), digest_size=16).hexdigest()


@dataclass(frozen=True)
class Declaration:
    """What one receiver holds: {tensor name: its box}; a tensor not named is held whole."""

    boxes: Mapping[str, Box]
    digest: str
    entries: tuple[BoxEntry, ...] = field(repr=False)

    @classmethod
    def of(cls, boxes: Mapping[str, Box]) -> Declaration:
        entries = tuple(BoxEntry(n, list(b.offsets), list(b.sizes)) for n, b in sorted(boxes.items()))
        return cls(dict(sorted(boxes.items())), _digest(list(entries)), entries)

    def pages(self, identity: str) -> list[Boxes]:
        """The declaration as `Boxes` messages, each at most `BOXES_PAGE_BYTES` encoded."""
        groups: list[list[BoxEntry]] = [[]]
        head = _ENTRY_SLACK + len(identity.encode()) * 4 + len(self.digest)  # a page's own fields
        used = head
        for entry in self.entries:
            size = len(msgspec.msgpack.encode(entry))
            if groups[-1] and used + size > BOXES_PAGE_BYTES:
                groups.append([])
                used = head
            groups[-1].append(entry)
            used += size
        if len(groups) > MAX_BOX_PAGES:
            raise ProtocolError(
                f"a declaration of {len(self.entries)} boxes takes {len(groups)} pages (limit {MAX_BOX_PAGES})"
            )
        return [Boxes(identity, self.digest, i, len(groups), g) for i, g in enumerate(groups)]


class Declarations:
    """The sender's side: the pages of each receiver's declaration as they come, one declaration per receiver
    (a newer digest replaces it), at most `MAX_MEMBERS` receivers (the oldest goes). Bounded: a page is bounded
    by the frame limit, a declaration by `MAX_BOX_PAGES`."""

    def __init__(self) -> None:
        self._pages: dict[str, tuple[str, int, dict[int, list[BoxEntry]]]] = {}

    def add(self, identity: str, page: Boxes) -> None:
        held = self._pages.get(identity)
        if held is None or held[0] != page.digest or held[1] != page.pages:
            self._pages.pop(identity, None)
            if len(self._pages) >= MAX_MEMBERS:
                del self._pages[next(iter(self._pages))]
            held = self._pages[identity] = (page.digest, page.pages, {})
        held[2][page.page] = page.entries

    def complete(self, identity: str, digest: str) -> dict[str, Box] | None:
        """The receiver's boxes named `digest`, once every page arrived and they hash to it (None before)."""
        held = self._pages.get(identity)
        if held is None or held[0] != digest or len(held[2]) != held[1]:
            return None
        entries = [e for i in range(held[1]) for e in held[2][i]]
        if _digest(entries) != digest:
            raise ProtocolError(f"the boxes {identity} declared do not hash to the digest they name ({digest})")
        boxes = {e.name: Box(tuple(e.offsets), tuple(e.sizes)) for e in entries}
        if len(boxes) != len(entries):
            raise ProtocolError(f"{identity} declared a box for a tensor twice")
        return boxes

    def forget(self, identity: str) -> None:
        self._pages.pop(identity, None)


def check_declared(boxes: Mapping[str, Box], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Box]:
    """A declaration against the tensors the sender sends (`shapes`: name -> shape, the last version's): every
    box inside its tensor, of its rank, not empty. Returns the boxes that are not the whole tensor (those go
    whole anyway). A name this sender does not send costs nothing and is left out (in sharded mode a rank may
    hold no part of a small tensor; a tensor that appears later goes whole to that lane, which keeps its box
    of it as any receiver does). `ProtocolError` naming the tensor and box."""
    parts: dict[str, Box] = {}
    for name, box in boxes.items():
        shape = shapes.get(name)
        if shape is None:
            continue
        check_boxes(name[:120], shape, [box])
        if not box.is_whole(shape):
            parts[name] = box
    return parts


__all__ = ["PAGES_PER_VERSION", "Declaration", "Declarations", "check_declared"]
