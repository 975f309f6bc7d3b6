"""The quantizers a rollout's contract can ask of the trainer, each bitwise what the engine's own code computes.

A rollout that loaded a serialized FP8 checkpoint reads FP8 bytes and scales through `load_weights`; an engine
that quantized a bf16 checkpoint itself (cold start) and one fed by the trainer must serve the same bytes, so
each scheme here repeats vLLM's own pure-torch function op for op (vLLM is no dependency of the library):

- `fp8_block`: vLLM's `per_block_cast_to_fp8` (`vllm/utils/deep_gemm.py`): a block of `block` elements (128 x
  128 by default) zero-padded at the edges, `amax` clamped to 1e-4, `sf = amax / 448`, `q = x * (1 / sf)` cast
  to float8_e4m3fn, and `sf` itself is the checkpoint's `weight_scale_inv` (float32, one per block).
- `fp8_block_ue8m0`: the same with each scale rounded up to a power of two (DeepGEMM's `ceil_to_ue8m0` on the
  bits of `amax / 448`): SGLang's `per_block_cast_to_fp8` (`srt/layers/quantization/fp8_utils.py`, "COPIED FROM
  DeepGEMM"), what a checkpoint whose quantization config says `scale_fmt: ue8m0` (DeepSeek-V3.1) holds and SGLang
  re-lays out as lossless. It differs from `fp8_block` in that one step only: where `amax / 448` is a power of two
  both give the same bytes, elsewhere the scale is up to 2x larger and the FP8 elements follow it.
- `mxfp8`: vLLM's `_mxfp8_e4m3_quantize_torch` (`.../quantization/utils/mxfp8_utils.py`): 32 elements along the
  last dimension share an E8M0 exponent (uint8, biased by 127) that fits the block's amax under 448.

Both run tile by tile (whole blocks, at most `max_temp_elems` elements a tile), so the float32 temporaries stay
a few tiles whatever the tensor's size: the output (one byte an element, plus the scales) is the only thing the
size of the weight. A block's result depends only on its own elements, so tiling changes no byte. A 3-D tensor
is a bank of experts, each quantized as its own 2-D weight (as vLLM's MoE methods do, expert by expert).

A NaN or an infinity in a weight is refused, naming the tensor and the element: FP8 has no honest answer for it
(block FP8 would make the whole block's scale NaN or inf, MXFP8 NaN bytes), and sending the bf16 tensor instead
would hand the rollout a dtype its model does not load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import QuantizeError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0, as vLLM's `get_fp8_min_max` on every non-FNUZ platform
AMAX_FLOOR = 1e-4  # vLLM's clamp of a block's amax (an all-zero block gets the scale 1e-4 / 448)
MXFP8_BLOCK = 32
E8M0_BIAS = 127.0
DEFAULT_MAX_TEMP_ELEMS = 1 << 22
"""Elements of one tile: the float32 temporaries are a small multiple of 16 MiB whatever the weight's size."""

