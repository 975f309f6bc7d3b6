"""Every plug-in table, one line an entry, low in the stack: data-plane backends, the join kinds a plan
carries, daemon sinks and rollout engines, each a name (the value of its knob) -> `package.module:Attr`.

An entry is a path (registry.py), imported only when it is used, so any layer may read these tables without
importing a plug-in: config lists the choices (`transport.backend`, `rollout.sink.type`, `rollout.engine`) and
collects each plug-in's config section from its entry (`section=`); the trainer reaches an engine's client and
the CLI its launcher through `ROLLOUT_ENGINES`. A section lives next to its plug-in's code, in a module that
imports only `errors` and `choice` (config imports it while config itself is being imported).

Also here, because the trainer drives it and the engines implement it: `RolloutClient`, one rollout server's
weight-update surface, every optional capability declared with its default.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import CannotAsk, ConfigError
from .registry import Registry

PKG = "lightning_weightsync"

BACKENDS: Registry[Any] = Registry("transport.backend", "data-plane backend")
"""Every backend by its `transport.backend` name -> its `Backend` subclass (`transport/backends/<name>.py`)."""
BACKENDS.add("gloo", f"{PKG}.transport.backends.gloo:GlooBackend")
BACKENDS.add("nccl", f"{PKG}.transport.backends.nccl:NcclBackend")
BACKENDS.add("hccl", f"{PKG}.transport.backends.hccl:HcclBackend")
BACKENDS.add("shm", f"{PKG}.transport.backends.shm:ShmBackend")
BACKENDS.add("cuda_ipc", f"{PKG}.transport.backends.cuda_ipc:CudaIpcBackend")
BACKENDS.add("nixl", f"{PKG}.transport.backends.nixl:NixlBackend")

JOIN_KINDS: Registry[Any] = Registry("plan join", "join kind")
"""Every join kind by its msgspec tag -> its `JoinSpec` struct (`protocol/joins/<kind>.py`): the union a plan
decodes into (`protocol/joins/__init__.py` checks and freezes it)."""
JOIN_KINDS.add("store", f"{PKG}.protocol.joins.store:StoreJoin")
JOIN_KINDS.add("nccl", f"{PKG}.protocol.joins.nccl:NcclJoin")
JOIN_KINDS.add("shared", f"{PKG}.protocol.joins.shared:SharedJoin")
JOIN_KINDS.add("nixl", f"{PKG}.protocol.joins.nixl:NixlJoin")

SINKS: Registry[Any] = Registry("rollout.sink.type", "sink")
"""The daemon sinks by their `rollout.sink.type` name -> their `Sink` subclass (`rollout/sinks/<name>.py`), and
each one's section of `rollout.sink` (`rollout/sinks/config.py`): the knobs that sink reads, and owns."""
SINKS.add("module", f"{PKG}.rollout.sinks.module:ModuleSink", section=f"{PKG}.rollout.sinks.config:ModuleSinkSection")
SINKS.add(
    "safetensors",
    f"{PKG}.rollout.sinks.safetensors:SafetensorsSink",
    section=f"{PKG}.rollout.sinks.config:SafetensorsSinkSection",
)
SINKS.add(
    "callable", f"{PKG}.rollout.sinks.callable:CallableSink", section=f"{PKG}.rollout.sinks.config:CallableSinkSection"
)


@dataclass(frozen=True)
class RolloutEngine:
    """A registered engine: its name (`rollout.engine=<name>`, config section `<name>`) and package, whose
    `client` module the trainer loads and whose `launch` module the CLI runs, each only when asked."""

    name: str
    package: str

    def _load(self, module: str, attr: str) -> Callable[..., Any]:
        return getattr(importlib.import_module(f"{self.package}.{module}"), attr)

    def section(self, config: Any) -> Any:
        """This engine's own section (`config.<name>`, its `config.py` dataclass) of a typed `WeightSyncConfig`."""
        return getattr(config, self.name)

    def clients(self, section: Any) -> list[RolloutClient]:
        """The trainer-side clients for the section's `urls` ([] when none); `section` is this engine's
        typed section (`section(config)`), the only part of the config its client module reads."""
        return list(self._load("client", "clients")(section))

    def launch(self, cfg: Any) -> int:
        """Run (exec) this engine's server, configured to receive every version."""
        return int(self._load("launch", "launch")(cfg))


ROLLOUT_ENGINES: Registry[RolloutEngine] = Registry("rollout.engine", "rollout engine", load=RolloutEngine)
"""Every engine by its `rollout.engine` name -> its package (`rollout_engines/<name>/`) and its config section
(the top-level `<name>` section, `<name>/config.py`)."""


