"""nccl: the communicator's unique id, new for every group generation."""

from __future__ import annotations

from ...errors import ProtocolError
from ..limits import INT_BYTES
from . import JoinSpec

NCCL_UNIQUE_ID_BYTES = 128


class NcclJoin(JoinSpec, tag="nccl", frozen=True):
    """nccl: the communicator's unique id, new for every group generation (the chars of
    `ncclUniqueId`, signed or unsigned as the sender's platform has them)."""

    MAX_BYTES = 5 + NCCL_UNIQUE_ID_BYTES * INT_BYTES

    unique_id: list[int]

    def validate(self) -> None:
        if len(self.unique_id) != NCCL_UNIQUE_ID_BYTES or any(not (-128 <= b <= 255) for b in self.unique_id):
            raise ProtocolError(f"plan has a malformed nccl unique_id ({len(self.unique_id)} values)")
