"""Connections that go down without a Bye are counted and logged (`dropped_connections`), on both ends:
libzmq drops a connection that sends a frame over `ZMQ_MAXMSGSIZE` with no event but EVENT_DISCONNECTED,
so without this an operator saw nothing at all. Real sockets on loopback: a sender, an honest receiver,
and a token holder's own CURVE connection (`tests/support/control.py: TokenHolder`)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from lightning_weightsync.protocol.messages import MAX_FRAME_TO_RECEIVER, MAX_FRAME_TO_SENDER
from lightning_weightsync.transport.control.sender import BYE_GRACE_S
from tests.support.control import TokenHolder, prepare, registered, started_sender, until


async def test_an_over_size_frame_from_a_token_holder_is_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    sender = await started_sender()
    honest = await registered(sender, "honest")
    holder = TokenHolder(sender)
    try:
        await holder.sock.send_multipart([b"x" * (MAX_FRAME_TO_SENDER + 1)])
        with caplog.at_level(logging.WARNING, logger="lightning_weightsync.transport.control.sender"):
            await until(lambda: sender.poll_connections() >= 1, sender)
        line = next(r.getMessage() for r in caplog.records if "lost a control connection" in r.getMessage())
        assert f"a frame over the {MAX_FRAME_TO_SENDER}-byte limit (ZMQ_MAXMSGSIZE" in line, line
        assert "had not registered" in line, line  # the honest receiver's connection is up: not named
        assert sender.dropped_messages == 0 and "honest" in sender.peers
        await prepare(sender, honest, 1)  # the sender keeps serving the honest receiver
        assert sender.poll_connections() == 1
    finally:
        holder.close()
        await honest.close()
        await sender.close()


async def test_a_receiver_that_says_bye_is_not_a_dropped_connection() -> None:
    sender = await started_sender()
    try:
        receiver = await registered(sender, "leaving")
        await prepare(sender, receiver, 1)  # its Bye is sealed for this session (before a Prepare: for none)
        await receiver.close()
        await until(lambda: "leaving" not in sender.peers, sender)
        await asyncio.sleep(BYE_GRACE_S + 0.2)
        await sender.recv(0.05)
        assert sender.poll_connections() == 0
    finally:
        await sender.close()


async def test_an_over_size_frame_to_a_receiver_is_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    sender = await started_sender()
    receiver = await registered(sender, "r")
    try:
        await until(lambda: receiver.sender_link()[0])
        await sender.inject(sender.route_of("r"), [b"x" * (MAX_FRAME_TO_RECEIVER + 1)])
        with caplog.at_level(logging.INFO, logger="lightning_weightsync.transport.control.receiver"):
            await until(lambda: receiver.sender_link() is not None and receiver.dropped_connections >= 1)
        line = next(r.getMessage() for r in caplog.records if "lost the control connection" in r.getMessage())
        assert f"the sender at {sender.address}" in line, line
        assert f"a frame over this receiver's {MAX_FRAME_TO_RECEIVER}-byte limit (ZMQ_MAXMSGSIZE" in line, line
        assert receiver.dropped_messages == 0
    finally:
        await receiver.close()
        await sender.close()


def test_closed_by_us_names_the_peer_of_a_connection_this_host_closed() -> None:
    """Where a refused handshake ends before its address is read, the kernel still lists the connection."""
    import socket
    import sys
    import time

    from lightning_weightsync.transport.control.handshakes import closed_by_us

    if not sys.platform.startswith("linux"):
        pytest.skip("TIME_WAIT is read from Linux's /proc/net/tcp")
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port), timeout=5)
    accepted, _ = server.accept()
    client_port = client.getsockname()[1]
    assert f"127.0.0.1:{client_port}" not in closed_by_us(port)
    accepted.close()  # this side closes first: its end of the connection waits in TIME_WAIT
    client.close()
    server.close()
    deadline = time.monotonic() + 5  # the client's FIN moves this side from FIN_WAIT2 to TIME_WAIT
    while f"127.0.0.1:{client_port}" not in closed_by_us(port):
        assert time.monotonic() < deadline, "no TIME_WAIT entry for the closed connection"
        time.sleep(0.01)


async def test_close_returns_when_the_handshake_watch_outlives_its_stop_wait() -> None:
    """On a machine starved of CPU the watch thread may not end within its stop wait; it still owns the monitor
    socket, so the context cannot be terminated (libzmq's term would wait for that socket forever): close leaves
    the context to the process and returns, instead of hanging the trainer's shutdown."""
    sender = await started_sender(None)
    watch = sender._handshakes
    assert watch is not None
    watch.stop = lambda: False  # as if the join timed out
    try:
        await asyncio.wait_for(sender.close(), 10)
    finally:
        watch._stop.set()


async def test_receivers_waiting_on_one_socket_at_once_are_each_woken_by_what_arrives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The receiver reads its socket in place and waits on its fd through one loop reader; reads waiting at once
    (a rendezvous store call beside a version's read) are each woken by arrivals, and one that ends does not
    leave the others unwatched, to their periodic look (made longer than the test here, so that only the fd's
    wake-up can end a wait)."""
    from lightning_weightsync.protocol.messages import Prepare
    from lightning_weightsync.transport.control import receiver as receiver_module

    monkeypatch.setattr(receiver_module, "EDGE_LOOK_S", 60.0)
    sender = await started_sender()
    receiver = await registered(sender, "r")
    try:
        # one read gives up (its timeout) while another still waits: the other stays watched
        waiting, brief = asyncio.ensure_future(receiver.recv(30)), asyncio.ensure_future(receiver.recv(0.2))
        assert await brief is None
        await sender.send("r", Prepare(1, sender.session))
        got_one = await asyncio.wait_for(waiting, 10)
        assert isinstance(got_one, Prepare) and got_one.version == 1
        # two reads waiting when two messages arrive: each gets one
        reads = [asyncio.ensure_future(receiver.recv(30)) for _ in range(2)]
        await asyncio.sleep(0.2)  # both are waiting on the fd now
        assert not any(r.done() for r in reads)
        for version in (2, 3):
            await sender.send("r", Prepare(version, sender.session))
        got = await asyncio.wait_for(asyncio.gather(*reads), 10)
        assert sorted(m.version for m in got if isinstance(m, Prepare)) == [2, 3]
    finally:
        await receiver.close()
        await sender.close()


async def test_a_bye_queued_behind_the_probe_that_forgot_its_connection_is_a_clean_leave() -> None:
    """A receiver that acks, says Bye and exits (a late joiner leaving its peer): the sender's liveness probe can
    find the connection gone and forget it before it reads the queued Bye. That Bye is a goodbye: not a message
    dropped from an unregistered connection (which an operator alerts on), and its disconnection not a lost one."""
    sender = await started_sender()
    receiver = await registered(sender, "leaving")
    try:
        await prepare(sender, receiver, 1)  # it took part in a version: its Bye is sealed for this session
        await receiver.close()  # Bye, then the connection closes
        deadline = asyncio.get_running_loop().time() + 10
        while await sender.connected("leaving"):  # probes only: the Bye stays queued, unread
            assert asyncio.get_running_loop().time() < deadline, "the closed connection still looks up"
            await asyncio.sleep(0.05)
        assert "leaving" not in sender.peers
        assert await sender.recv(1.0) is None  # reads the Bye
        assert sender.dropped_messages == 0
        await asyncio.sleep(BYE_GRACE_S + 0.2)
        assert sender.poll_connections() == 0  # its disconnection was a clean one
    finally:
        await sender.close()
