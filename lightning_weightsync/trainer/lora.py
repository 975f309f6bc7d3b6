"""A PEFT LoRA model's versions: the adapter (or the merged tensors), not the whole wrapped model.

Why: without this a PEFT model sends every base weight, every version, under PEFT's wrapped names
(``base_model.model.x.q_proj.base_layer.weight``) that no plain rollout model has. With rank 16 on every
linear layer the adapter is a few percent of the model; the base weights never change. `trainer.lora`:

- `adapter` (`auto`'s choice for a PEFT LoRA model): only the adapter tensors (``lora_A``/``lora_B``, DoRA
  magnitudes, `modules_to_save` copies) under PEFT's `save_pretrained` names, and the adapter's config in
  the version's first bucket (`LoraSpec`); the rollout loads them into its own PEFT model, merges them, or
  writes an adapter directory;
- `merged`: only the weights LoRA changes, merged (`W + scale * B @ A`, computed per layer while streaming,
  in `trainer.dtype`), and the `modules_to_save` copies, under the base model's names;
- `full`: every tensor, merged, under the base model's names (the fallback for a rollout that wants a
  whole model every version).

The base weights (every other tensor, under the base model's names) go in every version until one was
delivered (`trainer.lora_base: send_once`), or never (`rollout_has`). What is gathered is decided per
tensor before its collective, identically on every rank (the decision reads only the module tree and
the `SyncRecord`, which every rank shares), so FSDP ranks stay in step and a version without the base
all-gathers only the adapter.

Names are mapped by `protocol/lora.py` first, then by `trainer.names` (so a rename applies to the base
model's names, as without PEFT). Not supported: FSDP1 flat parameters (use FSDP2 or DDP) and
`trainer.send_mode: sharded` (the adapter is small; LoRA versions are gathered).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from torch import nn

from ..config import LoraBase, LoraMode, NamesConfig, TrainerConfig
from ..errors import ConfigError
from ..protocol.lora import LORA_PARTS, adapter_name, base_name, merge_weight
from ..protocol.messages import LoraSpec
from .gather import NamedTensor, cast_floating, iter_full_parameters, resolve_dtype
from .names import NameMapper, SentNames, own_tensors, tied_names, walk_modules

logger = logging.getLogger(__name__)


def import_peft() -> Any:
    """peft, or a ConfigError naming the extra that installs it."""
    try:
        import peft
    except ImportError as exc:
        raise ConfigError(
            f"trainer.lora needs peft ({exc}); install the extra: pip install 'lightning_weightsync[lora]'"
        ) from None
    return peft


class Role(Enum):
    BASE = "base"  # a base weight LoRA does not touch (sent with the base)
    TARGET = "target"  # the base weight of a LoRA layer (merged in merged/full)
    LORA_A = "lora_A"
    LORA_B = "lora_B"
    ADAPTER = "adapter"  # another adapter tensor (DoRA magnitude, embedding LoRA)
    SAVED = "saved"  # a modules_to_save copy (trainable, replaces the original under the base name)
    ORIGINAL = "original"  # the frozen original of a modules_to_save module


@dataclass(frozen=True)
class Layer:
    """One LoRA layer: where its tensors are, and what PEFT's merge needs."""

    target: str  # raw name of base_layer.weight
    lora_a: str
    lora_b: str
    scaling: float
    fan_in_fan_out: bool
    mergeable: bool  # a plain lora.Linear (no DoRA or other variant, no lora_bias)


@dataclass
class LoraRoles:
    """Every tensor's role, by raw (wrapper-free, full) name; built once per module (local, no collectives)."""

    spec: LoraSpec
    adapter: str
    peft_path: str  # raw path of the PeftModel ("" at the root)
    prefix: str | None
    roles: dict[str, Role] = field(default_factory=dict)
    layers: dict[str, Layer] = field(default_factory=dict)  # by target, lora_a and lora_b raw names

    def out_name(self, raw: str, role: Role) -> str:
        """The name sent, before `trainer.names`: PEFT's save name for adapter tensors in `adapter` mode,
        the base model's name for everything else."""
        if self.spec.mode == LoraMode.adapter.value and role in (Role.LORA_A, Role.LORA_B, Role.ADAPTER, Role.SAVED):
            rel = raw[len(self.peft_path) + 1 :] if self.peft_path else raw
            return adapter_name(rel, self.adapter)
        rel = _strip(raw, self.prefix)
        return base_name(rel, self.adapter)


