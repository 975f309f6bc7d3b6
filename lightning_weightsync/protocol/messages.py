"""Control-plane messages: schema, encoding, signing and validation. No pickle, ever.

Every message is a msgspec Struct encoded as msgpack. `decode()` is the only way bytes from the
network become objects: it checks the HMAC (when a token is configured), decodes into the closed
set of message types below (anything else is rejected by msgspec, not executed), then validates
ranges (dtype allow-list, non-negative shapes, chunk and bucket offsets in range, bounded names).
Whatever goes wrong, it raises `ProtocolError` and nothing else. An exception that nobody raised
on purpose (a bug here, not in the peer) is still a rejection, so hostile bytes never crash a
daemon, but it is a `DecoderBug`, logged with its traceback, so a test or an operator sees it.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, TypeAlias, Union

import msgspec

from ..errors import ProtocolError
from .boxes import Box, check_boxes
from .chunks import MAX_BUCKET_ENTRIES, TensorMeta
from .dtypes import DTYPES, dtype_from_name, dtype_name, itemsize
from .fingerprint import MASK, NO_FINGERPRINT
from .joins import JoinSpec, all_join_kinds
from .limits import INT_BYTES as _INT_BYTES
from .limits import MAX_SLOTS, MAX_TENSOR_BYTES, MAX_TEXT_LEN  # noqa: F401 - part of the schema's limits
from .limits import STRUCT_BYTES as _STRUCT_BYTES
from .limits import check_text as _check_text
from .limits import text_bytes as _text_bytes

logger = logging.getLogger(__name__)

MAX_NAME_LEN = 1024
MAX_NDIM = 16
MAX_TIED_NAMES = 1024  # names in a bucket's `tied` map, sources and aliases together
MAX_IDENTITY_LEN = 256  # a receiver's identity (config: rollout.identity, shorter: see config.py)
MAC_LEN = 32
MAX_MEMBERS = 4096  # receivers in one group
LAYOUT_DIGEST_LEN = 32  # hex digits of a bucket layout's digest (protocol/layout.py)
MAX_SENDERS = 1024  # trainer ranks that send one version (sharded send mode)
PROTOCOL_VERSION = 1


class Entry(msgspec.Struct, array_like=True, frozen=True):
    """One chunk in a bucket (the wire form of `TensorMeta`). `box`: empty, or the box of the tensor the
    chunk is a part of (its offsets, then its sizes: a receiver that declared it gets that box only, and the
    chunk's bytes count in the box's local tensor)."""

    name: str
    shape: list[int]
    dtype: str
    chunk_offset: int
    chunk_size: int
    offset: int
    box: list[int] = []

    @classmethod
    def from_meta(cls, meta: TensorMeta) -> Entry:
        assert meta.offset is not None, "chunk has no bucket offset"
        box = [] if meta.box is None else [*meta.box.offsets, *meta.box.sizes]
        return cls(
            meta.name, list(meta.shape), dtype_name(meta.dtype), meta.chunk_offset, meta.chunk_size, meta.offset, box
        )

    @property
    def the_box(self) -> Box | None:
        if not self.box:
            return None
        ndim = len(self.box) // 2
        return Box(tuple(self.box[:ndim]), tuple(self.box[ndim:]))

    def to_meta(self) -> TensorMeta:
        return TensorMeta(
            self.name, tuple(self.shape), dtype_from_name(self.dtype), self.chunk_offset, self.chunk_size, self.offset,
            self.the_box,
        )  # fmt: skip


class Register(msgspec.Struct, tag="register", frozen=True):
    """Receiver -> sender, on start and every heartbeat interval while idle."""

    identity: str
    host: str
    pid: int
    device: str
    last_version: int = -1
    protocol: int = PROTOCOL_VERSION
    instance: str = ""  # random per receiver process: a reconnect of the same process keeps its identity
    nonce: str = ""  # fresh per Register; the sender's answers carry it in their seal (`Seal.answers`: not a replay)


class Prepare(msgspec.Struct, tag="prepare", frozen=True):
    """Sender -> receiver: a version is about to start; answer `Ready` to be in its group.

    `session` is new for every sender process: versions are monotonic within a session, and a
    restarted trainer (new session) may start over.
    """

    version: int
    session: str


class Ready(msgspec.Struct, tag="ready", frozen=True):
    """Receiver -> sender. `generation` is the data-plane group the receiver still holds (-1:
    none), so the sender rebuilds the group when any member lost it."""

    identity: str
    version: int
    generation: int = -1
    delta_base: int = -1  # the version this receiver holds whole and can apply a delta to (-1: none)
    layout: str = ""  # the digest of the bucket layout this receiver holds (protocol/layout.py; "": none)
    boxes: str = ""  # the digest of the boxes it declared (protocol/declare.py; "": it takes whole tensors)
    contract: str = ""  # the digest of the quantization contract it declared (`Contract`; "": none)


class Contract(msgspec.Struct, tag="contract", frozen=True):
    """Receiver -> sender, before a `Ready` that names `digest`: what its model loads quantized and how
    (lightning_weightsync/quantize/contract.py), as that contract's canonical JSON, at most `CONTRACT_BYTES`.
    It is patterns, not names (a few KiB for a large MoE), so it goes whole with every version's Ready and the
    sender never serves a version without it."""

    identity: str
    digest: str  # `contract_digest(body)`: the sender checks it, so a Ready cannot name another body
    body: bytes


class BoxEntry(msgspec.Struct, array_like=True, frozen=True):
    """One tensor of a declaration: the box of it the receiver holds."""

    name: str
    offsets: list[int]
    sizes: list[int]


class Boxes(msgspec.Struct, tag="boxes", frozen=True):
    """Receiver -> sender, before a `Ready` that names `digest`: page `page` of `pages` of the declaration of
    what it holds of each tensor (protocol/declare.py). Pages are packed to `BOXES_PAGE_BYTES`; a few go with
    each version until the sender's plan says it took the declaration."""

    identity: str
    digest: str
    page: int
    pages: int
    entries: list[BoxEntry]


