"""A shard quantized on its own rank (quantize/shards.py): bitwise the byte ranges of quantizing the whole weight
wherever the shard holds whole blocks, and refused, naming the cut and the knobs, where it does not."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from lightning_weightsync.errors import QuantizeError
from lightning_weightsync.quantize import SCHEMES, QuantContract, Quantizer, QuantRule, quantize_shard, shard_blocks

MAX_TEMP = 1 << 22


def _weight(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.rand((*shape[:-1], 1), generator=gen) * 4  # rows of unlike scale
    return x.to(torch.bfloat16)


def _rule(pattern: str, scheme: str, block: tuple[int, int]) -> QuantRule:
    return QuantRule(pattern, scheme=scheme, block=block, scale_dtype="uint8" if scheme == "mxfp8" else "float32")


def _aligned_cuts(shape: tuple[int, ...], block_rows: int, pieces: int, seed: int) -> list[int]:
    """Row cuts (rows of the [experts * n, k] view) at block edges or expert ends, `pieces` shards at most."""
    n = shape[-2]
    experts = shape[0] if len(shape) == 3 else 1
    edges = sorted({e * n + r for e in range(experts) for r in range(0, n, block_rows)} | {experts * n})
    inner = [c for c in edges if 0 < c < experts * n]
    chosen = random.Random(seed).sample(inner, min(pieces - 1, len(inner)))
    return [0, *sorted(chosen), experts * n]


def _assembled(name: str, x: torch.Tensor, rule: QuantRule, cuts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole FP8 weight and scales written from each shard's own quantization by its byte offsets, every byte
    claimed exactly once."""
    scheme = SCHEMES[rule.scheme]
    k = x.shape[-1]
    weight = torch.zeros(x.numel(), dtype=torch.uint8)
    scale_shape = scheme.scale_shape(tuple(x.shape), rule.block)
    scale = torch.zeros(int(torch.Size(scale_shape).numel()) * scheme.scale_dtype.itemsize, dtype=torch.uint8)
    claimed_w, claimed_s = torch.zeros_like(weight, dtype=torch.int32), torch.zeros_like(scale, dtype=torch.int32)
    flat = x.reshape(-1)
    for first, end in itertools.pairwise(cuts):
        data = flat[first * k : end * k]
        (w_at, w), (s_at, s) = quantize_shard(name, tuple(x.shape), first * k, data, rule, MAX_TEMP)
        assert w.dtype == scheme.element_dtype and s.dtype == scheme.scale_dtype
        wb, sb = w.view(torch.uint8), s.contiguous().view(-1).view(torch.uint8)
        weight[w_at : w_at + wb.numel()] = wb
        scale[s_at : s_at + sb.numel()] = sb
        claimed_w[w_at : w_at + wb.numel()] += 1
        claimed_s[s_at : s_at + sb.numel()] += 1
    assert bool((claimed_w == 1).all()) and bool((claimed_s == 1).all()), "the shards' byte ranges do not tile"
    return weight, scale


CASES = [
    pytest.param("fp8_block", (128, 128), (300, 200), id="fp8-2d-128-short-last-block"),
    pytest.param("fp8_block", (16, 32), (100, 72), id="fp8-2d-16x32-many-cuts"),
    pytest.param("fp8_block", (16, 16), (3, 40, 24), id="fp8-3d-experts-cut-mid-bank"),
    pytest.param("fp8_block_ue8m0", (16, 32), (70, 64), id="ue8m0-2d"),
    pytest.param("fp8_block_ue8m0", (8, 16), (4, 20, 32), id="ue8m0-3d"),
    pytest.param("mxfp8", (1, 32), (37, 96), id="mxfp8-2d-any-row"),
    pytest.param("mxfp8", (1, 32), (3, 5, 64), id="mxfp8-3d-any-row"),
]


