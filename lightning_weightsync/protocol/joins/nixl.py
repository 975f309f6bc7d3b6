"""nixl: the sender's NIXL agent and where each bucket slot lives in it."""

from __future__ import annotations

import msgspec

from ...errors import ProtocolError
from ..limits import INT_BYTES, MAX_ADDRESS_LEN, MAX_SLOTS, MAX_TENSOR_BYTES, check_release_addr, check_text, text_bytes
from . import JoinSpec

MAX_NIXL_METADATA_BYTES = 1 << 20  # a NIXL agent's metadata: ~0.5 KiB over UCX on one host, more with RDMA NICs
NIXL_MEM_TYPES = ("DRAM", "VRAM")


class NixlRegion(msgspec.Struct, array_like=True, frozen=True):
    """One registered memory region of a NIXL agent: address in its process, size, device index."""

    addr: int
    nbytes: int
    device_id: int


class NixlJoin(JoinSpec, tag="nixl", frozen=True):
    """nixl: the sender's NIXL agent (its name, and its metadata as `get_agent_metadata` returns it:
    connection info and registered regions, parsed by NIXL), where each bucket slot lives in it and
    of which memory type, and the sender's socket that collects `BucketDone` releases."""

    MAX_BYTES = (
        text_bytes(MAX_ADDRESS_LEN) + MAX_NIXL_METADATA_BYTES + 5 + text_bytes(8) + 5
        + MAX_SLOTS * (5 + 3 * INT_BYTES) + text_bytes(MAX_ADDRESS_LEN)
    )  # fmt: skip

    agent: str
    metadata: bytes
    mem_type: str
    slots: list[NixlRegion]
    release_addr: str

    def validate(self) -> None:
        if not self.agent:
            raise ProtocolError("plan has an empty nixl agent name")
        check_text("nixl agent name", self.agent, MAX_ADDRESS_LEN)
        if not (1 <= len(self.metadata) <= MAX_NIXL_METADATA_BYTES):
            raise ProtocolError(
                f"plan has {len(self.metadata)} bytes of nixl agent metadata (expected 1 to {MAX_NIXL_METADATA_BYTES})"
            )
        if self.mem_type not in NIXL_MEM_TYPES:
            raise ProtocolError(
                f"plan has nixl memory type {self.mem_type[:16]!r} (one of {', '.join(NIXL_MEM_TYPES)})"
            )
        if not (1 <= len(self.slots) <= MAX_SLOTS):
            raise ProtocolError(f"plan has {len(self.slots)} nixl slots (expected 1 to {MAX_SLOTS})")
        for region in self.slots:
            in_range = region.addr > 0 and 0 < region.nbytes <= MAX_TENSOR_BYTES  # msgpack: addr < 2**64
            if not (in_range and 0 <= region.device_id < 1 << 16):
                raise ProtocolError(f"plan has a malformed nixl slot {region.addr}:{region.nbytes}@{region.device_id}")
        check_release_addr(self.release_addr)
