"""What every engine's quantization-contract learner shares: names to patterns, the refusal, the kept rest.

An engine's learner (`vllm/quant_contract.py`, `sglang/quant_contract.py`) reads its own model's modules and quant
methods into outcomes, one per checkpoint tensor name (the `QuantRule` it arrives by, or None: as the trainer holds
it); what is engine-neutral is here: the parameters no quantized or embedding module claimed are kept, the names
are folded into patterns (a layer or expert index as `*` wherever every name it merges agrees), and the contract is
built from them. Torch and `quantize` only: no engine is imported here.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Collection
from typing import Any

import torch

from ..errors import QuantizeError
from ..quantize import QuantContract, QuantRule

_DIGITS = re.compile(r"^\d+$")


def refuse(prefix: str, why: str) -> QuantizeError:
    """The error for a module whose checkpoint format the trainer cannot produce, naming it."""
    return QuantizeError(f"{prefix}: {why}; trainer-side quantization cannot produce what this model loads "
                         "(serve a block-FP8 checkpoint, or have the engine quantize bf16 online)")  # fmt: skip


def add_linear(
    out: dict[str, QuantRule | None], prefix: str, shards: Collection[str], rule: QuantRule | None, has_bias: bool
) -> None:
    """A Linear at `prefix` loads each of its checkpoint `shards` (the fused projections' own names, or its own leaf)
    as `rule` says, and their biases as the checkpoint holds them."""
    parent = prefix.rpartition(".")[0]
    for shard in shards:
        base = f"{parent}.{shard}" if parent else shard
        out[f"{base}.weight"] = rule
        if has_bias:
            out[f"{base}.bias"] = None


def add_embedding(out: dict[str, QuantRule | None], prefix: str, unquantized: bool, method: object) -> None:
    """An embedding loads its weight as the checkpoint holds it; any quant method on it is refused by name."""
    if not unquantized:
        raise refuse(prefix, f"embedding quant method {type(method).__name__} is not one the contract knows")
    out[f"{prefix}.weight"] = None


def keep_the_rest(model: torch.nn.Module, handled: Collection[str], out: dict[str, QuantRule | None]) -> None:
    """Every parameter of a module outside `handled` (and outside their children) loads as the checkpoint holds it:
    norms, biases of modules no learner knows, a router built unquantized."""
    for prefix, module in model.named_modules():
        if prefix in handled or any(prefix.startswith(f"{h}.") for h in handled):
            continue
        for name, _ in module.named_parameters(recurse=False):
            out[f"{prefix}.{name}" if prefix else name] = None


def compress(outcomes: dict[str, QuantRule | None]) -> dict[str, QuantRule | None]:
    """Names to patterns: a digit component (layer, expert) becomes `*` wherever every name it would merge
    agrees on the outcome; tried from the last such position to the first, so "experts of a layer agree, layers
    do not" (the first dense layers of a MoE) still merges the experts."""
    current = dict(outcomes)
    width = max((len(n.split(".")) for n in current), default=0)
    for position in reversed(range(width)):
        groups: dict[str, list[str]] = defaultdict(list)
        for name in current:
            parts = name.split(".")
            if position < len(parts) and _DIGITS.match(parts[position]):
                groups[".".join([*parts[:position], "*", *parts[position + 1 :]])].append(name)
        for pattern, names in groups.items():
            if len({_rule_key(current[n]) for n in names}) == 1 and pattern not in current:
                rule = current[names[0]]
                for n in names:
                    del current[n]
                current[pattern] = rule
    return current


def _rule_key(rule: QuantRule | None) -> tuple[Any, ...] | None:
    return None if rule is None else (rule.scheme, rule.block, rule.scale_suffix)


def contract_of(outcomes: dict[str, QuantRule | None]) -> QuantContract:
    """The contract of every checkpoint name's outcome, as patterns (`compress`)."""
    patterns = compress(outcomes)
    rules = tuple(
        QuantRule(pattern, scheme=rule.scheme, block=rule.block, scale_suffix=rule.scale_suffix)
        for pattern, rule in sorted(patterns.items())
        if rule is not None
    )
    keep = tuple(pattern for pattern, rule in sorted(patterns.items()) if rule is None)
    return QuantContract(rules=rules, keep=keep)


__all__ = ["compress", "contract_of", "keep_the_rest", "refuse"]
