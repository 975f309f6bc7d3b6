"""The trainer-side quantizers and the rollout's quantization contract (`lightning_weightsync.quantize`), without
vLLM: what the bytes must satisfy whatever vLLM does (their equality with vLLM's own functions is
`test_vllm_quant_contract_real.py`'s, in the contract kit)."""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_weightsync.errors import ProtocolError, QuantizeError
from lightning_weightsync.quantize import (
    QuantContract,
    QuantRule,
    quantize_fp8_block,
    quantize_fp8_block_ue8m0,
    quantize_mxfp8,
    quantize_stream,
)
from lightning_weightsync.quantize.contract import MAX_PATTERNS

SHAPES = [(128, 128), (300, 200), (1, 1), (257, 1000), (129, 127)]


def weight(shape: tuple[int, ...], seed: int = 0, std: float = 0.02) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * std).to(torch.bfloat16)


def dequant_block(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    full = scale.repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)
    return q.float() * full[..., : q.shape[-2], : q.shape[-1]]


def dequant_mx(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * torch.exp2(scale.float() - 127).repeat_interleave(32, -1)


@pytest.mark.parametrize("shape", SHAPES)
def test_block_fp8_shapes_and_error_bound_also_where_128_does_not_divide(shape: tuple[int, int]) -> None:
    x = weight(shape)
    q, scale = quantize_fp8_block("w", x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    # e4m3 keeps 3 mantissa bits: each element within half an ulp of its block's grid, |err| <= amax / 448 * 16
    err = (dequant_block(q, scale) - x.float()).abs()
    bound = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]] * 16 * 1.0001
    assert bool((err <= bound).all())
    if x.numel() > 1000:
        assert (err.norm() / x.float().norm()).item() < 0.04  # ~2.6 % expected on N(0, 0.02)


def test_block_fp8_an_all_zero_block_gets_the_floor_scale_and_zero_bytes() -> None:
    x = weight((256, 256))
    x[:128, 128:] = 0
    q, scale = quantize_fp8_block("w", x)
    assert scale[0, 1] == torch.tensor(1e-4, dtype=torch.float32) / 448  # vLLM's amax clamp, in float32
    assert bool((q[:128, 128:].view(torch.uint8) == 0).all())
    assert bool((scale[[0, 1, 1], [0, 0, 1]] > 1e-6).all())


def test_block_fp8_an_outlier_coarsens_its_own_block_only() -> None:
    x = weight((256, 256))
    q0, s0 = quantize_fp8_block("w", x)
    x[5, 7] = 1000.0
    q1, s1 = quantize_fp8_block("w", x)
    assert s1[0, 0].item() == pytest.approx(1000.0 / 448)
    assert q1[5, 7].float().item() == 448.0  # the outlier is the block's maximum code
    assert torch.equal(s1[1:], s0[1:]) and torch.equal(s1[0, 1:], s0[0, 1:])
    assert torch.equal(q1[128:].view(torch.uint8), q0[128:].view(torch.uint8))


@pytest.mark.parametrize("shape", [(64, 32), (300, 96), (3, 5, 64)])
def test_mxfp8_shapes_scales_and_error_bound(shape: tuple[int, ...]) -> None:
    x = weight(shape)
    x.view(-1, 32)[0] = 0  # an all-zero block: the smallest exponent
    q, scale = quantize_mxfp8("w", x)
    assert q.shape == x.shape and scale.dtype == torch.uint8 and scale.shape == (*shape[:-1], shape[-1] // 32)
    assert scale.view(-1)[0].item() == 0
    blocks = x.float().view(-1, 32).abs().amax(-1)
    descale = torch.exp2(scale.float().view(-1) - 127)
    assert bool((blocks <= 448 * descale).all()) and bool((blocks[1:] > 224 * descale[1:]).all())  # tightest
    err = (dequant_mx(q, scale) - x.float()).abs().view(-1, 32)
    assert bool((err <= descale.unsqueeze(-1) * 16 * 1.0001).all())


def test_mxfp8_refuses_a_last_dimension_not_divisible_by_32() -> None:
    with pytest.raises(QuantizeError, match=r"layers\.0\.w: mxfp8 needs a last dimension divisible by 32"):
        quantize_mxfp8("layers.0.w", weight((64, 48)))


@pytest.mark.parametrize("quantize", [quantize_fp8_block, quantize_fp8_block_ue8m0, quantize_mxfp8])
def test_tiling_and_reruns_change_no_byte(quantize: Any) -> None:
    x = weight((300, 416), seed=3)
    x[200:, :100] = 0
    x[7, 9] = -300.0
    block = (1, 32) if quantize is quantize_mxfp8 else (128, 128)
    want = quantize("w", x, block, 1 << 22)
    for tile in (1, 32, 128 * 128, 128 * 128 * 2 + 5, 1 << 30):
        got = quantize("w", x, block, tile)
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)), tile
        assert torch.equal(got[1], want[1]), tile