def register_rollout_engine(name: str, package: str, section: str | None = None) -> None:
    """Add an engine (its section: `<package>.config:<Name>Config` by default); a duplicate name is a bug."""
    if name == "none":
        raise ConfigError("rollout engine 'none' cannot be registered: rollout.engine=none means no engine")
    ROLLOUT_ENGINES.add(name, package, section=section)


register_rollout_engine("vllm", f"{PKG}.rollout_engines.vllm", f"{PKG}.rollout_engines.vllm.config:VLLMConfig")
register_rollout_engine("sglang", f"{PKG}.rollout_engines.sglang", f"{PKG}.rollout_engines.sglang.config:SGLangConfig")


def rollout_engine(name: str) -> RolloutEngine:
    """The engine `rollout.engine` names; `ConfigError` listing the registered ones otherwise."""
    return ROLLOUT_ENGINES[name]


class RolloutClient:
    """One rollout server's weight-update surface, as the trainer drives it for each version:

        workers() (once) -> pause() -> start_update() -> update(version) [while our sender broadcasts]
        -> finish_update(version) -> [load_adapter(version)] -> after_update(version) -> verify(version)
        -> resume() (always)

    `name` identifies the server in errors (its URL); `engine` names its kind (`vLLM`); `timeout_knob` names
    the setting that bounds one request (`vllm.request_timeout_s`), so a timeout message says what to change.

    Every client subclasses this. The required steps raise `NotImplementedError` here; the optional
    capabilities have their defaults, which a client overrides where it has them:
    - LoRA adapter versions (`trainer.lora=adapter`): `check_adapter()` (default: raises `ConfigError`, this
      client cannot load adapters) and `load_adapter(version)` (serve the adapter directory the server's worker
      wrote while receiving `version`; called after `finish_update`);
    - `weight_reports()`: what each worker holds, for the trainer's fingerprint check (default: raises
      `CannotAsk`).
    """

    name: str
    engine: str
    timeout_knob: str

    def workers(self) -> int | None:
        """How many receivers (workers) the server runs, or None when it cannot say; may raise
        `ConfigError` for a server this path cannot update (SGLang's dp_size > 1)."""
        raise NotImplementedError

    def pause(self) -> None:
        """Stop generating (the engine's pause mode, from its config section)."""
        raise NotImplementedError

    def start_update(self) -> None:
        """Open the engine's weight-update window."""
        raise NotImplementedError

    def update(self, version: int, receive_timeout_s: float | None) -> None:
        """Have every worker receive `version` from our sender; runs in a thread while the trainer
        sends, and returns when the server loaded it (or raises naming why not)."""
        raise NotImplementedError

    def finish_update(self, weight_version: str | None) -> None:
        """Close the session; `weight_version` is what the server then reports (None: failed version)."""
        raise NotImplementedError

    def after_update(self, version: int) -> None:
        """Engine hygiene after a delivered version (vLLM: reset the prefix cache); logs, never raises."""

    def verify(self, version: int) -> None:
        """Check the server holds `version` (its own report; content: `weight_reports`); raises `PeerError`."""
        raise NotImplementedError

    def resume(self) -> None:
        """Generate again (called after every pause, also after failures)."""
        raise NotImplementedError

    def weight_version(self) -> str | None:
        """The weight version the server reports now."""
        raise NotImplementedError

    def check_adapter(self) -> None:
        """Raise `ConfigError` naming the knob when this client cannot serve adapter versions as configured;
        checked before anything is paused for one."""
        raise ConfigError(
            f"{self.engine} rollout {self.name} cannot load LoRA adapters ({type(self).__name__}); "
            "set trainer.lora=merged"
        )

    def load_adapter(self, version: int) -> None:
        """Serve adapter `version` (the directory the server's worker wrote while receiving it)."""
        self.check_adapter()
        raise ConfigError(f"{self.engine} rollout {self.name}: load_adapter is not implemented")

    def weight_reports(self) -> list[dict[str, Any]]:
        """Per worker: which version its model holds and how its tensors matched the trainer's fingerprints
        (`rollout_engines.vllm.client.worker_weight_report`). Raises `CannotAsk` when this rollout cannot say."""
        raise CannotAsk(f"rollout {self.name}: cannot ask which weights it holds (no weight_reports)")


__all__ = [
    "BACKENDS",
    "JOIN_KINDS",
    "ROLLOUT_ENGINES",
    "SINKS",
    "RolloutClient",
    "RolloutEngine",
    "register_rollout_engine",
    "rollout_engine",
]
