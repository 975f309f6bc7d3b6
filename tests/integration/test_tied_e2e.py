"""Tied names travel with the version: the sender puts them in bucket 0, the receiver knows them before
any destination is asked for, and the daemon hands them to the sink (the callable sink yields every name)."""

from __future__ import annotations

import asyncio

import torch

from lightning_weightsync.rollout.daemon import RolloutDaemon
from lightning_weightsync.transport.process import free_port
from tests.integration.test_daemon import daemon_cfg, running, sender_on, until
from tests.support.transfer import with_timeout
from tests.unit import test_sinks

TIED = {"embed.weight": ["lm_head.weight"]}


def _weights(version: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(version)
    return [("embed.weight", torch.randn(64, 8, generator=g)), ("norm.weight", torch.randn(8, generator=g))]


async def test_receiver_knows_the_tied_names_before_the_first_destination(engine_pair) -> None:
    sender, receiver = engine_pair
    seen_at_first_destination: list[dict[str, list[str]]] = []

    def into(meta):
        if not seen_at_first_destination:
            seen_at_first_destination.append(receiver.tied)
        return None

    async def consume() -> dict[str, torch.Tensor]:
        return {n: t.clone() async for n, t in receiver.receive_weights(into=into)}

    got, _ = await with_timeout(asyncio.gather(consume(), sender.send_weights(_weights(1), version=1, tied=TIED)))
    assert seen_at_first_destination == [TIED]
    assert set(got) == {"embed.weight", "norm.weight"}  # sent once, under the embedding's name
    # a version without ties says so (no stale list from the previous version)
    await with_timeout(asyncio.gather(consume(), sender.send_weights(_weights(2), version=2)))
    assert receiver.tied == {}


async def test_daemon_hands_the_ties_to_the_sink() -> None:
    test_sinks.SEEN.clear()
    port = free_port()
    cfg = daemon_cfg(port, rollout__sink__type="callable", rollout__sink__target="tests.unit.test_sinks:record")
    daemon = RolloutDaemon(cfg, handle_signals=False)
    async with running(daemon), sender_on(port) as sender:
        await sender.send_weights(_weights(3), version=3, tied=TIED)
        await until(lambda: bool(test_sinks.SEEN))
    version, tensors = test_sinks.SEEN[-1]
    assert version == 3
    assert set(tensors) == {"embed.weight", "lm_head.weight", "norm.weight"}
    assert torch.equal(tensors["lm_head.weight"], tensors["embed.weight"])
    assert torch.equal(tensors["embed.weight"], _weights(3)[0][1])