def _strip(raw: str, prefix: str | None) -> str:
    if not prefix:
        return raw
    head = prefix.rstrip(".") + "."
    return raw[len(head) :] if raw.startswith(head) else raw


def _under(raw: str, prefix: str | None) -> bool:
    return not prefix or raw.startswith(prefix.rstrip(".") + ".")


def find_peft(module: nn.Module) -> tuple[str, nn.Module] | None:
    """(raw path, PeftModel) of the first PEFT model in `module`'s tree (through FSDP2/DDP/Accelerate wrappers
    and a LightningModule), or None. Never imports peft: a process that has not imported it holds none."""
    peft = sys.modules.get("peft")
    if peft is None:
        return None
    for path, mod in walk_modules(module, (), lambda _: False):
        if isinstance(mod, peft.PeftModel):
            return ".".join(path), mod
    return None


def _spec_of(peft_model: Any, mode: LoraMode, *, base: bool) -> tuple[LoraSpec, str]:
    adapter = peft_model.active_adapter
    if not isinstance(adapter, str):
        if len(adapter) != 1:
            raise ConfigError(f"the PEFT model has {len(adapter)} active adapters; trainer.lora sends exactly one")
        adapter = adapter[0]
    config = peft_model.peft_config[adapter]
    peft_type = str(getattr(config.peft_type, "value", config.peft_type))
    if peft_type != "LORA":
        raise ConfigError(
            f"the PEFT model's adapter {adapter!r} is {peft_type}, not LORA: trainer.lora={mode} handles LoRA "
            "adapters only; merge it yourself (merge_and_unload()) and train the plain model, or use a LoraConfig"
        )
    targets = config.target_modules
    target_modules: list[str] | str = targets if isinstance(targets, str) else sorted(targets or ())
    spec = LoraSpec(
        mode=mode.value,
        base=base,
        r=int(config.r),
        lora_alpha=float(config.lora_alpha),
        target_modules=target_modules,
        lora_dropout=float(config.lora_dropout or 0.0),
        use_rslora=bool(config.use_rslora),
        use_dora=bool(config.use_dora),
        fan_in_fan_out=bool(config.fan_in_fan_out),
        bias=str(config.bias),
        lora_bias=bool(getattr(config, "lora_bias", False)),
        modules_to_save=sorted(config.modules_to_save or ()),
        rank_pattern={str(k): int(v) for k, v in (config.rank_pattern or {}).items()},
        alpha_pattern={str(k): float(v) for k, v in (config.alpha_pattern or {}).items()},
        task_type=None if config.task_type is None else str(getattr(config.task_type, "value", config.task_type)),
    )
    return spec, adapter


def build_roles(module: nn.Module, mode: LoraMode, *, prefix: str | None, include_buffers: bool) -> LoraRoles | None:
    """The plan of a PEFT LoRA `module` for `mode` (the base flag is set per version), None without PEFT.

    Raises ConfigError (naming `trainer.lora`) for a non-LoRA adapter, FSDP1, or `merged`/`full` on layers
    whose merge this does not reproduce bitwise (DoRA and other variants, `lora_bias`, non-Linear layers)."""
    found = find_peft(module)
    if found is None:
        if mode in (LoraMode.adapter, LoraMode.merged):
            raise ConfigError(
                f"trainer.lora={mode} but the model holds no PEFT model (peft's get_peft_model); use trainer.lora=auto"
            )
        return None
    peft = import_peft()
    peft_path, peft_model = found
    resolved = LoraMode.adapter if mode is LoraMode.auto else mode
    spec, adapter = _spec_of(peft_model, resolved, base=True)
    plan = LoraRoles(spec=spec, adapter=adapter, peft_path=peft_path, prefix=prefix)
    lora_layer = peft.tuners.lora.LoraLayer
    linear = peft.tuners.lora.Linear
    seen: set[int] = set()
    for mod_path, mod in walk_modules(module, (), lambda _: False):
        path = ".".join(mod_path)
        if type(mod).__name__ == "FullyShardedDataParallel":
            raise ConfigError("trainer.lora: FSDP1 is not supported with a PEFT model; use FSDP2 (fully_shard) or DDP")
        if isinstance(mod, lora_layer) and adapter in getattr(mod, "lora_A", {}):
            variant = adapter in getattr(mod, "lora_variant", {}) or bool(getattr(mod, "use_dora", {}).get(adapter))
            lora_bias = bool(getattr(mod, "lora_bias", {}).get(adapter, False))
            layer = Layer(
                target=f"{path}.base_layer.weight",
                lora_a=f"{path}.lora_A.{adapter}.weight",
                lora_b=f"{path}.lora_B.{adapter}.weight",
                scaling=float(mod.scaling[adapter]),
                fan_in_fan_out=bool(getattr(mod, "fan_in_fan_out", False)),
                mergeable=isinstance(mod, linear) and not variant and not lora_bias,
            )
            if resolved is not LoraMode.adapter and not layer.mergeable:
                raise ConfigError(
                    f"trainer.lora={resolved}: LoRA layer {path!r} ({type(mod).__name__}, DoRA/variant or lora_bias) "
                    "cannot be merged bitwise as PEFT does here; use trainer.lora=adapter"
                )
            for name in (layer.target, layer.lora_a, layer.lora_b):
                plan.layers[name] = layer
        for attr, tensor in own_tensors(mod, include_buffers):
            raw = f"{path}.{attr}" if path else attr
            if id(tensor) in seen or not _under(raw, prefix):
                continue
            seen.add(id(tensor))
            plan.roles[raw] = _role(raw, adapter)
    for raw, layer in list(plan.layers.items()):
        if raw == layer.target:
            plan.roles[raw] = Role.TARGET
    if resolved is not LoraMode.adapter and any(r is Role.ADAPTER for r in plan.roles.values()):
        raise ConfigError(f"trainer.lora={resolved}: the adapter has tensors besides lora_A/lora_B; use adapter")
    return plan


