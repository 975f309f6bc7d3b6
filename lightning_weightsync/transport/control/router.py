"""The sender's ROUTER socket, read all the time by a thread of its own into the bounded `Inbox`, and
written by the asyncio side directly, the two kept apart by a lock.

Why a thread: the socket must never stop being read (`transport/sockets.py`: libzmq's pipe has no
high-water mark, so that a full pipe and a reset peer cannot abort the process), but the trainer's event
loop does not run during a training step (minutes). Read by the loop, what a peer sent meanwhile piled up
in libzmq without bound; read by this thread, it piles up in the inbox, which has a budget and drops the
excess, counted.

Why a lock and not a thread that also sends: a ZeroMQ socket may be used by one thread at a time, with a
full memory barrier between (a mutex gives it). Handing every send to the thread cost a thread hop per
message, ~180 us against ~10 us for a send in place (measured: 2000 sends through `SenderControl`), and the
sender sends one message per bucket or direct tensor: 12-18 % of a CPU loopback version's throughput. So
the caller sends in place, under the lock, NOBLOCK; the thread never blocks while it holds the lock: it
waits on the socket's file descriptor (`ZMQ_FD`, a plain fd: no socket call) outside it, then reads what is
there under it. `ZMQ_FD` is edge-triggered and any socket call may consume its edge, so whoever holds the
lock reads what is pending before letting go (a send drains too), and the thread also looks every
`POLL_S` without an edge.

A send that finds the peer's pipe full (`zmq.Again` on a blocking send) goes to the thread, which retries
it every `RETRY_S` and fails it with `zmq.Again` after `send_wait_s` (the ZMTP heartbeat drops a frozen peer
within `transport.liveness_s`, so a pipe full for longer belongs to a peer that is not reading). Every send
returns a `concurrent.futures.Future` with the exact outcome (`zmq.Again` for a NOBLOCK send to a full
pipe, `EHOSTUNREACH` under ROUTER_MANDATORY for a connection that is gone), almost always already done.

Decoding, unsealing and every decision stay on the asyncio side (`sender.py`); here only frames move.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import select
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, cast

import zmq

from .inbox import Inbox

logger = logging.getLogger(__name__)

READ_BATCH = 1024  # messages read per turn under the lock: a flood cannot hold a send up long
MAX_FRAMES = 5  # kept of one message: the route and one more frame than a legal message has (3 sealed)
RETRY_S = 0.002  # while a send waits for room in a full pipe, it is retried this often
POLL_S = 0.02  # the thread looks at the socket at least this often (ZMQ_FD's edge may have been taken)


@dataclass
class _Send:
    frames: list[bytes]
    nonblocking: bool
    deadline: float
    future: concurrent.futures.Future[None]


class RouterThread:
    """Reads `sock` (bound, options set) from `start` until `stop`; every other use of it goes through `submit`."""

    def __init__(self, sock: zmq.Socket[Any], inbox: Inbox, *, send_wait_s: float) -> None:
        self.sock, self.inbox, self.send_wait_s = sock, inbox, send_wait_s
        self._fd = int(sock.getsockopt(zmq.FD))
        self._lock = threading.Lock()  # whoever holds it may use the socket
        self._blocked: deque[_Send] = deque()  # blocking sends that met a full pipe, retried by the thread
        self._stopping = False
        self._notify_pending = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._arrived: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="lws-sender-router", daemon=True)

    # -- the asyncio side -----------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop, self._arrived = loop, asyncio.Event()
        self._loop_thread = threading.get_ident()
        self._thread.start()

    def submit(self, frames: list[bytes], flags: int = 0) -> concurrent.futures.Future[None]:
        """Send `frames` (the route first) now, in place; the future carries the outcome (done at once, but for
        a blocking send that met a full pipe: the thread retries that one)."""
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        future.set_running_or_notify_cancel()
        with self._lock:
            if self._stopping:
                future.set_exception(zmq.ZMQError(zmq.ENOTSOCK, "the sender's control socket is closed"))
                return future
            command = _Send(frames, bool(flags & zmq.NOBLOCK), time.monotonic() + self.send_wait_s, future)
            if self._blocked and not command.nonblocking:
                self._blocked.append(command)  # behind the blocked ones: one connection's messages keep their order
            elif not self._try(command, give_up=command.nonblocking):
                self._blocked.append(command)
            self._read(READ_BATCH)  # the send may have taken the fd's edge: read what is pending
        return future

    async def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        """A send on the socket: returns or raises as `zmq.Socket.send_multipart`."""
        future = self.submit(frames, flags)
        if not future.done():
            await asyncio.wrap_future(future)
        future.result()

    def take(self) -> list[bytes] | None:
        """The next message read (round-robin over connections), or None."""
        return self.inbox.take()

    async def wait(self, timeout_s: float) -> bool:
        """Until a message is queued (True) or `timeout_s` passed (False). A wake-up can be stale (its
        message already taken by a `recv` woken by a send's read), so the inbox decides, not the event."""
        assert self._arrived is not None, "call start() first"
        deadline = time.monotonic() + timeout_s
        while not self.inbox:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._arrived.clear()
            if self.inbox:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), left)
        return True

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop and join the thread; True when it has ended (then the socket is the caller's alone)."""
        with self._lock:
            self._stopping = True
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
        ended = not self._thread.is_alive()
        if not ended:
            logger.error("the sender's socket thread did not stop within %ss; its socket is left open", timeout_s)
        return ended

    def _on_arrival(self) -> None:
        with self._lock:
            self._notify_pending = False
        if self._arrived is not None:
            self._arrived.set()

    # -- the thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        waiter = select.poll()
        waiter.register(self._fd, select.POLLIN)
        try:
            while not self._stopping:
                waiter.poll(int((RETRY_S if self._blocked else POLL_S) * 1000))
                with self._lock:
                    if self._stopping:
                        break
                    more = self._read(READ_BATCH)
                    self._retry()
                if more:
                    time.sleep(0)  # a flood: let a waiting sender have the lock between batches
        except Exception:  # a bug here must not leave callers waiting on futures forever
            logger.exception("the sender's socket thread failed; the control plane is closed")
        finally:
            with self._lock:
                self._stopping = True
                blocked = list(self._blocked)
                self._blocked.clear()
            for command in blocked:
                command.future.set_exception(zmq.ZMQError(zmq.ENOTSOCK, "the sender's control socket is closed"))

    def _read(self, limit: int) -> bool:
        """Under the lock: read up to `limit` messages into the inbox; True when more may be pending."""
        got = 0
        # pyzmq's stub types getsockopt as int | bytes | str for every option; EVENTS is an int
        while got < limit and cast(int, self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            try:
                frames = [self.sock.recv(zmq.NOBLOCK)]
            except zmq.Again:  # EVENTS said a message was ready; believe the socket, not the flag
                break
            while self.sock.getsockopt(zmq.RCVMORE):  # the rest of a message has arrived with its first frame
                frame = self.sock.recv(zmq.NOBLOCK)
                if len(frames) < MAX_FRAMES:  # a longer message stays too long for any decoder to accept
                    frames.append(frame)
            self.inbox.put(frames)
            got += 1
        if got:
            self._notify()
        return got >= limit

    def _notify(self) -> None:
        """Wake the asyncio side, once per batch of arrivals it has not yet been woken for (under the lock)."""
        if self._loop is None or self._arrived is None:
            return
        if threading.get_ident() == self._loop_thread:
            self._arrived.set()  # a send on the loop read it: the loop is running this very code
            return
        if self._notify_pending:
            return
        self._notify_pending = True
        try:
            self._loop.call_soon_threadsafe(self._on_arrival)
        except RuntimeError:  # the loop is closed: nobody is waiting
            self._notify_pending = False

    def _retry(self) -> None:
        """Under the lock: the blocked sends, oldest first, until one still finds its pipe full."""
        while self._blocked and self._try(self._blocked[0], give_up=time.monotonic() >= self._blocked[0].deadline):
            self._blocked.popleft()

    def _try(self, command: _Send, *, give_up: bool) -> bool:
        """One NOBLOCK attempt (under the lock); False when the pipe is full and the send should be retried."""
        try:
            self.sock.send_multipart(command.frames, zmq.NOBLOCK)
        except zmq.Again as exc:
            if not give_up:
                return False
            command.future.set_exception(exc)
        except zmq.ZMQError as exc:
            command.future.set_exception(exc)
        else:
            command.future.set_result(None)
        return True