_JOIN_KINDS = all_join_kinds()  # loads every registered kind and freezes the table: the union is complete
if TYPE_CHECKING:
    Join: TypeAlias = JoinSpec  # what a type checker can know of a union built at import
else:
    Join = Union[_JOIN_KINDS]  # noqa: UP007 - msgspec decodes this tagged union, strictly
"""What a receiver needs to join one backend's group, one tagged kind per rendezvous (`protocol/joins/`,
one file each, listed in `JOIN_KINDS`); a backend reads only its own kind."""


class Member(msgspec.Struct, array_like=True, frozen=True):
    """A receiver in the group: its control-plane identity and its process (a restarted receiver,
    same identity and another pid, has lost the group)."""

    identity: str
    pid: int


class GroupSpec(msgspec.Struct, frozen=True):
    """One data-plane group generation, the same for every rank. `members[i]` has rank `i + 1`;
    the sender is rank 0. A restarted sender (new `session`) numbers generations afresh.

    `relay` (transport.fanout=chain): `relay[r]` is the rank that rank r receives each bucket from, in pieces of
    `relay_piece` bytes that it forwards at once to the ranks it feeds (`protocol/relay.py`); empty: the
    backend's own broadcast."""

    session: str
    generation: int
    backend: str
    bucket_size: int
    members: list[Member]
    join: Join
    relay: list[int] = []
    relay_piece: int = 0

    @property
    def world_size(self) -> int:
        return len(self.members) + 1


class SenderAddress(msgspec.Struct, array_like=True, frozen=True):
    """Another trainer rank that sends part of a version (sharded send mode): its control endpoint."""

    host: str
    port: int


class Plan(msgspec.Struct, tag="plan", frozen=True):
    """Sender -> receiver: the group of this version and your rank in it.

    `senders` (sharded send mode): the other trainer ranks that send their own part of this version;
    the receiver connects to each (same token), takes part in its own Prepare/Plan/buckets for the same
    version, and the version is complete when every tensor is tiled by the union of all their chunks.
    Sender 0 is the one this plan comes from; `senders[i]` is sender i + 1 (`BucketMeta.sender`)."""

    version: int
    rank: int
    group: GroupSpec
    senders: list[SenderAddress] = []
    boxes: str = ""  # the digest of the declaration this sender serves the receiver by ("": whole tensors)
    boxes_refused: str = ""  # why the receiver's declaration was refused (it gets whole tensors meanwhile)
    contract: str = ""  # the digest of the quantization contract this version is sent by ("": as the trainer holds)

    @property
    def session(self) -> str:
        return self.group.session


LORA_MODES = ("adapter", "merged", "full")
LORA_BIASES = ("none", "all", "lora_only")
MAX_LORA_RANK = 1 << 16
MAX_LORA_NAMES = 1024  # target_modules + modules_to_save + rank/alpha patterns together


class LoraSpec(msgspec.Struct, frozen=True):
    """What a version of a PEFT LoRA model is (`trainer.lora`), in its first bucket: the mode, whether the
    base weights are in it, and the adapter's config, as PEFT's `LoraConfig` has it (enough to write an
    `adapter_config.json` that `PeftModel.from_pretrained` loads, and to check the rollout's model)."""

    mode: str  # one of LORA_MODES
    base: bool  # the version carries base weights too (under the base model's names)
    r: int
    lora_alpha: float
    target_modules: list[str] | str  # a list of names, or PEFT's regex string
    lora_dropout: float = 0.0
    use_rslora: bool = False
    use_dora: bool = False
    fan_in_fan_out: bool = False
    bias: str = "none"
    modules_to_save: list[str] = []
    rank_pattern: dict[str, int] = {}
    alpha_pattern: dict[str, float] = {}
    task_type: str | None = None
    lora_bias: bool = False  # PEFT's `lora_bias`: each lora_B has a bias (adapter versions carry ``lora_B.bias``)


