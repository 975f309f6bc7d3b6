"""The quantization contract a vLLM rollout declares, learnt from its own loaded model.

A model loaded from a serialized block-FP8 checkpoint (`Fp8Config` with `weight_block_size`, as DeepSeek-V3 and
Qwen3-FP8 ship) loads, for every Linear and MoE expert its config quantizes, FP8 bytes and a float32
`weight_scale_inv`; every other tensor (embeddings, norms, the layers its `ignored_layers` names) as the
checkpoint holds it. What is quantized is read off the model, module by module, from the quant method vLLM gave
each (`Fp8LinearMethod` / `Fp8MoEMethod` with a block size, or an unquantized method), never from a table of
architectures; the checkpoint names come from vLLM's own maps (`packed_modules_mapping` for fused Linears, the
experts' `get_expert_mapping`), as vLLM itself maps `ignored_layers` onto them.

Refused, by module and method rather than guessed: per-tensor FP8 checkpoints (one scale per tensor, from the
amax of the whole fused, unsharded weight), UE8M0 scales (kernel-repacked), any other quantization method. A
model that is not quantized (or quantized online by the engine from bf16) declares that everything is kept.
vLLM is imported only inside `learn_quant_contract`.
"""

from __future__ import annotations

from typing import Any

import torch

from ...quantize import QuantContract, QuantRule
from ..quant_contract import add_embedding, add_linear, contract_of, keep_the_rest
from ..quant_contract import refuse as _refuse


def _linear_rule(prefix: str, method: Any) -> QuantRule | None:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

    if isinstance(method, UnquantizedLinearMethod):
        return None
    if type(method) is not Fp8LinearMethod:
        raise _refuse(prefix, f"quant method {type(method).__name__} is not one the contract knows")
    if not method.block_quant:
        raise _refuse(prefix, "a per-tensor FP8 checkpoint (weight_scale from the whole fused weight's amax)")
    if method.is_scale_e8m0:
        raise _refuse(prefix, "block FP8 with UE8M0 scales")
    return QuantRule("_", block=tuple(method.weight_block_size))


def _moe_rule(prefix: str, method: Any) -> QuantRule | None:
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod

    if isinstance(method, UnquantizedFusedMoEMethod):
        return None
    if type(method) is not Fp8MoEMethod:
        raise _refuse(prefix, f"MoE quant method {type(method).__name__} is not one the contract knows")
    if not method.block_quant:
        raise _refuse(prefix, "a per-tensor FP8 MoE checkpoint")
    return QuantRule("_", block=tuple(method.weight_block_size))


def _expert_names(layer: Any) -> list[str]:
    """The checkpoint names of a MoE layer's expert weights (`...mlp.experts.3.gate_proj.weight`), by vLLM's own
    mapping (the one its loader matches them with)."""
    parent = layer.layer_name.rpartition("experts")[0]
    return sorted({f"{parent}{weight_name}weight" for _, weight_name, _, _ in layer.get_expert_mapping()})


def _module_outcomes(model: torch.nn.Module) -> dict[str, QuantRule | None]:
    """Every checkpoint tensor name the model loads: the rule it is quantized by, or None (kept)."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    out: dict[str, QuantRule | None] = {}
    handled: set[str] = set()
    for prefix, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if isinstance(module, RoutedExperts):
            rule = _moe_rule(prefix, method)
            out.update({name: rule for name in _expert_names(module)})
        elif isinstance(module, LinearBase):
            leaf = prefix.rpartition(".")[2]
            has_bias = getattr(module, "bias", None) is not None
            add_linear(out, prefix, packed.get(leaf, [leaf]), _linear_rule(prefix, method), has_bias)
        elif isinstance(module, VocabParallelEmbedding):
            add_embedding(out, prefix, isinstance(method, UnquantizedEmbeddingMethod), method)
        else:
            continue
        handled.add(prefix)
    keep_the_rest(model, handled, out)
    return out


def learn_quant_contract(model: torch.nn.Module) -> QuantContract:
    """What `model` (a vLLM model, built by vLLM with its quant config) loads, as a `QuantContract` over its
    checkpoint names; `QuantizeError` naming the module for a configuration the library cannot produce."""
    return contract_of(_module_outcomes(model))
