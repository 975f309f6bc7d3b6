"""A tensor-parallel rollout (2 processes, `parallelize_module`: column- and row-wise linears, a vocab-parallel
embedding tied to a column-parallel LM head) receives versions with `receive_weights(into=...)` whose `into`
returns the rollout's own DTensor parameters, and nothing else: every rank's local tensors end equal to its box
of the trainer's weights, bitwise. The first version comes whole (each rank keeps its box: protocol/boxes.py
places each chunk's part of it) and teaches each rank its boxes, which it declares (transport.slices); from the
second on each rank receives exactly its boxes and the tensors it holds whole (versions/lanes.py), counted in
bytes against the model's, and every tensor, boxes included, is verified (transport.verify=full)."""

from __future__ import annotations

import asyncio
import faulthandler
from datetime import timedelta
from typing import Any

import pytest
import torch

from lightning_weightsync import WeightReceiver, WeightSender
from lightning_weightsync.demo.tiny_lm import build_model
from lightning_weightsync.protocol.chunks import as_bytes
from tests.support.mp import free_port, run_workers
from tests.support.transfer import engine_cfg, with_timeout

TP = 2
VERSIONS = (1, 2, 3)
TIMEOUT_S = 120
MODEL = {"vocab_size": 64, "dim": 32, "n_layers": 2, "max_seq_len": 16}


def _trainer_model(version: int) -> torch.nn.Module:
    """The trainer's weights of `version`, the same in every process (the rollout ranks check against them)."""
    model = build_model(MODEL, seed=1000 + version)
    model.lm_head.weight = model.embed.weight  # tied: sent once, as embed.weight
    return model


