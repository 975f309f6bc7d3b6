"""Colocated backends: the two bucket slots live in memory every process can map (POSIX shared
memory for `shm`, CUDA IPC for `cuda_ipc`), so nothing is copied over a network at all.

"Broadcast" is a handshake: the sender packs a slot and publishes its metadata (control plane);
each receiver reads the slot in place and sends a signed `BucketDone` to the sender's release
socket (ZeroMQ PUSH -> PULL). The sender's `broadcast()` returns once every receiver released the
bucket, which is exactly when the slot may be packed again (double buffering as for gloo).
"""

from __future__ import annotations

import logging
import threading
import time
from abc import abstractmethod
from typing import Any

import torch
import zmq

from ...errors import ConfigError, PeerError, ProtocolError, WeightSyncError, WeightSyncTimeout
from ...protocol.joins.shared import SharedJoin
from ...protocol.messages import (
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

logger = logging.getLogger(__name__)


class SharedBucketBackend(Backend):
    join_type = SharedJoin

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._ctx: zmq.Context[Any] | None = None
        self._socket: zmq.Socket[Any] | None = None
        self._release_addr = ""
        self._handles: list[str] = []
        # A sender's release wait still running on an executor thread given up after a failure may
        # overlap the next group's wait on the new thread: a ZeroMQ socket must not be used by both.
        self._socket_lock = threading.Lock()
        self._released: dict[tuple[int, int], set[str]] = {}  # (version, bucket index) -> who released it
        self._drops = DropLog(f"{self.name}: dropped a bad release message", log=logger)

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

    # -- data path --------------------------------------------------------------------------
    def broadcast(self, slot: int, nbytes: int, bucket_index: int, buffer: torch.Tensor | None = None) -> None:
        if not self.is_sender:
            return  # the bytes are already in the mapped slot
        self.wait_fence(slot)
        self._await_releases(bucket_index, self.world_size - 1)

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
                frames = self._socket.recv_multipart() if self._socket.poll(int(min(left, 0.5) * 1000)) else None
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

    def release(self, slot: int, bucket_index: int) -> None:
        socket = self._require_socket()
        self.wait_fence(slot)  # our copies out of the slot must be done before the sender reuses it
        socket.send_multipart(encode(BucketDone(self.identity, self.version, bucket_index), self.auth_key))

    def _require_socket(self) -> zmq.Socket[Any]:
        if self._socket is None:
            raise WeightSyncError(f"{self.name} backend used before setup()/join() or after close()")
        return self._socket

    def _drop_group(self) -> None:
        self._released.clear()

    def close(self) -> None:
        super().close()
        with self._socket_lock:  # a release wait still polling finishes its poll first (<= 0.5 s)
            if self._socket is not None:
                self._socket.close(linger=0)
                self._socket = None
