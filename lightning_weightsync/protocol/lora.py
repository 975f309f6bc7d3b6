"""LoRA on the wire: the names a PEFT model's tensors travel under, and the merge, written once for both sides.

Why here: the trainer merges (`trainer.lora: merged | full`) and the rollout merges (`rollout.sink.lora:
merge`), and the two must give the same bits as PEFT's own `merge_and_unload()`; the trainer maps PEFT's
wrapped names to the base model's and the rollout maps them back. Pure functions of names and tensors,
no sockets, no PEFT import (the rollout of a merged model needs no PEFT at all).

Names (PEFT 0.13+):
- the trainer holds ``base_model.model.<base path>.<attr>`` (a `PeftModel`), with targeted layers as
  ``<layer>.base_layer.weight`` plus ``<layer>.lora_A.<adapter>.weight`` / ``lora_B``, and each
  `modules_to_save` module as ``<module>.original_module.*`` (frozen) and ``<module>.modules_to_save.<adapter>.*``;
- `adapter_name`: what PEFT's `save_pretrained` writes, ``base_model.model.<layer>.lora_A.weight`` (the
  adapter's name dropped), ``base_model.model.<module>.<attr>`` for a `modules_to_save` copy;
- `base_name`: the plain model's name, ``<base path>.<attr>`` (``base_model.model.``, ``.base_layer``,
  ``.original_module`` and ``.modules_to_save.<adapter>`` dropped).
"""

from __future__ import annotations

import math

import torch

PEFT_PREFIX = "base_model.model."
LORA_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


def base_name(name: str, adapter: str = "default") -> str:
    """The plain (un-PEFT'd) model's name of a PEFT model's tensor: ``base_model.model.`` (wherever the PEFT
    model sits) and the ``base_layer`` / ``original_module`` / ``modules_to_save.<adapter>`` components go."""
    head, sep, tail = name.partition(PEFT_PREFIX)
    if sep and (not head or head.endswith(".")):
        name = head + tail
    parts = name.split(".")
    out: list[str] = []
    i = 0
    while i < len(parts):
        part = parts[i]
        if part in ("base_layer", "original_module"):
            i += 1
            continue
        if part == "modules_to_save" and i + 1 < len(parts) and parts[i + 1] == adapter:
            i += 2
            continue
        out.append(part)
        i += 1
    return ".".join(out)


def adapter_name(name: str, adapter: str = "default") -> str:
    """PEFT's `save_pretrained` name of an adapter tensor (`get_peft_model_state_dict`): the adapter's own
    name dropped after a ``lora_*`` part, ``modules_to_save.<adapter>.`` dropped from a saved module's copy."""
    parts = name.split(".")
    out: list[str] = []
    i = 0
    while i < len(parts):
        part = parts[i]
        out.append(part)
        if part in LORA_PARTS and i + 1 < len(parts) and parts[i + 1] == adapter:
            i += 2
            continue
        if part == "modules_to_save" and i + 1 < len(parts) and parts[i + 1] == adapter:
            out.pop()
            i += 2
            continue
        i += 1
    return ".".join(out)


def lora_scaling(lora_alpha: float, r: int, *, use_rslora: bool = False) -> float:
    """PEFT's `LoraLayer.update_layer` scaling, computed the same way (so the float is the same)."""
    return lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r


def delta_weight(a: torch.Tensor, b: torch.Tensor, scaling: float, *, fan_in_fan_out: bool = False) -> torch.Tensor:
    """`B @ A * scaling`, exactly as PEFT's `lora.Linear.get_delta_weight` computes it: on a CPU, half
    precision is multiplied in float32 and cast back (PEFT does so because CPU half matmuls are slow; we do
    so because that is the value PEFT merges)."""
    dtype = b.dtype
    cast_to_fp32 = b.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16)
    if cast_to_fp32:
        a, b = a.float(), b.float()
    out = b @ a
    if fan_in_fan_out:
        out = out.T
    out = out * scaling
    return out.to(dtype) if cast_to_fp32 else out


def merge_weight(
    weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, *, fan_in_fan_out: bool = False
) -> torch.Tensor:
    """A new tensor: `weight + delta_weight(...)`, bitwise what PEFT's `merge()` leaves in the base layer
    (it adds the delta in place, in the weight's dtype)."""
    delta = delta_weight(a, b, scaling, fan_in_fan_out=fan_in_fan_out)
    with torch.no_grad():
        return weight + delta.to(weight.dtype)


def adapter_path(lora_dir: str, version: int) -> str:
    """Where an engine worker writes adapter `version` (the safetensors sink's `step_<version>/` under
    `<engine>.lora_dir`) and what the trainer's client names to the engine: one rule for both sides."""
    return f"{lora_dir.rstrip('/')}/step_{version}"
