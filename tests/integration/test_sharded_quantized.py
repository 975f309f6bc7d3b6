"""A quantized version in sharded send mode: every FSDP2 rank quantizes its own shards to the contract the
rollout declares and sends them (no all-gather); the receiver tiles them into what the contract's quantizer makes
of the whole tensors, byte for byte, at about half the bytes. A shard that cuts a block fails the version on the
ranks that hold it, naming the tensor, the cut and the knobs, with nothing applied. Real processes: a gloo trainer
group running FSDP2 on CPU, a real receiver, real ZeroMQ sockets and gloo data-plane groups."""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from safetensors.torch import load, save
from torch import nn

from lightning_weightsync import WeightReceiver, load_config
from lightning_weightsync.quantize import QuantContract, QuantRule, quantize_stream
from lightning_weightsync.trainer.driver import SyncDriver
from lightning_weightsync.trainer.gather import named_full_state_dict
from tests.support.mp import free_port, run_workers
from tests.support.sharded_senders import gloo_group

WORKER_TIMEOUT_S = 120
WORLD = 2
CONTRACT = QuantContract(
    rules=(
        QuantRule("up.weight"),  # [511, 256]: rows [0, 256) and [256, 511): block edges, a short last block
        QuantRule("moe.gate_up_proj"),  # [4, 160, 128] expert bank: two whole experts a rank
        QuantRule("down.weight", scheme="mxfp8", block=(1, 32), scale_dtype="uint8"),  # [200, 512]: 100 rows a rank
        QuantRule("odd.weight"),  # [384, 64] (unaligned case only): 192 rows a rank cut block row 1
    ),
    keep=("up.bias", "down.bias", "norm.weight", "norm.bias", "odd.bias"),
)


class Bank(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(4, 160, 128) * 0.02)


class QNet(nn.Module):
    def __init__(self, unaligned: bool) -> None:
        super().__init__()
        self.up = nn.Linear(256, 511)
        self.moe = Bank()
        self.down = nn.Linear(512, 200)
        self.norm = nn.LayerNorm(200)
        self.odd = nn.Linear(64, 384) if unaligned else None


def _cfg(port: int) -> Any:
    return load_config(
        overrides=[f"transport.port={port}", "transport.timeout_s=60", "transport.heartbeat_interval_s=0.2",
                   "transport.bucket_size_mb=0.0625", "trainer.min_receivers=1", "trainer.send_mode=sharded",
                   "trainer.dtype=bfloat16"]
    )  # fmt: skip


def _trainer(rank: int, trainer_port: int, port: int, unaligned: bool) -> Any:
    import faulthandler

    from torch.distributed.fsdp import fully_shard

    faulthandler.dump_traceback_later(WORKER_TIMEOUT_S - 10, exit=True)
    with gloo_group(rank, WORLD, trainer_port):
        torch.manual_seed(0)
        model = fully_shard(QNet(unaligned))
        driver = SyncDriver(_cfg(port), rank=rank, device=torch.device("cpu"), prefix=None)
        driver.start()
        try:
            try:
                delivered, error = driver.sync(model, 1), ""
            except Exception as exc:
                delivered, error = False, f"{type(exc).__name__}: {exc}"
            full = named_full_state_dict(model, dtype="bfloat16")  # collective
            expected = save(dict(quantize_stream(full.items(), CONTRACT))) if rank == 0 else None
            stats = driver.last_stats
        finally:
            driver.close()
    sent = (stats.nbytes, stats.unquantized_bytes, stats.quantized_tensors) if stats is not None else None
    return {"delivered": delivered, "error": error, "expected": expected, "sent": sent}


def _receiver(port: int) -> dict[str, Any]:
    cfg = load_config(overrides=[f"transport.port={port}", "transport.timeout_s=60",
                                 "transport.heartbeat_interval_s=0.2", "rollout.identity=fp8-rollout"])  # fmt: skip

    async def main() -> dict[str, Any]:
        async with WeightReceiver(cfg) as receiver:
            receiver.declare_contract(CONTRACT)
            try:
                got = {n: t.clone() async for n, t in receiver.receive_weights(wait_s=60)}
            except Exception as exc:
                return {"error": f"{type(exc).__name__}: {exc}"}
            return {"got": save(got)}

    return asyncio.run(asyncio.wait_for(main(), WORKER_TIMEOUT_S - 20))


def _role(role: int, trainer_port: int, port: int, unaligned: bool) -> Any:
    if role < WORLD:
        return _trainer(role, trainer_port, port, unaligned)
    return _receiver(port)


def _run(unaligned: bool) -> list[Any]:
    trainer_port, port = free_port(), free_port()
    roles = [(r, trainer_port, port, unaligned) for r in range(WORLD + 1)]
    return run_workers(_role, roles, timeout_s=WORKER_TIMEOUT_S)


def test_every_rank_quantizes_its_own_shards_and_the_rollout_gets_the_whole_tensors_quantized_bitwise() -> None:
    *trainers, receiver = _run(unaligned=False)
    assert all(t["delivered"] for t in trainers), [t["error"] for t in trainers]
    got, want = load(receiver["got"]), load(trainers[0]["expected"])
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    assert {"up.weight_scale_inv", "moe.weight_scale_inv", "down.weight_scale_inv"} <= set(got)
    for name, ref in want.items():
        t = got[name]
        assert (t.dtype, t.shape) == (ref.dtype, ref.shape), name
        assert torch.equal(t.contiguous().view(torch.uint8), ref.contiguous().view(torch.uint8)), f"{name} differs"
    sent = [t["sent"] for t in trainers]
    assert all(s[2] == 3 for s in sent), sent  # each rank quantized its shard of each of the three weights
    ratio = sum(s[0] for s in sent) / sum(s[1] for s in sent)
    assert 0.45 < ratio < 0.6, (ratio, sent)  # bf16 -> FP8 plus scales and the kept tensors


def test_a_shard_that_cuts_a_block_fails_the_version_naming_the_tensor_the_cut_and_the_knobs() -> None:
    *trainers, receiver = _run(unaligned=True)
    assert not any(t["delivered"] for t in trainers)
    # the rank that reaches the tensor first fails with the whole refusal; the other may instead hear of it from the
    # receiver first (its nack quotes the refusal, cut to the ack's length), so each names the tensor or the abort
    errors = [trainer["error"] for trainer in trainers]
    assert all("odd.weight" in e or "aborted by the sender" in e for e in errors), errors
    named = [e for e in errors if "odd.weight" in e and "row 192 is not on a 128-row block edge" in e]
    assert any("trainer.send_mode=gather" in e and "multiple of 128" in e for e in named), errors
    assert "error" in receiver and "got" not in receiver, receiver  # nothing of the version applied