class BucketMeta(msgspec.Struct, tag="bucket", frozen=True):
    """Sender -> receiver: what the next broadcast bucket holds.

    `tied` (bucket 0 only, optional): tensors sent once for several names (tied embeddings:
    ``{"model.embed_tokens.weight": ["lm_head.weight"]}``), so every sink can restore the tie or
    yield every name; an older sender simply omits it.
    `fingerprints` (optional): empty, or one per entry, the fingerprint of that entry's whole tensor
    (`protocol/fingerprint.py`; `NO_FINGERPRINT` = none), checked by a receiver once the tensor is merged.
    `deltas` (optional): empty, or one per entry: -1 when the entry's chunk is of the tensor's bytes, else the
    size of the delta payload it is a chunk of (`versions/delta.py`), which applies to version `delta_base`.
    `delta_ranges` (optional, sharded send mode): empty (every delta rebuilds its whole tensor), or one per
    entry: `[byte start, bytes]` of the tensor that entry's delta payload rebuilds (a sender's shard; `[0, 0]`
    for an entry that is not a delta).
    """

    version: int
    bucket_index: int
    is_last: bool
    nbytes: int
    entries: list[Entry]
    tied: dict[str, list[str]] = {}
    sender: int = 0  # which sender of the version (sharded send mode) this bucket comes from
    fingerprints: list[int] = []
    deltas: list[int] = []
    delta_base: int = -1
    lora: LoraSpec | None = None  # bucket 0 only: the version is of a PEFT LoRA model (`trainer.lora`)
    delta_ranges: list[tuple[int, int]] = []
    layout: str = ""  # a layout digest: `entries` is empty on the wire and is that layout's bucket (layout.py)


class BucketDone(msgspec.Struct, tag="bucket_done", frozen=True):
    """Receiver -> sender: finished reading a bucket (shared-memory backends reuse it then)."""

    identity: str
    version: int
    bucket_index: int


class Ack(msgspec.Struct, tag="ack", frozen=True):
    """Receiver -> sender: a version was received whole (`ok`) or failed (`error`)."""

    identity: str
    version: int
    ok: bool
    error: str | None = None


class Abort(msgspec.Struct, tag="abort", frozen=True):
    """Sender -> receiver: drop the version in flight; nothing of it may be applied."""

    version: int
    reason: str


class Bye(msgspec.Struct, tag="bye", frozen=True):
    """Either side: leaving cleanly."""

    identity: str


class Refuse(msgspec.Struct, tag="refuse", frozen=True):
    """Sender -> a registering receiver: not admitted (its identity is held by another receiver that
    is still connected). Its seal answers the refused `Register`'s nonce, so it cannot be replayed later."""

    identity: str
    reason: str


class StoreRequest(msgspec.Struct, tag="store_req", frozen=True):
    """Receiver -> sender: one operation on the data-plane rendezvous store, which lives in the
    sender and is reached only through this (authenticated) control plane, never an open TCPStore."""

    identity: str
    request_id: int
    op: str  # one of STORE_OPS
    key: str
    value: bytes = b""


class StoreReply(msgspec.Struct, tag="store_reply", frozen=True):
    """Sender -> receiver: the answer to `StoreRequest` `request_id` (`found` is False for a get of
    a key not set yet: the receiver asks again until its timeout)."""

    request_id: int
    found: bool
    value: bytes = b""