@pytest.mark.parametrize("quantize", [quantize_fp8_block, quantize_fp8_block_ue8m0, quantize_mxfp8])
def test_a_3d_expert_bank_is_each_expert_quantized_alone(quantize: Any) -> None:
    bank = torch.stack([weight((200, 160), seed=e, std=0.01 * (e + 1)) for e in range(3)])
    q, scale = quantize("experts.w13", bank)
    for e in range(3):
        qe, se = quantize("x", bank[e].clone())
        assert torch.equal(q[e].view(torch.uint8), qe.view(torch.uint8)) and torch.equal(scale[e], se)


@pytest.mark.parametrize("quantize", [quantize_fp8_block, quantize_fp8_block_ue8m0, quantize_mxfp8])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("shape", [(300, 160), (2, 300, 160)])
def test_nan_or_inf_is_refused_naming_the_tensor_and_the_element(
    quantize: Any, value: float, shape: tuple[int, ...]
) -> None:
    x = weight(shape)
    where = (*(1,) * (len(shape) - 2), 260, 131)
    x[where] = value
    with pytest.raises(QuantizeError) as info:
        quantize("model.layers.3.mlp.down_proj.weight", x, max_temp_elems=128 * 128)
    text = str(info.value)
    assert f"model.layers.3.mlp.down_proj.weight: element {list(where)} is {value}" in text, text
    assert "not sent" in text


