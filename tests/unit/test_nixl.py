"""The nixl backend's wire fields (`NixlJoin` in a plan) and its missing-dependency error, without NIXL:
every check on the join fields rejects exactly its own hostile plan (each case differs from a valid plan in
one field only), a valid plan survives encode -> decode unchanged, and a missing NIXL names the extra."""

from __future__ import annotations

import builtins

import msgspec
import pytest

from lightning_weightsync.errors import BackendUnavailable, ProtocolError
from lightning_weightsync.protocol.joins.nixl import MAX_NIXL_METADATA_BYTES, NixlJoin, NixlRegion
from lightning_weightsync.protocol.messages import (
    MAX_SLOTS,
    MAX_TENSOR_BYTES,
    GroupSpec,
    Member,
    Plan,
    decode,
    encode,
    validate_group,
)

SLOT = NixlRegion(0x7F00_0000_1000, 1024, 0)


def _join(**change) -> NixlJoin:
    fields = {
        "agent": "lws-sender-1-ab12cd34",
        "metadata": b"\x01" * 456,
        "mem_type": "DRAM",
        "slots": [SLOT, NixlRegion(0x7F00_0000_9000, 1024, 0)],
        "release_addr": "tcp://127.0.0.1:5555",
    }
    return NixlJoin(**{**fields, **change})


def _plan(join: NixlJoin) -> Plan:
    return Plan(3, 1, GroupSpec("sess", 1, "nixl", 1024, [Member("r0", 42)], join))


def test_a_valid_plan_round_trips_unchanged_and_signed():
    plan = _plan(_join())
    assert decode(encode(plan)) == plan
    assert decode(encode(plan, b"key"), b"key") == plan
    validate_group(_plan(_join(mem_type="VRAM", slots=[NixlRegion(1, MAX_TENSOR_BYTES, 7)])).group)


HOSTILE = [
    pytest.param({"agent": ""}, "empty nixl agent name", id="agent-empty"),
    pytest.param({"agent": "a" * 257}, "nixl agent name is 257 characters", id="agent-long"),
    pytest.param({"metadata": b""}, "0 bytes of nixl agent metadata", id="metadata-empty"),
    pytest.param(
        {"metadata": b"\x00" * (MAX_NIXL_METADATA_BYTES + 1)}, "bytes of nixl agent metadata", id="metadata-huge"
    ),
    pytest.param({"mem_type": "FILE"}, "nixl memory type 'FILE'", id="mem-type"),
    pytest.param({"slots": []}, "0 nixl slots", id="no-slots"),
    pytest.param({"slots": [SLOT] * (MAX_SLOTS + 1)}, f"{MAX_SLOTS + 1} nixl slots", id="too-many-slots"),
    pytest.param({"slots": [NixlRegion(0, 1024, 0)] * 2}, "malformed nixl slot 0:1024@0", id="null-addr"),
    pytest.param({"slots": [NixlRegion(4096, 0, 0)] * 2}, "malformed nixl slot 4096:0@0", id="empty-slot"),
    pytest.param(
        {"slots": [NixlRegion(4096, MAX_TENSOR_BYTES + 1, 0)] * 2}, "malformed nixl slot", id="slot-too-large"
    ),
    pytest.param({"slots": [NixlRegion(4096, 1024, -1)] * 2}, "malformed nixl slot 4096:1024@-1", id="device-neg"),
    pytest.param({"slots": [NixlRegion(4096, 1024, 1 << 16)] * 2}, "malformed nixl slot", id="device-huge"),
    pytest.param({"release_addr": "ipc:///tmp/x"}, "is not a tcp:// address", id="release-not-tcp"),
    pytest.param({"release_addr": "tcp://" + "h" * 300}, "release_addr is 306 characters", id="release-long"),
]


@pytest.mark.parametrize(("change", "message"), HOSTILE)
def test_each_check_rejects_its_hostile_plan(change, message):
    """A plan differing from a valid one in that field alone: the rule for it (and no other) rejects it,
    on the decoded path a receiver takes."""
    frames = [msgspec.msgpack.encode(_plan(_join(**change)))]
    with pytest.raises(ProtocolError, match=message.replace("(", r"\(").replace("[", r"\[")) as info:
        decode(frames)
    assert type(info.value) is ProtocolError  # a check said no, not a decoder bug


def test_missing_nixl_names_the_extra_and_the_cuda_variant(monkeypatch):
    from lightning_weightsync.transport.backends import nixl

    real_import = builtins.__import__

    def no_nixl(name, *args, **kwargs):
        if name.split(".")[0] in ("nixl", "nixl_cu12", "nixl_cu13"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_nixl)
    with pytest.raises(BackendUnavailable, match=r"lightning-weightsync\[nixl\].*nixl-cu12.*nixl-cu13"):
        nixl.import_nixl()
