"""A late joiner: a rollout that comes up mid-training takes the current version from a peer that installed it
(`versions/peer_serve.py`), never from the trainer, bitwise and checked, then the trainer's next version as
any receiver; a peer stops serving the moment its own next version starts; a peer serves only tensors that
still hold the trainer's bytes, and only to holders of the session's token.

Everything in this process over real ZeroMQ sockets and real gloo groups, as `test_delta.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
import torch

from lightning_weightsync import WeightReceiver, WeightSender
from lightning_weightsync.config import ReceiverSettings
from lightning_weightsync.errors import WeightSyncError
from lightning_weightsync.protocol.chunks import TensorMeta
from lightning_weightsync.versions.peer_serve import POLL_S, CaughtUp, PeerServer, catch_up, serve_settings
from tests.support.transfer import assert_bitwise, engine_cfg, stream, with_timeout

pytestmark = pytest.mark.timeout(120)

BUCKET_MB = 1 / 128  # 8 KiB: a model-shaped stream goes in many buckets, so a serve can be caught mid-way


def cfg(port: int, **extra: Any) -> Any:
    extra.setdefault("transport__verify", "full")
    return engine_cfg(port, bucket_size_mb=BUCKET_MB, **extra)


class Rollout:
    """A receiver and the tensors it installed (its `into` destinations, allocated on first sight)."""

    def __init__(self, receiver: WeightReceiver) -> None:
        self.receiver = receiver
        self.held: dict[str, torch.Tensor] = {}
        self.on_write: Any = None  # called with each destination handed out

    def into(self, meta: TensorMeta) -> torch.Tensor:
        if self.on_write is not None:
            self.on_write(meta)
        tensor = self.held.get(meta.name)
        if tensor is None:
            tensor = self.held[meta.name] = torch.empty(meta.shape, dtype=meta.dtype)
        return tensor

    async def take(self) -> int | None:
        async for _ in self.receiver.receive_weights(into=self.into):
            pass
        return self.receiver.last_complete_version

    def installed(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.held.items())


@contextlib.asynccontextmanager
async def trainer(**extra: Any) -> AsyncIterator[WeightSender]:
    sender = WeightSender(cfg(0, **extra))
    await sender.start()
    try:
        yield sender
    finally:
        await sender.close()


@contextlib.asynccontextmanager
async def rollout(port: int, identity: str, **extra: Any) -> AsyncIterator[Rollout]:
    receiver = WeightReceiver(cfg(port, **extra), identity=identity)
    await receiver.start()
    try:
        yield Rollout(receiver)
    finally:
        await receiver.close()


@contextlib.asynccontextmanager
async def serving(peer: Rollout) -> AsyncIterator[PeerServer]:
    """`peer` serves what it installs: the server stops at each of its versions' start."""
    server = PeerServer(serve_settings(peer.receiver.settings, 0))
    await server.start()
    peer.receiver.on_version_start = server.release
    try:
        yield server
    finally:
        await server.close()


def hold(server: PeerServer, peer: Rollout) -> None:
    report = peer.receiver.last_verify
    assert report is not None and report.complete
    version = peer.receiver.last_complete_version
    assert version is not None
    server.hold(version, peer.held, report.checksums)


async def eventually(condition: Any, timeout_s: float = 10) -> None:
    async def wait() -> None:
        while not condition():
            await asyncio.sleep(0.01)

    await with_timeout(wait(), timeout_s)


def same(held: dict[str, torch.Tensor], expected: list[tuple[str, torch.Tensor]]) -> None:
    """Bitwise, whatever order the destinations were handed out in."""
    assert sorted(held) == sorted(n for n, _ in expected)
    assert_bitwise({n: held[n] for n, _ in expected}, expected)


async def join_from(server: PeerServer, joiner: Rollout, wait_s: float = 10, **extra: Any) -> CaughtUp | None:
    """`joiner` catches up from `server` (its transport settings: `extra`)."""
    settings = ReceiverSettings.of(cfg(0, **extra))
    identity = joiner.receiver.identity
    return await with_timeout(catch_up(settings, [server.address], joiner.into, identity=identity, wait_s=wait_s))


