"""The one interface the rollout daemon drives for every local sink.

A version flows through a sink as:

    begin(version)
    for each tensor, in stream order:
        destination(meta) -> Tensor | None   # where merge_weight_chunks writes the bytes (into=)
        accept(name, tensor)                 # the tensor is complete
    commit(version)                          # every tensor arrived: make the version visible
    # or, if anything went wrong on the way:
    abort(version, reason)                   # drop what was staged; say what broke

The apply policy (`rollout.apply`) decides what a sink hands out as destinations:

- `atomic`: destinations are staging space (or none); nothing the user can observe changes before
  `commit`, so a version that breaks mid-way leaves the sink on its previous complete version.
- `streaming`: destinations are the live tensors themselves (lowest memory, no staging copy); a
  version that breaks mid-way leaves the sink `incomplete` and `abort` is how it learns that.

Sinks raise `SinkError` (naming the tensor and the knob) when they cannot take a tensor; the daemon
then aborts the version. Methods are synchronous: the daemon runs the ones marked blocking
(`blocking_io`) in a worker thread so its event loop (heartbeats, signals) keeps running.
"""

from __future__ import annotations

import enum
import importlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...config import SINK_SECTIONS, ApplyMode, UserConfig, settings, sink_section
from ...errors import ConfigError, SinkError
from ...protocol.chunks import TensorMeta
from ...protocol.messages import LoraSpec, alias_sent_twice
from .config import SinkSection

logger = logging.getLogger(__name__)


class SinkState(str, enum.Enum):
    """What the sink holds right now (exported on /healthz and in metrics)."""

    EMPTY = "empty"  # no complete version yet
    COMPLETE = "complete"  # `version` is whole and visible
    INCOMPLETE = "incomplete"  # streaming: a version broke mid-way; the live tensors are a mix


class VersionSink(ABC):
    """What the receive loop (`rollout/consume.py` `consume_version`) drives: the daemon's `Sink` is one; a
    rollout engine brings its own. Every optional capability is a member with its default, which a sink
    overrides where it has it."""

    takes_lora: ClassVar[bool] = False
    """True when `begin` honours the version's LoRA spec (`lora=`); an adapter version into a sink that does
    not is refused before anything is applied (`begin_version`), merged and full ones are plain weights."""
    holds_tensors: ClassVar[bool] = False
    """True for a sink that holds its tensors (the module sink): a delta (`transport.delta`) is then applied
    onto what `held` returns, of version `delta_version`; every other sink gets whole tensors."""

    @property
    def delta_version(self) -> int | None:
        """The version `held` holds whole, a delta's base (None: none now)."""
        return None

    def held(self, meta: TensorMeta) -> torch.Tensor | None:
        """The tensor of `meta.name` of version `delta_version` this sink holds (None: not that one)."""
        return None

    def installed(self) -> Mapping[str, torch.Tensor] | None:
        """The tensors of the version committed last, as the sink holds them (not copies), under the names the
        trainer sent: what a rollout serves to late joiners (`rollout.serve_port`). None where it keeps none (it
        wrote them to disk, handed them on) or keeps them otherwise than sent (a LoRA version)."""
        return None

    @abstractmethod
    def begin(
        self, version: int, tied: Mapping[str, Sequence[str]] | None = None, lora: LoraSpec | None = None
    ) -> None: ...

    @abstractmethod
    def destination(self, meta: TensorMeta) -> torch.Tensor | None: ...

    @abstractmethod
    def accept(self, name: str, tensor: torch.Tensor) -> None: ...

    @abstractmethod
    def commit(self, version: int) -> None: ...

    @abstractmethod
    def abort(self, version: int, reason: str) -> None: ...


