"""The quantization contract an SGLang rollout declares, learnt from its own loaded model.

A model SGLang built from a serialized block-FP8 checkpoint (`Fp8Config` with `is_checkpoint_fp8_serialized` and a
`weight_block_size`, as Qwen3-FP8 and DeepSeek-V3 ship) loads, for every Linear and MoE expert its config
quantizes, FP8 bytes and a float32 `weight_scale_inv` (`Fp8LinearMethod.create_fp8_weight_`); every other tensor
(embeddings, norms, the MoE router SGLang builds unquantized, whatever `ignored_layers` names) as the checkpoint
holds it. What is quantized is read off the model, module by module, from the quant method SGLang gave each
(`Fp8LinearMethod` / `Fp8MoEMethod`, or an unquantized method), never from a table of architectures. The checkpoint
names come from SGLang's own maps: a fused Linear's shards from the model's `packed_modules_mapping`, else SGLang's
fallback (`_FALLBACK_FUSED_SHARDS`, what its `is_layer_skipped` maps `ignored_layers` with); the experts' from
`FusedMoE.make_expert_params_mapping`, recorded while the model's own `load_weights` runs on no tensors (it builds
the mapping its loader matches expert names with, per model: `gate_proj` for Qwen3-MoE, `w1` for Mixtral).

The scheme follows the checkpoint's `scale_fmt`: none gives `fp8_block` (scales `amax / 448`, as vLLM's and
DeepSeek's quantizers write them), `ue8m0` gives `fp8_block_ue8m0` (scales rounded up to powers of two, SGLang's own
`per_block_cast_to_fp8`, which SGLang re-lays out as lossless). Refused, by module and method rather than guessed:
per-tensor FP8 checkpoints, MXFP8 checkpoints (SGLang's uint8 scales), FP4 experts, another `scale_fmt`, any other
quantization method. SGLang is imported only inside the functions.
"""

from __future__ import annotations

from typing import Any

import torch

from ...quantize import QuantContract, QuantRule
from ..quant_contract import add_embedding, add_linear, contract_of, keep_the_rest, refuse

SCHEME_OF_SCALE_FMT = {None: "fp8_block", "ue8m0": "fp8_block_ue8m0"}


def _block_rule(prefix: str, method: Any, what: str) -> QuantRule | None:
    """The rule of an `Fp8LinearMethod` / `Fp8MoEMethod`; None where it quantizes bf16 itself (online)."""
    config = method.quant_config
    if not getattr(config, "is_checkpoint_fp8_serialized", False):
        return None  # SGLang quantizes the bf16 tensor it is given
    if getattr(method, "use_mxfp8", False):
        raise refuse(prefix, f"an MXFP8 {what} checkpoint (SGLang's uint8 scales)")
    if getattr(method, "is_fp4_expert", False):
        raise refuse(prefix, "FP4 experts")
    if not method.block_quant:
        raise refuse(prefix, f"a per-tensor FP8 {what} checkpoint (weight_scale from the whole fused weight's amax)")
    scale_fmt = getattr(config, "scale_fmt", None)
    if scale_fmt not in SCHEME_OF_SCALE_FMT:
        raise refuse(prefix, f"block FP8 with scale_fmt {scale_fmt!r} (known: {sorted(map(str, SCHEME_OF_SCALE_FMT))})")
    return QuantRule("_", scheme=SCHEME_OF_SCALE_FMT[scale_fmt], block=tuple(method.weight_block_size))


def _linear_rule(prefix: str, method: Any) -> QuantRule | None:
    from sglang.srt.layers.quantization.fp8 import Fp8LinearMethod
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    if isinstance(method, UnquantizedLinearMethod):
        return None
    if type(method) is not Fp8LinearMethod:
        raise refuse(prefix, f"quant method {type(method).__name__} is not one the contract knows")
    return _block_rule(prefix, method, "Linear")


def _moe_rule(prefix: str, method: Any) -> QuantRule | None:
    from sglang.srt.layers.quantization.fp8 import Fp8MoEMethod
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod

    if isinstance(method, UnquantizedFusedMoEMethod):
        return None
    if type(method) is not Fp8MoEMethod:
        raise refuse(prefix, f"MoE quant method {type(method).__name__} is not one the contract knows")
    return _block_rule(prefix, method, "MoE")


