"""An SGLang TP rank's tensor-parallel slices: the engine-neutral trace (`rollout_engines/slices.py`) with SGLang's
`default_weight_loader` for the parameters that have no loader of their own.

What it covers is what SGLang's own `load_weights` does on the rank: the FP8 weight of a block-quantized layer
(`Fp8Config`, `weight_block_size` [128, 128]) and its `weight_scale_inv` are checkpoint-format parameters, read
through their layers' loaders like bf16 weights, so each gets its box (`tests/unit/test_sglang_slices_real.py`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ..slices import Slices, copy_loader
from ..slices import derive_boxes as derive_engine_boxes


def default_loader() -> Callable[..., Any]:
    """SGLang's `default_weight_loader`; outside SGLang (tests), its behaviour for a same-shaped tensor."""
    try:
        from sglang.srt.model_loader.weight_utils import default_weight_loader

        return default_weight_loader
    except ImportError:
        return copy_loader


def derive_boxes(
    model: torch.nn.Module,
    shapes: Mapping[str, Sequence[int]],
    *,
    load: Callable[[Iterable[tuple[str, torch.Tensor]]], Any] | None = None,
) -> Slices:
    """`rollout_engines.slices.derive_boxes` on an SGLang model (see there)."""
    return derive_engine_boxes(model, shapes, load=load, default_loader=default_loader())


__all__ = ["Slices", "default_loader", "derive_boxes"]