def _tp_rollout(port: int, store_port: int, rank: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    faulthandler.dump_traceback_later(TIMEOUT_S - 10, exit=True)
    store = dist.TCPStore("127.0.0.1", store_port, TP, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=TP)
    mesh = init_device_mesh("cpu", (TP,))
    model = build_model(MODEL, seed=7)  # the rollout's own initial weights: not the trainer's
    plan: dict[str, Any] = {"embed": RowwiseParallel(), "lm_head": ColwiseParallel()}
    for i in range(MODEL["n_layers"]):
        plan |= {f"layers.{i}.qkv": ColwiseParallel(), f"layers.{i}.proj": RowwiseParallel(),
                 f"layers.{i}.up": ColwiseParallel(), f"layers.{i}.down": RowwiseParallel()}  # fmt: skip
    parallelize_module(model, mesh, plan)
    model.lm_head.weight = model.embed.weight  # tied on the rollout too, after parallelizing
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    sharded = sorted(n for n, p in params.items() if isinstance(p, DTensor) and p.to_local().shape != p.shape)
    trainer = _trainer_model(1).state_dict()
    model_bytes = sum(t.numel() * t.element_size() for n, t in trainer.items() if n != "lm_head.weight")
    held = {n: (params[n].to_local() if isinstance(params[n], DTensor) else params[n]) for n in trainer if n in params}
    held_bytes = sum(t.numel() * t.element_size() for n, t in held.items() if n != "lm_head.weight")

    async def main() -> dict[str, Any]:
        cfg = engine_cfg(port, transport__verify="full")
        seen: dict[int, list[str]] = {}
        received: dict[int, int] = {}
        async with WeightReceiver(cfg, identity=f"tp{rank}") as receiver:
            for version in VERSIONS:
                got = [n async for n, _ in receiver.receive_weights(into=lambda meta: params.get(meta.name))]
                seen[version] = got
                assert receiver.last_stats is not None
                received[version] = receiver.last_stats.nbytes
                # transport.verify=full: the first version, whole, checks every tensor held whole (a box kept of
                # a whole tensor cannot be, against the whole one's fingerprint: counted, not checked); from the
                # second on the boxes come alone, fingerprinted as such, and every tensor is checked
                plain = [n for n in got if n not in sharded]
                report = receiver.last_verify
                checked = len(plain) if version == VERSIONS[0] else len(got)
                assert report is not None and report.tensors == len(got) and report.verified == checked, report
                expected = _trainer_model(version).state_dict()
                for name, param in params.items():
                    if name not in expected or name == "lm_head.weight":
                        continue
                    local = param.to_local() if isinstance(param, DTensor) else param
                    if isinstance(param, DTensor):
                        from lightning_weightsync.protocol.boxes import box_of

                        box = box_of(param)
                        assert box is not None
                        want = box.of(expected[name])
                    else:
                        want = expected[name]
                    assert local.dtype == want.dtype and local.shape == want.shape, name
                    assert torch.equal(as_bytes(local.contiguous()), as_bytes(want.contiguous())), (version, name)
                assert model.lm_head.weight is model.embed.weight
        return {"seen": seen, "sharded": sharded, "received": received, "model": model_bytes, "held": held_bytes}

    try:
        return asyncio.run(main())
    finally:
        dist.destroy_process_group()


def _weights(version: int) -> list[tuple[str, torch.Tensor]]:
    model = _trainer_model(version)
    return [(n, t.detach()) for n, t in model.state_dict().items() if n != "lm_head.weight"]


TIED = {"embed.weight": ["lm_head.weight"]}


def _trainer(port: int) -> list[int]:
    """Gather mode: one sender, whole tensors."""

    async def main() -> list[int]:
        cfg = engine_cfg(port, trainer__min_receivers=TP, transport__verify="full")
        receivers = []
        async with WeightSender(cfg) as sender:
            for version in VERSIONS:
                stats = await with_timeout(sender.send_weights(_weights(version), version=version, tied=TIED), 90)
                receivers.append(stats.receivers)
        return receivers

    return asyncio.run(main())


def _sharded_trainer(port: int, store_port: int, rank: int, world: int) -> list[int]:
    """Sharded mode: every trainer rank sends its rows of every tensor (FSDP2's Shard(0) cut); the rollout's
    boxes are column and row blocks, so each chunk's part of a box is cut across rows and columns."""
    from tests.support.sharded_senders import ShardedRank, gloo_group, row_shard

    async def main() -> list[int]:
        cfg = engine_cfg(port if rank == 0 else 0, trainer__min_receivers=TP, transport__verify="full")
        receivers = []
        async with WeightSender(cfg) as sender:
            me = ShardedRank(sender, rank)
            for version in VERSIONS:
                mine: list[tuple[str, Any]] = []
                for name, tensor in _weights(version):
                    if tensor.dim() == 0:  # a scalar (the step count): whole, from rank 0, as sharded mode sends it
                        mine += [(name, tensor)] if rank == 0 else []
                    elif (shard := row_shard(tensor, rank, world)) is not None:
                        mine.append((name, shard))
                stats = await with_timeout(me.send(mine, version), 90)
                receivers.append(stats.receivers)
        return receivers

    with gloo_group(rank, world, store_port):
        return asyncio.run(main())


def _role(role: int, senders: int, port: int, store_port: int, rollout_store_port: int) -> Any:
    if role >= senders:
        return _tp_rollout(port, rollout_store_port, role - senders)
    if senders == 1:
        return _trainer(port)
    return _sharded_trainer(port, store_port, role, senders)


@pytest.mark.parametrize("senders", [1, 2], ids=["gather", "sharded-2-ranks"])
def test_a_tensor_parallel_rollout_receives_into_its_dtensors_bitwise(senders: int) -> None:
    port, store_port, rollout_store_port = free_port(), free_port(), free_port()
    args = [(r, senders, port, store_port, rollout_store_port) for r in range(senders + TP)]
    results = run_workers(_role, args, timeout_s=TIMEOUT_S)
    trainers, ranks = results[:senders], results[senders:]
    assert all(t == [TP] * len(VERSIONS) for t in trainers), trainers
    for rank in ranks:
        # column-wise (qkv, up, lm_head/embed: dim 0) and row-wise (proj, down: dim 1) boxes, not whole copies
        assert {"embed.weight", "layers.0.qkv.weight", "layers.0.proj.weight", "layers.1.down.weight"} <= set(
            rank["sharded"]
        ), rank["sharded"]
        for version in VERSIONS:
            assert "embed.weight" in rank["seen"][version] and "layers.1.down.weight" in rank["seen"][version]
        # bytes off the wire: the whole model first, then exactly this rank's boxes and what it holds whole
        received = rank["received"]
        print(f"rank bytes a version {received} of a {rank['model']}-byte model; its boxes and whole tensors: "
              f"{rank['held']} ({rank['held'] / rank['model']:.0%})")  # fmt: skip
        assert received[VERSIONS[0]] == rank["model"], received
        assert all(received[v] == rank["held"] for v in VERSIONS[1:]), (received, rank["held"])
        assert rank["held"] < 0.7 * rank["model"], rank
