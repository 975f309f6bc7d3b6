"""ZeroMQ control plane: registration, liveness, group formation, rendezvous, and message transport.

One ROUTER socket on the sender, one DEALER per receiver (reliable, per-peer ordered, no
slow-joiner losses as with PUB/SUB). Receivers register on start and re-register every heartbeat
interval while idle, so a restarted trainer learns about them again without any action. Liveness
is checked when it matters: at the start of every version the sender sends `Prepare` to every
registered receiver and forms the group from those that answer `Ready` in time.

Security, with `transport.auth_token` set (docs/security.md has the threat model):
- CURVE (libsodium, in pyzmq's wheels): both sides derive their key pairs from the token, and the
  sender's ZAP handler admits only the token-derived client key, so a peer without the token never
  completes a handshake: it can neither send a message nor receive one.
- Every message is also signed (HMAC-SHA256) and sealed (`protocol.messages.Seal`): bound to the
  sender session, with a per-origin sequence number; a copy from another run, another session or
  an earlier point of this one is rejected and counted (`replayed_messages`).
- Identities are application-level: the ROUTER assigns connection ids (no ROUTER_HANDOVER), the
  sender binds a receiver's identity to the connection that registered it, and refuses (with a
  `Refuse` the receiver logs and reports) a second registration under an identity whose connection
  is still up. "Up" is asked of ZeroMQ itself: an empty probe frame to the old connection, which
  ROUTER_MANDATORY refuses once the connection is gone (ZMQ_ROUTER_NOTIFY is a draft API, absent
  from the wheels); ZMTP heartbeats bound how long a dead link stays up.

Every received frame goes through `unseal` / `decode` (signature, schema, ranges); bad messages are
counted and dropped, never acted upon, and logged at most once per `DROP_LOG_INTERVAL_S` with a count.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import hmac
import logging
import math
import os
import secrets
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import zmq
import zmq.asyncio
from zmq.utils import z85

from ..errors import ConfigError, PeerError, ProtocolError, VersionAborted, WeightSyncError, WeightSyncTimeout
from ..protocol.messages import (
    Abort,
    Ack,
    BucketDone,
    BucketMeta,
    Bye,
    Message,
    Plan,
    Prepare,
    Ready,
    Refuse,
    Register,
    Seal,
    StoreReply,
    StoreRequest,
    decode,
    encode,
    seal,
    unseal,
)
from .rendezvous import ControlPlaneStore

logger = logging.getLogger(__name__)
PUMP_EVERY_S = 0.02  # while a version streams, the sender reads its socket at most this often
PROGRESS_AFTER_S = 0.05  # a receiver waiting this long for a bucket's metadata tells the sender where it is

DROP_LOG_INTERVAL_S = 10.0  # at most one WARNING line per side and interval for dropped messages
LINK_HEARTBEAT_MS = 1000  # ZMTP pings on every control connection ...
LINK_TIMEOUT_MS = 6000  # ... and a peer silent this long is disconnected (its identity freed)
MAX_TRACKED_ORIGINS = 4096  # receiver instances whose last seq the sender remembers
MAX_STORE_KEYS = 65536  # rendezvous keys a sender session holds at most
MAX_KEPT = 65536  # messages the sender keeps for its next `recv` while a version streams
STORE_POLL_S = 0.01


def endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


# -- CURVE keys from the shared token ----------------------------------------------------------------
@dataclass(frozen=True)
class CurveKeys:
    """Z85 key pairs of the two roles, derived from the token (HMAC-SHA256 with a per-role label;
    every 32-byte string is a valid Curve25519 secret). All receivers share the client pair: CURVE
    proves "holds the token"; which receiver is which is the control plane's bookkeeping."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def curve_keys(token: bytes) -> CurveKeys:
    if not zmq.has("curve"):
        raise ConfigError(
            "transport.auth_token is set but this pyzmq/libzmq has no CURVE support; "
            "install the pyzmq wheel (it bundles libsodium) or unset transport.auth_token"
        )

    def pair(label: bytes) -> tuple[bytes, bytes]:
        secret = z85.encode(hmac.new(token, b"lightning-weightsync curve " + label, hashlib.sha256).digest())
        return zmq.curve_public(secret), secret

    sp, ss = pair(b"server")
    cp, cs = pair(b"client")
    return CurveKeys(sp, ss, cp, cs)


class _TokenHolders:
    """ZAP credentials provider: admits exactly the token-derived client key."""

    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public
        self.rejected = 0

    def callback(self, domain: str, key: bytes) -> bool:
        ok = hmac.compare_digest(key, self.client_public)
        if not ok:
            self.rejected += 1
        return ok


