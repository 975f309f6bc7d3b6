"""A shared-slot sender's wait for bucket releases, on its event loop (`shared.py`).

The thread way (`SharedBucketBackend._await_releases`) polls the release sockets on the lane's data-plane thread;
a release then reaches the loop through three threads (that one, the executor's waiter, the loop's self-pipe),
one bucket at a time, on a machine where a thread hop costs tens of microseconds. Here the loop watches the same
two sockets itself (`add_reader`): a release datagram wakes it directly, and the wait of each bucket is a plain
future. What the thread way checks, this checks too: only members count, only releases of this version or later
are kept, a member whose process is gone fails the wait (looked at every `LIVENESS_S` while a wait is open), and
the wait ends after `timeout_s`, each failure with the same message.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import zmq

from ...errors import PeerError, ProtocolError, WeightSyncTimeout
from ...protocol.messages import MAC_LEN, MAX_FRAME_TO_SENDER, BucketDone, decode
from ..droplog import DropLog
from ..process import process_alive

LIVENESS_S = 0.5  # while a release is awaited, the members' processes are looked at this often (as the thread's poll)


class _Wait:
    """One bucket's release by every member of one version."""

    def __init__(self, future: asyncio.Future[None], members: dict[str, int], expected: int, timeout_s: float) -> None:
        self.future, self.members, self.expected, self.timeout_s = future, members, expected, timeout_s
        self.deadline = time.monotonic() + timeout_s

    def missing(self, done: set[str]) -> int:
        return len(self.members.keys() - done) if self.members else self.expected - len(done)


