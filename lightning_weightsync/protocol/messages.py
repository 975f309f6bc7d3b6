"""Control-plane messages: schema, encoding, signing and validation. No pickle, ever.

Every message is a msgspec Struct encoded as msgpack. `decode()` is the only way bytes from the
network become objects: it checks the HMAC (when a token is configured), decodes into the closed
set of message types below (anything else is rejected by msgspec, not executed), then validates
ranges (dtype allow-list, non-negative shapes, chunk and bucket offsets in range, bounded names).
Whatever goes wrong, it raises `ProtocolError` and nothing else.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from typing import Union

import msgspec

from ..errors import ProtocolError
from .chunks import TensorMeta
from .dtypes import DTYPES, dtype_from_name, dtype_name, itemsize

MAX_NAME_LEN = 1024
MAX_NDIM = 16
MAX_ENTRIES = 1_000_000
MAX_TEXT_LEN = 4096
MAX_TENSOR_BYTES = 1 << 40  # 1 TiB: larger than any real weight, small enough to refuse absurd shapes
MAC_LEN = 32
PROTOCOL_VERSION = 1


class Entry(msgspec.Struct, array_like=True, frozen=True):
    """One chunk in a bucket (the wire form of `TensorMeta`)."""

    name: str
    shape: list[int]
    dtype: str
    chunk_offset: int
    chunk_size: int
    offset: int

    @classmethod
    def from_meta(cls, meta: TensorMeta) -> Entry:
        assert meta.offset is not None, "chunk has no bucket offset"
        return cls(meta.name, list(meta.shape), dtype_name(meta.dtype), meta.chunk_offset, meta.chunk_size, meta.offset)

    def to_meta(self) -> TensorMeta:
        return TensorMeta(
            self.name, tuple(self.shape), dtype_from_name(self.dtype), self.chunk_offset, self.chunk_size, self.offset
        )


class Register(msgspec.Struct, tag="register", frozen=True):
    """Receiver -> sender, on start and every heartbeat interval while idle."""

    identity: str
    host: str
    pid: int
    device: str
    last_version: int = -1
    protocol: int = PROTOCOL_VERSION


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


class Plan(msgspec.Struct, tag="plan", frozen=True):
    """Sender -> receiver: your rank, and how to join the data-plane group for this version."""

    version: int
    session: str
    generation: int
    rank: int
    world_size: int
    backend: str
    bucket_size: int
    store_host: str
    store_port: int
    info: dict[str, str] = {}


class BucketMeta(msgspec.Struct, tag="bucket", frozen=True):
    """Sender -> receiver: what the next broadcast bucket holds."""

    version: int
    bucket_index: int
    is_last: bool
    nbytes: int
    entries: list[Entry]


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


Message = Union[Register, Prepare, Ready, Plan, BucketMeta, BucketDone, Ack, Abort, Bye]  # noqa: UP007

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def sign(body: bytes, key: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest()


def encode(msg: Message, key: bytes | None = None) -> list[bytes]:
    """Frames to send: `[body]`, or `[mac, body]` when a key is configured."""
    body = _encoder.encode(msg)
    return [sign(body, key), body] if key else [body]


def decode(frames: list[bytes], key: bytes | None = None, *, bucket_size: int | None = None) -> Message:
    """Authenticate, decode and validate one message; raises only `ProtocolError`."""
    try:
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
    except ProtocolError:
        raise
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed control message: {exc}") from None
    except Exception as exc:  # anything else from hostile bytes is still a protocol error
        raise ProtocolError(f"malformed control message: {type(exc).__name__}: {exc}") from None


def _check_text(what: str, value: str | None, limit: int = MAX_TEXT_LEN) -> None:
    if value is not None and len(value) > limit:
        raise ProtocolError(f"{what} is {len(value)} characters long (limit {limit})")


def _check_nonneg(what: str, value: int) -> None:
    if value < 0:
        raise ProtocolError(f"{what}={value} is negative")


def validate(msg: Message, *, bucket_size: int | None = None) -> None:
    """Range checks that the type schema cannot express."""
    if hasattr(msg, "version"):
        _check_nonneg("version", msg.version)
    for attr in ("identity", "host", "device", "reason", "error", "backend", "store_host", "session"):
        _check_text(attr, getattr(msg, attr, None))
    if isinstance(msg, Plan):
        if not (0 <= msg.rank < msg.world_size):
            raise ProtocolError(f"rank {msg.rank} not in world of size {msg.world_size}")
        if msg.bucket_size < 1 or not (0 <= msg.store_port <= 65535):
            raise ProtocolError("plan has a non-positive bucket_size or a bad store_port")
        for k, v in msg.info.items():
            _check_text("plan info key", k, 256)
            _check_text("plan info value", v)
    elif isinstance(msg, BucketMeta):
        validate_bucket(msg, bucket_size)
    elif isinstance(msg, BucketDone):
        _check_nonneg("bucket_index", msg.bucket_index)


def validate_bucket(msg: BucketMeta, bucket_size: int | None) -> None:
    _check_nonneg("bucket_index", msg.bucket_index)
    _check_nonneg("bucket nbytes", msg.nbytes)
    if bucket_size is not None and msg.nbytes > bucket_size:
        raise ProtocolError(f"bucket declares {msg.nbytes} bytes > bucket_size {bucket_size}")
    if len(msg.entries) > MAX_ENTRIES:
        raise ProtocolError(f"bucket has {len(msg.entries)} entries (limit {MAX_ENTRIES})")
    for e in msg.entries:
        if not e.name or len(e.name) > MAX_NAME_LEN:
            raise ProtocolError(f"tensor name of length {len(e.name)} is empty or over {MAX_NAME_LEN}")
        if e.dtype not in DTYPES:
            raise ProtocolError(f"dtype {e.dtype!r} of {e.name!r} is not in the allow-list")
        if len(e.shape) > MAX_NDIM or any(d < 0 for d in e.shape):
            raise ProtocolError(f"shape {e.shape} of {e.name!r} is invalid")
        nbytes = math.prod(e.shape) * itemsize(DTYPES[e.dtype])
        if nbytes > MAX_TENSOR_BYTES:
            raise ProtocolError(f"{e.name!r} declares {nbytes} bytes (limit {MAX_TENSOR_BYTES}); refusing to allocate")
        if e.chunk_offset < 0 or e.chunk_size < 0 or e.chunk_offset + e.chunk_size > nbytes:
            raise ProtocolError(f"chunk [{e.chunk_offset}, +{e.chunk_size}) of {e.name!r} outside {nbytes} bytes")
        if e.offset < 0 or e.offset + e.chunk_size > msg.nbytes:
            raise ProtocolError(
                f"chunk of {e.name!r} at bucket offset {e.offset} (+{e.chunk_size}) outside the "
                f"bucket's {msg.nbytes} bytes"
            )