Message = Union[  # noqa: UP007
    Register, Prepare, Ready, Plan, BucketMeta, BucketDone, Ack, Abort, Bye, Refuse, StoreRequest, StoreReply, Boxes,
    Contract,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def sign(body: bytes, key: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest()


def encode(msg: Message, key: bytes | None = None) -> list[bytes]:
    """Frames to send: `[body]`, or `[mac, body]` when a key is configured."""
    body = _encoder.encode(msg)
    return [sign(body, key), body] if key else [body]


class DecoderBug(ProtocolError):
    """Decoding raised an exception that no check raises on purpose: a bug in this module, not a
    bad peer. The message is still rejected (this is a `ProtocolError`, so callers treat it like
    any malformed message and a hostile peer cannot crash a daemon with it), but it is logged with
    its traceback and tests fail on it instead of counting it as a correct rejection."""


@contextlib.contextmanager
def _from_hostile_bytes() -> Iterator[None]:
    """Whatever bytes from the network make decoding raise becomes a `ProtocolError` (never anything
    else): decode and unseal share this one rule. The expected failures are our own checks and
    msgspec's schema errors (deep nesting included); anything else is a `DecoderBug`."""
    try:
        yield
    except ProtocolError:
        raise
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise ProtocolError(f"malformed control message: {exc}") from None
    except Exception as exc:
        logger.error("bug in the control-message decoder (message rejected); please report", exc_info=True)
        raise DecoderBug(f"malformed control message: {type(exc).__name__}: {exc} (a decoder bug)") from exc


def decode(frames: list[bytes], key: bytes | None = None, *, bucket_size: int | None = None) -> Message:
    """Authenticate, decode and validate one message; raises only `ProtocolError`."""
    with _from_hostile_bytes():
        if key:
            if len(frames) != 2 or len(frames[0]) != MAC_LEN:
                raise ProtocolError("unsigned message (transport.auth_token is set on this side)")
            mac, body = bytes(frames[0]), bytes(frames[1])
            if not hmac.compare_digest(mac, sign(body, key)):
                raise ProtocolError("bad message signature (transport.auth_token differs between peers?)")
        else:
            if len(frames) != 1:
                raise ProtocolError(
                    f"expected 1 frame, got {len(frames)} (is the peer signing with transport.auth_token?)"
                )
            body = bytes(frames[0])
        msg = _decoder.decode(body)
        validate(msg, bucket_size=bucket_size)
        return msg


class Seal(msgspec.Struct, array_like=True, frozen=True):
    """What binds a signed control message to one conversation (second frame, under the MAC).

    `session` is the sender session the message belongs to ("" in a receiver's first `Register`,
    before it has seen any); `origin` is who sealed it (the sender: its session; a receiver: its
    random per-process instance id); `seq` counts that origin's messages, strictly increasing, so a
    copy of a message (same origin, an old seq) is a replay; `to_sender` is the direction, so a
    message cannot be reflected back at the side that sealed it. `answers` (sender -> receiver): the nonce of
    that receiver's latest `Register` the sender saw; a receiver adopts a new sender session only through a
    message whose seal answers one of its recent registrations (so no recorded message of another run is).
    """

    session: str
    origin: str
    seq: int
    to_sender: bool
    answers: str = ""


_seal_decoder = msgspec.msgpack.Decoder(Seal)
_SEAL_CONTEXT = b"lightning-weightsync seal v1\x00"


def _seal_mac(key: bytes, header: bytes, body: bytes) -> bytes:
    # length-prefixed, so no split of header || body can collide with another
    return sign(_SEAL_CONTEXT + len(header).to_bytes(4, "big") + header + body, key)


def seal(msg: Message, key: bytes, envelope: Seal) -> list[bytes]:
    """Frames of a signed, sealed control message: `[mac, seal, body]`; the MAC covers both."""
    header, body = _encoder.encode(envelope), _encoder.encode(msg)
    return [_seal_mac(key, header, body), header, body]


def unseal(
    frames: Sequence[bytes], key: bytes, *, to_sender: bool, bucket_size: int | None = None
) -> tuple[Message, Seal]:
    """Authenticate, decode and validate one sealed message; raises only `ProtocolError`.

    Checks what one message can show (MAC, direction, ranges); whether its seq is fresh and its
    session the current one is the caller's (control plane's) bookkeeping.
    """
    with _from_hostile_bytes():
        if len(frames) != 3 or len(frames[0]) != MAC_LEN:
            raise ProtocolError(
                f"unsealed message ({len(frames)} frames; transport.auth_token is set on this side: "
                "is the peer an older version or not using the token?)"
            )
        mac, header, body = (bytes(f) for f in frames)
        if not hmac.compare_digest(mac, _seal_mac(key, header, body)):
            raise ProtocolError("bad message signature (transport.auth_token differs between peers?)")
        envelope = _seal_decoder.decode(header)
        _check_text("seal session", envelope.session)
        _check_text("seal origin", envelope.origin, 256)
        _check_text("seal answers", envelope.answers, 256)
        if not envelope.origin or not (0 <= envelope.seq < 1 << 63):
            raise ProtocolError(f"seal has an empty origin or a bad seq {envelope.seq}")
        if envelope.to_sender != to_sender:
            raise ProtocolError("message sealed for the other direction (reflected back at its origin?)")
        msg = _decoder.decode(body)
        validate(msg, bucket_size=bucket_size)
        return msg, envelope


STORE_OPS = ("set", "get", "add")  # add: value and answer are decimal integers
MAX_STORE_KEY_LEN = 512
MAX_STORE_VALUE_LEN = 1 << 16  # gloo stores a rank's address (~100 bytes) per key


def _validate_control(msg: Message) -> None:
    """Ranges of the registration and rendezvous messages."""
    if isinstance(msg, StoreRequest):
        if msg.op not in STORE_OPS:
            raise ProtocolError(f"store op {msg.op[:64]!r} is not one of {STORE_OPS}")
        if not msg.key:
            raise ProtocolError("store request with an empty key")
        _check_text("store key", msg.key, MAX_STORE_KEY_LEN)
        _check_nonneg("store request_id", msg.request_id)
        if len(msg.value) > MAX_STORE_VALUE_LEN:
            raise ProtocolError(f"store value of {len(msg.value)} bytes (limit {MAX_STORE_VALUE_LEN})")
    elif isinstance(msg, StoreReply):
        _check_nonneg("store request_id", msg.request_id)
        if len(msg.value) > MAX_STORE_VALUE_LEN:
            raise ProtocolError(f"store value of {len(msg.value)} bytes (limit {MAX_STORE_VALUE_LEN})")
    elif isinstance(msg, Register):
        _check_nonneg("pid", msg.pid)
        _check_text("instance", msg.instance, 256)
        _check_text("nonce", msg.nonce, 256)
    elif isinstance(msg, Ready):
        if msg.delta_base < -1:
            raise ProtocolError(f"Ready delta_base={msg.delta_base} is below -1")
        check_layout_digest(msg.layout)
        check_layout_digest(msg.boxes)
        check_layout_digest(msg.contract)
    elif isinstance(msg, Boxes):
        validate_boxes(msg)
    elif isinstance(msg, Contract):
        if len(msg.body) > CONTRACT_BYTES:
            raise ProtocolError(f"a Contract of {len(msg.body)} bytes (limit {CONTRACT_BYTES})")
        if not msg.digest or msg.digest != contract_digest(msg.body):
            raise ProtocolError("a Contract whose digest is not its body's")


CONTRACT_BYTES = 48 * 1024  # a contract's canonical JSON at most (under the frame limit to the sender)


def contract_digest(body: bytes) -> str:
    """The digest a `Ready` names a contract by (the form of a layout digest: `check_layout_digest`)."""
    return hashlib.blake2b(body, digest_size=LAYOUT_DIGEST_LEN // 2).hexdigest()


MAX_BOX_PAGES = 1024  # pages of one declaration (a page holds hundreds of tensors)
MAX_BOX_ENTRIES = 4096  # tensors in one page (its bytes bound it sooner: BOXES_PAGE_BYTES)
BOXES_PAGE_BYTES = 48 * 1024  # a page's encoded size at most (under the frame limit to the sender)


def validate_boxes(msg: Boxes) -> None:
    """A page of a declaration: a digest, a page in range, bounded names, boxes of at most MAX_NDIM dims with
    non-negative offsets and sizes of at least 1 (whether a box fits its tensor is the sender's check, which
    knows the tensor)."""
    check_layout_digest(msg.digest)
    if not msg.digest:
        raise ProtocolError("a Boxes page without a digest")
    if not (1 <= msg.pages <= MAX_BOX_PAGES) or not (0 <= msg.page < msg.pages):
        raise ProtocolError(f"Boxes page {msg.page} of {msg.pages} (at most {MAX_BOX_PAGES} pages)")
    if len(msg.entries) > MAX_BOX_ENTRIES:
        raise ProtocolError(f"Boxes page has {len(msg.entries)} entries (limit {MAX_BOX_ENTRIES})")
    for e in msg.entries:
        if not e.name or len(e.name) > MAX_NAME_LEN:
            raise ProtocolError(f"Boxes entry name of length {len(e.name)} is empty or over {MAX_NAME_LEN}")
        if len(e.offsets) != len(e.sizes) or len(e.sizes) > MAX_NDIM:
            raise ProtocolError(f"Boxes entry {e.name[:120]!r}: {len(e.offsets)} offsets, {len(e.sizes)} sizes")
        if any(o < 0 for o in e.offsets) or any(n < 1 for n in e.sizes):
            raise ProtocolError(f"Boxes entry {e.name[:120]!r}: a negative offset or an empty size")


def check_layout_digest(digest: str) -> None:
    """Empty (no layout), or `LAYOUT_DIGEST_LEN` lower-case hex digits (what `protocol/layout.py` computes)."""
    if digest and (len(digest) != LAYOUT_DIGEST_LEN or digest.strip("0123456789abcdef")):
        raise ProtocolError(f"layout digest {digest[:80]!r} is not {LAYOUT_DIGEST_LEN} lower-case hex digits")


def check_tensor(name: str, shape: Sequence[int], dtype: str) -> int:
    """The rules every tensor on the wire obeys, on both sides: the sender checks each tensor
    before it sends it (and fails the version naming it), a receiver checks each entry it decodes.
    Returns the tensor's size in bytes."""
    if not name or len(name) > MAX_NAME_LEN:
        raise ProtocolError(
            f"tensor name {name[:80]!r}{'...' if len(name) > 80 else ''} of length {len(name)} is empty or over "
            f"{MAX_NAME_LEN} characters (the wire limit)"
        )
    if dtype not in DTYPES:
        raise ProtocolError(f"dtype {dtype!r} of {name!r} is not in the allow-list ({', '.join(DTYPES)})")
    if len(shape) > MAX_NDIM or any(d < 0 for d in shape):
        raise ProtocolError(
            f"shape {list(shape)} of {name!r} is invalid (at most MAX_NDIM={MAX_NDIM} dims, none negative)"
        )
    nbytes = math.prod(shape) * itemsize(DTYPES[dtype])
    if nbytes > MAX_TENSOR_BYTES:
        raise ProtocolError(f"{name!r} declares {nbytes} bytes (limit {MAX_TENSOR_BYTES}); refusing to allocate")
    # An empty tensor is 0 bytes whatever its other dims, but torch still computes its strides from
    # them: shape [0, 2**62, 2**62] would pass the byte limit and then fail inside torch.empty
    # ("Stride calculation overflowed") on the receiver. The non-zero dims obey the same limit.
    if nbytes == 0 and math.prod(d for d in shape if d) * itemsize(DTYPES[dtype]) > MAX_TENSOR_BYTES:
        raise ProtocolError(f"empty tensor {name!r} declares absurd dims {list(shape)}; refusing to allocate")
    return nbytes


def _check_nonneg(what: str, value: int) -> None:
    if value < 0:
        raise ProtocolError(f"{what}={value} is negative")


def validate(msg: Message, *, bucket_size: int | None = None) -> None:
    """Range checks that the type schema cannot express."""
    if hasattr(msg, "version"):
        _check_nonneg("version", msg.version)
    _check_text("identity", getattr(msg, "identity", None), MAX_IDENTITY_LEN)
    for attr in ("host", "device", "reason", "error", "backend", "store_host", "session"):
        _check_text(attr, getattr(msg, attr, None))
    if isinstance(msg, Plan):
        validate_group(msg.group)
        if not (0 <= msg.rank < msg.group.world_size):
            raise ProtocolError(f"rank {msg.rank} not in world of size {msg.group.world_size}")
        validate_senders(msg.senders)
        check_layout_digest(msg.contract)
    elif isinstance(msg, BucketMeta):
        validate_bucket(msg, bucket_size)
    elif isinstance(msg, BucketDone):
        _check_nonneg("bucket_index", msg.bucket_index)
    else:
        _validate_control(msg)


def validate_senders(senders: Sequence[SenderAddress]) -> None:
    """A plan's other senders: bounded count, real ports, hosts of bounded length, none listed twice."""
    if len(senders) > MAX_SENDERS:
        raise ProtocolError(f"plan lists {len(senders)} other senders (limit {MAX_SENDERS})")
    for address in senders:
        _check_text("sender host", address.host, 256)
        if not address.host or not (1 <= address.port <= 65535):
            raise ProtocolError(f"plan has a bad sender address {address.host[:256]!r}:{address.port}")
    if len({(a.host, a.port) for a in senders}) != len(senders):
        raise ProtocolError("plan lists a sender twice")


def validate_group(group: GroupSpec) -> None:
    """A plan's group: bounded texts and counts, ports and ids in range, no member twice."""
    _check_text("session", group.session)
    _check_text("backend", group.backend, 64)
    _check_nonneg("generation", group.generation)
    if not (1 <= group.bucket_size <= MAX_TENSOR_BYTES):
        raise ProtocolError(f"plan bucket_size={group.bucket_size} is not in [1, {MAX_TENSOR_BYTES}]")
    if len(group.members) > MAX_MEMBERS:
        raise ProtocolError(f"plan lists {len(group.members)} members (limit {MAX_MEMBERS})")
    for member in group.members:
        if not member.identity:
            raise ProtocolError("plan lists a member with an empty identity")
        _check_text("member identity", member.identity, MAX_IDENTITY_LEN)
        _check_nonneg("member pid", member.pid)
    if len({m.identity for m in group.members}) != len(group.members):
        raise ProtocolError("plan lists a member twice")
    if not isinstance(group.join, JoinSpec):  # the union holds only JoinSpec kinds: a bug if not
        raise ProtocolError(f"plan has join fields of an unknown kind {type(group.join).__name__}")
    group.join.validate()


def validate_bucket(msg: BucketMeta, bucket_size: int | None) -> None:
    _check_nonneg("bucket_index", msg.bucket_index)
    _check_nonneg("bucket nbytes", msg.nbytes)
    if not (0 <= msg.sender <= MAX_SENDERS):
        raise ProtocolError(f"bucket from sender {msg.sender} (at most {MAX_SENDERS} other senders)")
    if bucket_size is not None and msg.nbytes > bucket_size:
        raise ProtocolError(f"bucket declares {msg.nbytes} bytes > bucket_size {bucket_size}")
    check_layout_digest(msg.layout)
    if msg.layout and msg.entries:
        raise ProtocolError(f"bucket {msg.bucket_index} names a held layout and carries {len(msg.entries)} entries")
    if len(msg.entries) > MAX_BUCKET_ENTRIES:
        raise ProtocolError(f"bucket has {len(msg.entries)} entries (limit MAX_BUCKET_ENTRIES={MAX_BUCKET_ENTRIES})")
    for e in msg.entries:
        nbytes = check_tensor(e.name, e.shape, e.dtype)
        if e.box:
            nbytes = _box_bytes(e)
        if e.chunk_offset < 0 or e.chunk_size < 0 or e.chunk_offset + e.chunk_size > nbytes:
            raise ProtocolError(f"chunk [{e.chunk_offset}, +{e.chunk_size}) of {e.name!r} outside {nbytes} bytes")
        if e.offset < 0 or e.offset + e.chunk_size > msg.nbytes:
            raise ProtocolError(
                f"chunk of {e.name!r} at bucket offset {e.offset} (+{e.chunk_size}) outside the "
                f"bucket's {msg.nbytes} bytes"
            )
    validate_tied(msg)
    if msg.lora is not None:
        if msg.bucket_index != 0:
            raise ProtocolError(f"bucket {msg.bucket_index} carries a LoRA spec; only bucket 0 may")
        validate_lora(msg.lora)
    if not msg.layout:  # a bucket of a held layout: checked against its entries once they are known (layout.py)
        validate_per_entry(msg)


def _box_bytes(e: Entry) -> int:
    """The bytes of an entry's box (inside its tensor, of its rank): what its chunks count in."""
    box = e.the_box
    if len(e.box) != 2 * len(e.shape) or box is None:
        raise ProtocolError(f"entry {e.name[:120]!r} has a box of {len(e.box)} numbers for {len(e.shape)} dims")
    check_boxes(e.name[:120], e.shape, [box])
    return box.numel * itemsize(DTYPES[e.dtype])


def validate_per_entry(msg: BucketMeta) -> None:
    """What a version says of each entry of its bucket (fingerprints, delta sizes and ranges)."""
    validate_fingerprints(msg)
    validate_deltas(msg)
    validate_delta_ranges(msg)


def validate_lora(spec: LoraSpec) -> None:
    """A LoRA spec's ranges: a known mode and bias, a rank and alpha in range, a dropout in [0, 1), names
    bounded like tensor names. Whether it fits the rollout's model is the sink's check."""
    if spec.mode not in LORA_MODES:
        raise ProtocolError(f"LoRA mode {spec.mode[:32]!r} is not one of {', '.join(LORA_MODES)}")
    if spec.bias not in LORA_BIASES:
        raise ProtocolError(f"LoRA bias {spec.bias[:32]!r} is not one of {', '.join(LORA_BIASES)}")
    ranks = [spec.r, *spec.rank_pattern.values()]
    if any(not (1 <= r <= MAX_LORA_RANK) for r in ranks):
        raise ProtocolError(f"LoRA rank out of [1, {MAX_LORA_RANK}]: {ranks[:4]}")
    alphas = [spec.lora_alpha, *spec.alpha_pattern.values()]
    if any(not math.isfinite(a) or a <= 0 for a in alphas):
        raise ProtocolError(f"LoRA alpha not a positive finite number: {alphas[:4]}")
    if not (0.0 <= spec.lora_dropout < 1.0):
        raise ProtocolError(f"LoRA dropout {spec.lora_dropout} is not in [0, 1)")
    targets = [spec.target_modules] if isinstance(spec.target_modules, str) else spec.target_modules
    names = [*targets, *spec.modules_to_save, *spec.rank_pattern, *spec.alpha_pattern]
    if len(names) > MAX_LORA_NAMES:
        raise ProtocolError(f"LoRA spec lists {len(names)} names (limit {MAX_LORA_NAMES})")
    for name in names:
        if not name or len(name) > MAX_NAME_LEN:
            raise ProtocolError(f"LoRA spec name of length {len(name)} is empty or over {MAX_NAME_LEN}")
    _check_text("LoRA task_type", spec.task_type, 64)


def validate_deltas(msg: BucketMeta) -> None:
    """None, or one per entry: -1 (whole), or a payload smaller than the tensor that holds the entry's chunk;
    a bucket with a delta names an earlier version as its base."""
    if not msg.deltas:
        return
    if len(msg.deltas) != len(msg.entries):
        raise ProtocolError(f"bucket has {len(msg.deltas)} delta sizes for {len(msg.entries)} entries")
    for e, size in zip(msg.entries, msg.deltas, strict=True):
        if size == -1:
            continue
        if e.box:
            raise ProtocolError(f"entry {e.name[:120]!r} is a box and a delta: a box goes whole")
        nbytes = check_tensor(e.name, e.shape, e.dtype)
        if not (0 < size < nbytes) or e.chunk_offset + e.chunk_size > size:
            raise ProtocolError(
                f"delta payload of {size} bytes for {e.name!r} ({nbytes} bytes), or its chunk, is out of range"
            )
        if not (0 <= msg.delta_base < msg.version):
            raise ProtocolError(f"delta of version {msg.version} based on version {msg.delta_base}")


def validate_delta_ranges(msg: BucketMeta) -> None:
    """None, or one per entry: `[0, 0]` for a whole entry, else whole elements inside the tensor, more bytes
    than the delta payload that rebuilds them (a delta is only sent when smaller)."""
    if not msg.delta_ranges:
        return
    if len(msg.delta_ranges) != len(msg.entries) or not msg.deltas:
        raise ProtocolError(f"bucket has {len(msg.delta_ranges)} delta ranges for {len(msg.entries)} entries")
    for e, size, (start, length) in zip(msg.entries, msg.deltas, msg.delta_ranges, strict=True):
        if size == -1:
            if (start, length) != (0, 0):
                raise ProtocolError(f"entry {e.name!r} is no delta but names a delta range [{start}, +{length})")
            continue
        nbytes, width = check_tensor(e.name, e.shape, e.dtype), itemsize(DTYPES[e.dtype])
        if start < 0 or length <= size or start + length > nbytes or start % width or length % width:
            raise ProtocolError(
                f"delta range [{start}, +{length}) of {e.name!r} ({nbytes} bytes) is out of range, not whole "
                f"elements, or not larger than its {size}-byte payload"
            )


def validate_fingerprints(msg: BucketMeta) -> None:
    """None, or exactly one per entry, each an unsigned 64-bit value or `NO_FINGERPRINT`."""
    if not msg.fingerprints:
        return
    if len(msg.fingerprints) != len(msg.entries):
        raise ProtocolError(f"bucket has {len(msg.fingerprints)} fingerprints for {len(msg.entries)} entries")
    for value in msg.fingerprints:
        if not (NO_FINGERPRINT <= value <= MASK):
            raise ProtocolError(f"fingerprint {value} is not a 64-bit unsigned value (or {NO_FINGERPRINT}: none)")


def validate_tied(msg: BucketMeta) -> None:
    """`tied` names are checked like tensor names; only bucket 0 may carry them, an alias is never
    also sent or aliased twice, and the whole list is bounded like a bucket's entries."""
    if not msg.tied:
        return
    if msg.bucket_index != 0:
        raise ProtocolError(f"bucket {msg.bucket_index} carries tied names; only bucket 0 may")
    if len(msg.tied) + sum(len(a) for a in msg.tied.values()) > MAX_TIED_NAMES:
        raise ProtocolError(f"tied names exceed MAX_TIED_NAMES={MAX_TIED_NAMES}")
    for source, aliases in msg.tied.items():
        for name in (source, *aliases):
            if not name or len(name) > MAX_NAME_LEN:
                raise ProtocolError(f"tied name of length {len(name)} is empty or over {MAX_NAME_LEN}")
    twice = alias_sent_twice(msg.tied)
    if twice is not None:
        raise ProtocolError(f"tied name {twice!r} is sent or aliased twice")


def alias_sent_twice(tied: Mapping[str, Sequence[str]]) -> str | None:
    """The first alias that is also sent, or aliased twice (it would make a version's content
    ambiguous), or None; the one rule for the wire (`validate_tied`) and for the sinks."""
    seen: set[str] = set()
    for source, aliases in tied.items():
        for alias in aliases:
            if alias in seen or alias in tied or alias == source:
                return alias
            seen.add(alias)
    return None


# -- the largest legal frame, each way (ZeroMQ's MAXMSGSIZE: transport/sockets.py) ---------------------
# Upper bounds of the msgpack encoding, from the limits above: a text of n characters is at most 4n
# bytes of UTF-8 plus a 5-byte header; an int at most 9 bytes; a struct's keys and tag fit in
# _STRUCT_BYTES (protocol/limits.py); each join kind counts its own (`MAX_BYTES`).
# tests/unit/test_messages.py builds the largest legal message of every kind and checks it fits, so a
# new field or limit that is not counted here fails there.


def _entry_bytes() -> int:
    dtype = max(len(name) for name in DTYPES)
    box = 5 + 2 * MAX_NDIM * _INT_BYTES
    return 5 + _text_bytes(MAX_NAME_LEN) + 5 + MAX_NDIM * _INT_BYTES + _text_bytes(dtype) + 3 * _INT_BYTES + box


def _to_receiver_bytes() -> int:
    """Sender -> receiver: bucket metadata (entries and tied names bounded) and the plan dominate."""
    tied = 5 + MAX_TIED_NAMES * (_text_bytes(MAX_NAME_LEN) + 5)
    per_entry = 2 * (5 + MAX_BUCKET_ENTRIES * _INT_BYTES) + _INT_BYTES  # fingerprints, deltas, delta_base
    per_entry += 5 + MAX_BUCKET_ENTRIES * (1 + 2 * _INT_BYTES)  # delta_ranges
    lora = _STRUCT_BYTES + 5 * (_text_bytes(16) + _INT_BYTES) + 4 * 5 + MAX_LORA_NAMES * (_text_bytes(MAX_NAME_LEN) + 9)
    bucket = 5 * _INT_BYTES + 5 + MAX_BUCKET_ENTRIES * _entry_bytes() + tied + per_entry + lora
    bucket += _text_bytes(LAYOUT_DIGEST_LEN)  # layout
    joins = [kind.MAX_BYTES for kind in _JOIN_KINDS]  # every kind the union holds
    members = 5 + MAX_MEMBERS * (5 + _text_bytes(MAX_IDENTITY_LEN) + _INT_BYTES)
    senders = 5 + MAX_SENDERS * (5 + _text_bytes(256) + _INT_BYTES)
    plan = 2 * _INT_BYTES + _text_bytes(MAX_TEXT_LEN) + _text_bytes(64) + 2 * _INT_BYTES + members + max(joins)
    plan += senders + 2 * _text_bytes(LAYOUT_DIGEST_LEN) + _text_bytes(MAX_TEXT_LEN)
    text = _text_bytes(MAX_IDENTITY_LEN) + _text_bytes(MAX_TEXT_LEN) + _text_bytes(MAX_TEXT_LEN) + _text_bytes(256)
    store = 2 * _INT_BYTES + MAX_STORE_VALUE_LEN + 5
    return max(bucket, plan + _STRUCT_BYTES, text, store) + _STRUCT_BYTES


def _to_sender_bytes() -> int:
    """Receiver -> sender: registrations, acks (an error text) and rendezvous requests (a value)."""
    register = _text_bytes(MAX_IDENTITY_LEN) + 2 * _text_bytes(MAX_TEXT_LEN) + 2 * _text_bytes(256) + 3 * _INT_BYTES
    ack = _text_bytes(MAX_IDENTITY_LEN) + _INT_BYTES + 1 + _text_bytes(MAX_TEXT_LEN)
    store = _text_bytes(MAX_IDENTITY_LEN) + _INT_BYTES + _text_bytes(8) + _text_bytes(MAX_STORE_KEY_LEN)
    store += MAX_STORE_VALUE_LEN + 5
    ready = _text_bytes(MAX_IDENTITY_LEN) + 3 * _INT_BYTES + 2 * _text_bytes(LAYOUT_DIGEST_LEN)
    boxes = BOXES_PAGE_BYTES  # packed to it by its sender (protocol/declare.py); the frame limit holds the rest
    ready += _text_bytes(LAYOUT_DIGEST_LEN)  # its contract's digest
    contract = _text_bytes(MAX_IDENTITY_LEN) + _text_bytes(LAYOUT_DIGEST_LEN) + CONTRACT_BYTES + 5
    return max(register, ack, store, ready, boxes, contract) + _STRUCT_BYTES


_SEAL_BYTES = 5 + _text_bytes(MAX_TEXT_LEN) + 2 * _text_bytes(256) + _INT_BYTES + 1
MAX_FRAME_TO_SENDER = max(MAC_LEN, _SEAL_BYTES, _to_sender_bytes())
"""The largest frame a sender (and a shm / nixl release socket) receives from a legal peer."""
MAX_FRAME_TO_RECEIVER = max(MAC_LEN, _SEAL_BYTES, _to_receiver_bytes())
"""The largest frame a receiver receives from a legal sender."""


def max_frame_bytes(*, to_sender: bool) -> int:
    """`ZMQ_MAXMSGSIZE` for a socket receiving messages sent the given way (each frame is checked)."""
    return MAX_FRAME_TO_SENDER if to_sender else MAX_FRAME_TO_RECEIVER
