"""Overlap's background gather (trainer/side_gather.py) in real gloo processes: a staged local shard rebuilt
on the mirror mesh equals `full_tensor()` on the model's own mesh bitwise, for 1-D uneven Shard(0),
Shard(1), a 1-rank submesh (ModelParallelStrategy's defaults: data_parallel 1 x tensor_parallel 2), 2-D
meshes both ways round, real FSDP2 parameters, and a bf16 cast of the shard; while the main thread keeps
all-reducing on the training group (a mirror that used the training group would interleave and hang or
mix the collectives' data).

And through the overlap sync, with a real rollout: a version whose tensors land on a mesh new to one rank only
(the other has every group it needs already): the exchange that makes the mirror groups is still collective,
and the version is delivered bitwise."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from safetensors.torch import load

from tests.support.mp import free_port, run_workers
from tests.support.overlap import (
    Rollout,
    applied,
    fsdp2_net,
    full_weights,
    init_rank,
    overlap_cfg,
    rollouts_main,
    touch,
)

WORKER_TIMEOUT_S = 150.0

pytestmark = pytest.mark.slow


def _cases(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(7)  # the same full tensors on both ranks
    world = init_device_mesh("cpu", (2,))
    dp_tp = init_device_mesh("cpu", (1, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    rep_shard = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    cases = {
        "shard0_uneven": distribute_tensor(torch.randn(7, 5), world, [Shard(0)]),
        "shard1": distribute_tensor(torch.randn(3, 9), world, [Shard(1)]),
        "submesh_dp1": distribute_tensor(torch.randn(6, 4), dp_tp["data_parallel"], [Shard(0)]),
        "tp_col": distribute_tensor(torch.randn(4, 6), dp_tp["tensor_parallel"], [Shard(1)]),
        "2d_rep_shard": distribute_tensor(torch.randn(5, 3), dp_tp, [Replicate(), Shard(0)]),
        "2d_hsdp": distribute_tensor(torch.randn(9, 2), rep_shard, [Replicate(), Shard(0)]),
        "int64": distribute_tensor(torch.arange(11, dtype=torch.int64), world, [Shard(0)]),
    }
    net = torch.nn.Sequential(torch.nn.Linear(5, 13), torch.nn.Linear(13, 3))
    fully_shard(net, mesh=world)
    for name, p in net.named_parameters():
        cases[f"fsdp2.{name}"] = p.detach()
    return cases


def _mirrors_bitwise(rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    from lightning_weightsync.trainer.side_gather import MirrorMeshes, StagedShard

    cases = _cases(rank)
    mirrors = MirrorMeshes(60.0, None)
    meshes = {id(t.device_mesh): t.device_mesh for t in cases.values()}
    mirrors.ensure(meshes.values(), "cpu")
    made = len(mirrors._groups)
    mirrors.ensure(meshes.values(), "cpu")  # a second snapshot makes nothing new
    expected: dict[str, torch.Tensor] = {}
    staged: list[tuple[str, StagedShard]] = []
    for name, dt in cases.items():
        for dtype in (dt.dtype, torch.bfloat16) if dt.is_floating_point() else (dt.dtype,):
            key = f"{name}/{dtype}"
            expected[key] = dt.full_tensor().to(dtype)
            local = torch.empty(dt.to_local().shape, dtype=dtype)
            local.copy_(dt.to_local())  # what Staging.copy does: cast on the way in
            mirror = mirrors.mirror(dt.device_mesh, "cpu")
            for d in range(mirror.ndim):
                assert mirror.get_group(d) is not dt.device_mesh.get_group(d), (key, d)
                assert mirror.get_group(d) is not dist.group.WORLD, (key, d)
            staged.append((key, StagedShard(local, mirror, tuple(dt.placements), dt.shape, dt.stride())))

    got: dict[str, torch.Tensor] = {}
    errors: list[BaseException] = []

    def background() -> None:
        try:
            for key, item in staged:
                got[key] = item.full()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=background)
    thread.start()
    sums = []
    for i in range(200):  # training's collectives on the training group, meanwhile
        flag = torch.full((1024,), float(rank + i))
        dist.all_reduce(flag)
        sums.append(float(flag[0]))
    thread.join(60)
    assert not thread.is_alive(), "the background gather hung"
    assert not errors, errors
    assert sums == [float(2 * i + 1) for i in range(200)]  # the training group's data was never mixed
    mismatched = [
        k
        for k, want in expected.items()
        if got[k].dtype != want.dtype or got[k].shape != want.shape or not torch.equal(got[k], want)
    ]
    return {"mismatched": mismatched, "cases": sorted(expected), "made": made, "after": len(mirrors._groups)}


def _new_mesh_on_one_rank(rank: int, port: int) -> dict[str, Any]:
    """Version 0: buffer `solo` is a plain tensor on rank 0 and a DTensor on rank 1's own 1-rank mesh (a
    submesh: rank 0's is [0], rank 1's [1]); version 1: rank 0's lands on its 1-rank mesh too. Only rank 0
    needs a new mirror group then (rank 1 made its own at version 0); neither version all-gathers `solo`
    across ranks, FSDP2's parameters are all-gathered in the background as usual."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from lightning_weightsync.trainer.driver import SyncDriver

    net = fsdp2_net()
    own = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))["dp"]
    solo = torch.arange(6.0)
    net.register_buffer("solo", distribute_tensor(solo, own, [Replicate()]) if rank == 1 else solo.clone())
    driver = SyncDriver(overlap_cfg(port), rank=dist.get_rank(), device=torch.device("cpu"), prefix=None)
    driver.start()
    try:
        refs = [full_weights(driver, net)]
        driver.sync(net, 0)
        net.solo = distribute_tensor(solo + 1, own, [Replicate()])
        refs.append(full_weights(driver, net))
        driver.sync(net, 1)
        finished = driver.finish(net, 1)
    finally:
        driver.close()
    return {"refs": refs, "finished": finished, "last": driver.record.last_synced_version}