def expert_mapping(model: torch.nn.Module) -> list[tuple[str, str, int, str]]:
    """(param_name, weight_name, expert_id, shard_id) as the model's `load_weights` builds it with SGLang's
    `FusedMoE.make_expert_params_mapping`: recorded while `load_weights` runs on no tensors (nothing is loaded)."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    original = FusedMoE.make_expert_params_mapping
    recorded: list[tuple[str, str, int, str]] = []

    def record(*args: Any, **kwargs: Any) -> list[tuple[str, str, int, str]]:
        mapping = original(*args, **kwargs)
        recorded.extend(mapping)
        return mapping

    FusedMoE.make_expert_params_mapping = staticmethod(record)
    try:
        model.load_weights(iter(()))  # type: ignore[operator]  # an SGLang model's own method
    finally:
        FusedMoE.make_expert_params_mapping = original
    return recorded


def _fused_shards(model: torch.nn.Module, prefix: str, module: Any) -> list[str]:
    """The checkpoint Linears a (possibly fused) SGLang Linear loads, as SGLang's `is_layer_skipped` maps them."""
    from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
    from sglang.srt.layers.quantization.utils import _FALLBACK_FUSED_SHARDS

    leaf = prefix.rpartition(".")[2]
    quant = getattr(model, "quant_config", None)
    for mapping in (getattr(model, "packed_modules_mapping", None), getattr(quant, "packed_modules_mapping", None),
                    _FALLBACK_FUSED_SHARDS):  # fmt: skip
        if mapping and isinstance(mapping.get(leaf), list):
            return list(mapping[leaf])
    if isinstance(module, (QKVParallelLinear, MergedColumnParallelLinear)):
        raise refuse(prefix, f"a fused Linear ({type(module).__name__}) whose checkpoint tensors SGLang's maps do not "
                             "name (no packed_modules_mapping entry)")  # fmt: skip
    return [leaf]


def _module_outcomes(model: torch.nn.Module) -> dict[str, QuantRule | None]:
    """Every checkpoint tensor name the model loads: the rule it is quantized by, or None (kept)."""
    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.quantization.unquant import UnquantizedEmbeddingMethod
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding

    out: dict[str, QuantRule | None] = {}
    handled: set[str] = set()
    mapping: list[tuple[str, str, int, str]] | None = None
    for prefix, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if isinstance(module, FusedMoE):
            rule = _moe_rule(prefix, method)
            mapping = expert_mapping(model) if mapping is None else mapping
            if not mapping:
                raise refuse(prefix, "experts whose checkpoint names the model's load_weights does not map by "
                                     "FusedMoE.make_expert_params_mapping")  # fmt: skip
            parent = prefix.rpartition("experts")[0]
            out.update({f"{parent}{weight_name}weight": rule for _, weight_name, _, _ in mapping})
        elif isinstance(module, LinearBase):
            has_bias = getattr(module, "bias", None) is not None
            add_linear(out, prefix, _fused_shards(model, prefix, module), _linear_rule(prefix, method), has_bias)
        elif isinstance(module, VocabParallelEmbedding):
            add_embedding(out, prefix, isinstance(method, UnquantizedEmbeddingMethod), method)
        else:
            continue
        handled.add(prefix)
    keep_the_rest(model, handled, out)
    return out


def learn_quant_contract(model: torch.nn.Module) -> QuantContract:
    """What `model` (an SGLang model, built by SGLang with its quant config) loads, as a `QuantContract` over its
    checkpoint names; `QuantizeError` naming the module for a configuration the library cannot produce."""
    return contract_of(_module_outcomes(model))


def declared_contract(model: torch.nn.Module) -> QuantContract | None:
    """The contract an SGLang rank declares: None where its model takes tensors as the trainer holds them (no
    quant config, or FP8 that SGLang quantizes online from bf16), else `learn_quant_contract` (which refuses, by
    module, a format the library cannot produce)."""
    quant = getattr(model, "quant_config", None)
    if quant is None:
        return None
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    if type(quant) is Fp8Config and not quant.is_checkpoint_fp8_serialized:
        return None
    contract = learn_quant_contract(model)
    return contract if contract.rules else None


__all__ = ["declared_contract", "expert_mapping", "learn_quant_contract"]
