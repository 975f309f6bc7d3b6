"""A tensor-parallel rollout (2 processes, `parallelize_module`: column- and row-wise linears, a vocab-parallel
embedding tied to a column-parallel LM head) receives versions with `receive_weights(into=...)` whose `into`
returns the rollout's own DTensor parameters, and nothing else: every rank's local tensors end equal to its box
of the trainer's weights, bitwise. The first version comes whole (each rank keeps its box: protocol/boxes.py
places each chunk's part of it) and teaches each rank its boxes, which it declares (transport.slices); from the
second on each rank receives exactly its boxes and the tensors it holds whole (versions/lanes.py), counted in
bytes against the model's, and every tensor, boxes included, is verified (transport.verify=full).

Trainers: one `WeightSender` (gather mode), two sending their rows (sharded mode), and a 2-rank FSDP2 model
driven by `SyncDriver` with `trainer.overlap` (background sends of each step's snapshot, gather and sharded
mode), whose weights are set to the next version's right after each sync returns."""

from __future__ import annotations

import asyncio
import faulthandler
from datetime import timedelta
from typing import Any

import pytest
import torch

from lightning_weightsync import WeightReceiver, WeightSender
from lightning_weightsync.demo.tiny_lm import build_model
from lightning_weightsync.protocol.boxes import Box
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