def _role(role: int, master_port: int, port: int, done: str) -> Any:
    """0, 1: the trainer ranks (the mirror cases, then the overlap sync); 2: the overlap sync's rollout."""
    import torch.distributed as dist

    if role == 2:
        return rollouts_main([Rollout(port, "rollout-mesh", done, keep=True)], WORKER_TIMEOUT_S - 20)
    init_rank(role, master_port, worker_timeout_s=WORKER_TIMEOUT_S, group_timeout_s=30)
    try:
        mirrors = _mirrors_bitwise(role)
        try:
            overlap = _new_mesh_on_one_rank(role, port)
        finally:
            if role == 0:
                touch(done)
        return {"mirrors": mirrors, "overlap": overlap}
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """One set of processes for both tests: two trainer ranks and a rollout."""
    done = str(tmp_path_factory.mktemp("side-gather") / "done")
    master, port = free_port(), free_port()
    return run_workers(_role, [(r, master, port, done) for r in range(3)], timeout_s=WORKER_TIMEOUT_S)


def test_staged_shards_rebuild_bitwise_on_mirror_groups_while_training_all_reduces(run: list[Any]) -> None:
    results = [r["mirrors"] for r in run[:2]]
    for rank, result in enumerate(results):
        assert result["mismatched"] == [], (rank, result)
        assert len(result["cases"]) >= 17, result  # every layout, fp32 and bf16
        assert result["made"] == result["after"], result  # the second ensure made no group


def test_a_mesh_new_to_one_rank_only_still_makes_its_mirror_groups_collectively_and_the_version_arrives(
    run: list[Any],
) -> None:
    r0, r1 = (r["overlap"] for r in run[:2])
    assert r0["finished"] is True and r1["finished"] is True and r0["last"] == r1["last"] == 1
    events = run[2]["rollout-mesh"]
    assert applied(events) == [0, 1], events
    for version, (_, _, blob) in enumerate(events):
        got, want = load(blob), load(r0["refs"][version])
        assert sorted(got) == sorted(want) and "solo" in want
        for name, tensor in want.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), (version, name)
