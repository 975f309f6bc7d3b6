"""shm / cuda_ipc: slots the sender shares, mapped by handle, released over a socket."""

from __future__ import annotations

from ...errors import ProtocolError
from ..limits import MAX_ADDRESS_LEN, MAX_SLOTS, MAX_TEXT_LEN, check_release_addr, check_text, text_bytes
from . import JoinSpec


class SharedJoin(JoinSpec, tag="shared", frozen=True):
    """shm / cuda_ipc: one handle per bucket slot to map, and the sender's socket that collects
    `BucketDone` releases."""

    MAX_BYTES = 5 + MAX_SLOTS * text_bytes(MAX_TEXT_LEN) + text_bytes(MAX_ADDRESS_LEN)

    slots: list[str]
    release_addr: str

    def validate(self) -> None:
        if not (1 <= len(self.slots) <= MAX_SLOTS):
            raise ProtocolError(f"plan has {len(self.slots)} slot handles (expected 1 to {MAX_SLOTS})")
        for handle in self.slots:
            if not handle:
                raise ProtocolError("plan has an empty slot handle")
            check_text("slot handle", handle)
        check_release_addr(self.release_addr)
