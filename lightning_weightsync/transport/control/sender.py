"""The sender's end of the control plane: one ROUTER socket, the registry of receivers, and the
rendezvous store served behind it.

One ROUTER socket on the sender, one DEALER per receiver (reliable, per-peer ordered, no
slow-joiner losses as with PUB/SUB). Receivers register on start and re-register every heartbeat
interval while idle, so a restarted trainer learns about them again without any action.

Identities are application-level: the ROUTER assigns connection ids (no ROUTER_HANDOVER), the
sender binds a receiver's identity to the connection that registered it, and refuses (with a
`Refuse` the receiver logs and reports) a second registration under an identity whose connection
is still up, whoever sends it (the same instance id on another connection included: a process has
one connection, so a second one claiming its instance is a copy). "Up" is asked of ZeroMQ itself: an
empty probe frame to the old connection, which ROUTER_MANDATORY refuses once the connection is gone
(ZMQ_ROUTER_NOTIFY is a draft API, absent from the wheels); TCP keepalive bounds how long a dead link
stays up (`transport/sockets.py`). A flood of duplicate registrations costs one probe and one `Refuse`
per identity and `REFUSE_EVERY_S`; the rest are dropped and counted (`throttled_registrations`).

Every received frame goes through `unseal` / `decode` (signature, schema, ranges); bad messages are
counted and dropped, never acted upon, and logged at most once per `DROP_LOG_INTERVAL_S` with a count.
What a message means for a version of weights is the versions layer's business (`versions/steps.py`).

Reading never waits for the trainer: a thread of its own reads the ROUTER (`router.py`), whatever
arrives, at once, and keeps it in per-connection queues with a budget (`inbox.py`: 256 messages and 1 MiB a
connection, 32 MiB in all; past it the oldest go, counted in `overflowed_messages`). A training step
(minutes without a `recv`) therefore costs at most the budget, whatever a token holder sends meanwhile;
before, it all waited in libzmq's pipe, which may not stop reading (`transport/sockets.py`). This class
stays on the asyncio side: it takes messages from the queues (round-robin over connections), unseals,
checks and books them here, and sends in place under the router's lock (a send that meets a full pipe
waits in the thread, which retries it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import logging
import math
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import zmq
from torch.distributed.distributed_c10d import PrefixStore, Store

from ...errors import ConfigError, PeerError, ProtocolError
from ...protocol.declare import Declarations
from ...protocol.messages import (
    MAX_FRAME_TO_SENDER,
    Boxes,
    BucketDone,
    Bye,
    Contract,
    Message,
    Refuse,
    Register,
    Seal,
    StoreRequest,
    decode,
    encode,
    seal,
    unseal,
)
from ..sockets import DEFAULT_LIVENESS_S
from .handshakes import HANDSHAKE_FAILED, HandshakeWatch
from .inbox import Inbox
from .link import (
    DropLog,
    Replay,
    TokenHolders,
    curve_keys,
    endpoint,
    link_options,
    resolve_host,
)
from .router import RouterThread
from .store import StoreServer

logger = logging.getLogger(__name__)
PUMP_EVERY_S = 0.02  # while a version streams, the sender reads its socket at most this often
MAX_TRACKED_ORIGINS = 4096  # receiver instances whose last seq the sender remembers
MAX_KEPT = 8192  # decoded messages kept for the next `recv` while a version streams (2 for each of 4096 receivers)
REFUSE_EVERY_S = 1.0  # per identity: at most one liveness probe and `Refuse` for duplicate registrations
BYE_GRACE_S = 0.5  # a disconnection is judged this long after it was seen: its connection's Bye may still be queued
DROPPED_CONNECTION_CAUSES = (
    "the peer process exited or was killed without a Bye, the link was silent past transport.liveness_s "
    "(ZMTP heartbeat), or it sent a frame over the {limit}-byte limit (ZMQ_MAXMSGSIZE; libzmq drops such a "
    "connection with no other sign)"
)


@dataclass
class Peer:
    identity: str
    host: str
    pid: int
    device: str
    last_seen: float
    route: bytes = b""  # the ROUTER's id of the connection that registered this identity
    instance: str = ""  # the receiver process's random id (a reconnect keeps it)
    nonce: str = ""  # from its latest `Register`, answered in the seal of what is sent to it

    @property
    def key(self) -> tuple[str, int]:
        """Same identity but another pid means a restarted receiver: its old group is gone."""
        return (self.identity, self.pid)


class SenderControl:
    """The sender's side: knows the registered receivers and talks to each of them."""

    def __init__(
        self,
        host: str,
        port: int,
        key: bytes | None,
        bucket_size: int,
        *,
        session: str | None = None,
        liveness_s: float = DEFAULT_LIVENESS_S,
    ) -> None:
        self.host, self.requested_port, self.key, self.bucket_size = host, port, key, bucket_size
        self.liveness_s = liveness_s
        # a blocked send outlives a frozen peer's connection (dropped after liveness_s) by this much at most
        self.send_wait_s = 2 * liveness_s + 1
        self.port = port
        self.session = session or secrets.token_hex(8)
        self.peers: dict[str, Peer] = {}
        self._dropped = 0
        self._overflowed_before = 0  # `overflowed_messages` of a closed socket
        self._failed_handshakes = 0
        self._monitor: zmq.Socket[Any] | None = None
        self._handshakes: HandshakeWatch | None = None  # reads `_monitor` on its own thread
        self.dropped_connections = 0  # see `poll_connections`
        self._byes = 0  # Byes read whose disconnection is still to come
        self._explained = 0  # failed handshakes whose disconnection is still to come
        self._disconnects: list[float] = []  # when each disconnection not judged yet was seen
        self._lost_connections = DropLog("lost a control connection", log=logger)
        self.replayed_messages = 0
        self.refused_registrations = 0  # duplicate registrations of a live identity (answered or not)
        self.throttled_registrations = 0  # ... of which dropped unanswered (REFUSE_EVERY_S)
        self.progress: dict[str, BucketDone] = {}  # identity -> its latest progress report
        self.declarations = Declarations()  # the boxes each receiver declared, page by page
        self.contracts: dict[str, Contract] = {}  # the quantization contract each registered receiver declared last
        self._routes: dict[bytes, str] = {}  # connection -> the identity it registered
        self._former: dict[str, bytes] = {}  # identity -> its last connection (an Abort may still reach it)
        # (identity, receiver instance) -> the last seq accepted: a Register that is refused records nothing,
        # and a Register for another identity under a victim's instance id counts apart from the victim's
        self._seqs: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._refused_at: OrderedDict[str, float] = OrderedDict()  # identity -> when a duplicate was last answered
        self._seq = 0
        self._kept: list[tuple[str, Message]] = []  # read by `_pump` while streaming, for the next `recv`
        self._pumped_at = 0.0
        self._store = StoreServer(f"lws/{self.session}/")  # the data-plane rendezvous, behind this socket
        self._drops = DropLog("dropped a control message", log=logger)
        self._overflows = DropLog("dropped a queued control message", log=logger)  # the socket thread's
        self._refusals = DropLog("refused a registration", log=logger)
        self._zap: TokenHolders | None = None
        self._auth: Any = None
        self._sync_ctx: zmq.Context[Any] | None = None
        self._router: RouterThread | None = None  # owns the ROUTER socket from `start` to `close`

    @property
    def address(self) -> str:
        return endpoint(self.host, self.port)

    @property
    def rejected_handshakes(self) -> int:
        """Connections refused before any message: a CURVE handshake that failed (another token, or
        none) or presented a key other than the token's."""
        self.poll_connections()
        return self._failed_handshakes + (self._zap.rejected if self._zap is not None else 0)

    def poll_connections(self) -> int:
        """Read the ROUTER's connection events; returns `dropped_connections`: connections that passed the
        handshake and then went without a Bye. libzmq 4.3 gives an over-size frame (`ZMQ_MAXMSGSIZE`) no
        event of its own (decoder EMSGSIZE -> protocol error -> EVENT_DISCONNECTED, as for a peer that
        exits), so this counts them all and the WARNING names every likely cause. Called by `recv` and
        `_pump` too, so the line comes while the sender runs, not only when someone asks."""
        if self._handshakes is not None:
            while not self._handshakes.events.empty():
                seen = self._handshakes.events.get_nowait()
                if seen.failed_handshake:
                    self._failed_handshakes += 1
                    self._explained += 1
                else:
                    self._disconnects.append(seen.at)
        due = time.monotonic() - BYE_GRACE_S
        while self._disconnects and self._disconnects[0] <= due:
            self._disconnects.pop(0)
            if self._explained:
                self._explained -= 1
            elif self._byes:
                self._byes -= 1
            else:
                self._note_lost_connection()
        return self.dropped_connections

    def _note_lost_connection(self) -> None:
        """Count one connection lost without a Bye and name who it was where the registry can tell: the
        registered receivers whose connection is gone now (a liveness probe each)."""
        self.dropped_connections += 1
        gone = []
        if self._router is not None:
            for identity, peer in list(self.peers.items()):
                try:  # a NOBLOCK send's outcome is known at once
                    self._router.submit([peer.route, b""], zmq.NOBLOCK).result()
                except zmq.Again:
                    pass  # its pipe is full: there, but slow
                except zmq.ZMQError:
                    gone.append(f"receiver {identity!r} (host {peer.host[:256]!r}, pid {peer.pid})")
                    self._routes.pop(peer.route, None)
                    del self.peers[identity]
        who = ", ".join(gone) if gone else "a connection that had not registered (or had already left)"
        self._lost_connections.note(who, DROPPED_CONNECTION_CAUSES.format(limit=MAX_FRAME_TO_SENDER))

    def refused_handshakes(self) -> str | None:
        """The addresses whose handshake this sender refused, with the cause (another token, or a token on one
        side only), or None: what a wait for receivers says instead of blaming a missing rollout."""
        return self._handshakes.refused_summary() if self._handshakes is not None else None

    @property
    def overflowed_messages(self) -> int:
        """Messages read but dropped unprocessed: their connection's queue (or all queues together) was over
        the budget while the trainer did not read (`inbox.py`). Honest receivers never get near it."""
        return self._router.inbox.overflowed if self._router is not None else self._overflowed_before

    @property
    def dropped_messages(self) -> int:
        """Messages dropped as malformed, unauthenticated or replayed, and refused handshakes."""
        return self._dropped + self.rejected_handshakes

    async def start(self) -> None:
        resolve_host(self.host)
        # one libzmq context for the socket and the ZAP handler thread (ZAP is per context)
        self._sync_ctx = zmq.Context()
        sock = self._sync_ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished peer raises instead of dropping
        sock.setsockopt(zmq.ROUTER_HANDOVER, 0)  # a connection never takes over another's id
        link_options(sock, self.host, self.liveness_s, to_sender=True)
        if self.key:
            from zmq.auth.thread import ThreadAuthenticator

            keys = curve_keys(self.key)
            self._zap = TokenHolders(keys.client_public)
            self._auth = ThreadAuthenticator(self._sync_ctx, log=logging.getLogger(__name__ + ".zap"))
            self._auth.start()
            self._auth.configure_curve_callback("*", credentials_provider=self._zap)
            sock.curve_server = True
            sock.curve_secretkey = keys.server_secret
            sock.curve_publickey = keys.server_public
        # handshake failures (`rejected_handshakes`) and disconnections (`dropped_connections`)
        self._monitor = sock.get_monitor_socket(HANDSHAKE_FAILED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
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
        self._handshakes = HandshakeWatch(self._monitor, self.address, self.port, bool(self.key))
        self._handshakes.start()
        inbox = Inbox(on_drop=lambda route, why: self._overflows.note(f"connection {route.hex()}", why))
        self._router = RouterThread(sock, inbox, send_wait_s=self.send_wait_s)
        self._router.start(asyncio.get_running_loop())
        logger.info(
            "weight sender control plane listening on %s (%s)", self.address, "CURVE + signed" if self.key else "open"
        )

    async def close(self) -> None:
        router, self._router = self._router, None
        if router is not None:
            self._overflowed_before = router.inbox.overflowed
            # joining takes a poll interval at most; off the loop, so receivers in this loop keep running
            if not await asyncio.to_thread(router.stop):
                return  # the thread still owns the socket: leave it (and the context) to the process exit
        watch_ended = self._handshakes is None or await asyncio.to_thread(self._handshakes.stop)
        if self._monitor is not None and watch_ended:
            if router is not None:
                router.sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        if router is not None:
            router.sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        ctx, self._sync_ctx = self._sync_ctx, None
        if ctx is not None and watch_ended:  # term() would wait forever for a monitor socket a live thread owns
            ctx.term()

    # -- transport ----------------------------------------------------------------------------
    def _frames(self, msg: Message, answers: str = "") -> list[bytes]:
        """`answers`: the nonce of the addressee's latest `Register` (its proof that this session is live)."""
        if not self.key:
            return encode(msg)
        self._seq += 1
        return seal(msg, self.key, Seal(self.session, self.session, self._seq, False, answers))

    async def _send_route(self, route: bytes, msg: Message, who: str) -> None:
        await self._sent(self._started().submit([route, *self._frames(msg)]), who)

    async def _sent(self, send: concurrent.futures.Future[None], who: str) -> None:
        """The outcome of a send (done at once, unless it waits in the socket thread for a full pipe), as
        `PeerError` when it failed."""
        try:
            if not send.done():
                await asyncio.wrap_future(send)
            send.result()
        except zmq.Again:
            raise PeerError(
                f"receiver {who!r} is unreachable (its connection took no message for "
                f"{self.send_wait_s:.0f}s: the process is frozen or not reading)"
            ) from None
        except zmq.ZMQError as exc:
            raise PeerError(f"receiver {who!r} is unreachable ({exc})") from None

    def _started(self) -> RouterThread:
        assert self._router is not None, "call start() first"
        return self._router

    async def inject(self, route: bytes, frames: list[bytes]) -> None:
        """Send raw `frames` on connection `route` (tests forge sender messages with it); raises what the
        socket raises."""
        await self._started().send_multipart([route, *frames])

    async def send(self, identity: str, msg: Message) -> None:
        """`msg` to one receiver, sealed as an answer to its latest registration (a receiver adopts this
        session, at its first version, only through such a message)."""
        peer = self.peers.get(identity)
        frames = self._frames(msg, peer.nonce if peer is not None else "")
        await self._sent(self._started().submit([self._route_to(identity), *frames]), identity)

    def _route_to(self, identity: str) -> bytes:
        peer = self.peers.get(identity)
        route = peer.route if peer is not None else self._former.get(identity)
        if route is None:
            raise PeerError(f"receiver {identity!r} is not connected")
        return route

    def route_of(self, identity: str) -> bytes:
        """The connection id a registered receiver talks from (tests inject frames through it)."""
        return self.peers[identity].route

    async def recv(self, timeout_s: float) -> tuple[str, Message] | None:
        """One valid message, or None when `timeout_s` passed; bad messages are dropped."""
        router = self._started()
        if self._kept:
            return self._kept.pop(0)
        deadline = time.monotonic() + timeout_s
        while True:
            frames = router.take()
            if frames is None:
                self.poll_connections()  # the queue is read: the Byes before any disconnection are counted
                left = deadline - time.monotonic()
                if left <= 0 or not await router.wait(left):
                    return None
                continue
            got = await self._read_one(frames)
            if got is not None:
                return got
            if time.monotonic() >= deadline:  # a stream of bad messages ends the wait too
                return None

    async def _read_one(self, frames: list[bytes]) -> tuple[str, Message] | None:
        """Check and book-keep one message read by the socket thread; returns it if the caller should see it."""
        route = frames[0]
        try:
            msg, envelope = self._open(route, frames[1:])
            if isinstance(msg, Bye) and self._forgotten(route):
                self._byes += 1  # queued behind the probe that found its connection closing: a clean leave
                return None
            self._admit(route, msg, envelope)
        except ProtocolError as exc:
            self._dropped += 1
            if isinstance(exc, Replay):
                self.replayed_messages += 1
            self._drops.note(self._routes.get(route, f"connection {route.hex()}"), exc)
            return None
        identity = msg.identity if isinstance(msg, Register) else self._routes[route]  # bound: `_admit` checked
        keep, admitted = await self._track(route, msg, envelope)
        if envelope is not None and admitted:
            key = (identity, envelope.origin)
            self._seqs[key] = envelope.seq
            self._seqs.move_to_end(key)
            while len(self._seqs) > MAX_TRACKED_ORIGINS:
                self._seqs.popitem(last=False)
        return (identity, msg) if keep else None

    async def _pump(self) -> None:
        """While a version streams nobody calls `recv`: handle what the socket thread read (progress
        reports, registrations, store requests) without waiting, so no connection's queue nears its budget
        and drops an Ack; what a caller should see is kept for its next `recv`."""
        router = self._started()
        for _ in range(1000):
            if len(self._kept) >= MAX_KEPT or (frames := router.take()) is None:
                self.poll_connections()
                return
            got = await self._read_one(frames)
            if got is not None:
                self._kept.append(got)

    def _open(self, route: bytes, frames: list[bytes]) -> tuple[Message, Seal | None]:
        if not self.key:
            return decode(frames, None, bucket_size=self.bucket_size), None
        msg, envelope = unseal(frames, self.key, to_sender=True, bucket_size=self.bucket_size)
        if isinstance(msg, Register):
            if envelope.origin != msg.instance:
                raise ProtocolError("a Register whose instance differs from its seal's origin")
        elif envelope.session != self.session:
            raise Replay(
                f"{type(msg).__name__} sealed for sender session {envelope.session[:32]!r}, not this one "
                f"({self.session}): a replay from another run?"
            )
        claimed = msg.identity if isinstance(msg, Register) else self._routes.get(route, "")
        last = self._seqs.get((claimed, envelope.origin), -1)
        if envelope.seq <= last:
            raise Replay(f"{type(msg).__name__} with seq {envelope.seq} <= {last} already seen (a replay)")
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
        if peer is None or self._router is None:
            return False
        try:
            await self._router.send_multipart([peer.route, b""], zmq.NOBLOCK)
        except zmq.Again:
            return True  # its pipe is full: there, but slow
        except zmq.ZMQError:
            self._routes.pop(peer.route, None)
            del self.peers[identity]
            logger.info("receiver %s disconnected (host %s, pid %d)", identity, peer.host, peer.pid)
            return False
        return True

    async def _track(self, route: bytes, msg: Message, envelope: Seal | None) -> tuple[bool, bool]:
        """Registry bookkeeping; returns (whether the caller should see `msg`, whether it was admitted:
        only an admitted message's seq is recorded)."""
        if isinstance(msg, Register):
            return False, await self._register(route, msg, envelope)
        identity = self._routes[route]
        if isinstance(msg, Bye):
            self._byes += 1  # its disconnection is a clean one (`poll_connections`)
            self._routes.pop(route, None)
            self.contracts.pop(identity, None)
            if self.peers.pop(identity, None) is not None:
                logger.info("receiver %s left", identity)
            return False, True
        if identity in self.peers:
            self.peers[identity].last_seen = time.monotonic()
        if isinstance(msg, BucketDone):  # where the receiver is (the version's steps name laggards from it)
            self.progress[identity] = msg
            return False, True
        if isinstance(msg, Boxes):  # a page of the boxes it holds (protocol/declare.py), read at its next Ready
            self.declarations.add(identity, msg)
            return False, True
        if isinstance(msg, Contract):  # what its model loads quantized, read at its next Ready
            if identity in self.peers:
                self.contracts[identity] = msg
            return False, True
        if isinstance(msg, StoreRequest):
            try:
                reply = self._store.serve(msg)
            except ProtocolError as exc:
                self._dropped += 1
                self._drops.note(identity, exc)
                return False, True
            with contextlib.suppress(PeerError):
                await self._send_route(route, reply, identity)
            return False, True
        return True, True

    async def _register(self, route: bytes, msg: Register, envelope: Seal | None) -> bool:
        """Bind `msg.identity` to `route`, unless another connection that is still up holds it."""
        current = self.peers.get(msg.identity)
        instance = envelope.origin if envelope is not None else msg.instance
        if current is not None and current.route != route:
            if self._throttled(msg.identity):
                return False
            if await self.connected(msg.identity):
                await self._refuse(route, msg, current)
                return False
            self._routes.pop(current.route, None)  # its old connection is gone
        if current is None or current.pid != msg.pid:
            logger.info("receiver %s registered (host %s, pid %d, %s)", msg.identity, msg.host, msg.pid, msg.device)
        self.peers[msg.identity] = Peer(
            msg.identity, msg.host, msg.pid, msg.device, time.monotonic(),
            route=route, instance=instance, nonce=msg.nonce,
        )  # fmt: skip
        self._routes[route] = self._former_set(msg.identity, route)
        return True

    def _throttled(self, identity: str) -> bool:
        """Whether a duplicate registration for `identity` is dropped unanswered: one was answered (probe
        and `Refuse`) less than REFUSE_EVERY_S ago. A flood then costs a decode per message, not a round
        trip; a misconfigured second receiver re-registers every heartbeat and still hears why."""
        now = time.monotonic()
        if now - self._refused_at.get(identity, -math.inf) < REFUSE_EVERY_S:
            self.refused_registrations += 1
            self.throttled_registrations += 1
            return True
        self._refused_at[identity] = now
        self._refused_at.move_to_end(identity)
        while len(self._refused_at) > MAX_TRACKED_ORIGINS:
            self._refused_at.popitem(last=False)
        return False

    def _forgotten(self, route: bytes) -> bool:
        """A connection that registered and was forgotten since (`connected` found it gone while its Bye was still
        queued): its Bye is a goodbye, not a message from a stranger."""
        return route not in self._routes and route in self._former.values()

    def _former_set(self, identity: str, route: bytes) -> str:
        self._former[identity] = route
        if len(self._former) > MAX_TRACKED_ORIGINS:
            self._former.pop(next(iter(self._former)))
        return identity

    async def _refuse(self, route: bytes, msg: Register, current: Peer) -> None:
        self.refused_registrations += 1
        reason = (
            f"identity {msg.identity!r} is held by a connected receiver (host {current.host[:256]!r}, pid "
            f"{current.pid}); this one (host {msg.host[:256]!r}, pid {msg.pid}) is refused: give every rollout its "
            "own rollout.identity (null = <hostname>-<pid>)"
        )
        self._refusals.note(f"{msg.host[:256]!r} pid {msg.pid}", reason)
        # never wait on the refused connection: a flooder that does not read would stall the sender
        with contextlib.suppress(zmq.ZMQError):
            frames = self._frames(Refuse(msg.identity, reason), msg.nonce)
            await self._started().send_multipart([route, *frames], zmq.NOBLOCK)

    def forget(self, identity: str) -> None:
        """Drop a receiver from the registry (it re-registers if it is alive)."""
        peer = self.peers.pop(identity, None)  # its contract stays: a receiver forgotten for a late Ready and asked
        if peer is not None:  # again re-sends only its Ready (versions/steps.py), naming the contract it declared
            self._routes.pop(peer.route, None)

    async def send_all(self, identities: list[str], msg: Message) -> None:
        """`msg` to every one of `identities`; the first that fails raises `PeerError` (the others are sent
        anyway: all are submitted at once, then their outcomes, almost always known already, are checked in order)."""
        router = self._started()
        sends = [(router.submit([self._route_to(i), *self._frames(msg)]), i) for i in identities]
        for send, identity in sends:
            await self._sent(send, identity)
        # called once per bucket while streaming: handle what arrived at most every PUMP_EVERY_S (receivers
        # only write on a stall or to register, so their queues cannot near the budget in that time)
        now = time.monotonic()
        if now - self._pumped_at >= PUMP_EVERY_S:
            self._pumped_at = now
            await self._pump()

    # -- the data-plane rendezvous store (replaces an open TCPStore) ----------------------------------
    def rendezvous_store(self, prefix: str, timeout_s: float) -> Store:
        """The sender's view of the rendezvous store: local; receivers reach it via `StoreRequest`."""
        return PrefixStore(prefix, self._store.store)

    async def serve_until(self, work: asyncio.Future[Any], timeout_s: float) -> Any:
        """Await `work` (a transfer on the data-plane thread) for at most `timeout_s`, reading the socket
        meanwhile: a receiver may still be finishing its rendezvous for the group that transfer needs
        (the sender's own join returns first), and its store requests must be answered, not left
        waiting behind the transfer that waits for them. Other messages are kept for the next `recv`."""
        deadline = time.monotonic() + timeout_s
        while not work.done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise asyncio.TimeoutError
            await asyncio.wait({work}, timeout=min(left, PUMP_EVERY_S))
            if not work.done() and self._router is not None:
                await self._pump()
        return work.result()