def _role(raw: str, adapter: str) -> Role:
    parts = raw.split(".")
    for i, part in enumerate(parts[:-1]):
        if parts[i + 1] == adapter:
            if part == "lora_A":
                return Role.LORA_A
            if part == "lora_B":
                return Role.LORA_B
            if part in LORA_PARTS:
                return Role.ADAPTER
            if part == "modules_to_save":
                return Role.SAVED
    if parts[-1] in LORA_PARTS or (len(parts) > 1 and parts[-2] in LORA_PARTS):
        return Role.ADAPTER  # a ParameterDict entry: lora_embedding_A.<adapter>
    if "original_module" in parts:
        return Role.ORIGINAL
    return Role.BASE


def _sent(mode: str, role: Role, base: bool) -> bool:
    """Whether a tensor of `role` goes in a version of `mode` (`base`: the version carries the base)."""
    if role is Role.ORIGINAL:
        return mode == LoraMode.adapter.value and base  # merged/full send the trained copy under its name
    if role in (Role.LORA_A, Role.LORA_B):
        return True  # adapter: sent; merged/full: gathered for the merge, not sent
    if role in (Role.ADAPTER, Role.SAVED):
        return True
    if role is Role.TARGET:
        return mode != LoraMode.adapter.value or base
    return base or mode == LoraMode.full.value


