"""Control-plane wire format: round trips, validation, HMAC, a fuzzed decoder, and no pickle anywhere.

`decode` is the only door from the network into the process, so it is held to one contract: it
returns a validated message or raises `ProtocolError`, whatever the bytes.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import pickle
from pathlib import Path

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lightning_weightsync
from lightning_weightsync import ProtocolError, TensorMeta
from lightning_weightsync.protocol.boxes import Box
from lightning_weightsync.protocol.chunks import MAX_BUCKET_ENTRIES
from lightning_weightsync.protocol.declare import Declaration
from lightning_weightsync.protocol.dtypes import DTYPES
from lightning_weightsync.protocol.joins.nccl import NCCL_UNIQUE_ID_BYTES, NcclJoin
from lightning_weightsync.protocol.joins.nixl import MAX_NIXL_METADATA_BYTES, NixlJoin, NixlRegion
from lightning_weightsync.protocol.joins.shared import SharedJoin
from lightning_weightsync.protocol.joins.store import StoreJoin
from lightning_weightsync.protocol.messages import (
    MAC_LEN,
    MAX_FRAME_TO_RECEIVER,
    MAX_FRAME_TO_SENDER,
    MAX_IDENTITY_LEN,
    MAX_LORA_NAMES,
    MAX_LORA_RANK,
    MAX_MEMBERS,
    MAX_NAME_LEN,
    MAX_NDIM,
    MAX_SENDERS,
    MAX_SLOTS,
    MAX_STORE_KEY_LEN,
    MAX_STORE_VALUE_LEN,
    MAX_TENSOR_BYTES,
    MAX_TEXT_LEN,
    MAX_TIED_NAMES,
    Abort,
    Ack,
    BoxEntry,
    Boxes,
    BucketDone,
    BucketMeta,
    Bye,
    Contract,
    DecoderBug,
    Entry,
    GroupSpec,
    LoraSpec,
    Member,
    Message,
    Plan,
    Prepare,
    Ready,
    Refuse,
    Register,
    Seal,
    SenderAddress,
    StoreReply,
    StoreRequest,
    contract_digest,
    decode,
    encode,
    seal,
    unseal,
    validate,
)

KEY = b"s3cret-token"
PACKAGE_DIR = Path(lightning_weightsync.__file__).parent


def _entries() -> list[Entry]:
    return [
        Entry("model.embed_tokens.weight", [8, 4], "bfloat16", 0, 64, 0),
        Entry("model.norm.weight", [4], "float32", 0, 16, 64),
        Entry("scalar", [], "float8_e4m3fn", 0, 1, 80),
        Entry("empty", [0, 3], "int64", 0, 0, 81),
        Entry("big", [1000], "float64", 4000, 19, 81),
    ]


NCCL_ID = [(i * 37) % 256 - 128 for i in range(NCCL_UNIQUE_ID_BYTES)]


def _group(
    n: int = 2, *, join=StoreJoin("127.0.0.1", 29601), backend: str = "gloo", members: list[Member] | None = None, **kw
) -> GroupSpec:
    members = [Member(f"rollout-{i}", 1000 + i) for i in range(n)] if members is None else members
    fields = {"session": "5f0c2a", "generation": 1, "backend": backend, "bucket_size": 1 << 20, **kw}
    return GroupSpec(members=members, join=join, **fields)


def _plan(rank: int = 1, version: int = 3, **group) -> Plan:
    return Plan(version, rank, _group(**group))


MESSAGES = [
    Register("rollout-0", "10.0.0.2", 1234, "cuda:0"),
    Register("rollout-1", "host", 1, "cpu", last_version=7),
    Prepare(3, "5f0c2a"),
    Ready("rollout-0", 3),
    _plan(),
    _plan(0, 4, n=0, join=NcclJoin(NCCL_ID), backend="nccl", generation=2, bucket_size=100),
    _plan(2, 5, join=SharedJoin(["psm_0a1b", "psm_2c3d"], "tcp://127.0.0.1:5555"), backend="shm"),
    BucketMeta(3, 0, False, 100, _entries()),
    BucketMeta(3, 5, True, 0, []),
    BucketDone("rollout-0", 3, 0),
    Ack("rollout-0", 3, True),
    Ack("rollout-1", 3, False, error="sink rejected 'x': shape [2] != [3]"),
    Abort(3, "trainer rank 0 died"),
    Bye("rollout-0"),
    Refuse("rollout-0", "identity held by a connected receiver"),
    StoreRequest("rollout-0", 7, "set", "lws/5f0c2a/1/0/1", b"addr"),
    StoreReply(7, False),
    Ready("rollout-1", 4, 2, 3, "ab" * 16, "cd" * 16),
    Boxes("rollout-1", "cd" * 16, 0, 2, [BoxEntry("layers.0.up.weight", [64, 0], [64, 128])]),
    Contract("rollout-1", contract_digest(b'{"format":1}'), b'{"format":1}'),
    BucketMeta(3, 1, False, 100, [Entry("w", [4, 8], "float32", 0, 64, 0, [2, 0, 2, 8])]),
]


# ----------------------------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("key", [None, KEY], ids=["unsigned", "signed"])
def test_roundtrip_every_message(msg, key: bytes | None) -> None:
    frames = encode(msg, key)
    assert all(isinstance(f, bytes) for f in frames)
    assert len(frames) == (2 if key else 1)
    got = decode(frames, key, bucket_size=1 << 20)
    assert type(got) is type(msg)
    assert got == msg


def test_every_message_type_is_covered() -> None:
    from lightning_weightsync.protocol import messages as wire

    declared = set(wire.Message.__args__)
    assert {type(m) for m in MESSAGES} == declared


def test_entry_meta_roundtrip_for_every_dtype() -> None:
    for name, dtype in DTYPES.items():
        meta = TensorMeta(f"w.{name}", (3, 0, 2) if name == "bool" else (5, 7), dtype, 0, 0, offset=11)
        if meta.nbytes:
            meta = dataclasses.replace(meta, chunk_offset=3, chunk_size=meta.nbytes - 3)
        entry = Entry.from_meta(meta)
        assert entry.dtype == name
        msg = BucketMeta(1, 0, True, 11 + meta.chunk_size, [entry])
        (back,) = decode(encode(msg)).entries
        assert back.to_meta() == meta


def test_encoding_is_msgpack_not_pickle() -> None:
    (body,) = encode(Ack("r", 1, True))
    assert msgspec.msgpack.decode(body) == {"type": "ack", "identity": "r", "version": 1, "ok": True, "error": None}
    assert not body.startswith(b"\x80")  # pickle protocol header


# ----------------------------------------------------------------------------------------------- validation


def _bucket(*entries: Entry, nbytes: int = 1000, **kw) -> BucketMeta:
    return BucketMeta(kw.get("version", 1), kw.get("bucket_index", 0), False, nbytes, list(entries))


def _box_delta() -> BucketMeta:
    """A chunk of a box that claims to be a delta payload: a box is always sent whole."""
    entry = _ok_entry(shape=[4, 8], chunk_size=16, box=[2, 0, 2, 8])
    return BucketMeta(2, 0, False, 1000, [entry], deltas=[20], delta_base=1)


def _ok_entry(**changes) -> Entry:
    base = {"name": "w", "shape": [10], "dtype": "float32", "chunk_offset": 0, "chunk_size": 40, "offset": 0}
    base.update(changes)
    return Entry(**base)


BAD = [
    ("dtype-unknown", _bucket(_ok_entry(dtype="float33")), "dtype 'float33'"),
    ("dtype-attr", _bucket(_ok_entry(dtype="__class__")), "allow-list"),
    ("dtype-torch-fn", _bucket(_ok_entry(dtype="load")), "allow-list"),
    ("dtype-object", _bucket(_ok_entry(dtype="Tensor")), "allow-list"),
    ("shape-negative", _bucket(_ok_entry(shape=[-1, 10])), "shape"),
    ("shape-negative-inner", _bucket(_ok_entry(shape=[10, -4], chunk_size=0)), "shape"),
    ("shape-ndim", _bucket(_ok_entry(shape=[1] * (MAX_NDIM + 1), chunk_size=4)), "shape"),
    ("chunk-past-end", _bucket(_ok_entry(chunk_offset=4, chunk_size=40)), "outside 40 bytes"),
    ("chunk-too-big", _bucket(_ok_entry(chunk_size=41)), "outside 40 bytes"),
    ("chunk-offset-negative", _bucket(_ok_entry(chunk_offset=-4, chunk_size=4)), "outside"),
    ("chunk-size-negative", _bucket(_ok_entry(chunk_offset=8, chunk_size=-4)), "outside"),
    ("bucket-offset-past-end", _bucket(_ok_entry(offset=961)), "bucket offset 961"),
    ("bucket-offset-negative", _bucket(_ok_entry(offset=-1)), "bucket offset -1"),
    ("bucket-small", _bucket(_ok_entry(offset=0), nbytes=39), "outside the bucket's 39 bytes"),
    ("name-too-long", _bucket(_ok_entry(name="x" * (MAX_NAME_LEN + 1))), f"over {MAX_NAME_LEN}"),
    ("name-empty", _bucket(_ok_entry(name="")), "empty"),
    ("bucket-index-negative", _bucket(_ok_entry(), bucket_index=-1), "bucket_index=-1"),
    ("bucket-nbytes-negative", _bucket(nbytes=-5), "nbytes=-5"),
    ("version-negative-bucket", _bucket(_ok_entry(), version=-1), "version=-1"),
    ("version-negative-prepare", Prepare(-1, "s"), "version=-1"),
    ("version-negative-ready", Ready("r", -2), "version=-2"),
    ("version-negative-plan", _plan(version=-1), "version=-1"),
    ("version-negative-done", BucketDone("r", -1, 0), "version=-1"),
    ("version-negative-ack", Ack("r", -1, True), "version=-1"),
    ("version-negative-abort", Abort(-1, "x"), "version=-1"),
    ("bucket-done-index-negative", BucketDone("r", 1, -3), "bucket_index=-3"),
    ("rank-eq-world", _plan(2, n=1), "rank 2 not in world of size 2"),
    ("rank-gt-world", _plan(5, n=1), "rank 5"),
    ("rank-negative", _plan(-1, n=1), "rank -1"),
    ("generation-negative", _plan(generation=-1), "generation=-1"),
    ("plan-bucket-zero", _plan(bucket_size=0), "bucket_size=0"),
    ("plan-bucket-absurd", _plan(bucket_size=1 << 60), "bucket_size="),
    ("plan-session-long", _plan(session="s" * (MAX_TEXT_LEN + 1)), "session"),
    ("plan-backend-long", _plan(backend="b" * 65), "backend"),
    ("member-identity-empty", _plan(members=[Member("", 1)]), "empty identity"),
    ("member-identity-long", _plan(members=[Member("i" * (MAX_IDENTITY_LEN + 1), 1)]), "member identity"),
    ("member-pid-negative", _plan(members=[Member("r", -7)]), "member pid=-7"),
    ("member-twice", _plan(2, members=[Member("r", 1), Member("r", 2)]), "member twice"),
    ("store-port-big", _plan(join=StoreJoin("h", 70000)), "store address"),
    ("store-port-zero", _plan(join=StoreJoin("h", 0)), "store address"),
    ("store-host-empty", _plan(join=StoreJoin("", 1)), "store address"),
    ("store-host-long", _plan(join=StoreJoin("h" * 257, 1)), "store host"),
    ("nccl-id-short", _plan(join=NcclJoin(NCCL_ID[:-1])), "nccl unique_id"),
    ("nccl-id-long", _plan(join=NcclJoin([*NCCL_ID, 0])), "nccl unique_id"),
    ("nccl-id-range", _plan(join=NcclJoin([256, *NCCL_ID[1:]])), "nccl unique_id"),
    ("nccl-id-negative", _plan(join=NcclJoin([-129, *NCCL_ID[1:]])), "nccl unique_id"),
    ("shared-no-slots", _plan(join=SharedJoin([], "tcp://h:1")), "0 slot handles"),
    ("shared-many-slots", _plan(join=SharedJoin(["a"] * 9, "tcp://h:1")), "9 slot handles"),
    ("shared-empty-slot", _plan(join=SharedJoin(["a", ""], "tcp://h:1")), "empty slot handle"),
    ("shared-long-slot", _plan(join=SharedJoin(["a", "b" * (MAX_TEXT_LEN + 1)], "tcp://h:1")), "slot handle"),
    ("shared-release-ipc", _plan(join=SharedJoin(["a", "b"], "ipc:///tmp/x")), "not a tcp://"),
    ("shared-release-long", _plan(join=SharedJoin(["a", "b"], "tcp://" + "h" * 300)), "release_addr"),
    ("session-long", Prepare(1, "s" * (MAX_TEXT_LEN + 1)), "session"),
    ("identity-long", Register("i" * (MAX_IDENTITY_LEN + 1), "h", 1, "cpu"), "identity"),
    ("error-long", Ack("r", 1, False, error="e" * (MAX_TEXT_LEN + 1)), "error"),
    ("reason-long", Abort(1, "r" * (MAX_TEXT_LEN + 1)), "reason"),
    # a chunk of a box (transport.slices): the box inside its tensor, the chunk inside the box's bytes
    ("box-odd-length", _bucket(_ok_entry(shape=[4, 8], box=[0, 0, 2])), "box of 3 numbers"),
    ("box-outside", _bucket(_ok_entry(shape=[4, 8], chunk_size=16, box=[3, 0, 2, 8])), "outside the tensor"),
    ("box-empty", _bucket(_ok_entry(shape=[4, 8], chunk_size=0, box=[0, 0, 0, 8])), "outside the tensor"),
    ("box-chunk-outside", _bucket(_ok_entry(shape=[4, 8], chunk_size=72, box=[2, 0, 2, 8])), "outside 64 bytes"),
    ("box-and-delta", _box_delta(), "a box and a delta"),
    ("ready-boxes-digest", Ready("r", 1, boxes="not-hex"), "digest"),
    ("boxes-no-digest", Boxes("r", "", 0, 1, []), "without a digest"),
    ("contract-other-digest", Contract("r", contract_digest(b"{}"), b"[]"), "digest is not its body's"),
    ("contract-too-large", Contract("r", "ab" * 16, b" " * (48 * 1024 + 1)), "49153 bytes"),
    ("ready-contract-not-hex", Ready("r", 1, contract="zz" * 16), "digest"),
    ("boxes-page-past-end", Boxes("r", "ab" * 16, 1, 1, []), "page 1 of 1"),
    ("boxes-too-many-pages", Boxes("r", "ab" * 16, 0, 1025, []), "of 1025"),
    ("boxes-name-empty", Boxes("r", "ab" * 16, 0, 1, [BoxEntry("", [0], [1])]), "name of length 0"),
    ("boxes-ranks-differ", Boxes("r", "ab" * 16, 0, 1, [BoxEntry("w", [0, 0], [1])]), "2 offsets, 1 sizes"),
    ("boxes-negative", Boxes("r", "ab" * 16, 0, 1, [BoxEntry("w", [-1], [1])]), "negative offset"),
    ("boxes-empty-size", Boxes("r", "ab" * 16, 0, 1, [BoxEntry("w", [0], [0])]), "empty size"),
    ("boxes-too-many", Boxes("r", "ab" * 16, 0, 1, [BoxEntry("w", [0], [1])] * 4097), "4097 entries"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_validation_rejects(case) -> None:
    _, msg, match = case
    with pytest.raises(ProtocolError, match=match):
        validate(msg)
    # and the same through the decoder, from bytes as a peer would send them
    with pytest.raises(ProtocolError, match=match):
        decode(encode(msg))
    with pytest.raises(ProtocolError, match=match):
        decode(encode(msg, KEY), KEY)


def test_validation_accepts_edges() -> None:
    validate(_bucket(_ok_entry(name="x" * MAX_NAME_LEN)))
    validate(_bucket(_ok_entry(offset=960)))  # ends exactly at the bucket's end
    validate(_bucket(_ok_entry(shape=[], dtype="float64", chunk_size=8)))
    validate(_bucket(_ok_entry(shape=[0, 5], chunk_size=0, offset=1000)))
    validate(_plan(1, n=1, bucket_size=1, generation=0, join=StoreJoin("h", 65535)))
    validate(_plan(0, n=0))  # the sender's own plan: a world of one
    validate(_plan(MAX_MEMBERS, n=MAX_MEMBERS))
    validate(_plan(join=NcclJoin([255] * NCCL_UNIQUE_ID_BYTES)))  # unsigned chars (aarch64)
    validate(_plan(join=SharedJoin(["a"] * 8, "tcp://[::1]:1")))


def test_plan_member_limit() -> None:
    with pytest.raises(ProtocolError, match=f"limit {MAX_MEMBERS}"):
        validate(_plan(n=MAX_MEMBERS + 1))


def test_plan_join_is_a_closed_tagged_union() -> None:
    """The backend-specific join fields decode only as one of the known kinds."""
    (body,) = encode(_plan())
    obj = msgspec.msgpack.decode(body)
    assert obj["group"]["join"] == {"type": "store", "host": "127.0.0.1", "port": 29601}
    for join in ({"type": "exec", "cmd": "x"}, {"host": "h", "port": 1}, {"type": "nccl", "unique_id": "abc"}, None):
        obj["group"]["join"] = join
        with pytest.raises(ProtocolError, match="malformed"):
            decode([msgspec.msgpack.encode(obj)])


def test_bucket_larger_than_local_bucket_size() -> None:
    msg = _bucket(_ok_entry(), nbytes=1000)
    decode(encode(msg), bucket_size=1000)
    with pytest.raises(ProtocolError, match="1000 bytes > bucket_size 999"):
        decode(encode(msg), bucket_size=999)


def test_unknown_message_type_and_wrong_field_types() -> None:
    for obj in (
        {"type": "exec", "cmd": "rm -rf /"},
        {"type": "prepare", "version": "3"},
        {"type": "prepare"},
        {"type": "bucket", "version": 1, "bucket_index": 0, "is_last": True, "nbytes": 1, "entries": [["w"]]},
        {"version": 1},
        [1, 2, 3],
        "prepare",
    ):
        with pytest.raises(ProtocolError, match="malformed"):
            decode([msgspec.msgpack.encode(obj)])


# ----------------------------------------------------------------------------------------------- HMAC


def test_signed_message_carries_a_mac() -> None:
    mac, body = encode(Prepare(1, "s"), KEY)
    assert len(mac) == MAC_LEN
    assert body == encode(Prepare(1, "s"))[0]


def test_unsigned_message_rejected_when_key_set() -> None:
    with pytest.raises(ProtocolError, match="unsigned"):
        decode(encode(Prepare(1, "s")), KEY)


def test_signed_message_rejected_without_key() -> None:
    with pytest.raises(ProtocolError, match="auth_token"):
        decode(encode(Prepare(1, "s"), KEY))


def test_wrong_key_rejected() -> None:
    with pytest.raises(ProtocolError, match="signature"):
        decode(encode(Prepare(1, "s"), b"other-token"), KEY)


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_tampered_body_rejected(msg) -> None:
    mac, body = encode(msg, KEY)
    for i in range(0, len(body), max(1, len(body) // 16)):
        tampered = bytearray(body)
        tampered[i] ^= 0x01
        with pytest.raises(ProtocolError, match="signature"):
            decode([mac, bytes(tampered)], KEY)
    with pytest.raises(ProtocolError, match="signature"):
        decode([mac, body + b"\x00"], KEY)


def test_tampered_mac_and_replayed_mac_rejected() -> None:
    mac, body = encode(Prepare(1, "s"), KEY)
    bad = bytes([mac[0] ^ 0x80]) + mac[1:]
    with pytest.raises(ProtocolError, match="signature"):
        decode([bad, body], KEY)
    other_mac, _ = encode(Prepare(2, "s"), KEY)
    with pytest.raises(ProtocolError, match="signature"):
        decode([other_mac, body], KEY)  # a valid MAC of another message
    with pytest.raises(ProtocolError):
        decode([mac[:-1], body], KEY)
    with pytest.raises(ProtocolError):
        decode([body, mac], KEY)


# ----------------------------------------------------------------------------------------------- fuzz


def _decode_or_protocol_error(frames: list[bytes], key: bytes | None, bucket_size: int | None = None) -> None:
    """The decoder's contract on any frames: a message that passes `_assert_receiver_invariants` and
    round-trips, or a deliberate rejection. A `DecoderBug` (an exception no check raised on purpose)
    fails the test: it is a ProtocolError too, so it must not be counted as a correct rejection."""
    try:
        msg = decode(frames, key, bucket_size=bucket_size)
    except DecoderBug:
        raise
    except ProtocolError:
        return
    _assert_receiver_invariants(msg, bucket_size)
    again = decode(encode(msg, key), key, bucket_size=bucket_size)  # what we accept, we can send
    assert again == msg and encode(again) == encode(msg)


def _assert_receiver_invariants(msg: Message, bucket_size: int | None) -> None:
    """What the receiver, the sender and the backends rely on in an accepted message, written from
    their side (sizes from torch meta tensors, not from the validator's arithmetic), so that a check
    missing from `validate` shows up here."""
    for attr in ("identity", "host", "device", "reason", "error", "backend", "session", "nonce", "instance"):
        value = getattr(msg, attr, None)
        assert value is None or len(value) <= (MAX_IDENTITY_LEN if attr == "identity" else MAX_TEXT_LEN), attr
    assert getattr(msg, "version", 0) >= 0
    if isinstance(msg, BucketMeta):
        assert msg.bucket_index >= 0 and msg.nbytes >= 0
        assert bucket_size is None or msg.nbytes <= bucket_size, "bucket larger than the receiver's buffer"
        assert len(msg.entries) <= MAX_BUCKET_ENTRIES
        for e in msg.entries:
            assert 0 < len(e.name) <= MAX_NAME_LEN and len(e.shape) <= MAX_NDIM and min(e.shape, default=0) >= 0
            assert e.dtype in DTYPES, "dtype outside the allow-list"
            meta = e.to_meta()  # the receiver's form: a real torch dtype
            try:
                size = torch.empty(meta.shape, dtype=meta.dtype, device="meta")  # what the merge allocates
            except RuntimeError as exc:
                raise AssertionError(f"the receiver cannot allocate {e.name!r} {e.shape}: {exc}") from None
            tensor_bytes = size.numel() * size.element_size()
            assert tensor_bytes <= MAX_TENSOR_BYTES
            assert e.chunk_offset >= 0 and e.chunk_size >= 0 and e.chunk_offset + e.chunk_size <= tensor_bytes
            assert e.offset >= 0 and e.offset + e.chunk_size <= msg.nbytes, "chunk outside its bucket"
        assert not msg.tied or msg.bucket_index == 0
        aliases = [a for group in msg.tied.values() for a in group]
        assert len(set(aliases)) == len(aliases) and not set(aliases) & set(msg.tied)
        assert all(0 < len(n) <= MAX_NAME_LEN for n in [*msg.tied, *aliases])
        assert all(source not in group for source, group in msg.tied.items())
        assert not msg.fingerprints or len(msg.fingerprints) == len(msg.entries), "fingerprints not one per entry"
        assert all(-1 <= f < 1 << 64 for f in msg.fingerprints), "fingerprint outside 64 bits"
        assert not msg.deltas or len(msg.deltas) == len(msg.entries), "delta sizes not one per entry"
        for e, size in zip(msg.entries, msg.deltas, strict=False):  # lengths checked just above
            if size != -1:
                whole = math.prod(e.shape) * DTYPES[e.dtype].itemsize
                assert 0 < size < whole and e.chunk_offset + e.chunk_size <= size, "delta payload out of range"
                assert 0 <= msg.delta_base < msg.version, "delta based on a later version"
    elif isinstance(msg, Plan):
        group = msg.group
        assert 0 <= msg.rank <= len(group.members), "rank outside the group"
        identities = [m.identity for m in group.members]
        assert len(identities) <= MAX_MEMBERS and len(set(identities)) == len(identities) and all(identities)
        assert all(m.pid >= 0 and len(m.identity) <= MAX_IDENTITY_LEN for m in group.members)
        assert group.generation >= 0 and 1 <= group.bucket_size <= MAX_TENSOR_BYTES
        assert len(group.session) <= MAX_TEXT_LEN and len(group.backend) <= 64
        join = group.join
        if isinstance(join, StoreJoin):
            assert join.host and len(join.host) <= 256 and 1 <= join.port <= 65535
        elif isinstance(join, NcclJoin):
            assert len(bytes(b & 0xFF for b in join.unique_id)) == NCCL_UNIQUE_ID_BYTES
            assert all(-128 <= b <= 255 for b in join.unique_id)
        else:
            assert isinstance(join, SharedJoin)
            assert 1 <= len(join.slots) <= MAX_SLOTS and all(0 < len(h) <= MAX_TEXT_LEN for h in join.slots)
            assert join.release_addr.startswith("tcp://") and len(join.release_addr) <= 256
    elif isinstance(msg, BucketDone):
        assert msg.bucket_index >= 0
    elif isinstance(msg, StoreRequest):
        assert msg.op in ("set", "get", "add") and 0 < len(msg.key) <= MAX_STORE_KEY_LEN
        assert msg.request_id >= 0 and len(msg.value) <= MAX_STORE_VALUE_LEN
    elif isinstance(msg, StoreReply):
        assert msg.request_id >= 0 and len(msg.value) <= MAX_STORE_VALUE_LEN
    elif isinstance(msg, Register):
        assert msg.pid >= 0 and len(msg.instance) <= 256 and len(msg.nonce) <= 256


_E = Entry("w", [4], "float32", 0, 16, 0)
# one message per rule an accepted message must satisfy; each breaks exactly that rule
HOSTILE = {
    "negative-version": Prepare(-1, "s"),
    "long-identity": Bye("x" * (MAX_IDENTITY_LEN + 1)),
    "bucket-over-buffer": BucketMeta(1, 0, True, (1 << 20) + 1, []),
    "empty-name": BucketMeta(1, 0, True, 16, [Entry("", [4], "float32", 0, 16, 0)]),
    "too-many-dims": BucketMeta(1, 0, True, 4, [Entry("w", [1] * (MAX_NDIM + 1), "float32", 0, 4, 0)]),
    "negative-dim": BucketMeta(1, 0, True, 16, [Entry("w", [-4], "float32", 0, 0, 0)]),
    "unknown-dtype": BucketMeta(1, 0, True, 16, [Entry("w", [4], "object", 0, 16, 0)]),
    "huge-tensor": BucketMeta(1, 0, True, 16, [Entry("w", [1 << 30, 1 << 20], "float32", 0, 16, 0)]),
    "empty-with-absurd-dims": BucketMeta(1, 0, True, 0, [Entry("w", [0, 1 << 62, 1 << 62], "float32", 0, 0, 0)]),
    "chunk-past-tensor": BucketMeta(1, 0, True, 32, [Entry("w", [4], "float32", 8, 16, 0)]),
    "chunk-past-bucket": BucketMeta(1, 0, True, 16, [Entry("w", [4], "float32", 0, 16, 8)]),
    "negative-offset": BucketMeta(1, 0, True, 16, [Entry("w", [4], "float32", 0, 16, -1)]),
    "tied-on-bucket-1": BucketMeta(1, 1, True, 16, [_E], tied={"w": ["v"]}),
    "alias-also-sent": BucketMeta(1, 0, True, 16, [_E], tied={"w": ["v"], "v": ["u"]}),
    "fingerprints-not-per-entry": BucketMeta(1, 0, True, 16, [_E], fingerprints=[1, 2]),
    "fingerprint-below-none": BucketMeta(1, 0, True, 16, [_E], fingerprints=[-2]),
    "deltas-not-per-entry": BucketMeta(1, 0, True, 16, [_E], deltas=[-1, -1]),
    "delta-not-smaller": BucketMeta(1, 0, True, 16, [_E], deltas=[16], delta_base=0),
    "delta-chunk-past-payload": BucketMeta(1, 0, True, 16, [_E], deltas=[8], delta_base=0),
    "delta-based-on-later": BucketMeta(
        1, 0, True, 16, [Entry("w", [8], "float32", 0, 16, 0)], deltas=[20], delta_base=1
    ),
    "rank-outside": _plan(rank=3, n=2),
    "member-twice": _plan(members=[Member("a", 1), Member("a", 2)]),
    "bad-port": _plan(join=StoreJoin("127.0.0.1", 0)),
    "short-nccl-id": _plan(join=NcclJoin(NCCL_ID[:-1]), backend="nccl"),
    "nccl-id-out-of-range": _plan(join=NcclJoin([300] * NCCL_UNIQUE_ID_BYTES), backend="nccl"),
    "no-slots": _plan(join=SharedJoin([], "tcp://127.0.0.1:1"), backend="shm"),
    "release-not-tcp": _plan(join=SharedJoin(["psm_1"], "ipc:///tmp/x"), backend="shm"),
    "store-op": StoreRequest("r", 1, "delete", "k"),
    "store-empty-key": StoreRequest("r", 1, "set", ""),
    "negative-pid": Register("r", "h", -1, "cpu"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_invariant_oracle_catches_what_validate_rejects(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The oracle is not vacuous: each hostile message breaks one invariant. With validation on,
    `decode` rejects it; with validation switched off (the bug a fuzz test must catch), the oracle
    fails on what `decode` then lets through."""
    from lightning_weightsync.protocol import messages

    frames = encode(HOSTILE[name])
    with pytest.raises(ProtocolError) as rejected:
        decode(frames, bucket_size=1 << 20)
    assert not isinstance(rejected.value, DecoderBug)
    monkeypatch.setattr(messages, "validate", lambda msg, *, bucket_size=None: None)
    with pytest.raises(AssertionError):
        _decode_or_protocol_error(frames, None, bucket_size=1 << 20)


def test_a_decoder_bug_surfaces_instead_of_passing_as_a_rejection(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug in a check (here: an IndexError) is still a rejection for a caller, but it is a
    `DecoderBug`, logged with its traceback, and the fuzz helper fails on it."""
    from lightning_weightsync.protocol import messages

    def buggy(msg: BucketMeta, bucket_size: int | None) -> None:
        return [][msg.bucket_index]

    monkeypatch.setattr(messages, "validate_bucket", buggy)
    frames = encode(BucketMeta(3, 0, True, 0, []))
    with pytest.raises(DecoderBug, match="IndexError") as info, caplog.at_level("ERROR"):
        decode(frames)
    assert isinstance(info.value, ProtocolError) and isinstance(info.value.__cause__, IndexError)
    assert "decoder" in caplog.text and "Traceback" in caplog.text
    with pytest.raises(DecoderBug):
        _decode_or_protocol_error(frames, None)


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(body=st.binary(max_size=512), key=st.sampled_from([None, KEY]))
def test_fuzz_random_bytes(body: bytes, key: bytes | None) -> None:
    _decode_or_protocol_error([body], key)
    _decode_or_protocol_error([b"\x00" * MAC_LEN, body], key)


@FUZZ
@given(frames=st.lists(st.binary(max_size=64), max_size=4), key=st.sampled_from([None, KEY]))
def test_fuzz_random_frame_lists(frames: list[bytes], key: bytes | None) -> None:
    _decode_or_protocol_error(frames, key)


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_truncation_of_valid_messages(msg) -> None:
    (body,) = encode(msg)
    for n in range(len(body)):
        with pytest.raises(ProtocolError):
            decode([body[:n]])
    mac, body = encode(msg, KEY)
    for n in range(len(body)):
        with pytest.raises(ProtocolError):
            decode([mac, body[:n]], KEY)


@FUZZ
@given(
    index=st.sampled_from(range(len(MESSAGES))),
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=6),
    cut=st.integers(0, 10_000),
    key=st.sampled_from([None, KEY]),
)
def test_fuzz_mutated_valid_messages(index: int, edits, cut: int, key: bytes | None) -> None:
    frames = encode(MESSAGES[index], key)
    body = bytearray(frames[-1])
    for pos, value in edits:
        body[pos % len(body)] = value
    body = body[: max(1, cut % (len(body) + 1))]
    _decode_or_protocol_error([*frames[:-1], bytes(body)], key, bucket_size=1 << 20)
    if key:  # re-signed, so the mutation reaches the msgpack decoder and the validator
        _decode_or_protocol_error(encode_raw(bytes(body), key), key, bucket_size=1 << 20)


def encode_raw(body: bytes, key: bytes) -> list[bytes]:
    from lightning_weightsync.protocol.messages import sign

    return [sign(body, key), body]


_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.sampled_from([*DTYPES, "float33", "", "__class__"]),
    st.binary(max_size=8),
)
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=6), max_leaves=30)
_TAGS = ["register", "prepare", "ready", "plan", "bucket", "bucket_done", "ack", "abort", "bye", "nope"]
_FIELDS = [
    "identity", "host", "pid", "device", "last_version", "protocol", "version", "generation", "rank",
    "world_size", "backend", "bucket_size", "store_host", "store_port", "info", "bucket_index", "is_last",
    "nbytes", "entries", "ok", "error", "reason", "session", "group", "extra",
]  # fmt: skip


@FUZZ
@given(
    tag=st.sampled_from(_TAGS),
    fields=st.dictionaries(st.sampled_from(_FIELDS), _VALUES, max_size=10),
    entries=st.lists(
        st.tuples(
            st.text(max_size=8),
            st.lists(st.integers(-3, 2**40), max_size=5),
            st.sampled_from([*DTYPES, "float33", "object"]),
            st.integers(-(2**40), 2**40),
            st.integers(-(2**40), 2**40),
            st.integers(-(2**40), 2**40),
        ).map(list),
        max_size=4,
    ),
    key=st.sampled_from([None, KEY]),
)
def test_fuzz_structured_messages(tag: str, fields: dict, entries: list, key: bytes | None) -> None:
    """Well-formed msgpack shaped like our messages, with hostile values: the validator's turn."""
    obj = {"type": tag, **fields}
    if tag == "bucket" and "entries" not in fields:
        obj["entries"] = entries
    body = msgspec.msgpack.encode(obj)
    frames = encode_raw(body, key) if key else [body]
    _decode_or_protocol_error(frames, key, bucket_size=1 << 20)


_GROUP_FIELDS = ["session", "generation", "backend", "bucket_size", "members", "join", "extra"]
_JOIN_FIELDS = ["host", "port", "unique_id", "slots", "release_addr", "extra"]


@FUZZ
@given(
    group=st.dictionaries(st.sampled_from(_GROUP_FIELDS), _VALUES, max_size=4),
    join_tag=st.sampled_from(["store", "nccl", "shared", "nope", None]),
    join=st.dictionaries(st.sampled_from(_JOIN_FIELDS), _VALUES, max_size=4),
    members=st.lists(st.tuples(st.text(max_size=8), st.integers(-3, 2**64 - 1)).map(list), max_size=4),
    unique_id=st.lists(st.integers(-300, 300), min_size=126, max_size=130),
    rank=st.integers(-3, 6),
    key=st.sampled_from([None, KEY]),
)
def test_fuzz_structured_plans(group: dict, join_tag, join: dict, members, unique_id, rank: int, key) -> None:
    """Plans shaped like ours down to the group spec and its tagged join fields, with hostile values:
    whatever decodes passes validation, everything else is a `ProtocolError`."""
    join_obj = {**({"type": join_tag} if join_tag else {}), **join}
    if join_tag == "nccl" and "unique_id" not in join:
        join_obj["unique_id"] = unique_id
    group_obj = {"session": "s", "generation": 1, "backend": "gloo", "bucket_size": 1 << 20, "members": members}
    obj = {"type": "plan", "version": 1, "rank": rank, "group": {**group_obj, "join": join_obj, **group}}
    body = msgspec.msgpack.encode(obj)
    _decode_or_protocol_error(encode_raw(body, key) if key else [body], key, bucket_size=1 << 20)


@st.composite
def _near_valid_plan(draw: st.DrawFn) -> dict:
    """A valid plan of one join kind, then (most of the time) one field moved to a value at or past
    its limit, so each limit is hit often even in a few hundred examples."""
    kind = draw(st.sampled_from(["store", "nccl", "shared"]))
    join: dict = {
        "store": {"type": "store", "host": "h", "port": 1},
        "nccl": {"type": "nccl", "unique_id": NCCL_ID},
        "shared": {"type": "shared", "slots": ["psm_1"], "release_addr": "tcp://127.0.0.1:1"},
    }[kind]
    group = {"session": "s", "generation": 1, "backend": "gloo", "bucket_size": 1 << 20}
    plan = {"type": "plan", "version": 1, "rank": 1, "group": {**group, "members": [["a", 1], ["b", 2]], "join": join}}
    near = {
        ("rank",): st.sampled_from([-1, 3, 4, 0, 2]),
        ("group", "members"): st.lists(
            st.tuples(st.sampled_from(["a", "b", ""]), st.integers(-1, 2)).map(list), max_size=3
        ),
        ("group", "generation"): st.integers(-2, 0),
        ("group", "bucket_size"): st.sampled_from([-1, 0, 1, MAX_TENSOR_BYTES, MAX_TENSOR_BYTES + 1]),
        ("group", "join", "host"): st.sampled_from(["", "h" * 256, "h" * 257]),
        ("group", "join", "port"): st.sampled_from([-1, 0, 65535, 65536]),
        ("group", "join", "unique_id"): st.lists(st.integers(-128, 255), min_size=127, max_size=129)
        | st.lists(st.sampled_from([-129, 0, 256]), min_size=128, max_size=128),
        ("group", "join", "slots"): st.sampled_from([[], [""], ["psm"] * MAX_SLOTS, ["psm"] * (MAX_SLOTS + 1)]),
        ("group", "join", "release_addr"): st.sampled_from(["ipc:///x", "", "tcp://" + "h" * 251]),
    }
    usable = [path for path in near if len(path) < 3 or path[-1] in join]
    path = draw(st.sampled_from([None, *usable]))
    if path is not None:
        target = plan
        for part in path[:-1]:
            target = target[part]
        target[path[-1]] = draw(near[path])
    return plan


@settings(FUZZ, max_examples=1000)
@given(plan=_near_valid_plan(), key=st.sampled_from([None, KEY]))
def test_fuzz_near_valid_plans(plan: dict, key: bytes | None) -> None:
    """Plans a hair inside or outside every limit (rank, members, each join kind): many decode."""
    body = msgspec.msgpack.encode(plan)
    _decode_or_protocol_error(encode_raw(body, key) if key else [body], key, bucket_size=1 << 20)


_BUCKET = 1024  # the receiver's bucket_size in the near-valid bucket fuzz


@st.composite
def _near_valid_entry(draw: st.DrawFn, may_break: bool = True) -> list:
    """A valid entry, or (when `may_break`, most of the time) one whose one field is at or past its
    limit; the other fields stay valid for it (a chunk inside a broken shape), so the broken one is
    what decides."""
    field = draw(st.sampled_from([None, "name", "shape", "dtype", "chunk_offset", "chunk_size", "offset"]))
    field = field if may_break else None
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    if field == "shape":
        shape = draw(st.sampled_from([[-1], [1] * MAX_NDIM, [1] * (MAX_NDIM + 1), [1 << 30, 1 << 20], [1 << 20] * 4]))
    dtype = draw(st.sampled_from(["float32", "bfloat16", "uint8", "float8_e4m3fn", "int64"]))
    nbytes = max(0, math.prod(shape)) * DTYPES[dtype].itemsize
    chunk_offset = draw(st.integers(0, min(nbytes, 64)))
    chunk_size = draw(st.integers(0, min(nbytes - chunk_offset, 64)))
    entry = {"name": "w", "shape": shape, "dtype": dtype, "chunk_offset": chunk_offset, "chunk_size": chunk_size}
    entry["offset"] = draw(st.integers(0, 8))
    near = {
        "name": st.sampled_from(["", "x" * MAX_NAME_LEN, "x" * (MAX_NAME_LEN + 1)]),
        "dtype": st.sampled_from(["float33", "object", ""]),
        "chunk_offset": st.integers(-2, nbytes + 2),
        "chunk_size": st.integers(-2, max(nbytes, _BUCKET) + 2),
        "offset": st.integers(-2, _BUCKET + 2),
    }
    if field in near:
        entry[field] = draw(near[field])
    return list(entry.values())


@st.composite
def _near_valid_bucket(draw: st.DrawFn) -> dict:
    """Valid bucket metadata with at most one thing at or past its limit: the bucket's size, index,
    tied names, or (most often) one field of its first entry."""
    broken = draw(
        st.sampled_from([None, "nbytes", "bucket_index", "tied", "fingerprints", "deltas", "entry", "entry", "entry"])
    )
    entries = [draw(_near_valid_entry(may_break=broken == "entry"))]
    entries += draw(st.lists(_near_valid_entry(may_break=False), max_size=3))
    bucket = {"type": "bucket", "version": 1, "bucket_index": 0, "is_last": True, "nbytes": _BUCKET}
    bucket["tied"] = draw(st.sampled_from([{}, {"w": ["v"]}, {"w": ["v", "u"]}]))
    bucket["fingerprints"] = draw(st.sampled_from([[], [-1] * len(entries), [(1 << 64) - 1] * len(entries)]))
    bucket["deltas"] = draw(st.sampled_from([[], [-1] * len(entries)]))
    bucket["delta_base"] = draw(st.sampled_from([-1, 0]))
    near = {
        "nbytes": st.integers(_BUCKET - 2, _BUCKET + 2) | st.integers(-2, 40),
        "bucket_index": st.integers(-1, 2),
        "tied": st.dictionaries(
            st.sampled_from(["w", "v", "u", "", "x" * (MAX_NAME_LEN + 1)]),
            st.lists(st.sampled_from(["w", "v", "u", ""]), max_size=2),
            min_size=1,
        ),
        "fingerprints": st.lists(st.integers(-2, 2) | st.sampled_from([(1 << 64) - 1, -(1 << 63)]), max_size=5),
        "deltas": st.lists(st.integers(-2, 40) | st.sampled_from([_BUCKET - 1, _BUCKET, 1 << 40]), max_size=5),
        "delta_base": st.integers(-2, 3),
    }
    if broken in near:
        bucket[broken] = draw(near[broken])
    return {**bucket, "entries": entries}


@settings(FUZZ, max_examples=1000)
@given(bucket=_near_valid_bucket(), key=st.sampled_from([None, KEY]))
def test_fuzz_near_valid_buckets(bucket: dict, key: bytes | None) -> None:
    """Bucket metadata a hair inside or outside every limit (sizes, offsets, dims, names, ties):
    many decode, so the invariants of accepted messages are really exercised, not only rejections."""
    body = msgspec.msgpack.encode(bucket)
    _decode_or_protocol_error(encode_raw(body, key) if key else [body], key, bucket_size=_BUCKET)


def test_decoded_entries_become_valid_metas() -> None:
    """Whatever passes validation can be turned into a TensorMeta without raising anything else."""
    msg = decode(encode(BucketMeta(1, 0, True, 100, _entries())))
    for e in msg.entries:
        meta = e.to_meta()
        assert meta.chunk_offset + meta.chunk_size <= meta.nbytes
        assert isinstance(meta.dtype, torch.dtype)


# ----------------------------------------------------------------------------------------------- no pickle

_PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
# torch.distributed object collectives pickle their payloads; zmq's *_pyobj pickle too.
_PICKLING_CALLS = {
    "send_pyobj", "recv_pyobj", "broadcast_object_list", "all_gather_object", "gather_object",
    "scatter_object_list", "send_object_list", "recv_object_list",
}  # fmt: skip


def _pickle_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[str] = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(PACKAGE_DIR.parent)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where} import {a.name}" for a in node.names if a.name.split(".")[0] in _PICKLE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in _PICKLE_MODULES:
            found.append(f"{where} from {node.module} import ...")
        elif isinstance(node, ast.Attribute) and node.attr in _PICKLING_CALLS:
            found.append(f"{where} .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in _PICKLING_CALLS | _PICKLE_MODULES:
            found.append(f"{where} {node.id}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            owner = func.value.id if isinstance(func.value, ast.Name) else None
            kwargs = {k.arg: k.value for k in node.keywords}
            if owner == "torch" and func.attr == "load":
                wo = kwargs.get("weights_only")
                if not (isinstance(wo, ast.Constant) and wo.value is True):
                    found.append(f"{where} torch.load without weights_only=True")
            if owner == "torch" and func.attr == "save":
                found.append(f"{where} torch.save (a pickle; use safetensors)")
            if owner in {"np", "numpy"} and func.attr == "load":
                ap = kwargs.get("allow_pickle")
                if ap is not None and not (isinstance(ap, ast.Constant) and ap.value is False):
                    found.append(f"{where} numpy.load with allow_pickle")
    return found


def test_package_never_pickles() -> None:
    sources = sorted(PACKAGE_DIR.rglob("*.py"))
    assert len(sources) >= 5
    found = [use for path in sources for use in _pickle_uses(path)]
    assert not found, "pickle on a wire/disk path:\n" + "\n".join(found)


def test_pickle_detector_detects(tmp_path: Path) -> None:
    """The scan above would fail on each of these (so a pass means something)."""
    bad = {
        "a.py": "import pickle\n",
        "b.py": "from cloudpickle import dumps\n",
        "c.py": "def f(sock):\n    return sock.recv_pyobj()\n",
        "d.py": "import torch\nx = torch.load('f')\n",
        "e.py": "import torch\nx = torch.load('f', weights_only=False)\n",
        "f.py": "import torch.distributed as dist\ndist.broadcast_object_list([1])\n",
        "g.py": "import torch\ntorch.save({}, 'f')\n",
    }
    pkg = tmp_path / "lightning_weightsync"
    pkg.mkdir()
    global PACKAGE_DIR
    saved, PACKAGE_DIR = PACKAGE_DIR, pkg
    try:
        for name, src in bad.items():
            (pkg / name).write_text(src)
            assert _pickle_uses(pkg / name), name
        (pkg / "ok.py").write_text("import torch\nx = torch.load('f', weights_only=True)\n# pickle in a comment\n")
        assert not _pickle_uses(pkg / "ok.py")
    finally:
        PACKAGE_DIR = saved


def test_decode_does_not_reach_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args, **kwargs):
        raise AssertionError("pickle was used on the wire path")

    for name in ("loads", "load", "dumps", "dump"):
        monkeypatch.setattr(pickle, name, boom)
    monkeypatch.setattr(pickle, "Unpickler", boom)
    for msg in MESSAGES:
        for key in (None, KEY):
            assert decode(encode(msg, key), key) == msg


def test_absurd_declared_tensor_size_is_refused():
    from lightning_weightsync.protocol.messages import (
        MAX_TENSOR_BYTES,
        BucketMeta,
        Entry,
        ProtocolError,
        decode,
        encode,
    )

    huge = BucketMeta(1, 0, True, 8, [Entry("w", [1 << 30, 1 << 20], "float32", 0, 8, 0)])
    assert MAX_TENSOR_BYTES < 4 * (1 << 50)
    with pytest.raises(ProtocolError, match="refusing to allocate"):
        decode(encode(huge))


# -- the largest legal frame each way: ZeroMQ's MAXMSGSIZE (issue 24 item 4) ---------------------------------

WIDE = "\U0001d538"  # 4 bytes of UTF-8: the most a character of a text costs on the wire


def _wide(chars: int, prefix: str = "") -> str:
    return (prefix + WIDE * chars)[:chars]


def _largest_lora() -> LoraSpec:
    names = [_wide(MAX_NAME_LEN, f"{i}.") for i in range(MAX_LORA_NAMES)]
    quarter = MAX_LORA_NAMES // 4
    return LoraSpec(
        "adapter", True, MAX_LORA_RANK, 1e308, names[:quarter], 0.999, True, True, True, "lora_only",
        names[quarter : 2 * quarter], {n: MAX_LORA_RANK for n in names[2 * quarter : 3 * quarter]},
        {n: 1e308 for n in names[3 * quarter :]}, _wide(64), lora_bias=True,
    )  # fmt: skip


def _largest_to_receiver() -> dict[str, Message]:
    dtype = max(DTYPES, key=len)
    entry = [
        Entry(_wide(MAX_NAME_LEN, f"{i}."), [1 << 20, *[1] * (MAX_NDIM - 2), 1 << 19], dtype, 1 << 38, 1 << 20, 1 << 39)
        for i in range(MAX_BUCKET_ENTRIES)
    ]
    ranges_end = (1 << 39) * DTYPES[dtype].itemsize  # the entries' tensor bytes
    tied = {_wide(MAX_NAME_LEN, "src."): [_wide(MAX_NAME_LEN, f"{i}.") for i in range(1000, 1000 + MAX_TIED_NAMES - 1)]}
    members = [Member(_wide(MAX_IDENTITY_LEN, f"{i}."), (1 << 63) - 1) for i in range(MAX_MEMBERS)]
    region = NixlRegion((1 << 64) - 1, 1 << 40, 65535)
    nixl = NixlJoin(_wide(256), b"m" * MAX_NIXL_METADATA_BYTES, "VRAM", [region] * MAX_SLOTS, "tcp://" + _wide(250))
    group = GroupSpec(_wide(MAX_TEXT_LEN), (1 << 63) - 1, _wide(64), 1 << 40, members, nixl)
    return {
        "bucket": BucketMeta(
            (1 << 63) - 1,
            0,
            True,
            1 << 40,
            entry,
            tied,
            MAX_SENDERS,
            [(1 << 64) - 1] * len(entry),
            [(1 << 39) - 1] * len(entry),
            (1 << 63) - 2,
            _largest_lora(),
            delta_ranges=[(ranges_end - (1 << 39), 1 << 39)] * len(entry),  # longer than the payload, in range
        ),
        "plan": Plan(
            (1 << 63) - 1,
            1,
            group,
            [SenderAddress(_wide(256, f"{i}."), 65535) for i in range(MAX_SENDERS)],
            "ab" * 16,
            _wide(1000),
        ),
        "refuse": Refuse(_wide(MAX_IDENTITY_LEN), _wide(MAX_TEXT_LEN)),
        "store-reply": StoreReply((1 << 63) - 1, True, b"v" * MAX_STORE_VALUE_LEN),
    }


def _largest_to_sender() -> dict[str, Message]:
    big, identity, text = (1 << 63) - 1, _wide(MAX_IDENTITY_LEN), _wide(MAX_TEXT_LEN)
    # the fullest page a receiver packs: names as long as legal, boxes of MAX_NDIM dims of 64-bit numbers
    box = Box((big,) * MAX_NDIM, (big,) * MAX_NDIM)
    pages = Declaration.of({_wide(MAX_NAME_LEN, f"{i}."): box for i in range(64)}).pages(identity)
    return {
        "register": Register(identity, text, big, text, big, big, _wide(256), _wide(256)),
        "ack": Ack(identity, big, False, text),
        "store-request": StoreRequest(identity, big, "set", _wide(MAX_STORE_KEY_LEN), b"v" * MAX_STORE_VALUE_LEN),
        "ready": Ready(identity, big, big, big, "ab" * 16, "cd" * 16),
        "boxes": max(pages, key=lambda page: len(encode(page)[0])),
    }


@pytest.mark.parametrize("to_sender", [True, False], ids=["to-sender", "to-receiver"])
def test_the_largest_legal_message_of_every_kind_fits_the_frame_limit(to_sender: bool) -> None:
    """Each socket's MAXMSGSIZE is `max_frame_bytes` of the way it receives: every legal message must
    fit (or a peer is disconnected for a legal message), and it is what bounds a stranger's frame."""
    limit = MAX_FRAME_TO_SENDER if to_sender else MAX_FRAME_TO_RECEIVER
    largest = _largest_to_sender() if to_sender else _largest_to_receiver()
    problems = []
    for kind, msg in largest.items():
        validate(msg)  # legal ...
        mac, header, body = seal(msg, KEY, Seal(_wide(MAX_TEXT_LEN), _wide(256), (1 << 63) - 1, to_sender, _wide(256)))
        unseal([mac, header, body], KEY, to_sender=to_sender)
        for frame in (mac, header, body):
            if len(frame) > limit:  # ... and within the limit
                problems.append(f"{kind}: a frame of {len(frame)} bytes > {limit}")
    assert not problems, problems
    biggest = max(len(encode(m)[0]) for m in largest.values())
    assert biggest > limit // 2, f"the limit {limit} is far above the largest legal frame ({biggest})"


def test_a_bucket_of_more_than_max_bucket_entries_is_refused() -> None:
    entries = [Entry(f"e{i}", [0], "float32", 0, 0, 0) for i in range(MAX_BUCKET_ENTRIES + 1)]
    validate(BucketMeta(1, 0, True, 0, entries[:-1]))
    with pytest.raises(ProtocolError, match="MAX_BUCKET_ENTRIES"):
        validate(BucketMeta(1, 0, True, 0, entries))


@pytest.mark.parametrize(
    "senders, match",
    [
        ([SenderAddress("", 5)], "bad sender address"),
        ([SenderAddress("h", 0)], "bad sender address"),
        ([SenderAddress("h", 70000)], "bad sender address"),
        ([SenderAddress("h" * 257, 5)], "sender host"),
        ([SenderAddress("h", 5), SenderAddress("h", 5)], "a sender twice"),
        ([SenderAddress(f"h{i}", 5) for i in range(MAX_SENDERS + 1)], "other senders"),
    ],
)
def test_a_plan_with_bad_other_senders_is_refused(senders: list, match: str) -> None:
    plan = _plan()
    validate(Plan(plan.version, plan.rank, plan.group, [SenderAddress("ok", 1)]))
    with pytest.raises(ProtocolError, match=match):
        validate(Plan(plan.version, plan.rank, plan.group, senders))


@pytest.mark.parametrize("sender", [-1, MAX_SENDERS + 1])
def test_a_bucket_from_an_impossible_sender_is_refused(sender: int) -> None:
    validate(BucketMeta(1, 0, True, 0, [], {}, MAX_SENDERS))
    with pytest.raises(ProtocolError, match="from sender"):
        validate(BucketMeta(1, 0, True, 0, [], {}, sender))


JOIN_SAMPLES = {
    "store": StoreJoin("127.0.0.1", 29601),
    "nccl": NcclJoin(NCCL_ID),
    "shared": SharedJoin(["psm_0a1b", "psm_2c3d"], "tcp://127.0.0.1:5555"),
    "nixl": NixlJoin("agent-0", b"md", "DRAM", [NixlRegion(4096, 1024, 0)] * 2, "tcp://127.0.0.1:5556"),
}


def test_every_join_kind_round_trips_in_a_plan() -> None:
    """The wire union is built from `JOIN_KINDS`: a plan carrying any registered kind decodes to the same
    kind (a new kind without a sample here fails, so it is round-tripped too)."""
    from lightning_weightsync.protocol.joins import JOIN_KINDS

    assert set(JOIN_SAMPLES) == set(JOIN_KINDS)
    for tag, join in JOIN_SAMPLES.items():
        assert isinstance(join, JOIN_KINDS[tag])
        plan = _plan(join=join)
        for key in (None, KEY):
            back = decode(encode(plan, KEY if key else None), key)
            assert back == plan and type(back.group.join) is type(join)


def test_a_join_of_an_unknown_kind_is_rejected() -> None:
    """A tag no registered kind has is a schema error (strict tagged union), never decoded loosely."""

    class OtherJoin(msgspec.Struct, tag="other", frozen=True):
        host: str
        port: int

    frames = encode(_plan(join=OtherJoin("127.0.0.1", 1)))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="malformed control message") as info:
        decode(frames)
    assert not isinstance(info.value, DecoderBug)
    untagged = msgspec.msgpack.encode({"type": "plan", "version": 3, "rank": 1, "group": {"join": {"host": "h"}}})
    with pytest.raises(ProtocolError, match="malformed control message"):
        decode([untagged])


def test_join_kinds_cannot_be_added_once_the_union_is_built() -> None:
    """`messages` builds its decoder from the complete table and freezes it: a kind added later would not
    be decodable, so adding one is refused instead of silently ignored."""
    from lightning_weightsync.errors import ConfigError
    from lightning_weightsync.protocol.joins import JOIN_KINDS

    with pytest.raises(ConfigError, match="registered after the wire union was built"):
        JOIN_KINDS.add("late", "lightning_weightsync.protocol.joins.store:StoreJoin")
    assert "late" not in JOIN_KINDS
