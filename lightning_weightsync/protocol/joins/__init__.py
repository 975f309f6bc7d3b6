"""The join kinds: what a receiver needs to join one backend's data-plane group, carried in a plan.

Each kind is a msgspec Struct with its own tag, its own `validate()` (range checks the schema cannot
express) and `MAX_BYTES` (its largest legal encoding, part of the receivers' frame budget), in one file
here, owned by the backends that use it (a backend names it as its `join_type`), and named by one line of
`JOIN_KINDS` (`plugins.py`). The wire union `messages.Join`, its validation and the frame budget are built
from that table, so a backend that needs its own rendezvous adds its file here and one table line, and
`messages.py` stays as it is.

The table is complete when `messages` builds its decoder (it loads every entry, then freezes the
table): decoding stays a strict tagged union, and a plan of a kind not listed here is rejected.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

from ...errors import ProtocolError
from ...plugins import JOIN_KINDS


class JoinSpec(msgspec.Struct, frozen=True):
    """Base of the join kinds (subclasses set `tag=`)."""

    MAX_BYTES: ClassVar[int] = 0

    def validate(self) -> None:
        """Raise `ProtocolError` on a value a legal sender never sends."""
        raise ProtocolError(f"{type(self).__name__} defines no validation")


def all_join_kinds() -> tuple[type[JoinSpec], ...]:
    """Every registered kind, loaded and checked (its tag is its name; it validates itself and
    declares its budget), then the table is frozen: the union built from these is the one decoded."""
    kinds: list[type[JoinSpec]] = []
    for name in JOIN_KINDS:
        kind = JOIN_KINDS[name]
        tag = kind.__struct_config__.tag
        if not (isinstance(kind, type) and issubclass(kind, JoinSpec)) or tag != name or kind.MAX_BYTES <= 0:
            raise TypeError(f"join kind {name!r}: {kind!r} must be a JoinSpec with tag {name!r} and MAX_BYTES")
        kinds.append(kind)
    JOIN_KINDS.freeze("the wire union was built (protocol.messages)")
    return tuple(kinds)


__all__ = ["JOIN_KINDS", "JoinSpec", "all_join_kinds"]