async def test_late_joiners_catch_up_from_a_peer_never_from_the_trainer_then_take_its_next_version() -> None:
    async with (
        trainer(trainer__min_receivers=2) as sender,
        rollout(sender.port, "a") as a,
        rollout(sender.port, "b") as b,
        serving(a) as server,
    ):
        v1 = stream(1)
        stats1, *_ = await with_timeout(asyncio.gather(sender.send_weights(v1, version=1), a.take(), b.take()))
        hold(server, a)
        joiners = [Rollout(WeightReceiver(cfg(sender.port), identity=f"joiner-{i}")) for i in range(2)]
        for joiner in joiners:  # one after another: the peer serves the same version again
            caught = await join_from(server, joiner)
            assert caught is not None and caught.version == 1
            same(joiner.held, v1)
        await eventually(lambda: len(server.served) == 2)  # the serve settles once the joiner's ack is in
        assert [s.receivers for s in server.served] == [1, 1]
        # a joiner served and gone is not served again: no serve starts for it while its Bye is still unread
        await asyncio.sleep(20 * POLL_S)
        assert not server.serving and server.sender.registered == [] and len(server.served) == 2
        assert stats1.receivers == 2 and sender.registered == ["a", "b"]  # the trainer never heard of them

        # the joiners' own receivers register with the trainer and take its next version, whole
        sender.settings = replace(sender.settings, min_receivers=4)
        v2 = stream(2)
        try:
            for joiner in joiners:
                await joiner.receiver.start()
            stats2, *got = await with_timeout(
                asyncio.gather(sender.send_weights(v2, version=2), *(r.take() for r in (a, b, *joiners)))
            )
        finally:
            for joiner in joiners:
                await joiner.receiver.close()
        assert got == [2, 2, 2, 2] and stats2.receivers == 4
        for r in (a, b, *joiners):
            same(r.held, v2)
        assert server.holds is None  # released when version 2 started, and not held again


async def test_a_peer_stops_serving_when_its_own_next_version_starts() -> None:
    async with trainer() as sender, rollout(sender.port, "a") as a, serving(a) as server:
        await with_timeout(asyncio.gather(sender.send_weights(stream(1), version=1), a.take()))
        hold(server, a)
        joiner = Rollout(WeightReceiver(cfg(server.port), identity="joiner"))
        first, resume = asyncio.Event(), asyncio.Event()

        async def slow_joiner() -> None:
            async for _ in joiner.receiver.receive_weights(into=joiner.into):
                first.set()
                await resume.wait()  # the serve stalls behind this consumer, mid-version

        writes_while_serving: list[bool] = []
        a.on_write = lambda meta: writes_while_serving.append(server.serving)
        await joiner.receiver.start()
        try:
            task = asyncio.create_task(slow_joiner())
            await with_timeout(first.wait())
            assert server.serving
            v2 = stream(2)
            await with_timeout(asyncio.gather(sender.send_weights(v2, version=2), a.take()))
            resume.set()
            with pytest.raises(WeightSyncError):
                await with_timeout(task)
        finally:
            await joiner.receiver.close()
        assert writes_while_serving and not any(writes_while_serving), "the peer's next version landed mid-serve"
        same(a.held, v2)
        assert joiner.receiver.last_complete_version is None and server.released == 1 and not server.served

        hold(server, a)  # it serves its new version from now on
        late = Rollout(WeightReceiver(cfg(server.port), identity="late"))
        caught = await join_from(server, late)
        assert caught is not None and caught.version == 2
        same(late.held, v2)


async def test_a_peer_serves_only_tensors_that_still_hold_the_trainers_bytes() -> None:
    async with trainer() as sender, rollout(sender.port, "a") as a, serving(a) as server:
        v1 = stream(1)
        await with_timeout(asyncio.gather(sender.send_weights(v1, version=1), a.take()))
        hold(server, a)
        name = v1[len(v1) // 2][0]
        a.held[name].view(-1)[0:1].view(torch.uint8).add_(1)  # the peer's tensor changed after it installed it
        joiner = Rollout(WeightReceiver(cfg(0), identity="joiner"))
        caught = await join_from(server, joiner, wait_s=2)
        assert caught is None
        assert not server.served and len(server.failed) == 1 and repr(name) in server.failed[0], server.failed
        assert server.holds is None  # it stopped serving what it no longer holds


async def test_a_joiner_without_the_sessions_token_is_refused() -> None:
    token = {"transport__auth_token": "the-session-token"}
    async with trainer(**token) as sender, rollout(sender.port, "a", **token) as a, serving(a) as server:
        v1 = stream(1)
        await with_timeout(asyncio.gather(sender.send_weights(v1, version=1), a.take()))
        hold(server, a)
        other = {"transport__auth_token": "another-token-than-the-session"}
        for who, extra in (("no-token", {}), ("other-token", other)):
            caught = await join_from(server, Rollout(WeightReceiver(cfg(0), identity=who)), wait_s=2, **extra)
            assert caught is None, who
        assert not server.served and server.sender.dropped_messages > 0
        member = Rollout(WeightReceiver(cfg(0), identity="member"))
        caught = await join_from(server, member, **token)
        assert caught is not None and caught.version == 1
        same(member.held, v1)
