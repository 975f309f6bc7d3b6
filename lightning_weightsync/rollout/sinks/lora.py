"""The module sink's LoRA side (`rollout.sink.lora`): adapter versions into a PEFT model, or merged into a plain one.

Why a file of its own: the module sink stays one loop over named tensors; what is particular to LoRA is
which live tensor a received name is (`keep`: a PEFT model's wrapped names), which tensors are not live
tensors at all (`merge`: ``lora_A``/``lora_B`` are held and merged at commit), and checking the version's
adapter config against the rollout's model before anything is applied.

- `keep`: `rollout.sink.factory` builds the PEFT model (`get_peft_model(model, LoraConfig(...))`, the
  trainer's config). Adapter tensors arrive under PEFT's `save_pretrained` names and land in the model's
  ``lora_A.<adapter>`` / ``modules_to_save.<adapter>`` tensors; base weights (the first version, unless the
  trainer says `rollout_has`) under the base model's names land in ``base_layer`` / ``original_module``.
  The version's rank, alpha, targets, rsLoRA and DoRA must equal the PEFT model's.
- `merge`: the factory builds the plain model. Each version's ``W + scale * B @ A`` is computed at commit
  from a copy of the base weight the sink keeps (taken from the version that carried the base, or from
  the factory's model at the first version), with `protocol/lora.py`'s merge, which is bitwise PEFT's own
  (`merge_and_unload()` on the trainer). Memory: one extra copy of every targeted weight. `modules_to_save`
  copies replace their module's tensors. Not supported here: DoRA, `lora_bias`, rank/alpha patterns (use `keep`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ...errors import SinkError
from ...protocol.lora import adapter_name, base_name, lora_scaling, merge_weight
from ...protocol.messages import LoraSpec
from .config import LoraApply

LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def peft_model_of(module: torch.nn.Module) -> Any | None:
    """The PEFT model `module` is (or holds at its root), without importing peft."""
    peft = sys.modules.get("peft")
    if peft is None:
        return None
    return module if isinstance(module, peft.PeftModel) else None


def _targets(value: Any) -> list[str] | str:
    return value if isinstance(value, str) else sorted(value or ())


class LoraLoader:
    """What the module sink asks about a LoRA version: the live name of a received name, and the merge."""

    def __init__(self, apply: LoraApply, module: torch.nn.Module, live: dict[str, torch.Tensor]) -> None:
        self.apply = apply
        self.live = live
        self.peft_model = peft_model_of(module)
        self.adapter = "default"
        self.aliases: dict[str, str] = {}  # received name -> live name (keep)
        if self.peft_model is not None:
            active = self.peft_model.active_adapter
            self.adapter = active if isinstance(active, str) else active[0]
            for name in live:
                sent = adapter_name(name, self.adapter) if _is_adapter(name, self.adapter) else base_name(name)
                self.aliases[sent] = name
        self.pristine: dict[str, torch.Tensor] = {}  # merge: live name -> the base weight, as last received
        self.factors: dict[str, torch.Tensor] = {}  # merge: the version's lora_A / lora_B, by received name
        self.spec: LoraSpec | None = None

    # -- per version -----------------------------------------------------------------------------
    def begin(self, spec: LoraSpec | None) -> None:
        """Check `spec` against the rollout's model (SinkError before anything is applied)."""
        self.spec, self.factors = spec, {}
        if spec is None or spec.mode != "adapter":
            return
        if self.apply is LoraApply.keep:
            self._check_keep(spec)
        else:
            self._check_merge(spec)

    def _check_keep(self, spec: LoraSpec) -> None:
        if self.peft_model is None:
            raise SinkError(
                "an adapter version (trainer.lora=adapter) arrived and rollout.sink.lora=keep, but "
                "rollout.sink.factory built no PEFT model: build get_peft_model(model, LoraConfig(...)) there, "
                "or set rollout.sink.lora=merge"
            )
        config = self.peft_model.peft_config[self.adapter]
        ours = {
            "r": int(config.r),
            "lora_alpha": float(config.lora_alpha),
            "target_modules": _targets(config.target_modules),
            "use_rslora": bool(config.use_rslora),
            "use_dora": bool(config.use_dora),
            "lora_bias": bool(getattr(config, "lora_bias", False)),
            "rank_pattern": {str(k): int(v) for k, v in (config.rank_pattern or {}).items()},
            "alpha_pattern": {str(k): float(v) for k, v in (config.alpha_pattern or {}).items()},
        }
        theirs = {key: getattr(spec, key) for key in ours}
        theirs["target_modules"] = _targets(spec.target_modules)
        differ = [f"{key}: trainer {theirs[key]!r}, rollout {ours[key]!r}" for key in ours if ours[key] != theirs[key]]
        if differ:
            raise SinkError(
                "the adapter does not match the rollout's PEFT model (" + "; ".join(differ)[:600] + "); build the "
                "model in rollout.sink.factory with the trainer's LoraConfig"
            )

    def _check_merge(self, spec: LoraSpec) -> None:
        if self.peft_model is not None:
            raise SinkError(
                "rollout.sink.lora=merge merges adapters into a plain model, but rollout.sink.factory built a PEFT "
                "model; return the base model there, or set rollout.sink.lora=keep"
            )
        if spec.lora_bias:
            raise SinkError(
                "the adapter has lora_bias=True (a bias on every lora_B), which rollout.sink.lora=merge does not "
                "merge; set rollout.sink.lora=keep (rollout.sink.factory builds the PEFT model with the trainer's "
                "LoraConfig)"
            )
        if spec.use_dora or spec.rank_pattern or spec.alpha_pattern:
            raise SinkError(
                "rollout.sink.lora=merge does not merge DoRA or rank/alpha patterns bitwise as PEFT does; "
                "set rollout.sink.lora=keep (a PEFT model) or trainer.lora=merged"
            )
        if isinstance(spec.target_modules, list):
            lacking = [t for t in spec.target_modules if not any(_is_weight_of(n, t) for n in self.live)]
            if lacking:
                raise SinkError(
                    f"the adapter targets {lacking[:3]} ({len(lacking)} in all) that the rollout model has no weight "
                    "for; rollout.sink.factory must build the trainer's base model"
                )

    def live_name(self, name: str) -> str | None:
        """The live tensor a received name goes to; None for a LoRA factor the merge holds instead."""
        if self.spec is None or self.spec.mode != "adapter":
            return name
        if self.apply is LoraApply.keep:
            return self.aliases.get(name, name)
        if name.endswith(LORA_SUFFIXES):
            return None
        return base_name(name)

    def check_factor(self, name: str, shape: tuple[int, ...]) -> None:
        """merge: a lora_A / lora_B fits its layer's weight ([r, in] and [out, r]) and the version's rank."""
        assert self.spec is not None
        weight = self._weight_of(name)
        live = self.live.get(weight)
        if live is None:
            raise SinkError(f"LoRA tensor {name!r} targets {weight!r}, which the rollout model does not have")
        out_f, in_f = live.shape[::-1] if self.spec.fan_in_fan_out else live.shape
        expected = (self.spec.r, in_f) if name.endswith(".lora_A.weight") else (out_f, self.spec.r)
        if len(live.shape) != 2 or tuple(shape) != tuple(expected):
            raise SinkError(
                f"LoRA tensor {name!r} has shape {list(shape)}, but rank r={self.spec.r} on the rollout's {weight!r} "
                f"{list(live.shape)} needs {list(expected)}; rollout.sink.factory must build the trainer's base model"
            )

    def hold(self, name: str, tensor: torch.Tensor) -> None:
        self.factors[name] = tensor

    def merges(self) -> list[tuple[str, str, str]]:
        """merge: (live weight, lora_A name, lora_B name) of this version; SinkError if a factor lacks its pair."""
        layers: dict[str, list[str | None]] = {}
        for name in self.factors:
            slot = 0 if name.endswith(".lora_A.weight") else 1
            layers.setdefault(self._weight_of(name), [None, None])[slot] = name
        out = []
        for weight, (a, b) in layers.items():
            if a is None or b is None:
                raise SinkError(f"version carries only one of lora_A / lora_B for {weight!r}; nothing applied")
            out.append((weight, a, b))
        return out

    def merge(self, weight: str, a: str, b: str, base_received: bool) -> torch.Tensor:
        """The merged value of live tensor `weight` (call under the sink's lock, before writing it)."""
        assert self.spec is not None
        live = self.live[weight]
        if base_received or weight not in self.pristine:
            self.pristine[weight] = live.detach().clone()  # the base this and later versions merge onto
        scaling = lora_scaling(self.spec.lora_alpha, self.spec.r, use_rslora=self.spec.use_rslora)
        factor_a, factor_b = (self.factors[n].to(live.device) for n in (a, b))
        return merge_weight(self.pristine[weight], factor_a, factor_b, scaling, fan_in_fan_out=self.spec.fan_in_fan_out)

    @staticmethod
    def _weight_of(name: str) -> str:
        for suffix in LORA_SUFFIXES:
            if name.endswith(suffix):
                return base_name(name[: -len(suffix)]) + ".weight"
        return base_name(name)


def _is_adapter(name: str, adapter: str) -> bool:
    parts = name.split(".")
    return any(
        parts[i + 1] == adapter and (part.startswith("lora_") or part == "modules_to_save")
        for i, part in enumerate(parts[:-1])
    )


def _is_weight_of(name: str, target: str) -> bool:
    return name == f"{target}.weight" or name.endswith(f".{target}.weight")
