"""The join kinds: what a receiver needs to join one backend's data-plane group, carried in a plan.

Each kind is a msgspec Struct with its own tag, its own `validate()` (range checks the schema cannot
express) and `MAX_BYTES` (its largest legal encoding, part of the receivers' frame budget), in one file
here, owned by the backends that use it (a backend names it as its `join_type`). The wire union
`messages.Join`, its validation and the frame budget are built from this table, so a backend that needs
its own rendezvous adds its file here and one line below, and `messages.py` stays as it is.

The table is complete when `messages` builds its decoder (it loads every entry, then freezes the
table): decoding stays a strict tagged union, and a plan of a kind not listed here is rejected.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

from ...errors import ProtocolError
from ...registry import Registry


class JoinSpec(msgspec.Struct, frozen=True):
    """Base of the join kinds (subclasses set `tag=`)."""

    MAX_BYTES: ClassVar[int] = 0

    def validate(self) -> None:
        """Raise `ProtocolError` on a value a legal sender never sends."""
        raise ProtocolError(f"{type(self).__name__} defines no validation")


JOIN_KINDS: Registry[type[JoinSpec]] = Registry("plan join", "join kind")
"""Every join kind by its msgspec tag (one line each; the union a plan decodes into)."""
JOIN_KINDS.add("store", "lightning_weightsync.protocol.joins.store:StoreJoin")
JOIN_KINDS.add("nccl", "lightning_weightsync.protocol.joins.nccl:NcclJoin")
JOIN_KINDS.add("shared", "lightning_weightsync.protocol.joins.shared:SharedJoin")
JOIN_KINDS.add("nixl", "lightning_weightsync.protocol.joins.nixl:NixlJoin")


def all_join_kinds() -> tuple[type[JoinSpec], ...]:
    """Every registered kind, loaded and checked (its tag is its name; it validates itself and
    declares its budget), then the table is frozen: the union built from these is the one decoded."""
    kinds = []
    for name in JOIN_KINDS:
        kind = JOIN_KINDS[name]
        tag = kind.__struct_config__.tag
        if not (isinstance(kind, type) and issubclass(kind, JoinSpec)) or tag != name or kind.MAX_BYTES <= 0:
            raise TypeError(f"join kind {name!r}: {kind!r} must be a JoinSpec with tag {name!r} and MAX_BYTES")
        kinds.append(kind)
    JOIN_KINDS.freeze("the wire union was built (protocol.messages)")
    return tuple(kinds)


__all__ = ["JOIN_KINDS", "JoinSpec", "all_join_kinds"]
