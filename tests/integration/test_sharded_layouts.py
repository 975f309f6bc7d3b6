"""Sharded send mode on the layouts trainers build (issue 34): who sends what comes from the DTensor
placements and mesh. Real processes: a gloo trainer group with FSDP2 (and tensor parallel) DTensors on CPU,
a real receiver per send mode, real ZeroMQ sockets and gloo data-plane groups. Every layout goes in both
send modes, bitwise against the gathered model; in sharded mode every rank sends, and the ranks' bytes add
up to the model's exactly (one rank per byte)."""

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

TIMEOUT_S = 150
MODES = ("sharded", "gather")
REFUSED = ("tp-rowwise", "partial", "fsdp1-hybrid")  # a ConfigError on every rank, nothing sent
DRIFTED = {"drift-plain": "head.bias", "drift-copies": "embed.weight", "drift-replicate": "head.weight",
           "fsdp1-drift": "scale"}  # fmt: skip
"""Layouts where every rank holds a tensor whole and rank 1's copy differs: the version equals gather mode's
(global rank 0's copy), a warning names the tensor and ranks, SendStats.replica_drift counts it."""


def _model(layout: str, world: int, rank: int) -> torch.nn.Module:
    """Tiny models placed as trainers place them (101-row embedding: larger than the 1 KiB bucket)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    net = Net(vocab=101, dim=7)
    if layout.startswith("fsdp1"):
        return _fsdp1_model(net, layout, world, rank)
    if layout == "partial":  # a pending reduction: no rank holds the tensor's bytes
        from torch.distributed.tensor import DTensor, Partial

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        net.head.weight = torch.nn.Parameter(DTensor.from_local(net.head.weight.detach(), mesh, [Partial()]))
        return net
    if layout == "hsdp":  # replicate x shard
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        dp = mesh
    else:
        # dp x tp: ModelParallelStrategy's defaults are 1 x N; on 4 ranks the TP layouts are 2 x 2
        shape = (world, 1) if layout.startswith("dp") else (world // 2, 2) if world == 4 else (1, world)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("data_parallel", "tensor_parallel"))
        dp = mesh["data_parallel"]
    if layout == "mp-defaults-tied":
        net.head.weight = net.embed.weight
    if layout == "drift-replicate":  # a Replicate DTensor over every rank (each holds a whole copy)
        from torch.distributed.tensor import Replicate, distribute_tensor

        flat = init_device_mesh("cpu", (world,), mesh_dim_names=("replicate",))
        net.head.weight = torch.nn.Parameter(distribute_tensor(net.head.weight.detach(), flat, [Replicate()]))
    if layout == "tp-colwise":
        parallelize_module(net, mesh["tensor_parallel"], {"head": ColwiseParallel(), "blocks.0.fc": ColwiseParallel()})
    if layout == "tp-rowwise":
        parallelize_module(net, mesh["tensor_parallel"], {"head": RowwiseParallel()})
    for block in net.blocks:
        fully_shard(block, mesh=dp)
    if layout not in ("dp-plain-root", "drift-plain", "drift-replicate"):  # else the root's tensors stay plain
        fully_shard(net, mesh=dp)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.25)  # the same on every rank: replicas stay in step
        if rank == 1 and layout in DRIFTED:  # replicas that drifted: rank 1's copy differs (real runs: by ulps)
            local = net.get_parameter(DRIFTED[layout])
            (local.to_local() if hasattr(local, "to_local") else local).add_(1.0)
    return net


def _fsdp1_model(net: torch.nn.Module, layout: str, world: int, rank: int) -> torch.nn.Module:
    """FSDP1 on the blocks only: the root's parameters and buffers stay whole on every rank (what
    `_fsdp1_local_shards` spreads over the ranks, or sends from global rank 0 where the copies differ);
    "fsdp1-hybrid": HYBRID_SHARD over a 2 x 2 mesh (every replica group holds the same shards: refused; on 2
    ranks a 2 x 1 mesh would not do: FSDP1 turns a 1-rank shard group into NO_SHARD)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.25)
        if layout == "fsdp1-drift" and rank == 1:  # a buffer FSDP1 leaves whole on every rank (think BatchNorm's)
            bits = net.get_buffer("scale").view(torch.int32)  # drifted as real replicas drift: an ulp up and an
            bits[1] += 1  # ulp down in one row, which cancel in a row's sum (`fingerprint` cannot see it)
            bits[5] -= 1
    if layout == "fsdp1-hybrid":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))  # 4 ranks: 2 x 2
        return FSDP(
            net, sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=mesh, device_id=torch.device("cpu")
        )
    for i, block in enumerate(net.blocks):
        net.blocks[i] = FSDP(block, device_id=torch.device("cpu"))
    return net


