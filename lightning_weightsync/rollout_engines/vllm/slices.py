"""A vLLM worker's tensor-parallel slices: the engine-neutral trace (`rollout_engines/slices.py`) with vLLM's
`default_weight_loader` for the parameters that have no loader of their own."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ..slices import CheckpointParams, Slices, copy_loader
from ..slices import derive_boxes as derive_engine_boxes


def default_loader() -> Callable[..., Any]:
    """vLLM's `default_weight_loader`; outside vLLM (tests), its behaviour for a same-shaped tensor."""
    try:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        return default_weight_loader
    except ImportError:
        return copy_loader


def derive_boxes(
    model: torch.nn.Module,
    shapes: Mapping[str, Sequence[int]],
    *,
    load: Callable[[Iterable[tuple[str, torch.Tensor]]], Any] | None = None,
    checkpoint_params: CheckpointParams | None = None,
) -> Slices:
    """`rollout_engines.slices.derive_boxes` on a vLLM model (see there)."""
    return derive_engine_boxes(
        model, shapes, load=load, checkpoint_params=checkpoint_params, default_loader=default_loader()
    )


__all__ = ["CheckpointParams", "Slices", "default_loader", "derive_boxes"]