class LargestTemporary(TorchDispatchMode):
    """The largest storage any op allocates while active (outputs of views share their input's storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.storages[storage.data_ptr()] = storage.nbytes()
        return out

    def largest_except(self, *tensors: torch.Tensor) -> int:
        own = {t.untyped_storage().data_ptr() for t in tensors}
        return max(n for ptr, n in self.storages.items() if ptr not in own)


@pytest.mark.parametrize("quantize", [quantize_fp8_block, quantize_fp8_block_ue8m0, quantize_mxfp8])
def test_temporaries_stay_a_tile_whatever_the_weight_s_size(quantize: Any) -> None:
    tile = 128 * 128 * 2
    for rows in (512, 2048):
        x = weight((rows, 1024))
        with LargestTemporary() as seen:
            q, scale = quantize("w", x, max_temp_elems=tile)
        largest = seen.largest_except(x, q, scale)
        assert largest <= 4 * tile, (rows, largest)  # one float32 tile; the weight is 2 or 8 times that
        assert largest < x.numel()


FP8 = QuantRule("model.layers.*.self_attn.q_proj.weight")


def contract() -> QuantContract:
    return QuantContract(
        rules=(
            QuantRule("model.layers.*.mlp.experts.*.down_proj.weight"),
            QuantRule("model.layers.*.mlp.down_proj.weight", scheme="mxfp8", block=(1, 32), scale_dtype="uint8",
                      scale_suffix="weight_scale"),
            QuantRule("model.layers.*.self_attn.q_proj.weight"),
        ),
        keep=("model.embed_tokens.weight", "model.layers.*.input_layernorm.weight", "lm_head.weight"),
    )  # fmt: skip


def test_the_contract_says_per_name_quantized_how_or_kept_and_refuses_the_rest() -> None:
    c = contract()
    assert c.rule_for("model.layers.12.self_attn.q_proj.weight") == QuantRule("model.layers.*.self_attn.q_proj.weight")
    rule = c.rule_for("model.layers.0.mlp.experts.127.down_proj.weight")
    assert rule is not None and rule.scale_name("a.down_proj.weight") == "a.down_proj.weight_scale_inv"
    assert c.rule_for("model.layers.3.input_layernorm.weight") is None
    for unknown in ("model.layers.x.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight", "q_proj"):
        with pytest.raises(QuantizeError, match="neither quantizes nor keeps"):
            c.rule_for(unknown)
    both = QuantContract(rules=(QuantRule("a.*.weight"),), keep=("a.1.weight",))
    with pytest.raises(QuantizeError, match="says two things"):
        both.rule_for("a.1.weight")


def test_the_contract_refuses_what_it_cannot_produce_by_name() -> None:
    with pytest.raises(QuantizeError, match="'fp8_per_tensor' is not one this library produces"):
        QuantRule("a.weight", scheme="fp8_per_tensor")
    with pytest.raises(QuantizeError, match="produces float8_e4m3fn with float32 scales"):
        QuantRule("a.weight", scale_dtype="float8_e8m0fnu")
    with pytest.raises(QuantizeError, match="layout 'swizzled'"):
        QuantRule("a.weight", layout="swizzled")
    with pytest.raises(QuantizeError, match="block"):
        QuantRule("a.weight", scheme="mxfp8", block=(128, 128), scale_dtype="uint8")
    with pytest.raises(QuantizeError, match="whole '\\*'"):
        QuantRule("a.layer*.weight")


def test_the_wire_form_round_trips_through_msgpack_and_json_and_the_digest_follows_the_content() -> None:
    c = contract()
    wire = c.to_wire()
    for codec in (msgspec.msgpack, msgspec.json):
        back = QuantContract.from_wire(codec.decode(codec.encode(wire)))
        assert back == c and back.digest() == c.digest()
    assert json.loads(json.dumps(wire)) == wire
    reordered = QuantContract(rules=tuple(reversed(c.rules)), keep=tuple(reversed(c.keep)))
    assert reordered.digest() == c.digest()  # one contract, one digest, whatever the order declared
    other = QuantContract(rules=c.rules, keep=(*c.keep, "model.norm.weight"))
    assert other.digest() != c.digest()


def _rule(**change: Any) -> dict[str, Any]:
    return {**QuantRule("a.*.weight").to_wire(), **change}


HOSTILE = {
    "not a map": ([1, 2], "expected a map"),
    "a key missing": ({"format": 1, "rules": []}, "expected a map of format, rules, keep"),
    "an extra key": ({"format": 1, "rules": [], "keep": [], "x": 1}, "expected a map"),
    "format a bool": ({"format": True, "rules": [], "keep": []}, "wire format"),
    "format 2": ({"format": 2, "rules": [], "keep": []}, "wire format 2"),
    "rules not a list": ({"format": 1, "rules": "a", "keep": []}, "must be lists"),
    "too many patterns": ({"format": 1, "rules": [], "keep": ["a"] * (MAX_PATTERNS + 1)}, "limit"),
    "a pattern too long": ({"format": 1, "rules": [], "keep": ["a" * 10_000]}, "characters long"),
    "a pattern not a string": ({"format": 1, "rules": [], "keep": [7]}, "not a string"),
    "a pattern with a path": ({"format": 1, "rules": [], "keep": ["a/../b"]}, "neither a name"),
    "a pattern twice": ({"format": 1, "rules": [], "keep": ["a", "a"]}, "twice"),
    "unknown scheme": ({"format": 1, "rules": [_rule(scheme="int4_awq")], "keep": []}, "'int4_awq' is not one"),
    "scheme not a string": ({"format": 1, "rules": [_rule(scheme=["fp8_block"])], "keep": []}, "must be a string"),
    "block of three": ({"format": 1, "rules": [_rule(block=[1, 2, 3])], "keep": []}, "two ints"),
    "block of floats": ({"format": 1, "rules": [_rule(block=[128.0, 128])], "keep": []}, "two ints"),
    "block of bools": ({"format": 1, "rules": [_rule(block=[True, True])], "keep": []}, "two ints"),
    "block zero": ({"format": 1, "rules": [_rule(block=[0, 128])], "keep": []}, "block"),
    "block huge": ({"format": 1, "rules": [_rule(block=[1 << 40, 128])], "keep": []}, "block"),
    "scale suffix a path": ({"format": 1, "rules": [_rule(scale_suffix="../x")], "keep": []}, "scale_suffix"),
    "a rule not a map": ({"format": 1, "rules": ["fp8"], "keep": []}, "rule 0"),
    "a rule's extra key": ({"format": 1, "rules": [_rule(pickle="x")], "keep": []}, "rule 0"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_wire_input_is_refused_naming_the_problem(case: str) -> None:
    data, message = HOSTILE[case]
    with pytest.raises(ProtocolError, match="quantization contract refused") as info:
        QuantContract.from_wire(data)
    assert message in str(info.value), str(info.value)
    assert len(str(info.value)) < 600


def test_the_stream_quantizes_per_contract_keeps_the_rest_and_counts_bytes() -> None:
    c = contract()
    items = [
        ("model.embed_tokens.weight", weight((100, 256))),
        ("model.layers.0.input_layernorm.weight", weight((256,))),
        ("model.layers.0.self_attn.q_proj.weight", weight((256, 256))),
        ("model.layers.0.mlp.down_proj.weight", weight((256, 384))),
        ("model.layers.0.mlp.experts.3.down_proj.weight", weight((256, 130))),
    ]
    stream = quantize_stream(iter(items), c)
    out = list(stream)
    assert [n for n, _ in out] == [
        "model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight_scale_inv",
        "model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight_scale",
        "model.layers.0.mlp.experts.3.down_proj.weight", "model.layers.0.mlp.experts.3.down_proj.weight_scale_inv",
    ]  # fmt: skip
    got = dict(out)
    assert got["model.embed_tokens.weight"] is items[0][1]  # kept: the tensor itself
    q, s = quantize_fp8_block("x", items[2][1])
    assert torch.equal(got["model.layers.0.self_attn.q_proj.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(got["model.layers.0.self_attn.q_proj.weight_scale_inv"], s)
    assert got["model.layers.0.mlp.down_proj.weight_scale"].shape == (256, 12)
    assert got["model.layers.0.mlp.experts.3.down_proj.weight_scale_inv"].shape == (2, 2)
    stats = stream.stats
    bytes_in = sum(t.numel() * 2 for _, t in items)
    assert (stats.quantized, stats.kept, stats.bytes_in) == (3, 2, bytes_in)
    assert stats.bytes_out == sum(t.numel() * t.element_size() for _, t in out)
    print(f"\nquantize_stream: {stats.bytes_out} of {stats.bytes_in} bytes ({100 * stats.ratio:.1f} %)")


def test_the_stream_refuses_what_the_contract_does_not_cover_and_a_nan_naming_the_tensor() -> None:
    c = contract()
    with pytest.raises(QuantizeError, match=r"model\.norm\.weight: the rollout's quantization contract neither"):
        list(quantize_stream([("model.norm.weight", weight((8,)))], c))
    bad = weight((256, 256))
    bad[3, 4] = float("nan")
    stream = quantize_stream([("model.embed_tokens.weight", weight((4, 4))),
                              ("model.layers.1.self_attn.q_proj.weight", bad)], c)  # fmt: skip
    assert next(stream)[0] == "model.embed_tokens.weight"
    with pytest.raises(QuantizeError, match=r"q_proj\.weight: element \[3, 4\] is nan"):
        next(stream)
    clash = [("model.layers.0.self_attn.q_proj.weight", weight((128, 128))),
             ("model.layers.0.self_attn.q_proj.weight_scale_inv", weight((1, 1)))]  # fmt: skip
    with pytest.raises(QuantizeError, match="name of a scale tensor"):
        scales_kept = QuantContract(rules=(FP8,), keep=("model.layers.*.self_attn.q_proj.weight_scale_inv",))
        list(quantize_stream(clash, scales_kept))