Quantizer = Callable[[str, torch.Tensor, tuple[int, int], int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Scheme:
    """One quantization scheme the library can produce, as a contract names it."""

    name: str
    element_dtype: torch.dtype
    scale_dtype: torch.dtype
    default_block: tuple[int, int]
    fixed_block: bool  # the scheme's block is part of its definition (MXFP8: 1 x 32)
    quantize: Quantizer  # (tensor name, weight, block, max_temp_elems) -> (FP8 weight, scales)

    def scale_shape(self, shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
        rows, cols = shape[-2], shape[-1]
        return (*shape[:-2], -(-rows // block[0]), -(-cols // block[1]))


def _tiles(count: int, per_tile: int) -> list[tuple[int, int]]:
    """(first, end) of each run of `per_tile` blocks out of `count`."""
    return [(i, min(count, i + per_tile)) for i in range(0, count, per_tile)]


def _refuse_nonfinite(name: str, tile: torch.Tensor, origin: tuple[int, ...], scheme: str) -> None:
    """Raise for the first NaN / inf of a 2-D `tile` whose element [0, 0] is `origin` of the weight (a 3-D
    weight's origin leads with the expert)."""
    bad = (~torch.isfinite(tile)).nonzero()[0].tolist()
    where = [*origin[:-2], origin[-2] + bad[0], origin[-1] + bad[1]]
    value = tile[bad[0], bad[1]].item()
    raise QuantizeError(
        f"{name}: element {where} is {value} (the weight holds a NaN or an infinity); it cannot be quantized to "
        f"{scheme}, and it was not sent (nor its bf16 bytes in its place): fix the trainer's weights, or have the "
        "rollout declare this tensor unquantized"
    )


def _check_input(name: str, x: torch.Tensor, scheme: str) -> None:
    if x.dim() not in (2, 3):
        raise QuantizeError(f"{name}: {scheme} quantizes 2-D weights (3-D: a bank of experts), got shape "
                            f"{tuple(x.shape)}; declare it unquantized in the rollout's contract")  # fmt: skip
    if not x.is_floating_point() or x.element_size() < 2:
        raise QuantizeError(f"{name}: {scheme} quantizes bf16 / fp16 / fp32 weights, got {x.dtype}")


def quantize_fp8_block(
    name: str, x: torch.Tensor, block: tuple[int, int] = (128, 128), max_temp_elems: int = DEFAULT_MAX_TEMP_ELEMS
) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight of `x`'s shape, float32 `weight_scale_inv` [ceil(n / bn), ceil(k / bk)]) as vLLM's
    `per_block_cast_to_fp8(x, block, use_ue8m0=False)`; per expert for a 3-D bank."""
    return _fp8_block(name, x, block, max_temp_elems, ue8m0=False)


def quantize_fp8_block_ue8m0(
    name: str, x: torch.Tensor, block: tuple[int, int] = (128, 128), max_temp_elems: int = DEFAULT_MAX_TEMP_ELEMS
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `quantize_fp8_block` with power-of-two scales: SGLang's `per_block_cast_to_fp8(x)` (128 x 128)."""
    return _fp8_block(name, x, block, max_temp_elems, ue8m0=True)


def ceil_to_ue8m0(x: torch.Tensor) -> torch.Tensor:
    """Each positive float32 rounded up to a power of two, on its bits (DeepGEMM's and SGLang's `ceil_to_ue8m0`:
    not `2 ** ceil(log2 x)`, whose float log2 rounds values just above a power of two down onto it)."""
    bits = x.abs().float().contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent.clamp(1, 254) << 23).view(torch.float32)


def _fp8_block(
    name: str, x: torch.Tensor, block: tuple[int, int], max_temp_elems: int, *, ue8m0: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    scheme = "fp8_block_ue8m0" if ue8m0 else "fp8_block"
    _check_input(name, x, scheme)
    bm, bn = block
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(FP8_BLOCK.scale_shape(tuple(x.shape), block), dtype=torch.float32, device=x.device)
    experts = [(x, q, scale)] if x.dim() == 2 else list(zip(x, q, scale, strict=True))
    rows_b, cols_b = scale.shape[-2], scale.shape[-1]
    cols_per = max(1, min(cols_b, max_temp_elems // (bm * bn)))
    rows_per = max(1, min(rows_b, max_temp_elems // (bm * bn * cols_per)))
    for e, (xe, qe, se) in enumerate(experts):
        for r0, r1 in _tiles(rows_b, rows_per):
            for c0, c1 in _tiles(cols_b, cols_per):
                origin = (e,) * (x.dim() == 3) + (r0 * bm, c0 * bn)
                _fp8_block_tile(name, xe, qe, se, (r0, r1, c0, c1), block, origin, ue8m0)
    return q, scale


def _fp8_block_tile(
    name: str,
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    span: tuple[int, int, int, int],
    block: tuple[int, int],
    origin: tuple[int, ...],
    ue8m0: bool,
) -> None:
    """Blocks rows r0..r1, columns c0..c1 of one 2-D weight: vLLM's (SGLang's, `ue8m0`) ops on the zero-padded
    tile."""
    (r0, r1, c0, c1), (bm, bn) = span, block
    tile = x[r0 * bm : r1 * bm, c0 * bn : c1 * bn]
    rows, cols = tile.shape
    padded = torch.zeros(((r1 - r0) * bm, (c1 - c0) * bn), dtype=x.dtype, device=x.device)
    padded[:rows, :cols] = tile
    view = padded.view(-1, bm, c1 - c0, bn)
    amax = view.abs().float().amax(dim=(1, 3), keepdim=True)
    if not bool(torch.isfinite(amax).all()):
        _refuse_nonfinite(name, tile, origin, "fp8_block_ue8m0" if ue8m0 else "fp8_block")
    sf = amax.clamp(AMAX_FLOOR) / FP8_MAX
    if ue8m0:
        sf = ceil_to_ue8m0(sf)
    scaled = (view * (1.0 / sf)).to(FP8_DTYPE)
    q[r0 * bm : r1 * bm, c0 * bn : c1 * bn] = scaled.view_as(padded)[:rows, :cols]
    scale[r0:r1, c0:c1] = sf.view(r1 - r0, c1 - c0)


def quantize_mxfp8(
    name: str, x: torch.Tensor, block: tuple[int, int] = (1, MXFP8_BLOCK), max_temp_elems: int = DEFAULT_MAX_TEMP_ELEMS
) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight of `x`'s shape, uint8 E8M0 scales [..., k / 32]) as vLLM's `_mxfp8_e4m3_quantize_torch(x)`
    (row-major scales, not swizzled)."""
    _check_input(name, x, "mxfp8")
    if block != (1, MXFP8_BLOCK):
        raise QuantizeError(f"{name}: mxfp8's block is (1, {MXFP8_BLOCK}), not {block}")
    k = x.shape[-1]
    if k % MXFP8_BLOCK:
        raise QuantizeError(f"{name}: mxfp8 needs a last dimension divisible by {MXFP8_BLOCK}, got shape "
                            f"{tuple(x.shape)}; declare it unquantized in the rollout's contract")  # fmt: skip
    rows = x.numel() // k if k else 0
    flat = x.reshape(rows, k)
    q = torch.empty((rows, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((rows, k // MXFP8_BLOCK), dtype=torch.uint8, device=x.device)
    cols_per = max(1, min(k // MXFP8_BLOCK, max_temp_elems // MXFP8_BLOCK))
    rows_per = max(1, max_temp_elems // (cols_per * MXFP8_BLOCK))
    for r0, r1 in _tiles(rows, rows_per):
        for c0, c1 in _tiles(k // MXFP8_BLOCK, cols_per):
            _mxfp8_tile(name, flat, q, scale, (r0, r1, c0, c1), tuple(x.shape))
    return q.view(x.shape), scale.view(*x.shape[:-1], k // MXFP8_BLOCK)


def _mxfp8_tile(
    name: str,
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    span: tuple[int, int, int, int],
    shape: tuple[int, ...],
) -> None:
    r0, r1, c0, c1 = span
    tile = x[r0:r1, c0 * MXFP8_BLOCK : c1 * MXFP8_BLOCK]
    blocked = tile.to(torch.float32).reshape(r1 - r0, c1 - c0, MXFP8_BLOCK)
    amax = blocked.abs().amax(dim=-1)
    if not bool(torch.isfinite(amax).all()):
        r = int((~torch.isfinite(tile)).any(dim=1).nonzero()[0])
        origin = (*_unflatten(r0 + r, shape[:-1]), c0 * MXFP8_BLOCK)
        _refuse_nonfinite(name, tile[r : r + 1], origin, "mxfp8")
    amax = amax.clamp(min=torch.finfo(torch.float32).tiny)
    biased = (torch.ceil(torch.log2(amax / FP8_MAX)) + E8M0_BIAS).clamp(0, 254)
    scale[r0:r1, c0:c1] = biased.to(torch.uint8)
    descale = torch.exp2(biased - E8M0_BIAS)
    q[r0:r1, c0 * MXFP8_BLOCK : c1 * MXFP8_BLOCK] = (blocked / descale.unsqueeze(-1)).view(tile.shape).to(FP8_DTYPE)


def _unflatten(row: int, dims: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for d in reversed(dims):
        out.append(row % d)
        row //= d
    return tuple(reversed(out))


FP8_BLOCK = Scheme("fp8_block", FP8_DTYPE, torch.float32, (128, 128), False, quantize_fp8_block)
FP8_BLOCK_UE8M0 = Scheme("fp8_block_ue8m0", FP8_DTYPE, torch.float32, (128, 128), False, quantize_fp8_block_ue8m0)
MXFP8 = Scheme("mxfp8", FP8_DTYPE, torch.uint8, (1, MXFP8_BLOCK), True, quantize_mxfp8)
SCHEMES: dict[str, Scheme] = {s.name: s for s in (FP8_BLOCK, FP8_BLOCK_UE8M0, MXFP8)}
