"""Sharded send mode end to end (issue 19): every FSDP2 rank sends the bytes it owns, with no all-gather;
receivers tile the ranks' byte ranges into whole tensors. Real processes: a gloo trainer group running
FSDP2 on CPU, real receivers, real ZeroMQ sockets and gloo data-plane groups (one per sender)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load, save

from lightning_weightsync import WeightReceiver, load_config
from lightning_weightsync.trainer.driver import SyncDriver
from lightning_weightsync.trainer.gather import named_full_state_dict
from tests.integration.test_gather import Net
from tests.support.mp import free_port, run_workers

WORKER_TIMEOUT_S = 150
VERSIONS = 2


def _model(tied: bool) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = Net(vocab=101, dim=7)  # 101 rows: uneven over 2 and 4 ranks; the embedding is larger than the bucket
    if tied:
        net.head.weight = net.embed.weight  # tied embeddings: sent once, under the first name
    for block in net.blocks:
        fully_shard(block)
    return fully_shard(net)


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


def _trainer(rank: int, world: int, trainer_port: int, port: int, receivers: int, tied: bool, dtype: str) -> Any:
    import faulthandler

    faulthandler.dump_traceback_later(WORKER_TIMEOUT_S - 10, exit=True)
    store = dist.TCPStore("127.0.0.1", trainer_port, world, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        model = _model(tied)
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
    finally:
        dist.destroy_process_group()


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


def _role(role: int, world: int, trainer_port: int, port: int, receivers: int, tied: bool, dtype: str) -> Any:
    if role < world:
        return _trainer(role, world, trainer_port, port, receivers, tied, dtype)
    return _receiver(role - world, port)


@pytest.mark.parametrize(
    "world, receivers, tied, dtype",
    [
        pytest.param(2, 1, False, "null", id="2-ranks-1-receiver"),
        pytest.param(2, 2, True, "bfloat16", id="2-ranks-2-receivers-tied-bf16"),
        pytest.param(4, 2, True, "null", id="4-ranks-2-receivers-tied", marks=pytest.mark.slow),
    ],
)
def test_every_fsdp2_rank_sends_its_shards_and_receivers_get_the_model_bitwise(
    world: int, receivers: int, tied: bool, dtype: str
) -> None:
    trainer_port, port = free_port(), free_port()
    args = [(role, world, trainer_port, port, receivers, tied, dtype) for role in range(world + receivers)]
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