@pytest.mark.parametrize("scheme, block, shape", CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shards_on_block_edges_quantize_alone_to_the_whole_tensor_s_bytes(
    scheme: str, block: tuple[int, int], shape: tuple[int, ...], seed: int
) -> None:
    """The quantizers are block-local: each shard, quantized from its own bytes only, gives exactly its byte
    ranges of the whole weight's FP8 bytes and scales (edge padding included), for any cut at block edges."""
    rule = _rule("w", scheme, block)
    x = _weight(shape, seed)
    whole_w, whole_s = SCHEMES[scheme].quantize("w", x, block, MAX_TEMP)
    cuts = _aligned_cuts(shape, block[0], pieces=2 + seed * 2, seed=seed)
    weight, scale = _assembled("w", x, rule, cuts)
    assert torch.equal(weight, whole_w.reshape(-1).view(torch.uint8))
    assert torch.equal(scale, whole_s.contiguous().reshape(-1).view(torch.uint8))


def test_a_block_s_result_depends_on_its_own_rows_only() -> None:
    """What another rank holds cannot change a shard's bytes: rows outside the shard replaced, its part of the
    whole quantization is the same (the property the per-shard path rests on)."""
    rule = QuantRule("w", block=(128, 128))
    x = _weight((384, 256), 3)
    y = x.clone()
    y[256:] *= 1000  # another rank's rows, far larger
    for t in (x, y):
        w, s = SCHEMES["fp8_block"].quantize("w", t, (128, 128), MAX_TEMP)
        (w_at, wq), (s_at, sq) = quantize_shard("w", (384, 256), 0, t[:256].reshape(-1), rule, MAX_TEMP)
        assert torch.equal(wq.view(torch.uint8), w.reshape(-1)[: 256 * 256].view(torch.uint8)) and w_at == 0
        assert torch.equal(sq, s[:2].reshape(-1)) and s_at == 0


def test_the_geometry_of_a_shard_in_rows_experts_and_scale_rows() -> None:
    rule = QuantRule("w", block=(128, 128))
    two = shard_blocks("w", (300, 200), 128 * 200, 172 * 200, rule)
    assert (two.rows, two.pieces, two.scale_rows, two.scale_cols) == ((128, 300), ((0, 128, 300),), (1, 3), 2)
    assert two.weight_byte_offset == 128 * 200
    bank = shard_blocks("w", (2, 200, 64), 128 * 64, 200 * 64, rule)  # rows 128..328: expert 0's tail, 1's head
    assert bank.pieces == ((0, 128, 200), (1, 0, 128)) and bank.scale_rows == (1, 3)
    mx = shard_blocks("w", (5, 64), 3 * 64, 64, _rule("w", "mxfp8", (1, 32)))
    assert mx.scale_rows == (3, 4) and mx.scale_cols == 2


@pytest.mark.parametrize(
    "shape, block, first, numel, said",
    [
        pytest.param((384, 256), (128, 128), 0, 192 * 256, "row 192 is not on a 128-row block edge", id="row-192"),
        pytest.param((384, 256), (128, 128), 192 * 256, 192 * 256, "row 192 is not on", id="starts-mid-block"),
        pytest.param((384, 256), (128, 128), 100, 128 * 256, "does not cover whole rows of 256", id="mid-row"),
        pytest.param((2, 200, 64), (128, 128), 0, 264 * 64, "row 64 of expert 1 is not on", id="expert-bank"),
        pytest.param((40, 64), (1, 32), 10 * 64 + 32, 64, "does not cover whole rows", id="mxfp8-mid-row"),
    ],
)
def test_a_shard_that_cuts_a_block_is_refused_naming_the_cut_and_the_knobs(
    shape: tuple[int, ...], block: tuple[int, int], first: int, numel: int, said: str
) -> None:
    rule = _rule("layers.0.w", "mxfp8" if block == (1, 32) else "fp8_block", block)
    with pytest.raises(QuantizeError) as err:
        shard_blocks("layers.0.w", shape, first, numel, rule)
    text = str(err.value)
    assert "layers.0.w" in text and said in text and "trainer.send_mode=gather" in text, text
    assert "multiple of" in text, text


def test_the_quantizer_takes_shards_keeps_what_the_contract_keeps_and_counts() -> None:
    contract = QuantContract(rules=(QuantRule("q.weight"),), keep=("norm.weight",))
    quantizer = Quantizer(contract)
    x = _weight((256, 128), 4)
    assert quantizer.shard("norm.weight", (512,), 256 * 2, torch.ones(256, dtype=torch.bfloat16)) is None
    parts = quantizer.shard("q.weight", (256, 128), 128 * 128 * 2, x[128:].reshape(-1))
    assert parts is not None
    weight, scale = parts
    whole_w, whole_s = SCHEMES["fp8_block"].quantize("q.weight", x, (128, 128), MAX_TEMP)
    assert (weight.name, weight.shape, weight.dtype, weight.byte_offset) == (
        "q.weight", (256, 128), torch.float8_e4m3fn, 128 * 128)  # fmt: skip
    assert (scale.name, scale.shape, scale.dtype, scale.byte_offset) == (
        "q.weight_scale_inv", (2, 1), torch.float32, 4)  # fmt: skip
    assert torch.equal(weight.data.view(torch.uint8), whole_w[128:].reshape(-1).view(torch.uint8))
    assert torch.equal(scale.data, whole_s[1:].reshape(-1))
    stats = quantizer.stats
    assert (stats.quantized, stats.kept, stats.bytes_in) == (1, 1, 512 + 128 * 128 * 2)
    assert stats.bytes_out == 512 + 128 * 128 + 4
    with pytest.raises(QuantizeError, match="sent twice"):
        quantizer.shard("q.weight", (256, 128), 0, x[:128].reshape(-1))
