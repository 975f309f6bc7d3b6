"""Overlap's background gather (trainer/side_gather.py) in real gloo processes: a staged local shard rebuilt
on the mirror mesh equals `full_tensor()` on the model's own mesh bitwise, for 1-D uneven Shard(0),
Shard(1), a 1-rank submesh (ModelParallelStrategy's defaults: data_parallel 1 x tensor_parallel 2), 2-D
meshes both ways round, real FSDP2 parameters, and a bf16 cast of the shard; while the main thread keeps
all-reducing on the training group (a mirror that used the training group would interleave and hang or
mix the collectives' data)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from tests.support.mp import free_port, run_workers

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


def _worker(rank: int, port: int) -> dict[str, Any]:
    import torch.distributed as dist

    from lightning_weightsync.trainer.side_gather import MirrorMeshes, StagedShard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
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
    finally:
        dist.destroy_process_group()


def test_staged_shards_rebuild_bitwise_on_mirror_groups_while_training_all_reduces() -> None:
    port = free_port()
    results = run_workers(_worker, [(r, port) for r in range(2)], timeout_s=150)
    for rank, result in enumerate(results):
        assert result["mismatched"] == [], (rank, result)
        assert len(result["cases"]) >= 17, result  # every layout, fp32 and bf16
        assert result["made"] == result["after"], result  # the second ensure made no group
