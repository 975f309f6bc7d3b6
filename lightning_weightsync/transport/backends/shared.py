"""Colocated backends: the two bucket slots live in memory every process can map (POSIX shared
memory for `shm`, CUDA IPC for `cuda_ipc`), so nothing is copied over a network at all.

"Broadcast" is a handshake: the sender packs a slot and publishes its metadata (control plane);
each receiver reads the slot in place and sends a signed `BucketDone` to the sender's release
socket (ZeroMQ PUSH -> PULL). The sender's `broadcast()` returns once every receiver released the
bucket, which is exactly when the slot may be packed again (double buffering as for gloo). The engine does
not call it on a thread: a receiver's broadcast does nothing (`receive_in_place`), and the sender waits for
the releases on its event loop (`loop_broadcast`, `loop_releases.py`), a thread hop or three fewer a bucket.

On Linux a release takes a shorter way where it can: one datagram to a Unix socket in the abstract
namespace, named after the release address (`release_name`), which the sender's wait polls beside the
ZeroMQ socket. A ZeroMQ message crosses two I/O threads and TCP (a round trip ~90 us on a 2-core
machine, the datagram's ~9 us), and a release is on every bucket's critical path. The same signed
frames travel either way; a receiver that cannot reach the name (another network namespace, a full
queue) sends over ZeroMQ, as everywhere else.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import socket
import sys
import threading
import time
from abc import abstractmethod
from typing import Any

import torch
import zmq

from ...errors import ConfigError, PeerError, ProtocolError, WeightSyncError, WeightSyncTimeout
from ...protocol.joins.shared import SharedJoin
from ...protocol.messages import (
    MAC_LEN,
    MAX_FRAME_TO_RECEIVER,
    MAX_FRAME_TO_SENDER,
    BucketDone,
    GroupSpec,
    decode,
    encode,
)
from ..droplog import DropLog
from ..process import process_alive
from ..sockets import network_options
from .base import NUM_SLOTS, Backend
from .loop_releases import LoopReleases

logger = logging.getLogger(__name__)

DATAGRAM_RELEASES = sys.platform.startswith("linux")  # abstract Unix socket names are Linux's


def release_name(release_addr: str) -> bytes:
    """The abstract Unix socket name a sender bound for the datagram releases of `release_addr`: unique on
    this host's network namespace while that TCP address is bound, so both sides derive it from the plan."""
    return b"\0lightning-weightsync/release/" + hashlib.sha256(release_addr.encode()).hexdigest()[:32].encode()


def to_datagram(frames: list[bytes]) -> bytes:
    """A release's frames (`[body]` or `[mac, body]`) as one datagram: a frame count byte, then the frames."""
    return bytes([len(frames)]) + b"".join(frames)


def from_datagram(data: bytes) -> list[bytes]:
    """The frames of a datagram from `to_datagram` (`decode` authenticates and validates them)."""
    if data[:1] == b"\x01":
        return [data[1:]]
    if data[:1] == b"\x02" and len(data) > 1 + MAC_LEN:
        return [data[1 : 1 + MAC_LEN], data[1 + MAC_LEN :]]
    raise ProtocolError(f"malformed release datagram ({len(data)} bytes)")