@dataclass(frozen=True)
class SinkSettings:
    """All a sink is built from: its own section of `rollout.sink` and the three knobs outside it that sinks
    read. Made once, by `SinkSettings.of` at the sink's constructor (the edge: `ModuleSink(cfg)` with a
    `load_config()` result keeps working), so a sink reads no other part of the config."""

    section: SinkSection
    """The sink's section (`rollout/sinks/config.py`, its `SINKS` entry's `section=`)."""
    apply: ApplyMode = ApplyMode.atomic
    """`rollout.apply`."""
    device: str = "cpu"
    """`rollout.device`: where a module sink puts the module its factory built."""
    timeout_s: float = 600.0
    """`transport.timeout_s`: how long a callable sink's hand-off waits for the user's function."""

    @classmethod
    def of(cls, cfg: UserConfig | SinkSettings | SinkSection, kind: str) -> SinkSettings:
        """`cfg` as the settings of sink `kind`: a user's config (converted here), `SinkSettings`, or the
        sink's own section alone (the other knobs at their defaults)."""
        if isinstance(cfg, SinkSettings):
            return cfg
        if isinstance(cfg, SINK_SECTIONS[kind]):
            return cls(cfg)
        assert not isinstance(cfg, SinkSection), f"a {type(cfg).__name__} is not the {kind} sink's section"
        typed = settings(cfg)
        ro = typed.rollout
        return cls(sink_section(ro.sink, kind), ro.apply, ro.device, typed.transport.timeout_s)


class Sink(VersionSink):
    """Base class of the local sinks (module, safetensors, callable).

    Subclasses implement `_begin/_destination/_accept/_commit/_abort`; this class keeps the
    bookkeeping (which version is in flight, which one is complete, the state) in one place so that
    every sink reports the same way.
    """

    #: True when accept/commit do file or user-code work that must not run on the event loop.
    blocking_io: bool = False
    #: True when `begin` takes the version's LoRA spec (`lora=`); every local sink does (see `lora_mode`).
    takes_lora: ClassVar[bool] = True

    #: The sink's `rollout.sink.type` name: which section of `rollout.sink` it reads (`rollout/sinks/config.py`).
    kind: ClassVar[str]

    def __init__(self, cfg: UserConfig | SinkSettings | SinkSection) -> None:
        """`cfg`: a user's config (`load_config()`, None = the defaults; converted here, once), the sink's
        `SinkSettings`, or its own section alone; the sink reads `self.settings` and nothing else."""
        self.settings = SinkSettings.of(cfg, self.kind)
        self.apply: ApplyMode = self.settings.apply
        self.version: int | None = None  # last complete version
        self.state = SinkState.EMPTY
        self.tied: dict[str, tuple[str, ...]] = {}  # the version in flight's {sent name: aliases}
        self.lora: LoraSpec | None = None  # the version in flight's LoRA spec (trainer.lora), None: plain weights
        self.lora_mode: str | None = None  # the LoRA mode of the committed versions ("none" for plain ones)
        self._in_flight: int | None = None

    # --- the driven interface -------------------------------------------------------------------
    def begin(
        self, version: int, tied: Mapping[str, Sequence[str]] | None = None, lora: LoraSpec | None = None
    ) -> None:
        """Start `version`. `tied` says which tensors the trainer sends once for several names
        (``{sent_name: (alias, ...)}``, e.g. ``{"model.embed_tokens.weight": ("lm_head.weight",)}``
        with tied embeddings); every sink honours it (module: restores the tie; safetensors: writes
        the tensor once, as Hugging Face checkpoints do, and records the aliases; callable: yields
        every name). Sinks that hold a module also find the ties of that module on their own.
        `lora`: the version is of a PEFT LoRA model (`trainer.lora`); a version whose mode differs from the
        versions this sink committed (adapter after merged, or LoRA after plain weights) is refused here."""
        if self._in_flight is not None:
            raise SinkError(f"version {version} begun while version {self._in_flight} is still in flight")
        mode = lora.mode if lora is not None else "none"
        if self.lora_mode is not None and mode != self.lora_mode:
            raise SinkError(
                f"version {version} is trainer.lora={mode} but this rollout holds trainer.lora={self.lora_mode} "
                "versions; a rollout takes one mode: restart it (or set trainer.lora back)"
            )
        self.tied = _check_tied(tied)
        self.lora = lora
        self._in_flight = version
        self._begin(version)

    def destination(self, meta: TensorMeta) -> torch.Tensor | None:
        return self._destination(meta)

    def accept(self, name: str, tensor: torch.Tensor) -> None:
        self._accept(name, tensor)

    def commit(self, version: int) -> None:
        if self._in_flight != version:
            raise SinkError(f"commit of version {version}, but version {self._in_flight} is in flight")
        try:
            self._commit(version)
        except BaseException:
            self._in_flight = None
            self._after_failed_commit(version)
            raise
        self._in_flight = None
        self.version = version
        self.state = SinkState.COMPLETE
        self.lora_mode = self.lora.mode if self.lora is not None else "none"

    def abort(self, version: int, reason: str) -> None:
        """Drop the version in flight (no-op when nothing is in flight)."""
        if self._in_flight is None:
            return
        self._in_flight = None
        touched_live = self._abort(version, reason)
        if touched_live:
            self.state = SinkState.INCOMPLETE
            logger.warning(
                "version %d broke mid-way (%s); sink %s is marked incomplete until the next whole version",
                version,
                reason,
                type(self).__name__,
            )
        else:
            logger.warning(
                "version %d dropped (%s); sink %s stays on version %s",
                version,
                reason,
                type(self).__name__,
                self.version,
            )

    def close(self) -> None:
        """Release what the sink holds; idempotent."""

    @property
    def in_flight(self) -> int | None:
        return self._in_flight

    def snapshot(self) -> dict[str, torch.Tensor] | None:
        """What the sink serves now, as tensors, for a dump on exit; None where the sink does not hold
        its tensors (it wrote them to disk, or handed them on). An optional capability."""
        return None

    # --- for subclasses -------------------------------------------------------------------------
    def _begin(self, version: int) -> None:
        pass

    @abstractmethod
    def _destination(self, meta: TensorMeta) -> torch.Tensor | None: ...

    @abstractmethod
    def _accept(self, name: str, tensor: torch.Tensor) -> None: ...

    @abstractmethod
    def _commit(self, version: int) -> None: ...

    @abstractmethod
    def _abort(self, version: int, reason: str) -> bool:
        """Drop staged state; return True when live (user-visible) tensors were already changed."""

    def _after_failed_commit(self, version: int) -> None:
        """A commit raised: by default the same as an abort (subclasses may be stricter)."""
        if self._abort(version, "commit failed"):
            self.state = SinkState.INCOMPLETE


