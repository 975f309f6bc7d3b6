"""What a sync needs to know of the model that does not change between syncs, derived once per model.

Its names, ties, FSDP wrapping and PEFT wrapping are facts of the module tree; the driver derives them at a
model's first sync and keeps them, rather than every step of every sync walking the tree again to re-derive
them (the gather itself still walks it: that is where the tensors come from).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..config import TrainerConfig
from .gather import fsdp1_units, is_sharded
from .lora import LoraSync
from .names import tied_names


@dataclass(frozen=True)
class ModelFacts:
    lora: bool  # a PEFT LoRA model whose versions `trainer.lora` shapes (trainer/lora.py)
    sharded: bool  # FSDP1 units or FSDP2 DTensors: the gather runs collectives
    fsdp1: bool
    stable: bool  # the gather yields fresh tensors (FSDP1's summoned views are reused unit by unit)
    tied: dict[str, tuple[str, ...]]  # tied names under trainer.names (a LoRA version's depend on its content)

    @classmethod
    def of(cls, module: nn.Module, lora: LoraSync, trainer: TrainerConfig, prefix: str | None) -> ModelFacts:
        buffers = trainer.include_buffers
        is_lora = lora.applies(module, prefix, buffers)
        fsdp1 = bool(fsdp1_units(module))
        tied = {} if is_lora else tied_names(module, include_buffers=buffers, names_cfg=trainer.names, prefix=prefix)
        return cls(is_lora, is_sharded(module), fsdp1, not fsdp1, tied)


__all__ = ["ModelFacts"]