def _link_options(sock: zmq.Socket[Any], host: str) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, LINK_HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, LINK_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, LINK_TIMEOUT_MS)
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)


def _resolve(host: str) -> None:
    """Fail with the knob when `transport.host` names nothing (ZeroMQ would only say 'No such device')."""
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(
            f"transport.host={host!r} does not resolve ({exc}); set transport.host to the sender's address or a "
            "name this machine can resolve"
        ) from None


class _DropLog:
    """Dropped-message reporting that a flood cannot turn into a log flood: the first drop is a
    WARNING, later ones are counted and summarised in at most one line every `interval_s`."""

    def __init__(self, what: str, interval_s: float = DROP_LOG_INTERVAL_S) -> None:
        self.what, self.interval_s = what, interval_s
        self._last = -math.inf
        self._unreported = 0

    def note(self, peer: str, reason: object) -> None:
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            more = f" (and {self._unreported} more since the last report)" if self._unreported else ""
            logger.warning("%s from %s: %s%s", self.what, peer, reason, more)
            self._last, self._unreported = now, 0
        else:
            self._unreported += 1
            logger.debug("%s from %s: %s", self.what, peer, reason)


class _Replay(ProtocolError):
    """A correctly signed message that is not fresh (another session, or a seq already seen)."""


@dataclass
class Peer:
    identity: str
    host: str
    pid: int
    device: str
    last_version: int
    last_seen: float
    group_generation: int = -1  # as reported in the peer's last `Ready`
    route: bytes = b""  # the ROUTER's id of the connection that registered this identity
    instance: str = ""  # the receiver process's random id (a reconnect keeps it)
    nonce: str = ""  # from its latest `Register`, echoed in `Prepare`

    @property
    def key(self) -> tuple[str, int]:
        """Same identity but another pid means a restarted receiver: its old group is gone."""
        return (self.identity, self.pid)