def _check_tied(tied: Mapping[str, Sequence[str]] | None) -> dict[str, tuple[str, ...]]:
    """`tied` as {sent name: aliases}, checked: names are non-empty strings and no alias is also
    sent or aliased twice (that would make the version's content ambiguous)."""
    out: dict[str, tuple[str, ...]] = {}
    for source, aliases in (tied or {}).items():
        names = (source, *aliases)
        if not all(isinstance(n, str) and n for n in names):
            raise SinkError(f"tied names {names!r} are not all non-empty strings")
        out[source] = tuple(aliases)
    twice = alias_sent_twice(out)
    if twice is not None:
        raise SinkError(f"tied name {twice!r} is sent or aliased twice")
    return out


def load_object(path: str | None, knob: str) -> Any:
    """Resolve `package.module:attribute` (dots allowed in the attribute) or raise one-line `ConfigError`."""
    if not path or not isinstance(path, str):
        raise ConfigError(f"{knob} is not set; give it as package.module:function")
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{knob}={path!r} is not of the form package.module:function")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{knob}={path!r}: cannot import module {module_name!r} ({exc}); the current directory is "
            "searched, like `python -m`; a module elsewhere needs its directory on PYTHONPATH "
            "(PYTHONPATH=/path/to/dir lightning-weightsync ...) or pip install -e of its package"
        ) from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{knob}={path!r}: module {module_name!r} has no attribute {attr!r}") from None
    return obj


def load_callable(path: str | None, knob: str) -> Callable[..., Any]:
    obj = load_object(path, knob)
    if not callable(obj):
        raise ConfigError(f"{knob}={path!r} names a {type(obj).__name__}, not a callable")
    checked: Callable[..., Any] = obj  # load_object's Any, checked callable above
    return checked


def describe(meta: TensorMeta) -> str:
    return f"{meta.dtype}{list(meta.shape)}"
