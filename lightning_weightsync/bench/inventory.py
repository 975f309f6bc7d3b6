"""Model-shaped weight streams from real inventories (Qwen3-8B, Qwen3-30B-A3B, Llama-3.1-8B).

Tests and benchmarks use the real names and the real mix of sizes, scaled down to fit a CPU
(every dimension divided by `scale`, at least 1), and generated deterministically from a seed so
that a receiver can recompute what the sender sent.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import lru_cache
from importlib import resources

import torch

from ..protocol.dtypes import dtype_from_name


@lru_cache(maxsize=1)
def inventories() -> dict[str, list[tuple[str, tuple[int, ...], str]]]:
    raw = json.loads(resources.files(__package__).joinpath("data/model_inventories.json").read_text())
    return {model: [(n, tuple(s), d) for n, s, d in spec["tensors"]] for model, spec in raw.items()}


def scaled_shapes(
    model: str = "qwen3-8b", scale: int = 64, max_tensors: int | None = None
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    specs = inventories()[model][:max_tensors]
    return [(n, tuple(max(1, d // scale) for d in shape), dtype_from_name(dt)) for n, shape, dt in specs]


def make_tensor(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    return torch.randint(-100, 100, shape, generator=generator).to(dtype)


def model_stream(
    model: str = "qwen3-8b",
    *,
    scale: int = 64,
    version: int = 0,
    max_tensors: int | None = None,
    extras: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the scaled model's tensors for `version`; `extras` adds the awkward cases: an empty
    tensor, 0-dim scalars, an fp32 tensor and a non-contiguous (transposed) one."""
    g = torch.Generator().manual_seed(1_000_003 * version + 17)
    for name, shape, dtype in scaled_shapes(model, scale, max_tensors):
        yield name, make_tensor(shape, dtype, g)
    if extras:
        yield "extras.empty", torch.empty(0, 5, dtype=torch.bfloat16)
        yield "extras.scalar_step", torch.tensor(version, dtype=torch.int64)
        yield "extras.scalar_temp", torch.tensor(0.5 + version, dtype=torch.float32)
        yield "extras.fp32_router", make_tensor((33, 17), torch.float32, g)
        yield "extras.transposed", make_tensor((19, 23), torch.float32, g).t()
