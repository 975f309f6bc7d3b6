"""Sharded send mode end to end (issue 19): every FSDP2 rank sends the bytes it owns, with no all-gather;
receivers tile the ranks' byte ranges into whole tensors. Real processes: a gloo trainer group running
FSDP2 on CPU, real receivers, real ZeroMQ sockets and gloo data-plane groups (one per sender)."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pytest
import torch
from safetensors.torch import load, save

from lightning_weightsync import WeightReceiver, WeightSender, load_config
from lightning_weightsync.trainer.driver import SyncDriver
from lightning_weightsync.trainer.gather import named_full_state_dict
from tests.integration.test_gather import Net
from tests.support.mp import free_port, run_workers
from tests.support.sharded_senders import ShardedRank, gloo_group, row_shard

WORKER_TIMEOUT_S = 150
VERSIONS = 2


def _model(tied: bool, fsdp: str) -> torch.nn.Module:
    torch.manual_seed(0)
    net = Net(vocab=101, dim=7)  # 101 rows: uneven over 2 and 4 ranks; the embedding is larger than the bucket
    if tied:
        net.head.weight = net.embed.weight  # tied embeddings: sent once, under the first name
    if fsdp == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in net.blocks:
            fully_shard(block)
        return fully_shard(net)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    orig = fsdp == "fsdp1-orig"  # use_orig_params=True: the parameters are views into the local flat shard
    for i, block in enumerate(net.blocks):
        net.blocks[i] = FSDP(block, use_orig_params=orig, device_id=torch.device("cpu"))
    return FSDP(net, use_orig_params=orig, device_id=torch.device("cpu"))


def _cfg(port: int, receivers: int, *extra: str) -> Any:
    return load_config(
        overrides=[
            f"transport.port={port}",
            "transport.timeout_s=60",
            "transport.heartbeat_interval_s=0.2",
            "transport.bucket_size_mb=0.001",  # 1 KiB: tensors larger than the bucket are chunked
            "transport.direct_min_mb=0.002",
            f"trainer.min_receivers={receivers}",
            "trainer.send_mode=sharded",
            *extra,
        ]
    )


def _trainer(
    rank: int, world: int, trainer_port: int, port: int, receivers: int, tied: bool, dtype: str, fsdp: str
) -> Any:
    import faulthandler

    faulthandler.dump_traceback_later(WORKER_TIMEOUT_S - 10, exit=True)
    with gloo_group(rank, world, trainer_port):
        model = _model(tied, fsdp)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        extra = [f"trainer.dtype={dtype}"] if dtype != "null" else []
        driver = SyncDriver(_cfg(port, receivers, *extra), rank=rank, device=torch.device("cpu"), prefix=None)
        driver.start()
        expected, stats = [], []
        try:
            for version in range(1, VERSIONS + 1):
                loss = model(torch.randint(0, 101, (4, 3))).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                assert driver.sync(model, version), f"version {version} not delivered"
                full = named_full_state_dict(model, dtype=None if dtype == "null" else dtype)  # collective
                expected.append(save(full) if rank == 0 else None)  # bytes: tensors do not outlive a process
                stats.append(driver.last_stats)
        finally:
            driver.close()
        return {"expected": expected, "addresses": driver.addresses, "bytes": [s.nbytes if s else 0 for s in stats]}


def _receiver(index: int, port: int) -> list[bytes]:
    cfg = load_config(
        overrides=[f"transport.port={port}", "transport.timeout_s=60", "transport.heartbeat_interval_s=0.2",
                   f"rollout.identity=rollout-{index}"]
    )  # fmt: skip

    async def main() -> list[bytes]:
        got = []
        async with WeightReceiver(cfg) as receiver:
            for _ in range(VERSIONS):
                one = {n: t.clone() async for n, t in receiver.receive_weights()}
                got.append(save(one))
        return got

    return asyncio.run(asyncio.wait_for(main(), WORKER_TIMEOUT_S - 20))


def _role(
    role: int, world: int, trainer_port: int, port: int, receivers: int, tied: bool, dtype: str, fsdp: str
) -> Any:
    if role < world:
        return _trainer(role, world, trainer_port, port, receivers, tied, dtype, fsdp)
    return _receiver(role - world, port)


@pytest.mark.parametrize(
    "fsdp, world, receivers, tied, dtype",
    [
        pytest.param("fsdp2", 2, 1, False, "null", id="fsdp2-2-ranks-1-receiver"),
        pytest.param("fsdp2", 2, 2, True, "bfloat16", id="fsdp2-2-ranks-2-receivers-tied-bf16"),
        pytest.param("fsdp2", 4, 2, True, "null", id="fsdp2-4-ranks-2-receivers-tied", marks=pytest.mark.slow),
        pytest.param("fsdp1", 2, 2, True, "null", id="fsdp1-2-ranks-2-receivers-tied"),
        pytest.param("fsdp1-orig", 4, 1, False, "bfloat16", id="fsdp1-orig-4-ranks-bf16", marks=pytest.mark.slow),
        pytest.param("fsdp1-orig", 2, 1, True, "null", id="fsdp1-orig-2-ranks-tied"),
    ],
)
def test_every_fsdp_rank_sends_its_shards_and_receivers_get_the_model_bitwise(
    fsdp: str, world: int, receivers: int, tied: bool, dtype: str
) -> None:
    trainer_port, port = free_port(), free_port()
    args = [(role, world, trainer_port, port, receivers, tied, dtype, fsdp) for role in range(world + receivers)]
    results = run_workers(_role, args, timeout_s=WORKER_TIMEOUT_S)
    expected = results[0]["expected"]
    assert len(results[0]["addresses"]) == world
    # every rank sent bytes of its own: no rank 0 bottleneck
    assert all(all(b > 0 for b in results[r]["bytes"]) for r in range(world)), [
        results[r]["bytes"] for r in range(world)
    ]
    problems = []
    for receiver in results[world:]:
        for version, (got_raw, want_raw) in enumerate(zip(receiver, expected, strict=True), start=1):
            got, want = load(got_raw), load(want_raw)
            if tied:
                want = {k: v for k, v in want.items() if k != "head.weight"}  # sent once, as embed.weight
            if sorted(got) != sorted(want):
                problems.append(f"v{version}: names {sorted(set(got) ^ set(want))}")
                continue
            for name, ref in want.items():
                t = got[name]
                if (
                    t.dtype != ref.dtype
                    or t.shape != ref.shape
                    or not torch.equal(t.view(torch.uint8), ref.view(torch.uint8))
                ):
                    problems.append(f"v{version}: {name} differs")
    assert not problems, problems


# -- a sender that dies mid-version: named on every receiver, nothing half-applied, the next version lands ------

KILL_TIMEOUT_S = 60.0
LIVENESS_S = 2.0
FAULT_WORLD = 3


def _weights(version: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(version)
    return {
        "w0": torch.randn(33, 40, generator=gen),  # 5 KiB a shard: direct buckets, each broadcast at once
        "w1": torch.randn(17, generator=gen),
        "w2": torch.randn(29, 31, generator=gen).to(torch.bfloat16),
        "w3": torch.randn(64, 24, generator=gen),
    }


def _fault_sender(
    rank: int, trainer_port: int, port: int, versions: list[int], die_in: int | None, flag: str,
    claim: int | None = None,
) -> Any:  # fmt: skip
    """One trainer rank of a sharded sender group, without FSDP: it owns torch.chunk row shards."""
    from lightning_weightsync import WeightSender
    from lightning_weightsync.errors import ConfigError

    if flag:  # phase B: a restarted trainer, once the first one is gone
        deadline = time.monotonic() + KILL_TIMEOUT_S
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.1)
    cfg = load_config(
        overrides=[f"transport.port={port if rank == 0 else 0}", "transport.timeout_s=60",
                   f"transport.liveness_s={LIVENESS_S}", "transport.bucket_size_mb=0.001",
                   "transport.direct_min_mb=0.002", "trainer.min_receivers=1", "transport.ready_timeout_s=3"]
    )  # fmt: skip

    async def main() -> list[str]:
        outcomes = []
        sender = WeightSender(cfg)
        for _ in range(50):  # phase B's rank 0 binds the port the first trainer's rank 0 just released
            try:
                await sender.start()
                break
            except ConfigError:
                await sender.close()
                sender = WeightSender(cfg)
                await asyncio.sleep(0.2)
        # -1: tells the others a port nobody serves
        group = ShardedRank(sender, rank, advertise=sender.port + 1 if claim == -1 else None)
        try:
            for version in versions:

                def mine(version: int = version):
                    for i, (name, tensor) in enumerate(_weights(version).items()):
                        if version == die_in and i == 3:
                            time.sleep(0.5)  # its first tensors' buckets are out (metadata and bytes) ...
                            os._exit(3)  # ... and the rest never come
                        shard = row_shard(tensor, rank, FAULT_WORLD)
                        if shard is not None:
                            yield name, shard

                outcomes.append(await group.outcome(mine(), version, index=claim if claim and claim > 0 else None))
        finally:
            await sender.close()
        return outcomes

    with gloo_group(rank, FAULT_WORLD, trainer_port):
        return asyncio.run(main())


def _fault_receiver(port: int, flag: str) -> list[Any]:
    from lightning_weightsync.rollout.consume import consume_version
    from lightning_weightsync.rollout.sinks.module import ModuleSink

    cfg = load_config(
        overrides=[f"transport.port={port}", "transport.timeout_s=60", f"transport.liveness_s={LIVENESS_S}",
                   "transport.heartbeat_interval_s=0.2", "rollout.identity=rollout-0"]
    )  # fmt: skip
    module = torch.nn.Module()
    for name, tensor in _weights(0).items():
        module.register_parameter(name, torch.nn.Parameter(torch.zeros_like(tensor), requires_grad=False))
    sink = ModuleSink(cfg, module=module)

    async def main() -> list[Any]:
        out: list[Any] = []
        async with WeightReceiver(cfg) as receiver:
            for _ in range(3):
                started = time.monotonic()
                try:
                    record = await consume_version(receiver, sink)
                    out.append(("ok", record.version))
                except Exception as exc:
                    out.append(("failed", str(exc), time.monotonic() - started))
                    open(flag, "w").close()  # the restarted trainer may start
                out.append(save({n: p.detach().clone() for n, p in module.named_parameters()}))
        return out

    return asyncio.run(asyncio.wait_for(main(), 2 * KILL_TIMEOUT_S))


def _fault_role(role: int, trainer_ports: tuple[int, int], port: int, flag: str) -> Any:
    if role == 2 * FAULT_WORLD:
        return _fault_receiver(port, flag)
    phase, rank = divmod(role, FAULT_WORLD)
    if phase == 0:
        return _fault_sender(rank, trainer_ports[0], port, [1, 2], 2 if rank == 2 else None, "")
    return _fault_sender(rank, trainer_ports[1], port, [3], None, flag)


def test_a_sender_killed_mid_version_fails_it_named_nothing_half_applied_and_the_next_version_lands(tmp_path) -> None:
    flag = str(tmp_path / "phase-a-done")
    trainer_ports, port = (free_port(), free_port()), free_port()
    args = [(role, trainer_ports, port, flag) for role in range(2 * FAULT_WORLD + 1)]
    results = run_workers(_fault_role, args, timeout_s=3 * KILL_TIMEOUT_S, doomed=[2])
    received = results[-1]
    v1, after1, v2, after2, v3, after3 = received
    assert v1 == ("ok", 1), v1
    assert v2[0] == "failed", v2
    print("version 2 on the receiver:", v2)
    # named: which sender, and bounded by liveness, not by transport.timeout_s (60 s)
    assert "127.0.0.1" in v2[1] and v2[2] < 30, v2
    # nothing of version 2 was applied: the model is exactly version 1
    problems = [n for n, t in load(after2).items() if not torch.equal(t, load(after1)[n])]
    assert not problems, f"version 2 was half-applied: {problems}"
    assert v3 == ("ok", 3), v3
    want = _weights(3)
    problems = [n for n, t in load(after3).items() if not torch.equal(t.view(torch.uint8), want[n].view(torch.uint8))]
    assert not problems, problems
    # the survivors of the first trainer were told too (a named failure, not a hang)
    for rank in (0, 1):
        assert results[rank][0] == "ok" and results[rank][1].startswith("failed"), results[rank]


def _lying_role(role: int, trainer_port: int, port: int, lie: int = 2) -> Any:
    if role == FAULT_WORLD:
        cfg = load_config(
            overrides=[f"transport.port={port}", "transport.timeout_s=60", "rollout.identity=rollout-0",
                       f"transport.liveness_s={LIVENESS_S}", "transport.heartbeat_interval_s=0.2",
                       "transport.ready_timeout_s=3"]
        )  # fmt: skip

        async def main() -> str:
            async with WeightReceiver(cfg) as receiver:
                try:
                    async for _ in receiver.receive_weights():
                        pass
                except Exception as exc:
                    return f"failed: {exc}"
            return "received"

        return asyncio.run(asyncio.wait_for(main(), KILL_TIMEOUT_S))
    # rank 1 marks its buckets as sender 2's: the wire names the sender, and the stream it came on must agree
    return _fault_sender(role, trainer_port, port, [1], None, "", claim=lie if role == 1 else None)


def test_a_bucket_claiming_another_sender_is_rejected_and_the_version_fails() -> None:
    trainer_port, port = free_port(), free_port()
    results = run_workers(_lying_role, [(role, trainer_port, port) for role in range(FAULT_WORLD + 1)],
                          timeout_s=2 * KILL_TIMEOUT_S)  # fmt: skip
    received = results[-1]
    assert received.startswith("failed") and "says it is from sender 2, but came from sender 1" in received, received
    assert all(r[0].startswith("failed") for r in results[:FAULT_WORLD]), results  # every sender was nacked


def test_a_sender_the_rollouts_cannot_reach_fails_the_version_within_ready_timeout_naming_the_knob() -> None:
    """Rank 1 advertises an address nobody serves (a wrong transport.sender_host): the receiver and rank 1
    both fail the version within transport.ready_timeout_s (3 s here), not transport.timeout_s (60 s)."""
    trainer_port, port = free_port(), free_port()
    started = time.monotonic()
    results = run_workers(_lying_role, [(role, trainer_port, port, -1) for role in range(FAULT_WORLD + 1)],
                          timeout_s=2 * KILL_TIMEOUT_S)  # fmt: skip
    elapsed = time.monotonic() - started
    received = results[-1]
    assert received.startswith("failed") and "no connection to it" in received and "sender_host" in received, received
    assert results[1][0].startswith("failed") and "sender_host" in results[1][0], results[1]
    assert elapsed < 40, elapsed  # process start-up included; the transfer timeout would be 60 s


# -- senders that lie about their part (issue 31): each version refused, nothing of it committed ---------------

LIE_WORLD = 2
LIES = {1: "hole", 2: "dtype", 3: "rogue"}  # version -> what rank 1 lies about; version 4 is honest


def _liar_sender(rank: int, trainer_port: int, port: int) -> list[str]:
    """Rank `rank` of a 2-rank sharded sender group (no FSDP: torch.chunk row shards); rank 1 lies in the
    versions of LIES (tests/support/lying.py), a different lie each, and tells the truth in version 4."""
    from tests.support.lying import RogueCoordinator, retyped, with_a_hole

    cfg = load_config(
        overrides=[f"transport.port={port if rank == 0 else 0}", "transport.timeout_s=60",
                   f"transport.liveness_s={LIVENESS_S}", "transport.bucket_size_mb=0.001",
                   "transport.direct_min_mb=0.002", "trainer.min_receivers=1", "transport.ready_timeout_s=5"]
    )  # fmt: skip
    rogue_in = [v for v, lie in LIES.items() if lie == "rogue"]

    async def main() -> list[str]:
        outcomes = []
        sender = RogueCoordinator(cfg, lie_in=rogue_in) if rank == 1 else WeightSender(cfg)
        await sender.start()
        group = ShardedRank(sender, rank)
        try:
            for version in (*LIES, 4):
                shards = ((n, s) for n, t in _weights(version).items() if (s := row_shard(t, rank, LIE_WORLD)))
                lie = LIES.get(version) if rank == 1 else None
                if lie == "hole":
                    shards = with_a_hole(shards, "w0")
                elif lie == "dtype":
                    shards = retyped(shards, "w0", torch.int32)  # float32 bytes, said to be int32
                outcomes.append(await group.outcome(shards, version))
        finally:
            await sender.close()
        return outcomes

    with gloo_group(rank, LIE_WORLD, trainer_port):
        return asyncio.run(asyncio.wait_for(main(), KILL_TIMEOUT_S * 2))


def _liar_receiver(port: int) -> list[Any]:
    cfg = load_config(
        overrides=[f"transport.port={port}", "transport.timeout_s=60", "rollout.identity=rollout-0",
                   f"transport.liveness_s={LIVENESS_S}", "transport.heartbeat_interval_s=0.2",
                   "transport.ready_timeout_s=5"]
    )  # fmt: skip

    async def main() -> list[Any]:
        out: list[Any] = []
        async with WeightReceiver(cfg) as receiver:
            for _ in range(len(LIES) + 1):
                started = time.monotonic()
                try:
                    got = {n: t.clone() async for n, t in receiver.receive_weights()}
                    out.append(("ok", receiver.last_complete_version, save(got), time.monotonic() - started))
                except Exception as exc:
                    out.append(("failed", receiver.version, str(exc), time.monotonic() - started))
        return out

    return asyncio.run(asyncio.wait_for(main(), KILL_TIMEOUT_S * 2))


def _liar_role(role: int, trainer_port: int, port: int) -> Any:
    return _liar_receiver(port) if role == LIE_WORLD else _liar_sender(role, trainer_port, port)


def test_lying_senders_a_hole_a_dtype_and_a_rogue_coordinator_are_refused_and_the_honest_version_lands() -> None:
    """Real sender processes, each version a different lie by rank 1: a row of `w0` sent by no rank (the
    receiver's tiling loop must run the end-of-version gap check), `w0` said to be int32 by one rank and
    float32 by the other (same shape, same bytes), and a plan from rank 1 listing other senders. Each is
    refused on the receiver naming what is wrong, every rank hears the nack, and the honest version 4 lands
    bitwise."""
    trainer_port, port = free_port(), free_port()
    results = run_workers(_liar_role, [(role, trainer_port, port) for role in range(LIE_WORLD + 1)],
                          timeout_s=3 * KILL_TIMEOUT_S)  # fmt: skip
    received = results[-1]
    print("receiver:", [(*r[:2], r[2] if r[0] == "failed" else "", round(r[3], 1)) for r in received])
    hole, dtype, rogue, honest = received
    assert hole[0] == "failed" and hole[1] == 1 and "gap in 'w0'" in hole[2], hole
    assert dtype[0] == "failed" and dtype[1] == 2 and "'w0' is torch." in dtype[2], dtype
    assert "int32" in dtype[2] and "float32" in dtype[2], dtype
    assert rogue[0] == "failed" and rogue[1] == 3 and "listing other senders" in rogue[2], rogue
    assert honest[:2] == ("ok", 4), honest
    # a refused sender is let go at once (its group given up), not left to broadcast until timeout_s (60 s)
    assert all(r[3] < 30 for r in received), [r[3] for r in received]
    want, got = _weights(4), load(honest[2])
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8)) for n in want)
    for rank in range(LIE_WORLD):  # every sender was nacked for each lie, and delivered the honest version
        assert [o[:6] for o in results[rank]] == ["failed"] * 3 + ["ok"], (rank, results[rank])
