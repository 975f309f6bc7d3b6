"""`rollout.sink.type=module`: load every version into a live `torch.nn.Module`.

The module comes from a factory (`rollout.sink.factory: package.module:function`, called with
`rollout.sink.options` as keyword arguments) and is moved to `rollout.device`, or is passed in by
code that embeds the daemon (then it stays where it is).

- `streaming`: the merge writes each tensor's bytes straight into the module's own parameter and
  buffer storage (`into=` destinations): no staging copy at all. Readers may see a mix of versions
  while one is arriving; if it breaks mid-way the sink is `incomplete` until the next whole version.
- `atomic`: the merge writes into shadow tensors (one per distinct parameter storage, allocated once
  and reused every version); `commit` copies them into the live tensors under `self.lock`. Readers
  that take `self.lock` never see a half-applied version. The price is one extra copy of the model.
  Copy rather than pointer-swap on purpose: live storages keep their addresses, so anything that
  captured them (CUDA graphs, compiled modules, an inference engine) stays valid.

Tied weights (`lm_head.weight` is `model.embed_tokens.weight`): the trainer sends the tensor once.
Names of the module that share one storage count as one tensor here, so the alias is neither
"missing" nor written twice; when the version says an alias is tied (`begin(version, tied=...)`)
and this module keeps it as a tensor of its own (built untied), the sent value is copied into it,
so the tie holds after every version either way.

LoRA adapter versions (`trainer.lora=adapter`): `rollout.sink.lora` decides, `lora.py` beside this file
says how (`keep`: into the factory's PEFT model; `merge`: merged into the factory's plain model at commit).
"""

from __future__ import annotations

import difflib
import logging
import threading

import torch

from ...config import ApplyMode, UserConfig
from ...errors import ConfigError, SinkError, explain
from ...protocol.chunks import TensorMeta
from .base import Sink, SinkSettings, SinkState, describe, load_callable
from .config import ModuleSinkSection, SinkSection
from .lora import LoraLoader

logger = logging.getLogger(__name__)