class SharedBucketBackend(Backend):
    join_type = SharedJoin
    receive_in_place = True  # a receiver reads the sender's slot where it is: its `broadcast` returns at once

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._ctx: zmq.Context[Any] | None = None
        self._socket: zmq.Socket[Any] | None = None
        # the datagram way (module docstring): the sender's bound socket, a receiver's unbound one and the name
        self._datagram: socket.socket | None = None
        self._datagram_to: bytes | None = None
        self._release_addr = ""
        self._handles: list[str] = []
        # A sender's release wait still running on an executor thread given up after a failure may
        # overlap the next group's wait on the new thread: a ZeroMQ socket must not be used by both.
        self._socket_lock = threading.Lock()
        self._released: dict[tuple[int, int], set[str]] = {}  # (version, bucket index) -> who released it
        self._drops = DropLog(f"{self.name}: dropped a bad release message", log=logger)
        self._on_loop = LoopReleases(
            self.name, lambda: (self._socket, self._datagram), self._socket_lock, from_datagram, self.auth_key,
            self._drops,
        )  # fmt: skip

    # -- buffers: what differs between shm and cuda_ipc -----------------------------------------
    @abstractmethod
    def _create_slots(self) -> tuple[list[torch.Tensor], list[str]]:
        """Sender: allocate the slots and return them with their handles (strings for the plan)."""

    @abstractmethod
    def _attach_slots(self, handles: list[str], nbytes: int) -> list[torch.Tensor]:
        """Receiver: map the sender's slots from their handles."""

    # -- set-up -----------------------------------------------------------------------------
    def setup(self, host: str, store_port: int) -> None:
        self.buckets, self._handles = self._create_slots()
        self._ctx = zmq.Context.instance()
        self._socket = self._ctx.socket(zmq.PULL)
        self._socket.linger = 0
        network_options(self._socket, max_frame_bytes=MAX_FRAME_TO_SENDER)  # anyone on the host may connect
        try:
            port = self._socket.bind_to_random_port(f"tcp://{host}") if store_port == 0 else store_port
            if store_port:
                self._socket.bind(f"tcp://{host}:{store_port}")
        except zmq.ZMQError as exc:
            raise ConfigError(
                f"{self.name}: cannot listen on {host}:{store_port} for bucket releases ({exc}); "
                "set transport.store_port to a free port (0: any) or transport.host to a local address"
            ) from exc
        self._release_addr = f"tcp://{host}:{port}"
        if DATAGRAM_RELEASES:
            self._datagram = _bound_datagram(release_name(self._release_addr))

    def join_spec(self, generation: int) -> SharedJoin:
        return SharedJoin(list(self._handles), self._release_addr)

    def _receiver_buckets(self, group: GroupSpec) -> list[torch.Tensor]:
        assert isinstance(group.join, SharedJoin)  # checked by Backend.join
        if len(group.join.slots) != NUM_SLOTS:
            raise ProtocolError(
                f"plan for backend {self.name} has {len(group.join.slots)} slot handles, expected {NUM_SLOTS}"
            )
        return self._attach_slots(group.join.slots, group.bucket_size)

    def _build_group(self, group: GroupSpec, rank: int) -> None:
        if self.is_sender:
            return
        assert isinstance(group.join, SharedJoin)  # checked by Backend.join
        if self._socket is not None:
            self._socket.close(linger=0)
        self._ctx = zmq.Context.instance()
        self._socket = self._ctx.socket(zmq.PUSH)
        network_options(self._socket, max_frame_bytes=MAX_FRAME_TO_RECEIVER)
        self._socket.linger = 1000
        try:
            self._socket.connect(group.join.release_addr)
        except zmq.ZMQError as exc:
            raise ProtocolError(f"plan release_addr {group.join.release_addr!r} is unusable: {exc}") from exc
        self._close_datagram()
        if DATAGRAM_RELEASES:
            self._datagram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._datagram_to = release_name(group.join.release_addr)

    # -- data path --------------------------------------------------------------------------
    def broadcast(self, slot: int, nbytes: int, bucket_index: int, buffer: torch.Tensor | None = None) -> None:
        if not self.is_sender:
            return  # the bytes are already in the mapped slot (`receive_in_place`: not even called)
        self.wait_fence(slot)
        self._await_releases(bucket_index, self.world_size - 1)

    def loop_broadcast(
        self, slot: int, nbytes: int, bucket_index: int, buffer: torch.Tensor | None = None
    ) -> asyncio.Future[None] | None:
        """Sender: the wait for every member's release of the bucket, on the running loop (`loop_releases.py`)."""
        if not self.is_sender or buffer is not None:
            return None
        self.wait_fence(slot)
        self._require_socket()
        return self._on_loop.wait(self.version, bucket_index, self.members, self.world_size - 1, self.timeout_s)

    def _await_releases(self, bucket_index: int, expected: int) -> None:
        """Block until every member released `bucket_index` of this version. Only members count, and
        only releases of this version (a stray or late release cannot free a slot early); since all
        processes share this host, a member whose process is gone fails the wait at once instead of
        after transport.timeout_s."""
        self._require_socket()
        deadline = time.monotonic() + self.timeout_s
        version = self.version
        for key in [k for k in list(self._released) if k[0] < version]:  # left by an abandoned version
            self._released.pop(key, None)
        done = self._released.setdefault((version, bucket_index), set())
        members = self.members

        def missing() -> int:
            return len(members.keys() - done) if members else expected - len(done)

        while missing() > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WeightSyncTimeout(
                    f"{self.name}: bucket {bucket_index} released by {expected - missing()} of {expected} receivers "
                    f"within transport.timeout_s={self.timeout_s}s (waiting for: {sorted(members.keys() - done)})"
                )
            with self._socket_lock:
                if self._socket is None:
                    raise PeerError(f"{self.name}: closed while waiting for releases of bucket {bucket_index}")
                frames = self._next_release(int(min(left, 0.5) * 1000))
            if frames is None:
                dead = sorted(i for i, pid in members.items() if i not in done and not process_alive(pid))
                if dead:
                    raise PeerError(f"{self.name}: receiver(s) {dead} died before releasing bucket {bucket_index}")
                continue
            try:
                msg = decode(frames, self.auth_key)
            except ProtocolError as exc:
                self._drops.note("a release connection", exc)
                continue
            # Recorded for whichever wait needs it: a wait of an abandoned version still running on an
            # old executor thread may read the next version's releases off the socket.
            if isinstance(msg, BucketDone) and msg.version >= version:
                self._released.setdefault((msg.version, msg.bucket_index), set()).add(msg.identity)
        self._released.pop((version, bucket_index), None)

    def _next_release(self, timeout_ms: int) -> list[bytes] | None:
        """Sender, under the socket lock: the frames of one release from either way, waiting up to `timeout_ms`;
        None if none came. A datagram that is not one is dropped (and counted) like a bad message."""
        assert self._socket is not None  # checked by the caller
        if self._datagram is None:
            return self._socket.recv_multipart() if self._socket.poll(timeout_ms) else None
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._datagram, zmq.POLLIN)
        ready = dict(poller.poll(timeout_ms))
        if self._datagram.fileno() in ready or self._datagram in ready:
            try:
                return from_datagram(self._datagram.recv(MAX_FRAME_TO_SENDER + 1 + MAC_LEN, socket.MSG_DONTWAIT))
            except BlockingIOError:
                pass
            except ProtocolError as exc:
                self._drops.note("a release datagram", exc)
        if self._socket in ready:
            return self._socket.recv_multipart()
        return None

    def release(self, slot: int, bucket_index: int) -> None:
        socket_ = self._require_socket()
        self.wait_fence(slot)  # our copies out of the slot must be done before the sender reuses it
        frames = encode(BucketDone(self.identity, self.version, bucket_index), self.auth_key)
        if self._datagram is not None and self._datagram_to is not None:
            try:
                self._datagram.sendto(to_datagram(frames), socket.MSG_DONTWAIT, self._datagram_to)
                return
            except OSError as exc:  # the sender's queue is full: this one over ZeroMQ; unreachable: all of them
                if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                    logger.debug("%s: releases go over ZeroMQ (%s)", self.name, exc)
                    self._datagram_to = None
        socket_.send_multipart(frames)

    def _require_socket(self) -> zmq.Socket[Any]:
        if self._socket is None:
            raise WeightSyncError(f"{self.name} backend used before setup()/join() or after close()")
        return self._socket

    def _drop_group(self) -> None:
        self._released.clear()
        self._on_loop.fail("the group was given up while a bucket's releases were awaited")

    def _close_datagram(self) -> None:
        if self._datagram is not None:
            self._datagram.close()
        self._datagram, self._datagram_to = None, None

    def close(self) -> None:
        super().close()
        self._on_loop.unwatch()
        with self._socket_lock:  # a release wait still polling finishes its poll first (<= 0.5 s)
            if self._socket is not None:
                self._socket.close(linger=0)
                self._socket = None
            self._close_datagram()


def _bound_datagram(name: bytes) -> socket.socket | None:
    """The sender's datagram socket bound to `name`, or None (releases then all come over ZeroMQ)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(name)
    except OSError as exc:
        sock.close()
        logger.debug("shared-slot releases over ZeroMQ only: cannot bind a datagram socket (%s)", exc)
        return None
    return sock
