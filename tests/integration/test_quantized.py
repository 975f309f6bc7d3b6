"""A version quantized on the trainer to the contract its receivers declare (versions/quantized.py), over a real
sender and receivers on loopback (ZeroMQ, gloo): what arrives is what the contract's quantizer makes of the
trainer's tensors, byte for byte, at about half the bytes; and what the sender cannot meet (receivers that
disagree, a contract that does not decode, a NaN weight) fails the version, named, before or without any
tensor of it reaching the rollout as the wrong format, and the next version lands."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from lightning_weightsync import WeightReceiver, WeightSender
from lightning_weightsync.errors import ProtocolError, QuantizeError, WeightSyncError
from lightning_weightsync.protocol.messages import contract_digest
from lightning_weightsync.quantize import QuantContract, QuantRule, quantize_stream
from tests.support.transfer import assert_bitwise, engine_cfg, receive_once, with_timeout

BUCKET_MB = 1 / 16
CONTRACT = QuantContract(
    rules=(QuantRule("layers.*.mlp.up_proj.weight"), QuantRule("layers.*.self_attn.qkv_proj.weight")),
    keep=("embed.weight", "layers.*.norm.weight"),
)


def _weights(seed: int, *, poison: str | None = None) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = [("embed.weight", torch.randn(64, 96, generator=gen).to(torch.bfloat16))]
    for layer in range(2):
        out += [
            (f"layers.{layer}.norm.weight", torch.randn(96, generator=gen).to(torch.bfloat16)),
            (f"layers.{layer}.self_attn.qkv_proj.weight", torch.randn(300, 96, generator=gen).to(torch.bfloat16)),
            (f"layers.{layer}.mlp.up_proj.weight", (torch.randn(256, 200, generator=gen) * 0.02).to(torch.bfloat16)),
        ]
    if poison is not None:
        tensor = dict(out)[poison]
        tensor.view(-1)[tensor.numel() // 2] = float("nan")
    return out


async def _sender(**extra) -> WeightSender:
    sender = WeightSender(engine_cfg(0, bucket_size_mb=BUCKET_MB, **extra))
    await sender.start()
    return sender


async def _receiver(port: int, identity: str, contract: QuantContract | None) -> WeightReceiver:
    receiver = WeightReceiver(engine_cfg(port, bucket_size_mb=BUCKET_MB), identity=identity)
    receiver.declare_contract(contract)
    await receiver.start()
    return receiver


async def test_a_declared_contract_gets_the_quantizers_bytes_at_half_the_size() -> None:
    sender = await _sender()
    receiver = await _receiver(sender.port, "fp8", CONTRACT)
    try:
        for version in (1, 2, 3):
            weights = _weights(version)
            got, stats = await with_timeout(
                asyncio.gather(receive_once(receiver), sender.send_weights(weights, version=version))
            )
            expected = list(quantize_stream(weights, CONTRACT))
            assert_bitwise(got, expected)  # FP8 weights, their float32 scales, and the kept tensors as they were
            assert got["layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
            assert got["layers.1.self_attn.qkv_proj.weight_scale_inv"].shape == (3, 1)  # ceil(300/128), ceil(96/128)
            assert stats.quantized_tensors == 4
            bf16 = sum(t.numel() * t.element_size() for _, t in weights)
            assert stats.unquantized_bytes == bf16
            quantized = sum(t.numel() * t.element_size() for _, t in weights if "proj" in _)
            assert stats.nbytes < bf16 - quantized * 0.45  # each quantized weight went at ~half its bf16 bytes
    finally:
        await receiver.close()
        await sender.close()


async def test_receivers_that_declare_different_contracts_are_refused_by_name_and_a_later_version_lands() -> None:
    sender = await _sender(trainer__min_receivers=2)
    fp8 = await _receiver(sender.port, "fp8-server", CONTRACT)
    plain = await _receiver(sender.port, "bf16-server", None)
    try:
        waiting = [asyncio.ensure_future(receive_once(r)) for r in (fp8, plain)]
        with pytest.raises(QuantizeError, match="different quantization contracts") as caught:
            await with_timeout(sender.send_weights(_weights(1), version=1))
        assert "bf16-server: none" in str(caught.value) and "fp8-server: " in str(caught.value)
        await asyncio.sleep(0.5)
        assert not any(task.done() for task in waiting)  # the version was dropped before its plan: they wait on
        plain.declare_contract(CONTRACT)  # the operator points both at the same format
        weights = _weights(2)
        got = await with_timeout(asyncio.gather(*waiting, sender.send_weights(weights, version=2)))
        expected = list(quantize_stream(weights, CONTRACT))
        assert_bitwise(got[0], expected)
        assert_bitwise(got[1], expected)
    finally:
        await plain.close()
        await fp8.close()
        await sender.close()


async def test_a_contract_naming_a_scheme_the_library_does_not_make_is_refused_naming_it() -> None:
    sender = await _sender()
    receiver = await _receiver(sender.port, "odd", CONTRACT)
    wire = CONTRACT.to_wire()
    wire["rules"][0]["scheme"] = "fp4_magic"  # what a newer or foreign rollout might ask for
    declared = receiver._contract.declared
    assert declared is not None
    declared.body = json.dumps(wire, sort_keys=True, separators=(",", ":")).encode()
    declared.digest = contract_digest(declared.body)
    try:
        waiting = asyncio.ensure_future(receive_once(receiver))
        with pytest.raises(ProtocolError, match="fp4_magic"):
            await with_timeout(sender.send_weights(_weights(1), version=1))
        await asyncio.sleep(0.5)
        assert not waiting.done() and receiver.last_complete_version is None  # nothing of it was sent
        waiting.cancel()
    finally:
        await receiver.close()
        await sender.close()


async def test_a_nan_weight_fails_the_version_naming_it_and_the_next_version_lands() -> None:
    sender = await _sender()
    receiver = await _receiver(sender.port, "fp8", CONTRACT)
    try:
        bad = "layers.1.mlp.up_proj.weight"
        waiting = asyncio.ensure_future(receive_once(receiver))
        with pytest.raises(QuantizeError, match=bad.replace(".", r"\.")):
            await with_timeout(sender.send_weights(_weights(1, poison=bad), version=1))
        with pytest.raises(WeightSyncError):  # aborted: no ok ack, nothing of version 1 is the version
            await with_timeout(waiting)
        assert receiver.last_complete_version is None
        weights = _weights(2)
        got, _ = await with_timeout(asyncio.gather(receive_once(receiver), sender.send_weights(weights, version=2)))
        assert_bitwise(got, list(quantize_stream(weights, CONTRACT)))
        assert receiver.last_complete_version == 2
    finally:
        await receiver.close()
        await sender.close()


async def test_quantized_versions_compose_with_delta_verify_and_layout_once() -> None:
    """Delta, verify and layout once act on what the wire carries: the FP8 bytes and scales. A weight that moved
    a little changes few FP8 bytes (most round to the same value), so the next version goes as a delta of them;
    each arrives fingerprint-checked, and what the receiver holds after each is bitwise the quantizer's output."""
    extra = {"transport__delta": "always", "transport__verify": "full", "transport__layout_once": True}
    sender = await _sender(**extra)
    receiver = WeightReceiver(engine_cfg(sender.port, bucket_size_mb=BUCKET_MB, **extra), identity="fp8")
    receiver.declare_contract(CONTRACT)
    await receiver.start()
    mine: dict[str, torch.Tensor] = {}

    def into(meta):  # the consumer keeps what it receives, in place from the second version on
        return mine.get(meta.name)

    try:
        weights = _weights(1)
        for version in (1, 2, 3):
            if version > 1:  # a small optimizer step on one weight: most of its FP8 bytes stay as they were
                up = dict(weights)["layers.0.mlp.up_proj.weight"]
                up.view(-1)[:64] += torch.full((64,), 1e-3, dtype=torch.bfloat16)
            send = sender.send_weights(weights, version=version)
            got, stats = await with_timeout(asyncio.gather(receive_once(receiver, into=into, base=into), send))
            mine.update({n: t.clone() for n, t in got.items() if n not in mine})
            expected = list(quantize_stream(weights, CONTRACT))
            assert_bitwise({n: mine[n] for n, _ in expected}, expected)
            assert receiver.last_stats is not None and receiver.last_stats.verified == len(expected)
            if version > 1:
                assert stats.delta_tensors > 0, "the quantized bytes did not go as a delta"
    finally:
        await receiver.close()
        await sender.close()
