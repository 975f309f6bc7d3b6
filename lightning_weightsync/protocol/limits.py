"""Bounds every control message keeps, and the checks and byte counts built on them: shared by the
message schema (`messages.py`) and the join kinds (`joins/`), which each validate and size their own
fields with them."""

from __future__ import annotations

from ..errors import ProtocolError

MAX_TEXT_LEN = 4096
MAX_TENSOR_BYTES = 1 << 40  # 1 TiB: larger than any real weight, small enough to refuse absurd shapes
MAX_SLOTS = 8  # bucket slots a plan may hand out (a lane uses 2)
MAX_ADDRESS_LEN = 256  # a host name or a tcp:// address

# Upper bounds of the msgpack encoding: a text of n characters is at most 4n bytes of UTF-8 plus a
# 5-byte header; an int at most 9 bytes; a struct's keys and tag fit in STRUCT_BYTES.
INT_BYTES = 9
STRUCT_BYTES = 256


def text_bytes(chars: int) -> int:
    return 4 * chars + 5


def check_text(what: str, value: str | None, limit: int = MAX_TEXT_LEN) -> None:
    if value is not None and len(value) > limit:
        raise ProtocolError(f"{what} is {len(value)} characters long (limit {limit})")


def check_release_addr(addr: str) -> None:
    """A shared-slot backend's release socket: a bounded tcp:// address."""
    check_text("release_addr", addr, MAX_ADDRESS_LEN)
    if not addr.startswith("tcp://"):
        raise ProtocolError(f"plan release_addr {addr[:256]!r} is not a tcp:// address")
