"""The checks a vLLM worker runs before it acknowledges a version (`rollout_engines/vllm/reload_checks.py`), on
tensors and progress records built here (the module is vLLM-free; `test_vllm_quantized_real.py` runs them inside
vLLM's real reload): each check on its own, so that none hides behind another (a NaN weight also writes NaN FP8
bytes, which the byte scan finds before the scale check would)."""

from __future__ import annotations

import torch

from lightning_weightsync.rollout_engines.vllm.reload_checks import (
    BufferWatch,
    ModuleLoad,
    bad_scales,
    incomplete_modules,
    missing_names,
    padding_counts,
    refusal,
)


def load(
    name: str,
    loaded: int,
    total: int,
    written: tuple[str, ...] = ("weight",),
    *,
    params: dict[str, int] | None = None,
    buffered: int = 0,
    pending: bool = True,
) -> ModuleLoad:
    return ModuleLoad(
        name=name, params={"weight": total} if params is None else params, written=frozenset(written), loaded=loaded,
        total=total, buffered_bytes=buffered, pending=pending,
    )  # fmt: skip


def test_float_scales_nan_inf_and_zero_are_named_finite_ones_pass() -> None:
    good = torch.tensor([[0.01, 2e-7]])
    scales = {
        "a.weight_scale_inv": good,
        "b.weight_scale_inv": torch.tensor([[float("nan"), 1.0]]),
        "c.weight_scale": torch.tensor([float("inf")]),
        "d.weight_scale": torch.tensor([0.0, 1.0]),
    }
    problems = bad_scales(scales, {})
    assert problems == [
        "b.weight_scale_inv: scale holds NaN",
        "c.weight_scale: scale holds inf",
        "d.weight_scale: scale holds 0",
    ]
    assert bad_scales({"a": good, "m": torch.empty(2, device="meta")}, {}) == []


def test_e8m0_scales_nan_code_and_ceiling_are_named_a_zero_exponent_is_a_scale() -> None:
    assert bad_scales({"w.weight_scale": torch.tensor([[0, 120, 247]], dtype=torch.uint8)}, {}) == []
    assert bad_scales({"w.weight_scale": torch.tensor([[120, 255]], dtype=torch.uint8)}, {}) == [
        "w.weight_scale: E8M0 scale 0xFF (NaN)"
    ]
    assert bad_scales({"w.weight_scale": torch.tensor([[120, 254]], dtype=torch.uint8)}, {}) == [
        "w.weight_scale: E8M0 scale 2^127 (the quantizer's ceiling: an infinite weight)"
    ]


def test_fp8_weights_with_a_nan_byte_are_named_saturated_ones_pass() -> None:
    weight = torch.tensor([1.0, -448.0, 448.0, 0.0]).to(torch.float8_e4m3fn)
    assert bad_scales({}, {"w.weight": weight}) == []
    broken = weight.clone()
    broken.view(torch.uint8)[1] = 0xFF  # -NaN in e4m3fn
    assert bad_scales({}, {"w.weight": broken}) == ["w.weight: FP8 weight holds NaN"]
    e5m2 = torch.tensor([1.0, float("inf")]).to(torch.float8_e5m2)  # inf is not NaN
    assert bad_scales({}, {"x": e5m2}) == []
    e5m2.view(torch.uint8)[0] = 0x7D  # S.11111.01: NaN
    assert bad_scales({}, {"x": e5m2}) == ["x: FP8 weight holds NaN"]
    assert bad_scales({}, {"bf16": torch.tensor([float("nan")], dtype=torch.bfloat16)}) == []  # not FP8: not scanned


def test_a_module_left_short_is_named_padding_a_whole_version_leaves_is_not() -> None:
    loads = [
        load("model.layers.0.self_attn.qkv_proj", 32, 64, written=("weight",)),  # k, v arrived; q did not
        load("model.layers.0.mlp.down_proj", 0, 16, written=()),  # nothing arrived
        load("model.embed_tokens", 36, 64),  # rank 1's vocabulary rows; the rest is padding
        load("model.layers.0.self_attn.rotary_emb", 0, 99, written=(), params={}),  # buffers only: not a parameter
        load("model.layers.0.mlp.gate_up_proj", 0, 0, pending=False),  # processed this version
        load("lm_head", 0, 64, written=()),  # tied to the embedding: never loaded under its own name
    ]
    # a first version: no count to go by, and a module that got nothing keeps its kernel tensors (maybe never sent)
    assert incomplete_modules(loads, None, tied=["lm_head.weight"]) == []
    expected = padding_counts([loads[2]])
    assert expected == {"model.embed_tokens": 36}
    assert incomplete_modules(loads, expected, tied=["lm_head.weight"]) == [
        "model.layers.0.self_attn.qkv_proj.weight: 32 of 64 elements written",
        "model.layers.0.mlp.down_proj.weight: not written (the last version wrote it)",
    ]
    assert incomplete_modules([load("model.embed_tokens", 20, 64)], expected) == [
        "model.embed_tokens.weight: 20 of 64 elements written"
    ]
    assert "lm_head.weight: not written (the last version wrote it)" in incomplete_modules(loads, expected)  # untied
    # a module never sent, version after version (the last version left it at 0): not refused
    never_sent = load("model.layers.0.mlp.down_proj", 0, 16, written=())
    assert incomplete_modules([never_sent], {"model.layers.0.mlp.down_proj": 0}) == []
    # a module with two parameters, one written, the other not: refused on a first version too
    two = load("m", 8, 24, written=("weight",), params={"weight": 8, "bias": 16})
    assert incomplete_modules([two], None) == ["m.bias: not written"]


def test_missing_names_and_refusal_message() -> None:
    assert missing_names(["a", "b", "c"], {"b": 1}) == ["a", "c"]
    assert missing_names([], ["a"]) == []
    message = refusal([f"p{i}" for i in range(7)], "7 broken")
    assert message == "7 broken: p0; p1; p2; p3; p4 (and 2 more)"


def test_buffer_watch_counts_modules_waiting_for_elements() -> None:
    watch = BufferWatch()
    watch.sample([load("a", 8, 16, buffered=100), load("b", 0, 16), load("c", 16, 16, pending=False)])
    assert (watch.modules_peak, watch.bytes_peak, watch.names_at_peak) == (1, 100, ["a"])
    watch.sample([load("a", 8, 16, buffered=100), load("b", 4, 16, buffered=50)])
    assert (watch.modules_peak, watch.bytes_peak, watch.names_at_peak) == (2, 150, ["a", "b"])
    watch.sample([])
    assert (watch.modules_peak, watch.bytes_peak) == (2, 150)
