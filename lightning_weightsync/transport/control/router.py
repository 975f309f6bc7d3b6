"""The thread that owns the sender's ROUTER socket: it reads whatever arrives, at once and always, into
the bounded `Inbox`, and performs the sends the asyncio side asks for.

Why a thread: the socket must never stop being read (`transport/sockets.py`: libzmq's pipe has no
high-water mark, so that a full pipe and a reset peer cannot abort the process), but the trainer's event
loop does not run during a training step (minutes). Read by the loop, what a peer sent meanwhile piled up
in libzmq without bound; read by this thread, it piles up in the inbox, which has a budget and drops the
excess, counted. A ZeroMQ socket belongs to one thread, so every send is a command executed here too,
with a `concurrent.futures.Future` that carries the result or the exact zmq error back
(`zmq.Again` for a NOBLOCK send to a full pipe, `EHOSTUNREACH` under ROUTER_MANDATORY for a connection
that is gone), so the caller sees what a send on the socket itself would have raised.

Sends without NOBLOCK never block this thread: they are retried every `RETRY_S` (reading meanwhile) and,
oldest first, each fails with `zmq.Again` after `send_wait_s`; the ZMTP heartbeat drops a frozen peer
within `transport.liveness_s` (then the send fails with EHOSTUNREACH), so a pipe that stays full longer
than that belongs to a peer that is not reading and has to be given up on. NOBLOCK sends (the liveness
probe, a `Refuse`) are tried once, at once, never behind a blocked one.

Decoding, unsealing and every decision stay on the asyncio side (`sender.py`); this thread only moves
frames.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import zmq

from .inbox import Inbox

logger = logging.getLogger(__name__)

READ_BATCH = 1024  # messages read per turn before queued sends run: a flood cannot hold a send up long
MAX_FRAMES = 5  # kept of one message: the route and one more frame than a legal message has (3 sealed)
RETRY_S = 0.002  # while a send waits for room in a full pipe, it is retried this often
IDLE_S = 1.0  # the longest the thread sleeps without checking whether it should stop
_ids = itertools.count()


@dataclass
class _Send:
    frames: list[bytes]
    nonblocking: bool
    deadline: float
    future: concurrent.futures.Future[None]


class RouterThread:
    """Owns `sock` (bound, options set) from `start` until `stop`; nobody else may touch it meanwhile."""

    def __init__(self, sock: zmq.Socket[Any], ctx: zmq.Context[Any], inbox: Inbox, *, send_wait_s: float) -> None:
        self.sock, self.inbox, self.send_wait_s = sock, inbox, send_wait_s
        address = f"inproc://lightning-weightsync-router-wake-{next(_ids)}"
        self._wake_rx: zmq.Socket[Any] = ctx.socket(zmq.PAIR)  # this thread's end
        self._wake_rx.bind(address)
        self._wake_tx: zmq.Socket[Any] = ctx.socket(zmq.PAIR)  # the callers' end, under `_lock`
        self._wake_tx.connect(address)
        self._lock = threading.Lock()
        self._commands: deque[_Send] = deque()  # submitted, not yet seen by the thread
        self._blocked: deque[_Send] = deque()  # blocking sends the thread retries, oldest first
        self._stopping = False
        self._notify_pending = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._arrived: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="lws-sender-router", daemon=True)

    # -- the asyncio side -----------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop, self._arrived = loop, asyncio.Event()
        self._thread.start()

    def submit(self, frames: list[bytes], flags: int = 0) -> concurrent.futures.Future[None]:
        """Queue a send of `frames` (the route first) for the thread; the future carries its outcome."""
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        command = _Send(frames, bool(flags & zmq.NOBLOCK), time.monotonic() + self.send_wait_s, future)
        with self._lock:
            if self._stopping or not self._thread.is_alive():
                future.set_exception(zmq.ZMQError(zmq.ENOTSOCK, "the sender's control socket is closed"))
                return future
            self._commands.append(command)
            self._wake()
        return future

    async def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        """A send on the socket, done by its thread: returns or raises as `zmq.Socket.send_multipart`."""
        await asyncio.wrap_future(self.submit(frames, flags))

    def take(self) -> list[bytes] | None:
        """The next message read (round-robin over connections), or None."""
        return self.inbox.take()

    async def wait(self, timeout_s: float) -> bool:
        """Until a message is queued (True) or `timeout_s` passed (False)."""
        assert self._arrived is not None, "call start() first"
        if self.inbox:
            return True
        self._arrived.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._arrived.wait(), max(timeout_s, 0.0))
        return bool(self.inbox)

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop and join the thread; True when it has ended (then the socket is the caller's again)."""
        with self._lock:
            self._stopping = True
            if self._thread.is_alive():
                self._wake()
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
        ended = not self._thread.is_alive()
        if ended:
            self._wake_tx.close(linger=0)
            self._wake_rx.close(linger=0)
        else:
            logger.error("the sender's socket thread did not stop within %ss; its socket is left open", timeout_s)
        return ended

    def _wake(self) -> None:
        with contextlib.suppress(zmq.Again):  # a wake-up is pending already
            self._wake_tx.send(b"", zmq.NOBLOCK)

    def _on_arrival(self) -> None:
        with self._lock:
            self._notify_pending = False
        if self._arrived is not None:
            self._arrived.set()

    # -- the thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        try:
            while not self._stopping:
                ready = dict(poller.poll(int((RETRY_S if self._blocked else IDLE_S) * 1000)))
                if self._wake_rx in ready:
                    with contextlib.suppress(zmq.Again):
                        while True:
                            self._wake_rx.recv(zmq.NOBLOCK)
                self._read()
                self._send()
        except Exception:  # a bug here must not leave callers waiting on futures forever
            logger.exception("the sender's socket thread failed; the control plane is closed")
        finally:
            with self._lock:
                self._stopping = True
                running = list(self._blocked)  # taken up (set running), not done
                pending = [c for c in self._commands if c.future.set_running_or_notify_cancel()]
                self._blocked.clear()
                self._commands.clear()
            for command in running + pending:
                command.future.set_exception(zmq.ZMQError(zmq.ENOTSOCK, "the sender's control socket is closed"))

    def _read(self) -> None:
        got = False
        for _ in range(READ_BATCH):
            try:
                frames = [self.sock.recv(zmq.NOBLOCK)]
            except zmq.Again:
                break
            while self.sock.get(zmq.RCVMORE):  # the rest of a message has arrived with its first frame
                frame = self.sock.recv(zmq.NOBLOCK)
                if len(frames) < MAX_FRAMES:  # a longer message stays too long for any decoder to accept
                    frames.append(frame)
            self.inbox.put(frames)
            got = True
        if got:
            self._notify()

    def _notify(self) -> None:
        """Wake the asyncio side, once per batch of arrivals it has not yet been woken for."""
        with self._lock:
            if self._notify_pending or self._loop is None:
                return
            self._notify_pending = True
        try:
            self._loop.call_soon_threadsafe(self._on_arrival)
        except RuntimeError:  # the loop is closed: nobody is waiting
            with self._lock:
                self._notify_pending = False

    def _send(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            if not command.future.set_running_or_notify_cancel():
                continue  # the caller gave up (cancelled) before the thread got to it
            if command.nonblocking:
                self._try(command, give_up=True)
            else:
                self._blocked.append(command)
        while self._blocked and self._try(self._blocked[0], give_up=time.monotonic() >= self._blocked[0].deadline):
            self._blocked.popleft()

    def _try(self, command: _Send, *, give_up: bool) -> bool:
        """One NOBLOCK attempt; False when the pipe is full and the command should be retried."""
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
