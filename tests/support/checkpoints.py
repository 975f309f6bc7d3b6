"""Checkpoint-format tensors for the engine kit tests (vLLM's and SGLang's real model classes)."""

from __future__ import annotations

import torch


def per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Transformers 5 holds a Qwen3-MoE layer's experts fused (`mlp.experts.gate_up_proj` [E, 2I, H], gate's rows
    first; `mlp.experts.down_proj` [E, H, I]); Hugging Face's Qwen3-MoE checkpoints (and a trainer saving them)
    name each expert's `gate_proj` [I, H], `up_proj` [I, H], `down_proj` [H, I]: those, split from the fused."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            half = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{name.removesuffix('gate_up_proj')}{e}.gate_proj.weight"] = tensor[e, :half].clone()
                out[f"{name.removesuffix('gate_up_proj')}{e}.up_proj.weight"] = tensor[e, half:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(tensor.shape[0]):
                out[f"{name.removesuffix('down_proj')}{e}.down_proj.weight"] = tensor[e].clone()
        else:
            out[name] = tensor
    return out