def _tp_model(store_port: int, rank: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """This rank's part of the rollout's model, tensor-parallel over a 2-rank mesh, and its tensors by name."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
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
    return model, dict(model.named_parameters()) | dict(model.named_buffers())


def _tp_rollout(port: int, store_port: int, rank: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    model, params = _tp_model(store_port, rank)
    sharded = sorted(n for n, p in params.items() if isinstance(p, DTensor) and p.to_local().shape != p.shape)
    trainer = _trainer_model(1).state_dict()
    held = {n: (params[n].to_local() if isinstance(params[n], DTensor) else params[n]) for n in trainer if n in params}

    def nbytes(names: list[str], kept: bool) -> int:
        """Bytes of these tensors: whole, or what this rank keeps of each (its box, or the whole)."""
        tensors = [held[n] if kept else trainer[n] for n in names]
        return sum(t.numel() * t.element_size() for t in tensors)

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
                assert {"embed.weight", "layers.1.down.weight"} <= set(got), got
                for name, param in params.items():
                    if name not in got:
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
        whole = nbytes(seen[VERSIONS[0]], kept=False)
        kept = [nbytes(seen[v], kept=True) for v in VERSIONS[1:]]
        return {"seen": seen, "sharded": sharded, "received": received, "model": whole, "held": kept}

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


def _overlap_trainer(port: int, store_port: int, rank: int, mode: str) -> list[int]:
    """A 2-rank FSDP2 model (each layer its own unit; the tied embedding and head in the root's) synced by
    `SyncDriver` with `trainer.overlap`: each version is snapshotted at `sync` and sent in the background while
    the weights move on to the next version's."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    from lightning_weightsync.trainer.driver import SyncDriver
    from tests.support.overlap import init_rank, overlap_cfg

    init_rank(rank, store_port, worker_timeout_s=TIMEOUT_S, group_timeout_s=60)
    net = _trainer_model(0)
    for layer in net.layers:
        fully_shard(layer)
    fully_shard(net)
    cfg = overlap_cfg(port, f"trainer.send_mode={mode}", f"trainer.min_receivers={TP}", "transport.verify=full")
    driver = SyncDriver(cfg, rank=rank, device=torch.device("cpu"), prefix=None)
    driver.start()
    delivered = []
    try:
        for version in VERSIONS:
            want = _trainer_model(version).state_dict()
            with torch.no_grad():
                for name, param in net.named_parameters():
                    param.copy_(distribute_tensor(want[name], param.device_mesh, param.placements))
            delivered.append(driver.sync(net, version))  # whether the version before was delivered
        delivered.append(driver.finish(net, VERSIONS[-1]))  # ... and the last one
    finally:
        driver.close()
    return [TP] * len(VERSIONS) if all(delivered[1:]) and driver.record.failures == 0 else delivered


def _tp_rollout_keeping(port: int, store_port: int, rank: int) -> list[str]:
    """A rank that takes whole tensors (transport.slices=false) and keeps what it receives (`base=`): a delta
    (transport.delta=always) rebuilds a whole tensor, which a DTensor's box cannot hold: refused by name."""
    import torch.distributed as dist

    _, params = _tp_model(store_port, rank)

    async def main() -> list[str]:
        cfg = engine_cfg(port, transport__slices="false")
        outcomes = []
        async with WeightReceiver(cfg, identity=f"tp{rank}") as receiver:
            for _ in VERSIONS:
                try:
                    tensors = receiver.receive_weights(
                        into=lambda m: params.get(m.name), base=lambda m: params.get(m.name)
                    )
                    async for _name, _t in tensors:
                        pass
                    outcomes.append(f"{receiver.version}: ok")
                except Exception as exc:
                    outcomes.append(f"{receiver.version}: {type(exc).__name__}: {exc}")
        return outcomes

    try:
        return asyncio.run(main())
    finally:
        dist.destroy_process_group()


def _delta_trainer(port: int) -> list[str]:
    async def main() -> list[str]:
        cfg = engine_cfg(port, trainer__min_receivers=TP, transport__delta="always")
        outcomes = []
        async with WeightSender(cfg) as sender:
            for version in VERSIONS:
                try:
                    weights = [(n, t.clone()) for n, t in _weights(1)]  # one element a version changes: deltas win
                    for _, tensor in weights:
                        tensor.view(-1)[:1] += version
                    stats = await with_timeout(sender.send_weights(weights, version=version, tied=TIED), 90)
                    outcomes.append(f"{version}: {stats.delta_tensors} deltas")
                except Exception as exc:
                    outcomes.append(f"{version}: {type(exc).__name__}")
        return outcomes

    return asyncio.run(main())


def _delta_role(role: int, port: int, rollout_store_port: int) -> Any:
    return _delta_trainer(port) if role == 0 else _tp_rollout_keeping(port, rollout_store_port, role - 1)


def test_a_delta_into_a_dtensor_is_refused_by_name_and_the_next_version_comes_whole() -> None:
    port, rollout_store_port = free_port(), free_port()
    trainer, *ranks = run_workers(
        _delta_role, [(r, port, rollout_store_port) for r in range(1 + TP)], timeout_s=TIMEOUT_S
    )
    assert trainer[0] == "1: 0 deltas" and trainer[1] == "2: PeerError" and trainer[2] == "3: 0 deltas", trainer
    for outcomes in ranks:
        assert outcomes[0] == "1: ok" and outcomes[2] == "3: ok", outcomes
        assert outcomes[1].startswith("2: DeltaError") and "DTensor's box" in outcomes[1], outcomes
        assert "transport.slices=true" in outcomes[1] and "transport.delta=off" in outcomes[1], outcomes


def _role(role: int, senders: int, port: int, store_port: int, rollout_store_port: int, overlap: str) -> Any:
    if role >= senders:
        return _tp_rollout(port, rollout_store_port, role - senders)
    if overlap:
        return _overlap_trainer(port, store_port, role, overlap)
    if senders == 1:
        return _trainer(port)
    return _sharded_trainer(port, store_port, role, senders)


@pytest.mark.parametrize(
    ("senders", "overlap"),
    [(1, ""), (2, ""), (2, "gather"), (2, "sharded")],
    ids=["gather", "sharded-2-ranks", "overlap-fsdp2-gather", "overlap-fsdp2-sharded"],
)
def test_a_tensor_parallel_rollout_receives_into_its_dtensors_bitwise(senders: int, overlap: str) -> None:
    port, store_port, rollout_store_port = free_port(), free_port(), free_port()
    args = [(r, senders, port, store_port, rollout_store_port, overlap) for r in range(senders + TP)]
    results = run_workers(_role, args, timeout_s=TIMEOUT_S)
    trainers, ranks = results[:senders], results[senders:]
    assert all(t == [TP] * len(VERSIONS) for t in trainers if t is not None), trainers
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
              f"{rank['held']} ({max(rank['held']) / rank['model']:.0%})")  # fmt: skip
        assert received[VERSIONS[0]] == rank["model"], received
        assert [received[v] for v in VERSIONS[1:]] == rank["held"], (received, rank["held"])
        assert max(rank["held"]) < 0.7 * rank["model"], rank


WRONG = {"w": (64, 512)}  # 128 KiB: a box of half its rows fills a 64 KiB bucket, a direct bucket of its own
ROWS_BOX = Box((0, 0), (32, 512))


def _wrong_trainer(port: int, store_port: int) -> list[str]:
    """Rank 1 of the rollout's mesh (its DTensors need a 2-rank world), and the trainer: 4 versions of "w"."""
    from torch.distributed.device_mesh import init_device_mesh

    from tests.support.sharded_senders import gloo_group

    async def main() -> list[str]:
        outcomes = []
        async with WeightSender(engine_cfg(port, transport__verify="full")) as sender:
            for version in (1, 2, 3, 4):
                weights = [("w", torch.full(WRONG["w"], float(version)))]
                try:
                    await with_timeout(sender.send_weights(weights, version=version), 60)
                    outcomes.append(f"{version}: ok")
                except Exception as exc:
                    outcomes.append(f"{version}: {type(exc).__name__}")
        return outcomes

    with gloo_group(1, TP, store_port):
        init_device_mesh("cpu", (TP,))
        return asyncio.run(main())


def _wrong_rollout(port: int, store_port: int) -> list[str]:
    """Declares the first half of the rows of "w"; version 1 lands whole in a plain tensor, version 2 (its box
    alone, a direct bucket) in a DTensor that holds that box, version 3 in one that holds another box (its
    columns), version 4 in one of the same box of another global shape. Each failed one must leave the
    DTensor's bytes as they were: the refusal comes before any write."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from tests.support.sharded_senders import gloo_group

    with gloo_group(0, TP, store_port):
        mesh = init_device_mesh("cpu", (TP,))

        def dtensor(shape: tuple[int, int], dim: int) -> DTensor:
            local_shape = (-(-shape[0] // TP), shape[1]) if dim == 0 else (shape[0], shape[1] // TP)
            local = torch.full(local_shape, -7.0)
            return DTensor.from_local(local, mesh, [Shard(dim)], shape=torch.Size(shape),
                                      stride=(shape[1], 1), run_check=False)  # fmt: skip

        async def main() -> list[str]:
            outcomes = []
            cfg = engine_cfg(port, transport__verify="full")
            async with WeightReceiver(cfg, identity="tp0") as receiver:
                # its own box (rows 0-32), another box (columns 0-256), its box of another tensor (rows 0-32 of 63)
                dests = {2: dtensor(WRONG["w"], 0), 3: dtensor(WRONG["w"], 1), 4: dtensor((63, 512), 0)}
                for version in (1, 2, 3, 4):
                    receiver.declare_boxes({"w": ROWS_BOX})
                    dest = dests.get(version)
                    before = None if dest is None else dest.to_local().clone()
                    try:
                        async for name, tensor in receiver.receive_weights(
                            into=lambda meta, d=dest: d if d is not None else torch.empty(meta.local_shape)
                        ):
                            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                            assert name == "w" and torch.equal(local, torch.full(tuple(local.shape), float(version)))
                        stats = receiver.last_stats
                        assert stats is not None
                        outcomes.append(f"{version}: ok {stats.nbytes} bytes, {stats.direct_buckets} direct")
                    except Exception as exc:
                        outcomes.append(f"{version}: {type(exc).__name__}: {exc}")
                    if version == 2:  # its box, received in place
                        assert dest is not None and torch.equal(dest.to_local(), torch.full((32, 512), 2.0))
                    elif dest is not None:  # the live weights untouched by a refused version
                        assert torch.equal(dest.to_local(), before), f"version {version} wrote into the DTensor"
            return outcomes

        return asyncio.run(main())


def _wrong_role(role: int, port: int, store_port: int) -> list[str]:
    return _wrong_rollout(port, store_port) if role == 0 else _wrong_trainer(port, store_port)


def test_a_box_never_lands_in_a_dtensor_of_another_box_or_global_shape_and_nothing_is_written() -> None:
    """A direct bucket (one box filling a bucket) is received in place only into a destination that holds
    exactly that box of a tensor of the stream's shape; otherwise the merge refuses it by name, and the live
    weights were not touched first."""
    port, store_port = free_port(), free_port()
    rollout, trainer = run_workers(_wrong_role, [(r, port, store_port) for r in range(TP)], timeout_s=TIMEOUT_S)
    assert trainer == ["1: ok", "2: ok", "3: PeerError", "4: PeerError"], (trainer, rollout)
    box_bytes = 32 * 512 * 4
    assert rollout[0] == f"1: ok {2 * box_bytes} bytes, 2 direct", rollout
    assert rollout[1] == f"2: ok {box_bytes} bytes, 1 direct", rollout  # the box alone, received in place
    assert rollout[2].startswith("3: ProtocolError") and "box at [0, 0] of sizes [32, 512]" in rollout[2], rollout
    assert "box at [0, 0] of sizes [64, 256]" in rollout[2], rollout
    assert rollout[3].startswith("4: ProtocolError") and "[63, 512]" in rollout[3] and "'w'" in rollout[3], rollout
