"""`transport.verify` in sharded send mode (versions/shard_verify.py), through real processes: two trainer
ranks (a gloo group, each sending its torch.chunk row shards), rank 1 a corrupting peer
(tests/support/corrupt.py: one byte of its first bucket flipped on the wire, after it fingerprinted its
shards) in version 2 only, and one rollout daemon's receive loop into a module sink.

With `verify=full`: version 1 lands and is reported verified (every tensor, whole); version 2 fails on the
receiver naming the tensor, the corrupted bytes and rank 1's sender, and the module still holds version
1 bitwise; version 3 lands. With `verify=off` (the control): the same corruption lands unnoticed, so the
check above is what caught it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch
from safetensors.torch import load, save

from lightning_weightsync import WeightReceiver, load_config
from tests.integration.test_sharded import _weights
from tests.support.mp import free_port, run_workers
from tests.support.sharded_senders import ShardedRank, gloo_group, row_shard

pytestmark = pytest.mark.slow

WORLD = 2
VERSIONS = [1, 2, 3]
CORRUPT_IN = 2


def _common(port: int, verify: str) -> list[str]:
    return [f"transport.port={port}", "transport.timeout_s=60", "transport.liveness_s=3",
            "transport.bucket_size_mb=0.001", "transport.direct_min_mb=0.002",
            f"transport.verify={verify}"]  # fmt: skip


def _sender(rank: int, trainer_port: int, port: int, verify: str) -> list[str]:
    from lightning_weightsync import WeightSender
    from tests.support.corrupt import CorruptingSender

    cfg = load_config(overrides=[*_common(port if rank == 0 else 0, verify), "trainer.min_receivers=1"])

    async def main() -> list[str]:
        outcomes = []
        sender = WeightSender(cfg) if rank == 0 else CorruptingSender(cfg, bucket_index=-1, byte=3)
        await sender.start()
        group = ShardedRank(sender, rank)
        try:
            for version in VERSIONS:
                if rank == 1:
                    sender.bucket_index = 0 if version == CORRUPT_IN else -1
                shards = [(n, s) for n, t in _weights(version).items() if (s := row_shard(t, rank, WORLD)) is not None]
                outcomes.append(await group.outcome(shards, version))
        finally:
            await sender.close()
        return outcomes

    with gloo_group(rank, WORLD, trainer_port):
        return asyncio.run(main())


def _receiver(port: int, verify: str) -> list[Any]:
    from lightning_weightsync.rollout.consume import consume_version
    from lightning_weightsync.rollout.sinks.module import ModuleSink

    cfg = load_config(
        overrides=[*_common(port, verify), "transport.heartbeat_interval_s=0.2", "rollout.identity=rollout-0"]
    )
    module = torch.nn.Module()
    for name, tensor in _weights(0).items():
        module.register_parameter(name, torch.nn.Parameter(torch.zeros_like(tensor), requires_grad=False))
    sink = ModuleSink(cfg, module=module)

    async def main() -> list[Any]:
        out: list[Any] = []
        async with WeightReceiver(cfg) as receiver:
            for _ in VERSIONS:
                try:
                    record = await consume_version(receiver, sink)
                    report = receiver.last_verify
                    out.append(("ok", record.version, report.verified if report else None))
                except Exception as exc:
                    out.append(("failed", str(exc), None))
                out.append(save({n: p.detach().clone() for n, p in module.named_parameters()}))
        return out

    return asyncio.run(asyncio.wait_for(main(), 120))


def _role(role: int, trainer_port: int, port: int, verify: str) -> Any:
    return _receiver(port, verify) if role == WORLD else _sender(role, trainer_port, port, verify)


def _run(verify: str) -> tuple[list[list[str]], list[Any]]:
    trainer_port, port = free_port(), free_port()
    *senders, received = run_workers(_role, [(r, trainer_port, port, verify) for r in range(WORLD + 1)], timeout_s=150)
    return senders, received


def _differs(blob: bytes, version: int) -> list[str]:
    got, want = load(blob), _weights(version)
    return [n for n, t in want.items() if got[n].dtype != t.dtype or not torch.equal(got[n], t)]


def test_a_corrupted_shard_fails_the_version_naming_the_tensor_and_its_sender_and_nothing_is_applied() -> None:
    started = time.monotonic()
    senders, received = _run("full")
    (ok1, held1, failed2, held2, ok3, held3) = received
    assert ok1 == ("ok", 1, len(_weights(1))), ok1  # every tensor verified whole, from both senders' shards
    assert _differs(held1, 1) == []
    assert failed2[0] == "failed", failed2
    error = failed2[1]
    assert "arrived corrupted in bytes" in error and "sender 1" in error, error
    assert any(f"'{name}'" in error for name in _weights(2)), error
    assert _differs(held2, 1) == [], "a corrupted version touched the held weights"
    assert ok3 == ("ok", 3, len(_weights(3))), ok3
    assert _differs(held3, 3) == []
    for outcomes in senders:  # every sender heard the same failure of version 2, and went on
        assert outcomes[0] == "ok" and outcomes[2] == "ok", outcomes
        assert outcomes[1].startswith("failed") and "arrived corrupted" in outcomes[1], outcomes
    assert time.monotonic() - started < 120


def test_without_verify_the_same_corruption_lands_unnoticed() -> None:
    _, received = _run("off")
    outcomes = received[0::2]
    assert [o[0] for o in outcomes] == ["ok", "ok", "ok"], outcomes
    assert len(_differs(received[3], 2)) == 1, "the corruption is real: exactly one tensor of version 2 is wrong"
