"""The sender's socket thread (`transport/control/router.py`) on a real ROUTER: it reads while nobody awaits,
sends happen in place under its lock, and a stale wake-up never ends a wait early (before: a `recv` woken by a
notification whose message a send's read had already handed out returned None, "no message", at once)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from lightning_weightsync.transport.control.inbox import Inbox
from lightning_weightsync.transport.control.router import RouterThread


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    yield router, dealer
    dealer.close(linger=0)
    router.close(linger=0)
    ctx.term()


async def test_reads_while_nobody_waits_sends_in_place_and_a_stale_wakeup_does_not_end_a_wait(pair) -> None:
    router_sock, dealer = pair
    thread = RouterThread(router_sock, Inbox(), send_wait_s=2.0)
    thread.start(asyncio.get_running_loop())
    try:
        dealer.send(b"hello")
        deadline = time.monotonic() + 5
        while not thread.inbox and time.monotonic() < deadline:
            time.sleep(0.01)  # the loop does not run: the thread reads anyway
        route, body = thread.take()  # type: ignore[misc]
        assert body == b"hello"
        future = thread.submit([route, b"back"])
        assert future.done() and future.result() is None  # in place, not a thread hop
        assert dealer.poll(5000) and dealer.recv() == b"back"
        with pytest.raises(zmq.ZMQError):  # a connection that is gone: ROUTER_MANDATORY's error, as before
            await thread.send_multipart([b"no-such-route", b"x"])
        thread._arrived.set()  # type: ignore[union-attr]  # a notification whose message is already taken
        threading.Timer(0.2, lambda: dealer.send(b"later")).start()
        assert await thread.wait(5), "a stale wake-up ended the wait with nothing queued"
        assert thread.take()[1] == b"later"  # type: ignore[index]
        assert not await thread.wait(0.05)
    finally:
        assert await asyncio.to_thread(thread.stop)


async def test_a_blocking_send_to_a_peer_that_stops_reading_fails_after_the_send_wait(pair) -> None:
    """A peer that keeps its connection (and its heartbeat) but never reads fills its pipe; a blocking send to it
    is retried by the thread and must fail with `zmq.Again` once `send_wait_s` has passed, never wait on (the
    sender would stall the version, and every later one, on one frozen rollout)."""
    router_sock, dealer = pair
    router_sock.setsockopt(zmq.SNDHWM, 4)
    send_wait_s = 0.5
    thread = RouterThread(router_sock, Inbox(), send_wait_s=send_wait_s)
    thread.start(asyncio.get_running_loop())
    try:
        dealer.send(b"hello")  # the route; after it the dealer never reads again
        deadline = time.monotonic() + 5
        while not thread.inbox and time.monotonic() < deadline:
            time.sleep(0.01)
        route, _ = thread.take()  # type: ignore[misc]
        payload = b"x" * 65536  # a few of these fill the kernel buffers and the pipe's high-water mark
        started = time.monotonic()
        with pytest.raises(zmq.Again):
            for _ in range(10_000):  # far more than the pipe and both kernels' buffers hold
                await asyncio.wait_for(thread.send_multipart([route, payload]), timeout=send_wait_s + 5)
        waited = time.monotonic() - started
        assert waited < send_wait_s + 5, f"the send to a peer that does not read took {waited:.1f}s"
    finally:
        assert await asyncio.to_thread(thread.stop)


class _Descheduled(RouterThread):
    """A socket thread that never gets to read (as when the OS does not schedule it for a while): every message
    is then read by a send on the event loop's own thread (`submit` reads what is pending, for the fd's edge)."""

    def _run(self) -> None:
        while not self._stopping:
            time.sleep(0.005)


async def test_a_message_read_by_a_send_on_the_loop_wakes_a_waiting_receive_at_once(pair) -> None:
    """The waiter sleeps on the arrival event; a message that a send on the loop read is in the inbox with no
    socket-thread notification to come, so that read itself must wake the waiter (else it waits out its whole
    timeout with a message queued: a `Ready` missed, a version failed)."""
    router_sock, dealer = pair
    thread = _Descheduled(router_sock, Inbox(), send_wait_s=2.0)
    thread.start(asyncio.get_running_loop())
    try:
        dealer.send(b"hello")
        deadline = time.monotonic() + 5
        while not thread.inbox and time.monotonic() < deadline:
            thread.submit([b"no-such-route", b"x"], zmq.NOBLOCK)  # each send reads what is pending
            await asyncio.sleep(0.01)
        route, _ = thread.take()  # type: ignore[misc]
        for n in range(3):
            waiter = asyncio.ensure_future(thread.wait(10))
            await asyncio.sleep(0.05)  # the waiter is asleep on the event, the inbox empty
            assert not waiter.done()
            dealer.send(b"m%d" % n)
            started = time.monotonic()
            while not thread.inbox and time.monotonic() - started < 5:  # the loop's sends read it
                await thread.send_multipart([route, b"ping"])
                await asyncio.sleep(0.01)
            assert thread.inbox, "the message never arrived"
            assert await asyncio.wait_for(waiter, 2), "the wait ended without a message"
            assert time.monotonic() - started < 2, "the waiter slept past a message a send on the loop had read"
            assert thread.take()[1] == b"m%d" % n  # type: ignore[index]
    finally:
        assert await asyncio.to_thread(thread.stop)