class SenderControl:
    """The sender's side: knows the registered receivers and talks to each of them."""

    def __init__(
        self, host: str, port: int, key: bytes | None, bucket_size: int, *, session: str | None = None
    ) -> None:
        self.host, self.requested_port, self.key, self.bucket_size = host, port, key, bucket_size
        self.port = port
        self.session = session or secrets.token_hex(8)
        self.peers: dict[str, Peer] = {}
        self._dropped = 0
        self._failed_handshakes = 0
        self._monitor: zmq.Socket[Any] | None = None
        self.replayed_messages = 0
        self.refused_registrations = 0
        self.progress: dict[str, tuple[int, int]] = {}  # identity -> (version, last bucket received)
        self.members_in_flight: list[str] = []  # receivers of the version being sent
        self._routes: dict[bytes, str] = {}  # connection -> the identity it registered
        self._former: dict[str, bytes] = {}  # identity -> its last connection (an Abort may still reach it)
        self._seqs: OrderedDict[str, int] = OrderedDict()  # receiver instance -> last seq accepted
        self._seq = 0
        self._kept: list[tuple[str, Message]] = []  # read by `_pump` while streaming, for the next `recv`
        self._pumped_at = 0.0
        self._store: dist.HashStore | None = None
        self._drops = _DropLog("dropped a control message")
        self._refusals = _DropLog("refused a registration")
        self._zap: _TokenHolders | None = None
        self._auth: Any = None
        self._sync_ctx: zmq.Context[Any] | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None

    @property
    def address(self) -> str:
        return endpoint(self.host, self.port)

    @property
    def rejected_handshakes(self) -> int:
        """Connections refused before any message: a CURVE handshake that failed (another token, or
        none) or presented a key other than the token's."""
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                while True:
                    self._monitor.recv_multipart(flags=zmq.NOBLOCK)
                    self._failed_handshakes += 1
        return self._failed_handshakes + (self._zap.rejected if self._zap is not None else 0)

    @property
    def dropped_messages(self) -> int:
        """Messages dropped as malformed, unauthenticated or replayed, and refused handshakes."""
        return self._dropped + self.rejected_handshakes

    async def start(self) -> None:
        _resolve(self.host)
        self._sync_ctx = zmq.Context()
        # one libzmq context for the socket and the ZAP handler thread (ZAP is per context)
        self._ctx = zmq.asyncio.Context.shadow(self._sync_ctx.underlying)
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished peer raises instead of dropping
        sock.setsockopt(zmq.ROUTER_HANDOVER, 0)  # a connection never takes over another's id
        _link_options(sock, self.host)
        if self.key:
            from zmq.auth.thread import ThreadAuthenticator

            keys = curve_keys(self.key)
            self._zap = _TokenHolders(keys.client_public)
            self._auth = ThreadAuthenticator(self._sync_ctx, log=logging.getLogger(__name__ + ".zap"))
            self._auth.start()
            self._auth.configure_curve_callback("*", credentials_provider=self._zap)
            sock.curve_server = True
            sock.curve_secretkey = keys.server_secret
            sock.curve_publickey = keys.server_public
            failed = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            monitor = sock.get_monitor_socket(failed | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
            self._monitor = zmq.Socket.shadow(monitor.underlying)
            self._monitor_async = monitor
        try:
            if self.requested_port == 0:
                self.port = sock.bind_to_random_port(endpoint(self.host, 0).rsplit(":", 1)[0])
            else:
                sock.bind(endpoint(self.host, self.requested_port))
        except zmq.ZMQError as exc:
            sock.close()
            await self.close()
            where = endpoint(self.host, self.requested_port)
            if exc.errno == errno.EADDRINUSE:
                fix = f"port {self.requested_port} is in use; set transport.port to a free port (0 lets the OS choose)"
            else:
                fix = f"set transport.host to an address of this machine (got {self.host!r})"
            raise ConfigError(f"cannot bind the control socket on {where}: {exc}; {fix}") from None
        self._sock = sock
        logger.info(
            "weight sender control plane listening on %s (%s)", self.address, "CURVE + signed" if self.key else "open"
        )

    async def close(self) -> None:
        if self._monitor is not None:
            self._sock.disable_monitor() if self._sock is not None else None
            self._monitor_async.close(linger=0)
            self._monitor = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._ctx is not None:
            self._ctx = None
        if self._sync_ctx is not None:
            self._sync_ctx.term()
            self._sync_ctx = None

    # -- transport ----------------------------------------------------------------------------
    def _frames(self, msg: Message) -> list[bytes]:
        if not self.key:
            return encode(msg)
        self._seq += 1
        return seal(msg, self.key, Seal(self.session, self.session, self._seq, False))

    async def _send_route(self, route: bytes, msg: Message, who: str) -> None:
        assert self._sock is not None, "call start() first"
        try:
            await self._sock.send_multipart([route, *self._frames(msg)])
        except zmq.ZMQError as exc:
            raise PeerError(f"receiver {who!r} is unreachable ({exc})") from None

    async def send(self, identity: str, msg: Message) -> None:
        peer = self.peers.get(identity)
        route = peer.route if peer is not None else self._former.get(identity)
        if route is None:
            raise PeerError(f"receiver {identity!r} is not connected")
        await self._send_route(route, msg, identity)

    def route_of(self, identity: str) -> bytes:
        """The connection id a registered receiver talks from (tests inject frames through it)."""
        return self.peers[identity].route

    async def recv(self, timeout_s: float) -> tuple[str, Message] | None:
        """One valid message, or None when `timeout_s` passed; bad messages are dropped."""
        assert self._sock is not None, "call start() first"
        if self._kept:
            return self._kept.pop(0)
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not await self._sock.poll(max(1, int(left * 1000))):
                return None
            got = await self._read_one()
            if got is not None:
                return got

    async def _read_one(self) -> tuple[str, Message] | None:
        """Read, check and book-keep one message; returns it if the caller should see it."""
        assert self._sock is not None
        frames = await self._sock.recv_multipart()
        route = frames[0]
        try:
            msg, envelope = self._open(frames[1:])
            self._admit(route, msg, envelope)
        except ProtocolError as exc:
            self._dropped += 1
            if isinstance(exc, _Replay):
                self.replayed_messages += 1
            self._drops.note(self._routes.get(route, f"connection {route.hex()}"), exc)
            return None
        if envelope is not None:
            self._seqs[envelope.origin] = envelope.seq
            self._seqs.move_to_end(envelope.origin)
            while len(self._seqs) > MAX_TRACKED_ORIGINS:
                self._seqs.popitem(last=False)
        if await self._track(route, msg, envelope):
            return self._routes[route], msg
        return None

    async def _pump(self) -> None:
        """While a version streams nobody calls `recv`: read what arrived (progress reports,
        registrations) without waiting, so receivers' queues never fill up and drop an Ack; what
        a caller should see is kept for its next `recv`."""
        assert self._sock is not None
        for _ in range(1000):
            if len(self._kept) >= MAX_KEPT or not await self._sock.poll(0):
                return
            got = await self._read_one()
            if got is not None:
                self._kept.append(got)

    def _open(self, frames: list[bytes]) -> tuple[Message, Seal | None]:
        if not self.key:
            return decode(frames, None, bucket_size=self.bucket_size), None
        msg, envelope = unseal(frames, self.key, to_sender=True, bucket_size=self.bucket_size)
        if isinstance(msg, Register):
            if envelope.origin != msg.instance:
                raise ProtocolError("a Register whose instance differs from its seal's origin")
        elif envelope.session != self.session:
            raise _Replay(
                f"{type(msg).__name__} sealed for sender session {envelope.session[:32]!r}, not this one "
                f"({self.session}): a replay from another run?"
            )
        last = self._seqs.get(envelope.origin, -1)
        if envelope.seq <= last:
            raise _Replay(f"{type(msg).__name__} with seq {envelope.seq} <= {last} already seen (a replay)")
        return msg, envelope

    def _admit(self, route: bytes, msg: Message, envelope: Seal | None) -> None:
        """A connection speaks for the identity it registered, and only after registering."""
        bound = self._routes.get(route)
        if isinstance(msg, Register):
            if bound is not None and bound != msg.identity:
                raise ProtocolError(f"connection registered as {bound!r} now claims identity {msg.identity!r}")
            return
        if bound is None:
            raise ProtocolError(f"{type(msg).__name__} from a connection that has not registered")
        claimed = getattr(msg, "identity", bound)
        if claimed != bound:
            raise ProtocolError(f"message claims identity {claimed!r} but its connection registered as {bound!r}")
        if envelope is not None and self.peers.get(bound) and envelope.origin != self.peers[bound].instance:
            raise ProtocolError(f"message for {bound!r} sealed by another receiver instance")

    async def connected(self, identity: str) -> bool:
        """Whether the connection that registered `identity` is still up (an empty probe frame,
        which receivers ignore; ROUTER_MANDATORY refuses it once ZeroMQ dropped the connection)."""
        peer = self.peers.get(identity)
        if peer is None or self._sock is None:
            return False
        try:
            await self._sock.send_multipart([peer.route, b""], flags=zmq.NOBLOCK)
        except zmq.Again:
            return True  # its pipe is full: there, but slow
        except zmq.ZMQError:
            self._routes.pop(peer.route, None)
            del self.peers[identity]
            logger.info("receiver %s disconnected (host %s, pid %d)", identity, peer.host, peer.pid)
            return False
        return True

    async def _track(self, route: bytes, msg: Message, envelope: Seal | None) -> bool:
        """Registry bookkeeping; returns False for messages fully handled here."""
        if isinstance(msg, Register):
            current = self.peers.get(msg.identity)
            instance = envelope.origin if envelope is not None else msg.instance
            if current is not None and current.route != route:
                same = bool(instance) and instance == current.instance  # the same process, reconnected
                if not same and await self.connected(msg.identity):
                    await self._refuse(route, msg, current)
                    return False
                self._routes.pop(current.route, None)  # its old connection is gone (or superseded)
            if current is None or current.pid != msg.pid:
                logger.info("receiver %s registered (host %s, pid %d, %s)", msg.identity, msg.host, msg.pid, msg.device)
            self.peers[msg.identity] = Peer(
                msg.identity, msg.host, msg.pid, msg.device, msg.last_version, time.monotonic(),
                route=route, instance=instance, nonce=msg.nonce,
            )  # fmt: skip
            self._routes[route] = self._former_set(msg.identity, route)
            return False
        identity = self._routes[route]
        if isinstance(msg, Bye):
            self._routes.pop(route, None)
            if self.peers.pop(identity, None) is not None:
                logger.info("receiver %s left", identity)
            return False
        if identity in self.peers:
            self.peers[identity].last_seen = time.monotonic()
        if isinstance(msg, BucketDone):  # progress of the version in flight (names a laggard on a timeout)
            self.progress[identity] = (msg.version, msg.bucket_index)
            return False
        if isinstance(msg, StoreRequest):
            await self._serve_store(route, identity, msg)
            return False
        return True

    def _former_set(self, identity: str, route: bytes) -> str:
        self._former[identity] = route
        if len(self._former) > MAX_TRACKED_ORIGINS:
            self._former.pop(next(iter(self._former)))
        return identity

    async def _refuse(self, route: bytes, msg: Register, current: Peer) -> None:
        self.refused_registrations += 1
        reason = (
            f"identity {msg.identity!r} is held by a connected receiver (host {current.host}, pid {current.pid}); "
            f"this one (host {msg.host}, pid {msg.pid}) is refused: give every rollout its own rollout.identity "
            "(null = <hostname>-<pid>)"
        )
        self._refusals.note(f"{msg.host} pid {msg.pid}", reason)
        with contextlib.suppress(PeerError):
            await self._send_route(route, Refuse(msg.identity, reason, msg.nonce), msg.identity)

    async def send_all(self, peers: list[Peer], msg: Message) -> None:
        for peer in peers:
            await self.send(peer.identity, msg)
        # called once per bucket while streaming: read what arrived at most every PUMP_EVERY_S (receivers
        # only write on a stall or to register, so their queues cannot fill in that time)
        now = time.monotonic()
        if now - self._pumped_at >= PUMP_EVERY_S:
            self._pumped_at = now
            await self._pump()

    # -- the data-plane rendezvous store (replaces an open TCPStore) ----------------------------------
    @property
    def store(self) -> dist.HashStore:
        if self._store is None:
            self._store = dist.HashStore()
        return self._store

    def rendezvous_store(self, prefix: str, timeout_s: float) -> dist.Store:
        """The sender's view of the rendezvous store: local; receivers reach it via `StoreRequest`."""
        return dist.PrefixStore(prefix, self.store)

    async def _serve_store(self, route: bytes, identity: str, msg: StoreRequest) -> None:
        if not msg.key.startswith(f"lws/{self.session}/"):
            self._dropped += 1
            self._drops.note(identity, f"store {msg.op} of {msg.key[:80]!r}, outside this session's namespace")
            return
        store = self.store
        found, value = False, b""
        if msg.op == "set":
            if store.num_keys() >= MAX_STORE_KEYS:
                self._dropped += 1
                self._drops.note(identity, f"store set refused: {MAX_STORE_KEYS} keys already")
                return
            store.set(msg.key, msg.value)
            found = True
        elif msg.op == "add":  # counters (barriers) of process groups other than gloo
            try:
                amount = int(msg.value.decode("ascii")) if len(msg.value) <= 20 else None
            except (UnicodeDecodeError, ValueError):
                amount = None
            if amount is None:
                self._dropped += 1
                self._drops.note(identity, f"store add of a non-integer {msg.value[:20]!r}")
                return
            found, value = True, str(store.add(msg.key, amount)).encode()
        elif store.check([msg.key]):
            found, value = True, store.get(msg.key)
        with contextlib.suppress(PeerError):
            await self._send_route(route, StoreReply(msg.request_id, found, value), identity)

    async def serve_while(self, work: asyncio.Future[Any]) -> Any:
        """Await `work` (e.g. the sender's group join on the executor) while answering the
        receivers' rendezvous requests; other messages that arrive meanwhile are dropped."""
        while not work.done():
            if self._sock is None:
                break
            got = await self.recv(0.01)
            if got is not None:
                logger.debug("ignoring %s from %s while joining the group", type(got[1]).__name__, got[0])
        return await work

    # -- group formation ----------------------------------------------------------------------
    async def gather_ready(
        self, version: int, session: str, *, min_receivers: int, timeout_s: float, ready_timeout_s: float
    ) -> list[Peer]:
        """Ask every registered receiver to join `version`; return those that answered in time.

        Waits up to `timeout_s` for at least `min_receivers`; a registered receiver that does not
        answer within `ready_timeout_s` is presumed dead and forgotten (it re-registers if alive).
        If too few answered, every receiver asked gets an `Abort`, so none waits for a plan.
        """
        deadline = time.monotonic() + timeout_s
        asked: dict[str, float] = {}
        ready: dict[str, Peer] = {}
        while True:
            now = time.monotonic()
            for identity in list(self.peers):
                if identity not in asked:
                    try:
                        await self.send(identity, Prepare(version, session, self.peers[identity].nonce))
                        asked[identity] = now
                    except PeerError:
                        del self.peers[identity]
                elif identity not in ready and now - asked[identity] > ready_timeout_s:
                    logger.warning(
                        "receiver %s did not answer within transport.ready_timeout_s=%ss; dropping it",
                        identity,
                        ready_timeout_s,
                    )
                    del self.peers[identity]
                    del asked[identity]
            waiting = [i for i in self.peers if i not in ready]
            if len(ready) >= min_receivers and not waiting:
                members = sorted(ready.values(), key=lambda p: p.identity)
                self.members_in_flight = [p.identity for p in members]
                return members
            if now >= deadline:
                reason = (
                    f"version {version}: {len(ready)} of trainer.min_receivers={min_receivers} receivers ready "
                    f"within transport.timeout_s={timeout_s}s at {self.address} (registered: {sorted(self.peers)}); "
                    "start a rollout daemon pointing at this address, or lower trainer.min_receivers"
                )
                for identity in asked:
                    with contextlib.suppress(PeerError):
                        await self.send(identity, Abort(version, reason[:1000]))
                raise WeightSyncTimeout(reason)
            got = await self.recv(min(0.05 if waiting else 0.5, max(deadline - now, 0.001)))
            if got is None:
                continue
            identity, msg = got
            if isinstance(msg, Ready) and msg.version == version and identity in self.peers and identity in asked:
                ready[identity] = self.peers[identity]
                ready[identity].group_generation = msg.generation

    async def collect_acks(self, version: int, peers: list[Peer], timeout_s: float) -> dict[str, Ack | None]:
        """Acks for `version` from `peers`; a missing one is None after `timeout_s`."""
        acks: dict[str, Ack | None] = {p.identity: None for p in peers}
        deadline = time.monotonic() + timeout_s
        while any(a is None for a in acks.values()):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            got = await self.recv(left)
            if got is None:
                break
            identity, msg = got
            if isinstance(msg, Ack) and msg.version == version and identity in acks:
                acks[identity] = msg
        return acks

    async def laggards(self, version: int, wait_s: float = 0.5) -> str:
        """After a broadcast of `version` failed or timed out: which receivers are behind, from what
        they reported (per-bucket progress, failure acks) and which connections dropped."""
        failed: dict[str, str] = {}
        deadline = time.monotonic() + wait_s
        with contextlib.suppress(WeightSyncError):
            while (left := deadline - time.monotonic()) > 0:
                got = await self.recv(left)
                if got is None:
                    break
                identity, msg = got
                if isinstance(msg, Ack) and msg.version == version and not msg.ok:
                    failed[identity] = msg.error or "failed"
        members = self.members_in_flight
        if not members:
            return "no receivers in the group"
        state: dict[str, str] = {}
        done: dict[str, int] = {}
        for identity in members:
            v, index = self.progress.get(identity, (version, -1))  # the bucket it reached
            done[identity] = index if v == version else -1
            if identity in failed:
                state[identity] = f"failed: {failed[identity][:200]}"
            elif not await self.connected(identity):
                state[identity] = "disconnected"
            else:
                state[identity] = "connected"
        lowest = min(done.values())
        behind = [i for i in members if done[i] == lowest or state[i] != "connected"]
        text = ", ".join(
            f"{i} ({state[i]}, {'no progress reported' if done[i] < 0 else f'reached bucket {done[i]}'})"
            for i in behind
        )
        ahead = [i for i in members if i not in behind]
        others = f"; the others ({len(ahead)}) are further" if ahead else ""
        return f"stalled or dead: {text}{others}"


class ReceiverControl:
    """The receiver's side: registers, heartbeats while idle, and reads what the sender says."""

    def __init__(self, host: str, port: int, key: bytes | None, identity: str, device: str) -> None:
        self.host, self.port, self.key, self.identity, self.device = host, port, key, identity, device
        self.instance = secrets.token_hex(8)  # this process; a reconnect keeps it, a restart does not
        self.dropped_messages = 0
        self.replayed_messages = 0
        self.last_version = -1
        self.bucket_size: int | None = None
        self.refused: str | None = None  # the sender's reason, while it refuses our registration
        self.sender_session: str | None = None  # the session whose messages we accept (sealed mode)
        self._sender_seq = -1
        self._seq = 0
        self._nonces: OrderedDict[str, int] = OrderedDict()  # nonce of each recent Register -> its index
        self._nonce_count = 0
        self._nonce_floor = -1  # a new session must echo a nonce issued after this index
        self._request_id = 0
        self._drops = _DropLog("dropped a control message")
        self._refusals = _DropLog("registration refused")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._stash: list[Message] = []

    @property
    def address(self) -> str:
        return endpoint(self.host, self.port)

    async def start(self) -> None:
        _resolve(self.host)
        self._loop = asyncio.get_running_loop()
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.DEALER)  # no IDENTITY: the sender's ROUTER names the connection
        _link_options(sock, self.host)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        if self.key:
            keys = curve_keys(self.key)
            sock.curve_serverkey = keys.server_public
            sock.curve_publickey = keys.client_public
            sock.curve_secretkey = keys.client_secret
        sock.connect(self.address)
        self._sock = sock
        await self.register()

    async def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                await self.send(Bye(self.identity))
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def register(self) -> None:
        nonce = secrets.token_hex(8)
        self._nonces[nonce] = self._nonce_count
        self._nonce_count += 1
        while len(self._nonces) > 256:
            self._nonces.popitem(last=False)
        msg = Register(
            self.identity, socket.gethostname(), os.getpid(), self.device, self.last_version,
            instance=self.instance, nonce=nonce,
        )  # fmt: skip
        await self.send(msg)

    def _frames(self, msg: Message) -> list[bytes]:
        if not self.key:
            return encode(msg)
        self._seq += 1
        return seal(msg, self.key, Seal(self.sender_session or "", self.instance, self._seq, True))

    async def send(self, msg: Message) -> None:
        assert self._sock is not None, "call start() first"
        # never block on a missing sender: drop the message if the pipe is full
        with contextlib.suppress(zmq.Again):
            await self._sock.send_multipart(self._frames(msg), flags=zmq.NOBLOCK)

    def progress(self, version: int, bucket_index: int) -> None:
        """Tell the sender we reached bucket `bucket_index` (earlier broadcasts posted, a slot free for
        this one): on the control socket `BucketDone` is this progress report; the sender names the
        receivers furthest behind when a broadcast stalls."""
        if self._sock is None:
            return
        with contextlib.suppress(zmq.ZMQError):
            sent = self._sock.send_multipart(
                self._frames(BucketDone(self.identity, version, bucket_index)), flags=zmq.NOBLOCK
            )
            if isinstance(sent, asyncio.Future):  # a full pipe (EAGAIN) is fine: progress is best effort
                sent.add_done_callback(lambda f: f.cancelled() or f.exception())

    def stash(self, msg: Message) -> None:
        """Keep a message for the next `recv` (e.g. a new version's `Prepare` seen mid-version)."""
        self._stash.append(msg)

    async def recv(self, timeout_s: float) -> Message | None:
        assert self._sock is not None, "call start() first"
        if self._stash:
            return self._stash.pop(0)
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not await self._sock.poll(max(1, int(left * 1000))):
                return None
            frames = await self._sock.recv_multipart()
            if len(frames) == 1 and not frames[0]:
                continue  # the sender's liveness probe (see `SenderControl.connected`)
            try:
                msg = self._open(frames)
            except ProtocolError as exc:
                self.dropped_messages += 1
                if isinstance(exc, _Replay):
                    self.replayed_messages += 1
                self._drops.note("the sender", exc)
                continue
            if isinstance(msg, Refuse):
                if self.refused is None:
                    logger.error("the sender at %s refused this receiver: %s", self.address, msg.reason)
                self.refused = msg.reason
                self._refusals.note(self.address, msg.reason)
                continue
            if isinstance(msg, Prepare):
                self.refused = None
            return msg

    def _open(self, frames: list[bytes]) -> Message:
        if not self.key:
            return decode(frames, None, bucket_size=self.bucket_size)
        msg, envelope = unseal(frames, self.key, to_sender=False, bucket_size=self.bucket_size)
        if envelope.origin != envelope.session:
            raise ProtocolError("a sender message whose seal origin is not its session")
        if getattr(msg, "session", envelope.session) != envelope.session:
            raise ProtocolError(f"{type(msg).__name__} names session {msg.session!r} but is sealed for another")  # type: ignore[union-attr]
        if envelope.session == self.sender_session:
            if envelope.seq <= self._sender_seq:
                raise _Replay(f"{type(msg).__name__} with seq {envelope.seq} <= {self._sender_seq} (a replay)")
            self._sender_seq = envelope.seq
            return msg
        # another session: only a Prepare (or Refuse) answering one of our recent Registers counts
        nonce = msg.nonce if isinstance(msg, (Prepare, Refuse)) else ""
        index = self._nonces.get(nonce, -1) if nonce else -1
        if index <= self._nonce_floor:
            raise _Replay(
                f"{type(msg).__name__} from sender session {envelope.session[:32]!r}, not the current one, and "
                "not answering a recent registration (a replay from another run?)"
            )
        if isinstance(msg, Prepare):
            self.sender_session, self._sender_seq, self._nonce_floor = envelope.session, envelope.seq, index
        return msg

    async def wait_prepare(self, heartbeat_interval_s: float, wait_s: float | None) -> Prepare:
        """Block until the sender starts a version; re-register every heartbeat meanwhile."""
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while True:
            left = heartbeat_interval_s if deadline is None else min(heartbeat_interval_s, deadline - time.monotonic())
            if left <= 0:
                why = f"; the sender refuses us: {self.refused}" if self.refused else ""
                hint = (
                    " (with transport.auth_token set, a different token on either side fails the handshake silently)"
                    if self.key and not self.refused
                    else ""
                )
                raise WeightSyncTimeout(
                    f"no version started by the sender at {self.address} within {wait_s}s{why}{hint}"
                )
            msg = await self.recv(left)
            if msg is None:
                await self.register()
            elif isinstance(msg, Prepare):
                return msg
            else:
                logger.debug("ignoring %s while idle", type(msg).__name__)

    async def _recv_before(self, deadline: float, awaited: str) -> Message:
        """The next valid message, or `WeightSyncTimeout` naming what was awaited from whom."""
        left = deadline - time.monotonic()
        msg = await self.recv(left) if left > 0 else None
        if msg is None:
            raise WeightSyncTimeout(f"{awaited} not received from the sender at {self.address} in time")
        return msg

    async def wait_plan(self, prepare: Prepare, timeout_s: float) -> Plan:
        """After answering `Ready`: the plan for that version (or a newer `Prepare` supersedes it)."""
        deadline = time.monotonic() + timeout_s
        awaited = f"version {prepare.version}: the group plan (transport.timeout_s={timeout_s}s)"
        while True:
            msg = await self._recv_before(deadline, awaited)
            if isinstance(msg, Plan) and msg.version == prepare.version and msg.session == prepare.session:
                return msg
            if isinstance(msg, Prepare):
                self.stash(msg)
                raise VersionAborted(f"version {prepare.version} superseded by {msg.version} before it started")
            if isinstance(msg, Abort) and msg.version == prepare.version:
                raise VersionAborted(f"version {msg.version} aborted by the sender: {msg.reason}")

    async def next_bucket(self, version: int, bucket_index: int, timeout_s: float) -> BucketMeta:
        # Progress is reported only when this wait lasts (PROGRESS_AFTER_S): while buckets stream,
        # their metadata is already here and a message per bucket would only compete with the data
        # plane for the CPU; when a broadcast stalls, every healthy receiver waits here and reports,
        # and the stalled one, which cannot, is the one the sender names.
        report = asyncio.get_running_loop().call_later(PROGRESS_AFTER_S, self.progress, version, bucket_index)
        try:
            return await self._next_bucket(version, bucket_index, timeout_s)
        finally:
            report.cancel()

    async def _next_bucket(self, version: int, bucket_index: int, timeout_s: float) -> BucketMeta:
        deadline = time.monotonic() + timeout_s
        awaited = (
            f"version {version}: bucket {bucket_index} metadata (transport.timeout_s={timeout_s}s; "
            "trainer dead or stalled?)"
        )
        while True:
            msg = await self._recv_before(deadline, awaited)
            if isinstance(msg, BucketMeta) and msg.version == version:
                if msg.bucket_index != bucket_index:
                    raise ProtocolError(
                        f"version {version}: got bucket {msg.bucket_index}, expected {bucket_index} (lost or reordered)"
                    )
                return msg
            if isinstance(msg, Abort) and msg.version == version:
                raise VersionAborted(f"version {version} aborted by the sender: {msg.reason}")
            if isinstance(msg, Prepare):
                self.stash(msg)
                raise VersionAborted(f"version {version} abandoned: the sender started version {msg.version}")

    # -- the data-plane rendezvous, through the sender ----------------------------------------------
    async def store_call(self, op: str, key: str, value: bytes, timeout_s: float) -> StoreReply:
        """One request to the sender's rendezvous store; other messages that arrive meanwhile are
        kept for later, except an `Abort` or a new `Prepare`, which end the join."""
        self._request_id += 1
        request_id = self._request_id
        await self.send(StoreRequest(self.identity, request_id, op, key, value))
        deadline = time.monotonic() + timeout_s
        kept: list[Message] = []
        try:
            while True:
                msg = await self._recv_before(deadline, f"the rendezvous store's answer to {op} {key!r}")
                if isinstance(msg, StoreReply):
                    if msg.request_id == request_id:
                        return msg
                    continue  # an answer to an earlier request we stopped waiting for
                kept.append(msg)
                if isinstance(msg, (Abort, Prepare)):
                    raise VersionAborted(f"the sender gave up the group while we joined it ({type(msg).__name__})")
        finally:
            self._stash[:0] = kept

    async def store_get(self, key: str, timeout_s: float) -> bytes:
        """The value of `key` once some rank has set it (polls the sender)."""
        deadline = time.monotonic() + timeout_s
        while True:
            reply = await self.store_call("get", key, b"", max(deadline - time.monotonic(), 0.001))
            if reply.found:
                return reply.value
            if time.monotonic() >= deadline:
                raise WeightSyncTimeout(
                    f"rendezvous key {key!r} not set by the other ranks within transport.timeout_s={timeout_s}s "
                    "(a receiver died while the group formed?)"
                )
            await asyncio.sleep(STORE_POLL_S)

    def rendezvous_store(self, prefix: str, timeout_s: float) -> dist.Store:
        """A `dist.Store` for a process group built on another thread (the executor): each call
        runs `store_call` / `store_get` on this control plane's event loop."""
        assert self._loop is not None, "call start() first"
        return ControlPlaneStore(self, self._loop, prefix, timeout_s)


def default_identity() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


__all__ = ["CurveKeys", "Peer", "ReceiverControl", "SenderControl", "curve_keys", "default_identity", "endpoint"]