def _trainer(rank: int, world: int, trainer_port: int, ports: dict[str, int], layouts: list[str]) -> Any:
    import faulthandler

    faulthandler.dump_traceback_later(TIMEOUT_S - 10, exit=True)
    store = dist.TCPStore("127.0.0.1", trainer_port, world, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    import logging

    warnings: list[str] = []  # what the driver says at start (sharded mode: what it does not do)

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("lightning_weightsync.trainer.driver").addHandler(Keep())
    logging.getLogger("lightning_weightsync.trainer.sharded").addHandler(Keep())
    drivers = {}
    for mode in MODES:
        cfg = load_config(
            overrides=[f"transport.port={ports[mode]}", "transport.timeout_s=60", "transport.heartbeat_interval_s=0.2",
                       "transport.bucket_size_mb=0.001", "transport.direct_min_mb=0.002", "trainer.min_receivers=1",
                       f"trainer.send_mode={mode}"]
        )  # fmt: skip
        drivers[mode] = SyncDriver(cfg, rank=rank, device=torch.device("cpu"), prefix=None)
        drivers[mode].start()
    out: dict[str, Any] = {"expected": [], "bytes": [], "errors": {}, "warnings": warnings, "drift": {}, "wholes": {}}
    version = 0
    try:
        for layout in layouts:
            model = _model(layout, world, rank)
            if layout in REFUSED:
                try:
                    drivers["sharded"].sync(model, 100 + len(out["errors"]))
                    out["errors"][layout] = "sent"
                except Exception as exc:
                    out["errors"][layout] = f"{type(exc).__name__}: {exc}"
                continue
            version += 1
            sent = {}
            for mode in MODES:
                assert drivers[mode].sync(model, version), f"{layout}: version {version} not delivered ({mode})"
                stats = drivers[mode].last_stats
                sent[mode] = stats.nbytes if stats is not None else 0
            out["bytes"].append(sent)
            if layout.startswith("fsdp1"):  # which whole tensors this rank sends (a collective: every rank)
                from lightning_weightsync.protocol.chunks import TensorShard
                from lightning_weightsync.trainer.sharded import iter_local_shards

                drift = drivers["sharded"].replica_drift  # the same run: warned once already
                mine = iter_local_shards(model, device=torch.device("cpu"), version=version, drift=drift)
                out["wholes"][layout] = sorted(n for n, t in mine if not isinstance(t, TensorShard))
            if layout in DRIFTED:
                stats = drivers["sharded"].last_stats
                out["drift"][layout] = stats.replica_drift if stats is not None else None
            full = named_full_state_dict(model)  # collective
            out["expected"].append((layout, save(full), sum(t.nbytes for t in full.values())) if rank == 0 else None)
    finally:
        for driver in drivers.values():
            driver.close()
        dist.destroy_process_group()
    return out


def _receiver(ports: dict[str, int], versions: int) -> dict[str, list[bytes]]:
    async def one(mode: str) -> list[bytes]:
        cfg = load_config(
            overrides=[f"transport.port={ports[mode]}", "transport.timeout_s=60", "transport.heartbeat_interval_s=0.2",
                       f"rollout.identity=rollout-{mode}"]
        )  # fmt: skip
        got = []
        async with WeightReceiver(cfg) as receiver:
            for _ in range(versions):
                got.append(save({n: t.clone() async for n, t in receiver.receive_weights()}))
        return got

    async def main() -> dict[str, list[bytes]]:
        results = await asyncio.gather(*(one(mode) for mode in MODES))
        return dict(zip(MODES, results, strict=True))

    return asyncio.run(asyncio.wait_for(main(), TIMEOUT_S - 20))


def _role(role: int, world: int, trainer_port: int, ports: dict[str, int], layouts: list[str]) -> Any:
    if role < world:
        return _trainer(role, world, trainer_port, ports, layouts)
    sent = [x for x in layouts if x not in REFUSED]
    return _receiver(ports, len(sent))


def _run(world: int, layouts: list[str]) -> tuple[list[Any], dict[str, list[bytes]]]:
    trainer_port, ports = free_port(), {mode: free_port() for mode in MODES}
    results = run_workers(_role, [(role, world, trainer_port, ports, layouts) for role in range(world + 1)],
                          timeout_s=TIMEOUT_S)  # fmt: skip
    return results[:world], results[world]


def _check_bitwise(trainers: list[Any], received: dict[str, list[bytes]]) -> None:
    problems = []
    for mode in MODES:
        for index, (layout, want_raw, _) in enumerate(trainers[0]["expected"]):
            got, want = load(received[mode][index]), load(want_raw)
            if layout.endswith("tied"):
                want = {k: v for k, v in want.items() if k != "head.weight"}  # sent once, as embed.weight
            if sorted(got) != sorted(want):
                problems.append(f"{mode} {layout}: names {sorted(set(got) ^ set(want))}")
                continue
            for name, ref in want.items():
                t = got[name]
                if (
                    t.dtype != ref.dtype
                    or t.shape != ref.shape
                    or not torch.equal(t.view(torch.uint8), ref.view(torch.uint8))
                ):
                    problems.append(f"{mode} {layout}: {name} differs")
    assert not problems, problems
    for index, (layout, _, nbytes) in enumerate(trainers[0]["expected"]):
        sharded = [t["bytes"][index]["sharded"] for t in trainers]
        gathered = [t["bytes"][index]["gather"] for t in trainers]
        assert all(b > 0 for b in sharded), (layout, sharded)  # every rank sends, replicas included
        assert sum(sharded) == nbytes, (layout, sharded, nbytes)  # exactly one rank sends each byte
        assert gathered[0] == nbytes and not any(gathered[1:]), (layout, gathered)


def test_two_rank_layouts_send_their_own_bytes_in_sharded_mode_and_refuse_what_they_cannot() -> None:
    """ModelParallelStrategy's defaults (1 x 2 mesh, FSDP2 on the 1-rank data-parallel submesh: both ranks
    hold whole copies), dp 2 x tp 1 with the root's tensors left plain beside sharded blocks, and FSDP2 over
    column-wise tensor parallel (2-D placements); replicas that drifted (a plain tensor, whole copies on a
    1-rank data-parallel submesh, a Replicate DTensor: rank 1's copy differs) go as gather mode sends them,
    global rank 0's, with a warning and a count, never a mix of ranks' stripes; then row-wise tensor parallel
    (a Shard(1) strided box) and a Partial tensor (each a ConfigError on every rank naming the tensor, its
    placements, its mesh and the knob). FSDP1 with the root left whole: its whole tensors spread over the
    ranks where the copies agree, from global rank 0 where they differ; FSDP1 hybrid sharding refused."""
    layouts = ["mp-defaults-tied", "dp-plain-root", "tp-colwise", "fsdp1", *DRIFTED, "tp-rowwise", "partial"]
    trainers, received = _run(2, layouts)
    _check_bitwise(trainers, received)
    sharded_said = [w for w in trainers[0]["warnings"] if "send_mode=sharded" in w]
    for layout, name in DRIFTED.items():
        assert trainers[0]["drift"][layout] == 1, (layout, trainers[0]["drift"])
        said = [w for w in sharded_said if repr(name) in w and "differs between ranks" in w]
        difference = "rank 1: 1.19e-07" if layout == "fsdp1-drift" else "rank 1: 1"  # one ulp of 1.58, or 1.0
        assert len(said) == 1 and "ranks [0], ranks [1]" in said[0] and difference in said[0], (layout, sharded_said)
    # nothing else to warn about at the default settings (sharded mode verifies: each rank fingerprints its shards)
    assert len(sharded_said) == len(DRIFTED), sharded_said
    for rank, trainer in enumerate(trainers):
        errors = trainer["errors"]
        for layout, placed in (("tp-rowwise", "Shard(dim=1)"), ("partial", "Partial(")):
            error = errors[layout]
            assert error.startswith("ConfigError") and "'head.weight'" in error and placed in error, (rank, error)
            assert "mesh" in error and "global ranks" in error and "trainer.send_mode=gather" in error, error
    # FSDP1's whole tensors: each rank sends some (spread), never the same one twice; a drifted one from rank 0
    wholes = [set(t["wholes"]["fsdp1"]) for t in trainers]
    assert all(wholes) and not wholes[0] & wholes[1], wholes
    drifted = [set(t["wholes"]["fsdp1-drift"]) for t in trainers]
    assert "scale" in drifted[0] and "scale" not in drifted[1] and drifted[1], drifted


@pytest.mark.slow
def test_hsdp_and_fsdp2_over_tp_2x2_send_every_byte_once_from_every_rank_bitwise() -> None:
    """HSDP on 4 ranks (a 2 x 2 replicate x shard mesh): each shard is held by two replicas, and each sends
    half of it; then FSDP2 over column-wise tensor parallel on a 2 x 2 dp x tp mesh. All four ranks send,
    and the bytes add up to the model's exactly. FSDP1 hybrid sharding (2 x 2) is refused on every rank."""
    trainers, received = _run(4, ["hsdp", "tp-colwise", "fsdp1-hybrid"])
    _check_bitwise(trainers, received)
    for trainer in trainers:  # FSDP1 hybrid sharding: refused on every rank, naming the knob
        hybrid = trainer["errors"]["fsdp1-hybrid"]
        assert hybrid.startswith("ConfigError") and "hybrid" in hybrid and "trainer.send_mode=gather" in hybrid, hybrid
