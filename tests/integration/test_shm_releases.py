"""A shared-slot sender waits for bucket releases on its event loop (`transport/backends/loop_releases.py`): the
same checks as the data-plane thread's wait (test_backends.py), each through `loop_broadcast`, with real sender
and receiver backends, real sockets and a real receiver process where one must die."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import Coroutine
from typing import Any

import pytest
import torch

from lightning_weightsync import PeerError, WeightSyncTimeout
from lightning_weightsync.protocol.joins.shared import SharedJoin
from lightning_weightsync.protocol.messages import BucketDone, GroupSpec, Member, encode
from lightning_weightsync.transport.backends import build_backend
from lightning_weightsync.transport.backends import shared as shared_backends

pytestmark = pytest.mark.timeout(60)


def _backend(is_sender: bool, timeout_s: float = 5.0, identity: str = ""):
    kwargs = {"bucket_size": 1024, "device": torch.device("cpu"), "timeout_s": timeout_s, "is_sender": is_sender}
    return build_backend("shm", **kwargs, identity=identity)


def _group(join: SharedJoin, members: dict[str, int]) -> GroupSpec:
    return GroupSpec("sess", 1, "shm", 1024, [Member(m, pid) for m, pid in members.items()], join)


def _joined(members: dict[str, int], timeout_s: float = 5.0):
    """A sender (version 5) and receiver r0 joined to one group of `members`."""
    sender = _backend(True, timeout_s)
    receiver = _backend(False, identity="r0")
    sender.setup("127.0.0.1", 0)
    group = _group(sender.join_spec(1), members)
    sender.join(group, 0, 5)
    receiver.join(group, 1, 5)
    return sender, receiver, group


def _run_then_close(main: Coroutine[Any, Any, None], *opened: Any) -> None:
    """Run a test's loop, then close what it opened (sockets, backends), in order, also when it fails."""
    try:
        asyncio.run(main)
    finally:
        for thing in opened:
            thing.close()


def test_the_loop_counts_only_this_versions_releases_by_members():
    """A late release of an earlier version, or one by a non-member (over ZeroMQ), frees nothing: the wait times
    out naming who it waits for; the member's own release of this version completes it."""
    import zmq

    sender, receiver, group = _joined({"r0": os.getpid()}, timeout_s=1.0)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.linger = 0

    async def main() -> None:
        push.connect(group.join.release_addr)
        push.send_multipart(encode(BucketDone("r0", 4, 0)))  # late, from version 4
        push.send_multipart(encode(BucketDone("intruder", 5, 0)))  # not a member
        waited = sender.loop_broadcast(0, 10, 0)
        assert waited is not None
        with pytest.raises(WeightSyncTimeout, match=r"released by 0 of 1 .*timeout_s=1.0s.*'r0'"):
            await asyncio.wait_for(waited, 10)
        waited = sender.loop_broadcast(0, 10, 0)
        receiver.release(0, 0)
        await asyncio.wait_for(waited, 10)  # r0 released bucket 0 of version 5

    _run_then_close(main(), push, receiver, sender)


@pytest.mark.skipif(not shared_backends.DATAGRAM_RELEASES, reason="datagram releases are Linux's")
def test_releases_read_for_one_wait_settle_the_others_and_a_bad_datagram_is_dropped():
    """Releases of earlier buckets that a new wait reads off the socket (their wake-up taken) complete those
    buckets' waits at once, not at the next look; a malformed datagram is dropped, not fatal."""
    sender, receiver, group = _joined({"r0": os.getpid()})
    client = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = shared_backends.release_name(group.join.release_addr)

    async def main() -> None:
        first, second = sender.loop_broadcast(0, 10, 0), sender.loop_broadcast(1, 10, 1)
        client.sendto(b"\x07not a release", name)
        receiver.release(0, 0)
        receiver.release(1, 1)
        third = sender.loop_broadcast(0, 10, 2)  # reads all three datagrams, before the loop ran again
        assert first is not None and second is not None and third is not None
        assert first.done() and second.done() and not third.done()
        first.result(), second.result()
        receiver.release(0, 2)
        await asyncio.wait_for(third, 10)

    _run_then_close(main(), client, receiver, sender)


def test_releases_over_zeromq_reach_the_loop(monkeypatch):
    """A sender with no datagram socket hears every release over ZeroMQ on its loop (ZeroMQ's edge-triggered
    descriptor: each release is read, none waits for the next look)."""
    monkeypatch.setattr(shared_backends, "DATAGRAM_RELEASES", False)
    sender = _backend(True)
    sender.setup("127.0.0.1", 0)  # ZeroMQ only
    monkeypatch.undo()
    receiver = _backend(False, identity="r0")
    group = _group(sender.join_spec(1), {"r0": os.getpid()})
    sender.join(group, 0, 5)
    receiver.join(group, 1, 5)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for index in range(6):  # the first refused datagram switches the receiver to ZeroMQ for good
            waited = sender.loop_broadcast(index % 2, 10, index)
            assert waited is not None
            loop.call_later(0.01, receiver.release, index % 2, index)
            await asyncio.wait_for(waited, 0.4)  # well before the first look (0.5 s)

    _run_then_close(main(), receiver, sender)


def test_a_member_that_died_fails_the_wait_naming_it():
    """A member whose process is gone fails the loop's wait within a look, naming it, not after timeout_s."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    sender, receiver, _ = _joined({"r0": os.getpid(), "gone": int(dead.stdout)}, timeout_s=30.0)

    async def main() -> None:
        waited = sender.loop_broadcast(0, 10, 0)
        assert waited is not None
        receiver.release(0, 0)
        with pytest.raises(PeerError, match=r"\['gone'\] died before releasing bucket 0"):
            await asyncio.wait_for(waited, 10)

    _run_then_close(main(), receiver, sender)


def test_a_group_given_up_fails_the_open_waits():
    """`broken()` after a failure: a wait still open ends with PeerError instead of lasting until timeout_s."""
    sender, receiver, _ = _joined({"r0": os.getpid()}, timeout_s=30.0)

    async def main() -> None:
        waited = sender.loop_broadcast(0, 10, 0)
        assert waited is not None
        sender.broken()
        with pytest.raises(PeerError, match="given up"):
            await asyncio.wait_for(waited, 10)

    _run_then_close(main(), receiver, sender)
