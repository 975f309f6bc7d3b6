"""A shard of a weight (sharded send mode: one trainer rank's contiguous byte range of it) quantized on its own
rank, where that gives bitwise what quantizing the whole weight gives.

Every scheme here is block-local: a block's FP8 bytes and its scale depend only on that block's elements (the
zero padding at an edge included, which is the same whether the edge is met whole or in a shard). So a shard that
holds whole blocks quantizes alone: one that covers whole rows, starting on a block-row edge and ending on one (or
at the end of its 2-D weight, where the last block row is short anyway). Its FP8 bytes are the same byte range of
the whole FP8 weight (one byte an element), its scales one contiguous run of block rows of the scale tensor. An
expert bank ([experts, n, k]) is one 2-D weight per expert, so a shard may span experts; each expert's part is
quantized as the 2-D piece it is. MXFP8's blocks are 1 x 32 along the last dimension: any whole-row shard is local.

A shard that cuts a block (mid-row, or a row inside a block row) cannot be quantized from its own bytes: the
block's scale depends on rows another rank holds. It is refused here, naming the tensor, the cut and the knobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import QuantizeError
from .contract import QuantRule
from .schemes import SCHEMES


@dataclass(frozen=True)
class ShardBlocks:
    """Where a whole-row shard of a weight lies in block terms (rows of the weight seen as [experts * n, k]).

    `pieces`: (expert, first row, end row) of each expert's part, rows counted within the expert; `scale_rows`:
    the shard's [first, end) rows of the scale tensor seen as [experts * ceil(n / block rows), scale columns]."""

    rows: tuple[int, int]
    pieces: tuple[tuple[int, int, int], ...]
    scale_rows: tuple[int, int]
    row_elems: int  # k: elements of one row
    scale_cols: int

    @property
    def weight_byte_offset(self) -> int:
        """Where the shard's FP8 bytes start in the whole FP8 weight (one byte an element)."""
        return self.rows[0] * self.row_elems


def shard_blocks(name: str, shape: tuple[int, ...], element_offset: int, numel: int, rule: QuantRule) -> ShardBlocks:
    """The block geometry of elements [element_offset, +numel) of a weight of `shape` quantized by `rule`, or a
    `QuantizeError` naming the cut where they are not whole blocks of it."""
    scheme = SCHEMES[rule.scheme]
    if len(shape) not in (2, 3):
        raise QuantizeError(f"{name}: {rule.scheme} quantizes 2-D weights (3-D: a bank of experts), got shape "
                            f"{list(shape)}; declare it unquantized in the rollout's contract")  # fmt: skip
    n, k = shape[-2], shape[-1]
    block_rows = rule.block[0]
    fix = (
        f"send it with trainer.send_mode=gather (the whole tensor is quantized on one rank), or shard it so that "
        f"every rank's share of its {n} rows is a multiple of {block_rows} (a rank count that cuts the rows into "
        "whole blocks)"
    )
    where = f"{name} ({list(shape)}): this rank's shard, elements [{element_offset}, {element_offset + numel})"
    if k == 0 or element_offset % k or numel % k:
        raise QuantizeError(f"{where}, does not cover whole rows of {k} elements, so it cuts {rule.scheme} blocks "
                            f"that other ranks hold part of: it cannot be quantized on this rank; {fix}")  # fmt: skip
    first, end = element_offset // k, (element_offset + numel) // k
    for row in (first, end):
        if (row % n) % block_rows:
            of = f"row {row % n} of expert {row // n}" if len(shape) == 3 else f"row {row}"
            raise QuantizeError(
                f"{where}, holds rows [{first}, {end}): {of} is not on a {block_rows}-row block edge, so the shard "
                f"shares a block row with another rank and cannot be quantized on this rank; {fix}"
            )
    pieces = []
    row = first
    while row < end:
        expert, within = divmod(row, n)
        stop = min(end - expert * n, n)
        pieces.append((expert, within, stop))
        row = expert * n + stop
    blocks_per_expert = -(-n // block_rows)
    scale_first = (first // n) * blocks_per_expert + (first % n) // block_rows
    scale_end = (end // n) * blocks_per_expert + -(-(end % n) // block_rows)
    scale_cols = scheme.scale_shape(tuple(shape), rule.block)[-1]
    return ShardBlocks((first, end), tuple(pieces), (scale_first, scale_end), k, scale_cols)


def quantize_shard(
    name: str, shape: tuple[int, ...], element_offset: int, data: torch.Tensor, rule: QuantRule, max_temp_elems: int
) -> tuple[tuple[int, torch.Tensor], tuple[int, torch.Tensor]]:
    """((byte offset in the whole FP8 weight, the shard's FP8 bytes), (byte offset in the whole scale tensor, the
    shard's scales)): bitwise those byte ranges of quantizing the whole weight. `data` is the shard's elements."""
    blocks = shard_blocks(name, shape, element_offset, data.numel(), rule)
    scheme = SCHEMES[rule.scheme]
    rows = data.detach().reshape(-1, blocks.row_elems)
    weights = [torch.empty(0, dtype=scheme.element_dtype, device=data.device)]
    scales = [torch.empty(0, dtype=scheme.scale_dtype, device=data.device)]
    at = 0
    for expert, first, end in blocks.pieces:
        try:
            q, s = scheme.quantize(name, rows[at : at + end - first], rule.block, max_temp_elems)
        except QuantizeError as exc:
            of = f" of expert {expert}" if len(shape) == 3 else ""
            raise QuantizeError(f"{exc} (element indices counted from row {first}{of}: this rank's shard)") from None
        weights.append(q.reshape(-1))
        scales.append(s.reshape(-1))
        at += end - first
    weight = torch.cat(weights) if len(weights) != 2 else weights[1]
    scale = torch.cat(scales) if len(scales) != 2 else scales[1]
    scale_offset = blocks.scale_rows[0] * blocks.scale_cols * scheme.scale_dtype.itemsize
    return (blocks.weight_byte_offset, weight), (scale_offset, scale)


__all__ = ["ShardBlocks", "quantize_shard", "shard_blocks"]
