"""gloo / hccl: the sender's TCPStore, where every rank meets to form the group."""

from __future__ import annotations

from ...errors import ProtocolError
from ..limits import INT_BYTES, MAX_ADDRESS_LEN, check_text, text_bytes
from . import JoinSpec


class StoreJoin(JoinSpec, tag="store", frozen=True):
    """gloo / hccl: the sender's TCPStore, where every rank meets to form the group."""

    MAX_BYTES = text_bytes(MAX_ADDRESS_LEN) + INT_BYTES

    host: str
    port: int

    def validate(self) -> None:
        check_text("store host", self.host, MAX_ADDRESS_LEN)
        if not self.host or not (1 <= self.port <= 65535):
            raise ProtocolError(f"plan has a bad store address {self.host[:256]!r}:{self.port}")