class ModuleSink(Sink):
    """Loads versions into `self.module` in place; see the module docstring for the two policies."""

    kind = "module"
    holds_tensors = True  # `held`, `delta_version`: a delta is applied onto the module

    def __init__(
        self, cfg: UserConfig | SinkSettings | SinkSection = None, module: torch.nn.Module | None = None
    ) -> None:
        super().__init__(cfg)
        own = self.settings.section
        assert isinstance(own, ModuleSinkSection)
        if module is None:
            factory_path = own.factory
            if not factory_path:  # the default sink of a bare `lightning-weightsync rollout`
                raise ConfigError(
                    "rollout.sink.type=module (the default) needs rollout.sink.factory=package.module:function, "
                    "the function that builds the torch module each version is loaded into; or write files with "
                    "rollout.sink.type=safetensors rollout.sink.dir=DIR (every sink type: "
                    "`lightning-weightsync rollout --help`)"
                )
            factory = load_callable(factory_path, "rollout.sink.factory")
            try:
                module = factory(**own.options)
            except Exception as exc:
                raise ConfigError(f"rollout.sink.factory={factory_path!r} failed: {explain(exc)}") from exc
            if not isinstance(module, torch.nn.Module):
                raise ConfigError(
                    f"rollout.sink.factory={factory_path!r} returned a {type(module).__name__}, not a torch.nn.Module"
                )
            module = module.to(torch.device(self.settings.device))  # a module passed in stays where it is
        self.module: torch.nn.Module = module
        self.lock = threading.Lock()
        # state_dict(keep_vars=True): parameters + persistent buffers under the names a trainer
        # sends; tied weights appear under every name and share one storage.
        self._live: dict[str, torch.Tensor] = {
            name: t.data if isinstance(t, torch.nn.Parameter) else t
            for name, t in self.module.state_dict(keep_vars=True).items()
        }
        # names sharing one storage (tied weights) -> the first name of that storage
        self._storage_of: dict[str, str] = _storage_groups(self._live)
        self._shadows: dict[int, torch.Tensor] = {}  # id(live tensor) -> staging tensor (atomic)
        self._received: dict[str, torch.Tensor] = {}
        self._installed: dict[str, torch.Tensor] | None = None  # the committed version's live tensors, by sent name
        self._touched_live = False
        self._lora = LoraLoader(own.lora, self.module, self._live)

    # --- helpers --------------------------------------------------------------------------------
    def _name(self, name: str) -> str:
        """The live name of a received one (a LoRA adapter's names map onto the PEFT model's)."""
        live = self._lora.live_name(name)
        return name if live is None else live

    def _target(self, meta: TensorMeta) -> torch.Tensor:
        live = self._live.get(self._name(meta.name))
        if live is None:
            raise SinkError(_unknown_name_message(meta, self._live))
        if tuple(live.shape) != meta.shape or live.dtype != meta.dtype:
            raise SinkError(
                f"tensor {meta.name!r} arrives as {meta.dtype}{list(meta.shape)} but the rollout module holds "
                f"{live.dtype}{list(live.shape)}; cast on the trainer with trainer.dtype or fix rollout.sink.factory"
            )
        return live

    def snapshot(self) -> dict[str, torch.Tensor] | None:
        return self.state_dict()

    @property
    def delta_version(self) -> int | None:
        """The version a delta (`transport.delta`) may be applied to: the one held whole, between versions."""
        return self.version if self.state is SinkState.COMPLETE and self.in_flight is None else None

    def held(self, meta: TensorMeta) -> torch.Tensor | None:
        """The live tensor of `meta.name` a delta is applied onto (read only, unless it is the destination:
        `streaming`); None where it does not match (the version then fails and the next one is whole)."""
        if self._lora.live_name(meta.name) is None:
            return None
        live = self._live.get(self._name(meta.name))
        if live is None or tuple(live.shape) != meta.shape or live.dtype != meta.dtype:
            return None
        return live

    def installed(self) -> dict[str, torch.Tensor] | None:
        """The live tensors the last committed version wrote, by the names it sent (None: a LoRA version, whose
        names and bytes are not the module's, or none committed yet)."""
        return self._installed

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Clones of what the module holds now, taken under `self.lock`.

        One whole version with `rollout.apply=atomic` (commits copy under the same lock). With
        `streaming` the merge writes into the live tensors without the lock, so a snapshot taken
        while a version arrives (`self.in_flight` is set) may mix two versions, and after one broke
        mid-way (`self.state` is `incomplete`) it does mix them.
        """
        with self.lock:
            return {name: t.detach().clone() for name, t in self._live.items()}

    # --- Sink -----------------------------------------------------------------------------------
    def _begin(self, version: int) -> None:
        self._received = {}
        self._installed = None  # written from now on (streaming), or at commit
        self._touched_live = False
        self._lora.begin(self.lora)

    def _destination(self, meta: TensorMeta) -> torch.Tensor | None:
        if self._lora.live_name(meta.name) is None:  # a LoRA factor, merged at commit
            self._lora.check_factor(meta.name, meta.shape)
            return None
        live = self._target(meta)
        if self.apply is ApplyMode.streaming:
            if not live.is_contiguous():
                return None  # merge allocates; accept() copies in
            self._touched_live = True
            return live
        shadow = self._shadows.get(id(live))
        if shadow is None:
            shadow = torch.empty(live.shape, dtype=live.dtype, device=live.device)
            self._shadows[id(live)] = shadow
        return shadow

    def _accept(self, name: str, tensor: torch.Tensor) -> None:
        if self._lora.live_name(name) is None:
            self._lora.check_factor(name, tuple(tensor.shape))
            self._lora.hold(name, tensor)
            return
        name = self._name(name)
        live = self._live.get(name)
        if live is None:  # a destination was not asked for (should not happen); same message
            self._target(TensorMeta(name, tuple(tensor.shape), tensor.dtype, 0, 0))
            return
        if self.apply is ApplyMode.streaming:
            if tensor is not live and tensor.data_ptr() != live.data_ptr():
                self._target(TensorMeta(name, tuple(tensor.shape), tensor.dtype, 0, 0))
                self._touched_live = True
                with torch.no_grad():
                    live.copy_(tensor)
        elif tensor.data_ptr() != self._shadows[id(live)].data_ptr():
            raise SinkError(f"tensor {name!r} was not merged into its staging buffer (atomic apply)")
        self._received[name] = live

    def _commit(self, version: int) -> None:
        merges = self._lora.merges()  # raises before anything is applied when a factor lacks its pair
        carried = {self._storage_of[n] for n in self._received}
        carried.update(self._storage_of[w] for w, _, _ in merges)
        for aliases in (self.tied.get(n, ()) for n in self._received):
            carried.update(self._storage_of[self._name(a)] for a in aliases if self._name(a) in self._live)
        missing = [n for n in self._live if self._storage_of[n] not in carried]
        if self.lora is not None and not self.lora.base:
            missing = []  # a LoRA version without the base carries only what changes, by design
        if missing:
            logger.warning(
                "version %d did not carry %d of the module's %d tensors (e.g. %s); they keep their old values",
                version,
                len(missing),
                len(self._live),
                ", ".join(repr(n) for n in missing[:3]),
            )
        if self.apply is ApplyMode.atomic:
            with self.lock, torch.no_grad():
                done: set[int] = set()
                for live in self._received.values():
                    if id(live) not in done:
                        live.copy_(self._shadows[id(live)])
                        done.add(id(live))
                self._restore_ties()
                self._merge(merges)
        else:
            with torch.no_grad():
                self._restore_ties()
                self._merge(merges)
        self._installed = dict(self._received) if self.lora is None else None
        self._received = {}

    def _merge(self, merges: list[tuple[str, str, str]]) -> None:
        """rollout.sink.lora=merge: each targeted weight becomes base + scale * B @ A (after the base, if this
        version carried it, was copied in)."""
        for weight, a, b in merges:
            self._live[weight].copy_(self._lora.merge(weight, a, b, base_received=weight in self._received))

    def _restore_ties(self) -> None:
        """Aliases the version declares tied but this module keeps apart get the sent value."""
        for source, aliases in self.tied.items():
            src = self._received.get(self._name(source))
            if src is None:
                continue
            for alias in (self._name(a) for a in aliases):
                live = self._live.get(alias)
                if live is None or self._storage_of[alias] == self._storage_of[self._name(source)]:
                    continue  # not in this module, or tied here already (one storage)
                if live.shape != src.shape or live.dtype != src.dtype:
                    raise SinkError(
                        f"{alias!r} is tied to {source!r} on the trainer but the rollout module holds it as "
                        f"{live.dtype}{list(live.shape)}, not {src.dtype}{list(src.shape)}; fix rollout.sink.factory"
                    )
                live.copy_(src)

    def _abort(self, version: int, reason: str) -> bool:
        self._received = {}
        self._lora.factors = {}
        touched, self._touched_live = self._touched_live, False
        return touched

    def close(self) -> None:
        self._shadows.clear()


def _storage_groups(live: dict[str, torch.Tensor]) -> dict[str, str]:
    """Each name -> the first name whose tensor is the same view of the same storage (tied weights)."""
    first: dict[tuple[object, ...], str] = {}
    out: dict[str, str] = {}
    for name, t in live.items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        out[name] = first.setdefault(key, name) if t.numel() else name
    return out


def _unknown_name_message(meta: TensorMeta, live: dict[str, torch.Tensor]) -> str:
    """Say which name arrived, what the module has instead, and the knob that maps one to the other."""
    head, _, rest = meta.name.partition(".")
    what = f"tensor {meta.name!r} {describe(meta)} is not in the rollout module"
    if rest and rest in live:  # the classic: a LightningModule's `self.model` prefix on every name
        return (
            f"{what}, which has {rest!r}: the trainer sends its LightningModule attribute {head!r} as a name "
            f"prefix; pass module_attr={head!r} to WeightSyncCallback / AccelerateWeightSync, or set "
            f"trainer.names.strip_prefixes=[{head}.]"
        )
    close = difflib.get_close_matches(meta.name, live, n=1)
    hint = f" (closest: {close[0]!r})" if close else ""
    return (
        f"{what}{hint}; choose what the trainer sends with module_attr (WeightSyncCallback / AccelerateWeightSync) "
        "and map names with trainer.names.strip_prefixes / rename / rename_regex / exclude, or fix rollout.sink.factory"
    )
