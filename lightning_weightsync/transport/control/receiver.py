"""A receiver's end of the control plane: one DEALER socket that registers (and re-registers while
idle), reads and checks what the sender says, and reaches the sender's rendezvous store.

Every received frame goes through `unseal` / `decode` (signature, schema, ranges, and in sealed
mode: the sender session and its sequence); bad messages are counted and dropped, never acted upon.
A new sender session is adopted only through a message whose seal answers one of our recent `Register`s
(`Seal.answers`); what a message means for a version is the versions layer's business (`versions/steps.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections import OrderedDict
from typing import Any, cast

import zmq
from torch.distributed.distributed_c10d import Store
from zmq.utils.monitor import parse_monitor_message

from ...errors import ProtocolError, VersionAborted, WeightSyncTimeout
from ...protocol.messages import (
    MAX_FRAME_TO_RECEIVER,
    Bye,
    Message,
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
from ..sockets import DEFAULT_LIVENESS_S
from .handshakes import HANDSHAKE_FAILED, HandshakeVerdict
from .link import DropLog, Replay, curve_keys, endpoint, link_options, resolve_host
from .store import STORE_POLL_S, ControlPlaneStore

logger = logging.getLogger(__name__)
EDGE_LOOK_S = 0.05  # a recv that waits looks at the socket at least this often (an fd edge taken elsewhere)
BYE_LINGER_MS = 100  # on close, our Bye may take this long to leave (so the sender counts a clean close)
LOST_SENDER_CAUSES = (
    "the trainer exited or restarted, the link was silent past transport.liveness_s (ZMTP heartbeat), or the "
    "sender sent a frame over this receiver's {limit}-byte limit (ZMQ_MAXMSGSIZE: a sender of another "
    "lightning-weightsync version; libzmq drops such a connection with no other sign)"
)


class ReceiverControl:
    """The receiver's side: registers, heartbeats while idle, and reads what the sender says."""

    def __init__(
        self,
        host: str,
        port: int,
        key: bytes | None,
        identity: str,
        device: str,
        *,
        liveness_s: float = DEFAULT_LIVENESS_S,
    ) -> None:
        self.host, self.port, self.key, self.identity, self.device = host, port, key, identity, device
        self.liveness_s = liveness_s
        self.instance = secrets.token_hex(8)  # this process; a reconnect keeps it, a restart does not
        self.dropped_messages = 0
        self.replayed_messages = 0
        self.bucket_size: int | None = None
        self.refused: str | None = None  # the sender's reason, while it refuses our registration
        self.ends_join: tuple[type[Message], ...] = ()  # kinds that end a rendezvous wait (set by the version's steps)
        self.sender_session: str | None = None  # the session whose messages we accept (sealed mode)
        self._sender_seq = -1
        self._seq = 0
        self._nonces: OrderedDict[str, int] = OrderedDict()  # nonce of each recent Register -> its index
        self._nonce_count = 0
        self._nonce_floor = -1  # a new session must echo a nonce issued after this index
        self._request_id = 0
        self._drops = DropLog("dropped a control message", log=logger)
        self._refusals = DropLog("registration refused", log=logger)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ctx: zmq.Context[Any] | None = None
        self._sock: zmq.Socket[Any] | None = None
        self._stash: list[Message] = []
        self._fd: int | None = None  # the DEALER's ZMQ_FD, watched by the loop while a recv waits
        self._waiters: set[asyncio.Future[None]] = set()  # the recvs waiting for it
        self._watching: asyncio.AbstractEventLoop | None = None  # the loop whose reader watches it
        self._monitor: zmq.Socket[Any] | None = None  # the DEALER's connection events (see `sender_link`)
        self._linked = False
        self._link_changed = time.monotonic()
        self.dropped_connections = 0  # links to the sender lost after their handshake (`sender_link`)
        # INFO, not WARNING: the usual cause is a trainer that finished (it says no Bye), not a fault
        self._lost_links = DropLog("lost the control connection", log=logger, level=logging.INFO)
        self._handshake = HandshakeVerdict(self.address, bool(key))

    @property
    def address(self) -> str:
        return endpoint(self.host, self.port)

    async def start(self) -> None:
        resolve_host(self.host)
        self._loop = asyncio.get_running_loop()
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.DEALER)  # no IDENTITY: the sender's ROUTER names the connection
        link_options(sock, self.host, self.liveness_s, to_sender=False)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        if self.key:
            keys = curve_keys(self.key)
            sock.curve_serverkey = keys.server_public
            sock.curve_publickey = keys.client_public
            sock.curve_secretkey = keys.client_secret
        events = zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILED | zmq.EVENT_DISCONNECTED
        self._monitor = sock.get_monitor_socket(events)
        sock.connect(self.address)
        self._sock, self._fd = sock, int(cast(int, sock.getsockopt(zmq.FD)))
        await self.register()

    def sender_link(self) -> tuple[bool, float]:
        """(whether a connection to the sender is up, its handshake done, seconds since that last changed).
        Between versions the sender says nothing, so this is the only sign of a trainer: its process keeps
        the connection (and the ZMTP heartbeat) up whether or not it is syncing; a wrong port, a trainer
        not running, or another `transport.auth_token` all read as not linked (the last one also sets
        `handshake_refused` and says so in the log)."""
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                while True:
                    message = parse_monitor_message(self._monitor.recv_multipart(flags=zmq.NOBLOCK))
                    event = message["event"]
                    self._handshake.seen(event, message["value"])
                    if event not in (zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_DISCONNECTED):
                        continue
                    linked = event == zmq.EVENT_HANDSHAKE_SUCCEEDED
                    if self._linked and event == zmq.EVENT_DISCONNECTED:
                        self._lost_link()
                    if linked != self._linked:
                        self._linked, self._link_changed = linked, time.monotonic()
        return self._linked, time.monotonic() - self._link_changed

    @property
    def handshake_refused(self) -> str | None:
        """Why the sender refuses our handshake (another `transport.auth_token`, or one on one side only), or
        None; read from the link's events by `sender_link`."""
        return self._handshake.refused

    def _lost_link(self) -> None:
        """A link that passed its handshake went down, and not by our `close` (it stops the monitor first).
        libzmq 4.3 gives an over-size frame no event of its own (decoder EMSGSIZE -> protocol error ->
        EVENT_DISCONNECTED, as for a sender that exits), so the line names every likely cause."""
        self.dropped_connections += 1
        self._lost_links.note(f"the sender at {self.address}", LOST_SENDER_CAUSES.format(limit=MAX_FRAME_TO_RECEIVER))

    async def close(self) -> None:
        if self._monitor is not None:
            if self._sock is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        if self._sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                await self.send(Bye(self.identity))
            if self._watching is not None and self._fd is not None and not self._watching.is_closed():
                self._watching.remove_reader(self._fd)
                self._watching = None
            self._sock.close(linger=BYE_LINGER_MS)
            self._sock = self._fd = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def register(self, last_version: int = -1) -> None:
        """Announce this receiver (`last_version`: the last version it received whole, as the version's steps say)."""
        nonce = secrets.token_hex(8)
        self._nonces[nonce] = self._nonce_count
        self._nonce_count += 1
        while len(self._nonces) > 256:
            self._nonces.popitem(last=False)
        msg = Register(
            self.identity, socket.gethostname(), os.getpid(), self.device, last_version,
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
            self._sock.send_multipart(self._frames(msg), flags=zmq.NOBLOCK)

    def send_soon(self, msg: Message) -> None:
        """Best effort, from a callback (no await): queue `msg` unless the pipe is full or the socket
        closed (a progress report that does not get through is superseded by the next one)."""
        if self._sock is None:
            return
        with contextlib.suppress(zmq.ZMQError):  # a full pipe (EAGAIN) is fine: best effort
            self._sock.send_multipart(self._frames(msg), flags=zmq.NOBLOCK)

    def stash(self, msg: Message) -> None:
        """Keep a message for the next `recv` (e.g. a new version's `Prepare` seen mid-version)."""
        self._stash.append(msg)

    @property
    def stashed(self) -> int:
        """Messages kept for the next `recv`s."""
        return len(self._stash)

    async def recv(self, timeout_s: float, *, from_stash: bool = True) -> Message | None:
        """The next message (a stashed one first, unless `from_stash` is false: then only what the socket holds,
        for a reader that stashes what it is not after, in order), or None after `timeout_s`."""
        assert self._sock is not None, "call start() first"
        if self._stash and from_stash:
            return self._stash.pop(0)
        deadline = time.monotonic() + timeout_s
        while True:
            frames = await self._next_frames(deadline)
            if frames is None:
                return None
            if len(frames) == 1 and not frames[0]:
                continue  # the sender's liveness probe (see `SenderControl.connected`)
            try:
                msg = self._open(frames)
            except ProtocolError as exc:
                self.dropped_messages += 1
                if isinstance(exc, Replay):
                    self.replayed_messages += 1
                self._drops.note("the sender", exc)
                continue
            if isinstance(msg, Refuse):
                if self.refused is None:
                    logger.error("the sender at %s refused this receiver: %s", self.address, msg.reason)
                self.refused = msg.reason
                self._refusals.note(self.address, msg.reason)
                continue
            return msg

    async def _next_frames(self, deadline: float) -> list[bytes] | None:
        """The next message's frames off the socket, or None at `deadline`. Read in place when one is there (the
        usual case while a version streams: metadata runs ahead of the bytes); else the loop watches the socket's
        fd until it signals. ZMQ_FD is edge-triggered and any socket call may take its edge, so ZMQ_EVENTS decides,
        and a wait never lasts over `EDGE_LOOK_S` without looking again."""
        sock = self._sock
        assert sock is not None, "call start() first"
        while True:
            if cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                with contextlib.suppress(zmq.Again):
                    return sock.recv_multipart(zmq.NOBLOCK)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.sender_link()  # reads the link's events: a lost link is counted and logged while we wait
            await self._readable(min(left, EDGE_LOOK_S))

    async def _readable(self, timeout_s: float) -> None:
        """Until the socket's fd signals or `timeout_s` passed. Several readers may wait at once (a store call
        of the data plane's rendezvous beside a version's read): the loop holds one reader of the fd, which
        wakes them all."""
        assert self._fd is not None
        loop = asyncio.get_running_loop()  # the one that reads now (a caller may drive us from another than start's)
        woken: asyncio.Future[None] = loop.create_future()
        if not self._waiters:
            loop.add_reader(self._fd, self._wake_all)
            self._watching = loop
        self._waiters.add(woken)
        timer = loop.call_later(timeout_s, _wake, woken)
        try:
            await woken
        finally:
            timer.cancel()
            self._waiters.discard(woken)
            if not self._waiters and self._fd is not None:
                loop.remove_reader(self._fd)
                self._watching = None

    def _wake_all(self) -> None:
        for woken in self._waiters:
            _wake(woken)

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
                raise Replay(f"{type(msg).__name__} with seq {envelope.seq} <= {self._sender_seq} (a replay)")
            self._sender_seq = envelope.seq
            return msg
        # another session: only a message whose seal answers one of our recent Registers counts
        nonce = envelope.answers
        index = self._nonces.get(nonce, -1) if nonce else -1
        if index <= self._nonce_floor:
            raise Replay(
                f"{type(msg).__name__} from sender session {envelope.session[:32]!r}, not the current one, and "
                "not answering a recent registration (a replay from another run?)"
            )
        if not isinstance(msg, Refuse):  # a refusal answers a registration but starts no conversation
            self.sender_session, self._sender_seq, self._nonce_floor = envelope.session, envelope.seq, index
        return msg

    async def recv_before(self, deadline: float, awaited: str) -> Message:
        """The next valid message, or `WeightSyncTimeout` naming what was awaited from whom."""
        left = deadline - time.monotonic()
        msg = await self.recv(left) if left > 0 else None
        if msg is None:
            raise WeightSyncTimeout(f"{awaited} not received from the sender at {self.address} in time")
        return msg

    # -- the data-plane rendezvous, through the sender ----------------------------------------------
    async def store_call(self, op: str, key: str, value: bytes, timeout_s: float) -> StoreReply:
        """One request to the sender's rendezvous store; other messages that arrive meanwhile are
        kept for later, except those of the kinds in `ends_join` (the version steps': the sender gave up the group),
        which end the wait with `VersionAborted`."""
        self._request_id += 1
        request_id = self._request_id
        await self.send(StoreRequest(self.identity, request_id, op, key, value))
        deadline = time.monotonic() + timeout_s
        kept: list[Message] = []
        try:
            while True:
                msg = await self.recv_before(deadline, f"the rendezvous store's answer to {op} {key!r}")
                if isinstance(msg, StoreReply):
                    if msg.request_id == request_id:
                        return msg
                    continue  # an answer to an earlier request we stopped waiting for
                kept.append(msg)
                if isinstance(msg, self.ends_join):
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

    def rendezvous_store(self, prefix: str, timeout_s: float) -> Store:
        """A `torch.distributed.Store` for a process group built on another thread (the executor): each call
        runs `store_call` / `store_get` on this control plane's event loop."""
        assert self._loop is not None, "call start() first"
        return ControlPlaneStore(self, self._loop, prefix, timeout_s)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def default_identity() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"
