"""ZeroMQ control plane: registration, liveness, group formation, and message transport.

One ROUTER socket on the sender, one DEALER per receiver (reliable, per-peer ordered, no
slow-joiner losses as with PUB/SUB). Receivers register on start and re-register every heartbeat
interval while idle, so a restarted trainer learns about them again without any action. Liveness
is checked when it matters: at the start of every version the sender sends `Prepare` to every
registered receiver and forms the group from those that answer `Ready` in time.

Every received frame goes through `wire.decode` (signature, schema, ranges); bad messages are
logged, counted and dropped, never acted upon.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio

from ..errors import PeerError, ProtocolError, VersionAborted, WeightSyncTimeout
from ..protocol.messages import Abort, Ack, BucketMeta, Bye, Message, Plan, Prepare, Ready, Register, decode, encode

logger = logging.getLogger(__name__)


def endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


@dataclass
class Peer:
    identity: str
    host: str
    pid: int
    device: str
    last_version: int
    last_seen: float
    group_generation: int = -1  # as reported in the peer's last `Ready`

    @property
    def key(self) -> tuple[str, int]:
        """Same identity but another pid means a restarted receiver: its old group is gone."""
        return (self.identity, self.pid)


class SenderControl:
    """The sender's side: knows the registered receivers and talks to each of them."""

    def __init__(self, host: str, port: int, key: bytes | None, bucket_size: int) -> None:
        self.host, self.requested_port, self.key, self.bucket_size = host, port, key, bucket_size
        self.port = port
        self.peers: dict[str, Peer] = {}
        self.dropped_messages = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None

    @property
    def address(self) -> str:
        return endpoint(self.host, self.port)

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished peer raises instead of dropping
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted receiver reclaims its identity
        sock.setsockopt(zmq.LINGER, 0)
        if ":" in self.host:
            sock.setsockopt(zmq.IPV6, 1)
        try:
            if self.requested_port == 0:
                self.port = sock.bind_to_random_port(endpoint(self.host, 0).rsplit(":", 1)[0])
            else:
                sock.bind(endpoint(self.host, self.requested_port))
        except zmq.ZMQError as exc:
            sock.close()
            raise PeerError(
                f"cannot bind the control socket on {endpoint(self.host, self.requested_port)}: {exc}; "
                "set transport.port to a free port (0 lets the OS choose)"
            ) from None
        self._sock = sock
        logger.info("weight sender control plane listening on %s", self.address)

    async def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # -- transport ----------------------------------------------------------------------------
    async def send(self, identity: str, msg: Message) -> None:
        assert self._sock is not None, "call start() first"
        try:
            await self._sock.send_multipart([identity.encode(), *encode(msg, self.key)])
        except zmq.ZMQError as exc:
            raise PeerError(f"receiver {identity!r} is unreachable ({exc})") from None

    async def recv(self, timeout_s: float) -> tuple[str, Message] | None:
        """One valid message, or None when `timeout_s` passed; bad messages are dropped."""
        assert self._sock is not None, "call start() first"
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not await self._sock.poll(max(1, int(left * 1000))):
                return None
            frames = await self._sock.recv_multipart()
            routing_id = frames[0].decode(errors="replace")
            try:
                msg = decode(frames[1:], self.key, bucket_size=self.bucket_size)
                claimed = getattr(msg, "identity", routing_id)
                if claimed != routing_id:
                    raise ProtocolError(f"message claims identity {claimed!r} but came from {routing_id!r}")
            except ProtocolError as exc:
                self.dropped_messages += 1
                logger.warning("dropped a control message from %r: %s", routing_id, exc)
                continue
            if self._track(routing_id, msg):
                return routing_id, msg

    def _track(self, identity: str, msg: Message) -> bool:
        """Registry bookkeeping; returns False for messages fully handled here."""
        if isinstance(msg, Register):
            peer = self.peers.get(identity)
            if peer is None or peer.pid != msg.pid:
                logger.info("receiver %s registered (host %s, pid %d, %s)", identity, msg.host, msg.pid, msg.device)
            self.peers[identity] = Peer(identity, msg.host, msg.pid, msg.device, msg.last_version, time.monotonic())
            return False
        if isinstance(msg, Bye):
            if self.peers.pop(identity, None) is not None:
                logger.info("receiver %s left", identity)
            return False
        if identity in self.peers:
            self.peers[identity].last_seen = time.monotonic()
        return True

    async def send_all(self, peers: list[Peer], msg: Message) -> None:
        for peer in peers:
            await self.send(peer.identity, msg)

    # -- group formation ----------------------------------------------------------------------
    async def gather_ready(
        self, version: int, session: str, *, min_receivers: int, timeout_s: float, ready_timeout_s: float
    ) -> list[Peer]:
        """Ask every registered receiver to join `version`; return those that answered in time.

        Waits up to `timeout_s` for at least `min_receivers`; a registered receiver that does not
        answer within `ready_timeout_s` is presumed dead and forgotten (it re-registers if alive).
        """
        deadline = time.monotonic() + timeout_s
        asked: dict[str, float] = {}
        ready: dict[str, Peer] = {}
        while True:
            now = time.monotonic()
            for identity in list(self.peers):
                if identity not in asked:
                    try:
                        await self.send(identity, Prepare(version, session))
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
                return sorted(ready.values(), key=lambda p: p.identity)
            if now >= deadline:
                raise WeightSyncTimeout(
                    f"version {version}: {len(ready)} of trainer.min_receivers={min_receivers} receivers ready "
                    f"within transport.timeout_s={timeout_s}s at {self.address} (registered: {sorted(self.peers)}); "
                    "start a rollout daemon pointing at this address, or lower trainer.min_receivers"
                )
            got = await self.recv(min(0.05 if waiting else 0.5, max(deadline - now, 0.001)))
            if got is None:
                continue
            identity, msg = got
            if isinstance(msg, Ready) and msg.version == version and identity in self.peers:
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


class ReceiverControl:
    """The receiver's side: registers, heartbeats while idle, and reads what the sender says."""

    def __init__(self, host: str, port: int, key: bytes | None, identity: str, device: str) -> None:
        self.host, self.port, self.key, self.identity, self.device = host, port, key, identity, device
        self.dropped_messages = 0
        self.last_version = -1
        self.bucket_size: int | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._stash: list[Message] = []

    @property
    def address(self) -> str:
        return endpoint(self.host, self.port)

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.identity.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        if ":" in self.host:
            sock.setsockopt(zmq.IPV6, 1)
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
        msg = Register(self.identity, socket.gethostname(), os.getpid(), self.device, self.last_version)
        await self.send(msg)

    async def send(self, msg: Message) -> None:
        assert self._sock is not None, "call start() first"
        # never block on a missing sender: drop the message if the pipe is full
        with contextlib.suppress(zmq.Again):
            await self._sock.send_multipart(encode(msg, self.key), flags=zmq.NOBLOCK)

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
            try:
                return decode(frames, self.key, bucket_size=self.bucket_size)
            except ProtocolError as exc:
                self.dropped_messages += 1
                logger.warning("dropped a control message from the sender: %s", exc)

    async def wait_prepare(self, heartbeat_interval_s: float, wait_s: float | None) -> Prepare:
        """Block until the sender starts a version; re-register every heartbeat meanwhile."""
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while True:
            left = heartbeat_interval_s if deadline is None else min(heartbeat_interval_s, deadline - time.monotonic())
            if left <= 0:
                raise WeightSyncTimeout(f"no version started by the sender at {self.address} within {wait_s}s")
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


def default_identity() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


__all__ = ["Peer", "ReceiverControl", "SenderControl", "default_identity", "endpoint"]