class LoraSync:
    """`trainer.lora` for one `SyncDriver`: per version, which tensors are gathered and what is sent.

    Cheap until a sync meets a PEFT model; `weights` decides the version's content eagerly (the
    returned iterator is lazy), so `spec` and `tied` describe the version `weights` was last called for.
    The driver tells it of every delivered version (`delivered`, from the `SyncRecord`, on every rank alike).
    """

    def __init__(self, trainer: TrainerConfig) -> None:
        self.mode = trainer.lora
        self.base_policy = trainer.lora_base
        self._roles: dict[tuple[int, str | None], LoraRoles | None] = {}
        self._tied: dict[tuple[int, str | None], dict[str, tuple[str, ...]]] = {}  # raw names, per model
        self._base_delivered = self.base_policy is LoraBase.rollout_has
        self._base_pending = False  # a version with the base was produced; none known delivered since
        self.spec: LoraSpec | None = None  # of the version in flight
        self._logged = False

    def delivered(self, version: int) -> None:
        """`version` reached every rollout. Every LoRA version carries the base until one is delivered, so once
        any is (after one with the base was produced), the rollouts hold the base and later versions go
        without it. A version a resumed run's checkpoint recorded is not announced: the new run sends the
        base again, for rollouts that may have restarted since."""
        if self._base_pending:
            self._base_delivered = True

    def roles(self, module: nn.Module, prefix: str | None, include_buffers: bool) -> LoraRoles | None:
        key = (id(module), prefix)
        if key not in self._roles:
            self._roles[key] = build_roles(module, self.mode, prefix=prefix, include_buffers=include_buffers)
        return self._roles[key]

    def applies(self, module: nn.Module, prefix: str | None, include_buffers: bool) -> bool:
        """Whether versions of `module` are LoRA versions (a PEFT LoRA model, trainer.lora not overridden)."""
        return self.roles(module, prefix, include_buffers) is not None

    def weights(
        self,
        module: nn.Module,
        *,
        include_buffers: bool,
        names_cfg: NamesConfig | None,
        dtype: torch.dtype | str | None,
        keep_on_rank: int | None,
        prefix: str | None,
    ) -> Iterator[NamedTensor]:
        """The version's stream: the tensors `trainer.lora` sends, mapped and merged (see the module docstring)."""
        plan = self.roles(module, prefix, include_buffers)
        assert plan is not None, "LoraSync.weights on a model that is not a PEFT LoRA model"
        base = not self._base_delivered
        if base:
            self._base_pending = True
        spec = self.spec = _with_base(plan.spec, base)
        if not self._logged:
            self._logged = True
            adapter_tensors = sum(
                r in (Role.LORA_A, Role.LORA_B, Role.ADAPTER, Role.SAVED) for r in plan.roles.values()
            )
            logger.info(
                "PEFT LoRA model (r=%d, alpha=%g, %d LoRA layers): trainer.lora=%s, %d adapter tensors a version; "
                "base weights %s", spec.r, spec.lora_alpha, len({id(v) for v in plan.layers.values()}), spec.mode,
                adapter_tensors, "never sent (trainer.lora_base=rollout_has)" if not base else "in the first version",
            )  # fmt: skip
        roles = plan.roles
        raw_stream = iter_full_parameters(
            module,
            include_buffers=include_buffers,
            keep_on_rank=keep_on_rank,
            select=lambda raw: raw in roles and _sent(spec.mode, roles[raw], base),
        )
        return _mapped(raw_stream, plan, spec, NameMapper.from_config(names_cfg), resolve_dtype(dtype))

    def tied(
        self, module: nn.Module, *, include_buffers: bool, names_cfg: NamesConfig | None, prefix: str | None
    ) -> dict[str, tuple[str, ...]]:
        """Tied names of the version `weights` was last called for, under the names sent."""
        plan = self.roles(module, prefix, include_buffers)
        if plan is None or self.spec is None or not (self.spec.base or self.spec.mode == LoraMode.full.value):
            return {}
        mapper = NameMapper.from_config(names_cfg)
        out: dict[str, tuple[str, ...]] = {}
        key = (id(module), prefix)
        if key not in self._tied:
            self._tied[key] = tied_names(module, include_buffers=include_buffers, prefix=prefix)
        for source, aliases in self._tied[key].items():
            sent = mapper(base_name(source, plan.adapter))
            mapped = tuple(a for a in (mapper(base_name(a, plan.adapter)) for a in aliases) if a and a != sent)
            if sent and mapped:
                out[sent] = mapped
        return out


def _with_base(spec: LoraSpec, base: bool) -> LoraSpec:
    import msgspec

    return msgspec.structs.replace(spec, base=base)


def _mapped(
    raw_stream: Iterator[NamedTensor], plan: LoraRoles, spec: LoraSpec, mapper: NameMapper, cast: torch.dtype | None
) -> Iterator[NamedTensor]:
    """Map (and in merged/full, merge) the raw stream. A LoRA layer's tensors come in module order (base
    weight, then A, then B): the base weight is held until B arrives, then merged and sent as one tensor."""
    names = SentNames(mapper)
    merging = spec.mode != LoraMode.adapter.value
    held: dict[str, torch.Tensor] = {}  # raw name -> the layer's base weight or lora_A, until lora_B arrives
    for raw, tensor in raw_stream:
        role = plan.roles[raw]
        tensor = cast_floating(tensor, cast)
        if merging and role in (Role.TARGET, Role.LORA_A):
            held[raw] = tensor
            continue
        if merging and role is Role.LORA_B:
            layer = plan.layers[raw]
            weight, a = held.pop(layer.target, None), held.pop(layer.lora_a, None)
            if weight is None or a is None:
                raise ConfigError(
                    f"trainer.lora={spec.mode}: {layer.target!r} or {layer.lora_a!r} did not come before {raw!r}"
                )
            tensor = merge_weight(weight, a, tensor, layer.scaling, fan_in_fan_out=layer.fan_in_fan_out)
            raw, role = layer.target, Role.TARGET
        name = names(plan.out_name(raw, role))
        if name is not None:
            yield name, tensor
    if held:
        raise ConfigError(f"trainer.lora={spec.mode}: LoRA tensors without their layer's lora_B: {sorted(held)[:3]}")