class LoopReleases:
    """The releases of one sender backend read on the event loop that awaits them. `sockets()` gives the ZeroMQ
    socket and the datagram socket (or None) as they are now, `lock` the ZeroMQ socket's (a wait of the thread
    way may still hold it), `frames_of` a datagram's frames; `name` names the backend in errors."""

    def __init__(
        self,
        name: str,
        sockets: Callable[[], tuple[zmq.Socket[Any] | None, socket.socket | None]],
        lock: threading.Lock,
        frames_of: Callable[[bytes], list[bytes]],
        auth_key: bytes | None,
        drops: DropLog,
    ) -> None:
        self.name, self._sockets, self._lock, self._frames_of = name, sockets, lock, frames_of
        self._auth_key, self._drops = auth_key, drops
        self.released: dict[tuple[int, int], set[str]] = {}  # (version, bucket index) -> who released it
        self._waits: dict[tuple[int, int], _Wait] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fds: list[int] = []
        self._timer: asyncio.TimerHandle | None = None

    def wait(self, version: int, bucket_index: int, members: dict[str, int], expected: int,
             timeout_s: float) -> asyncio.Future[None]:  # fmt: skip
        """A future of the running loop that completes once every member released `bucket_index` of `version`."""
        loop = asyncio.get_running_loop()
        self._watch(loop)
        for key in [k for k in self.released if k[0] < version]:  # left by an abandoned version
            self.released.pop(key, None)
        future: asyncio.Future[None] = loop.create_future()
        wait = _Wait(future, members, expected, timeout_s)
        key = (version, bucket_index)
        old = self._waits.pop(key, None)
        if old is not None and not old.future.done():
            old.future.set_exception(PeerError(f"{self.name}: bucket {bucket_index} awaited again"))
        self._waits[key] = wait
        # what came before this wait (and any edge of ZeroMQ's fd taken meanwhile): a release read here may be an
        # earlier bucket's too, so every open wait is settled, not only this one
        self._on_readable()
        if self._timer is None and key in self._waits:
            self._timer = loop.call_later(LIVENESS_S, self._look)
        return future

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Register the sockets with `loop` (again, where the sockets or the loop changed)."""
        sock, datagram = self._sockets()
        fds = [] if sock is None else [int(cast(int, sock.getsockopt(zmq.FD)))]
        if datagram is not None:
            fds.append(datagram.fileno())
        if loop is self._loop and fds == self._fds:
            return
        self.unwatch()
        for fd in fds:
            loop.add_reader(fd, self._on_readable)
        self._loop, self._fds = loop, fds

    def unwatch(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            for fd in self._fds:
                self._loop.remove_reader(fd)
        if self._timer is not None:
            self._timer.cancel()
        self._loop, self._fds, self._timer = None, [], None

    def _on_readable(self) -> None:
        self._read()
        for key in list(self._waits):
            self._settle(key)

    def _read(self) -> None:
        """Every release waiting on either socket, recorded (of this version or later: a stray or late release
        cannot free a slot early); a bad one is dropped and counted, as on the thread way."""
        sock, datagram = self._sockets()
        frames: list[list[bytes]] = []
        while datagram is not None:
            try:
                data = datagram.recv(MAX_FRAME_TO_SENDER + 1 + MAC_LEN, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            try:
                frames.append(self._frames_of(data))
            except ProtocolError as exc:
                self._drops.note("a release datagram", exc)
        # ZeroMQ's fd is edge-triggered: read until the socket says nothing is left, or the next edge never comes;
        # never block the loop on the lock (a thread way's wait polls under it): the next look reads it then
        if sock is not None and self._lock.acquire(blocking=False):
            try:
                while cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    try:
                        frames.append(sock.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break
            finally:
                self._lock.release()
        oldest = min((k[0] for k in self._waits), default=None)
        for message in frames:
            try:
                msg = decode(message, self._auth_key)
            except ProtocolError as exc:
                self._drops.note("a release connection", exc)
                continue
            if isinstance(msg, BucketDone) and (oldest is None or msg.version >= oldest):
                self.released.setdefault((msg.version, msg.bucket_index), set()).add(msg.identity)

    def _settle(self, key: tuple[int, int]) -> None:
        wait = self._waits.get(key)
        if wait is None:
            return
        if wait.future.done():  # given up by its caller (cancelled)
            self._waits.pop(key, None)
            return
        if wait.missing(self.released.get(key, set())) <= 0:
            self._waits.pop(key, None)
            self.released.pop(key, None)
            wait.future.set_result(None)

    def _look(self) -> None:
        """Every `LIVENESS_S` while a wait is open: an edge missed, a member gone, a wait past its deadline."""
        self._timer = None
        self._on_readable()
        now = time.monotonic()
        for key, wait in list(self._waits.items()):
            done = self.released.get(key, set())
            if now >= wait.deadline:
                error: Exception | None = WeightSyncTimeout(
                    f"{self.name}: bucket {key[1]} released by {wait.expected - wait.missing(done)} of "
                    f"{wait.expected} receivers within transport.timeout_s={wait.timeout_s}s (waiting for: "
                    f"{sorted(wait.members.keys() - done)})"
                )
            else:
                dead = sorted(i for i, pid in wait.members.items() if i not in done and not process_alive(pid))
                error = (
                    PeerError(f"{self.name}: receiver(s) {dead} died before releasing bucket {key[1]}")
                    if dead
                    else None
                )
            if error is not None:
                self._waits.pop(key, None)
                if not wait.future.done():
                    wait.future.set_exception(error)
        if self._waits and self._loop is not None and not self._loop.is_closed():
            self._timer = self._loop.call_later(LIVENESS_S, self._look)

    def fail(self, why: str) -> None:
        """Every open wait fails (the group was given up, or rebuilt: `join` runs on the data-plane thread, so each
        future is failed on its own loop)."""
        waits, self._waits = self._waits, {}
        for wait in waits.values():
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits any more
                wait.future.get_loop().call_soon_threadsafe(_fail, wait.future, PeerError(f"{self.name}: {why}"))
        self.released.clear()


def _fail(future: asyncio.Future[None], error: Exception) -> None:
    if not future.done():
        future.set_exception(error)
