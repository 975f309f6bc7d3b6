"""The rollout engines (vLLM, SGLang): one registry line each, one folder each under `rollout_engines/`.

An engine is a server that generates and also receives our versions in its own workers. Its folder
`lightning_weightsync/rollout_engines/<name>/` holds its config section and two halves that run on
different machines:

- `config.py`: the `<name>` config section (a dataclass and its `Choice` enums); `config.py` imports it
  into `WeightSyncConfig`, so it imports only `choice.py`.
- `client.py`: the trainer side. `clients(section) -> list[RolloutClient]`, one per server in the section's
  `urls` (the typed `<name>` section, nothing else of the config), each driving the engine's own HTTP routes
  (pause, open an update, update while our sender broadcasts, close it with the version, resume). It imports
  nothing of the rollout layer nor the receiving half of this package (only errors, config, engine, transport
  and its own config section: tests/unit/test_layers.py and tests/unit/test_rollout_engines.py check it), so
  the trainer, which drives it through `control.py` and loads it by path, does not cross into the rollout
  side.
- `launch.py`: the rollout side. `launch(cfg) -> int` runs the engine's server configured to receive
  (`lightning-weightsync rollout rollout.engine=<name>`); the receiving code the server loads lives
  next to it, on the shared pieces beside the folders (`worker.py`, `launch.py`, `host_copy.py`,
  `adapter.py`).

Entries are module paths in a `Registry` (registry.py: the one plug-in seam, also for backends and sinks),
imported only when used (as vLLM's `WeightTransferEngineFactory`), so naming an engine costs nothing until
it is used, and the layer that lists the engines (config: `rollout.engine`'s choices) imports none of
their code but the config sections. Adding an engine: its folder (with its config section, documented in
`configs/default.yaml`), one `register_rollout_engine` line below, and the section's field in
`config/schema.py`'s `WeightSyncConfig` (docs/concepts.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ..errors import ConfigError
from ..registry import Registry


@runtime_checkable
class RolloutClient(Protocol):
    """One rollout server's weight-update surface, as the trainer drives it for each version:

        workers() (once) -> pause() -> start_update() -> update(version) [while our sender broadcasts]
        -> finish_update(version) -> after_update(version) -> verify(version) -> resume() (always)

    `name` identifies the server in errors (its URL); `timeout_knob` names the setting that bounds one
    request (`vllm.request_timeout_s`), so a timeout message says what to change.

    LoRA adapter versions (`trainer.lora=adapter`) need two more methods, optional (a client without them is
    refused such versions before anything is paused): `check_adapter()` (raises `ConfigError` naming the knob
    when the client cannot serve adapters as configured) and `load_adapter(version)`, called after
    `finish_update`: serve the adapter directory the server's worker wrote while receiving `version`.
    """

    name: str
    engine: str
    timeout_knob: str

    def workers(self) -> int | None:
        """How many receivers (workers) the server runs, or None when it cannot say; may raise
        `ConfigError` for a server this path cannot update (SGLang's dp_size > 1)."""
        ...

    def pause(self) -> None:
        """Stop generating (the engine's pause mode, from its config section)."""
        ...

    def start_update(self) -> None:
        """Open the engine's weight-update session."""
        ...

    def update(self, version: int, receive_timeout_s: float | None) -> None:
        """Have every worker receive `version` from our sender; runs in a thread while the trainer
        sends, and returns when the server loaded it (or raises naming why not)."""
        ...

    def finish_update(self, weight_version: str | None) -> None:
        """Close the session; `weight_version` is what the server then reports (None: failed version)."""
        ...

    def after_update(self, version: int) -> None:
        """Engine hygiene after a delivered version (vLLM: reset the prefix cache); logs, never raises."""
        ...

    def verify(self, version: int) -> None:
        """Check the server holds `version` (a hook: issue 22 adds content checks); raises `PeerError`."""
        ...

    def resume(self) -> None:
        """Generate again (called after every pause, also after failures)."""
        ...

    def weight_version(self) -> str | None:
        """The weight version the server reports now."""
        ...


@dataclass(frozen=True)
class RolloutEngine:
    """A registered engine: its name (`rollout.engine=<name>`, config section `<name>`) and package."""

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
"""Every engine by its `rollout.engine` name -> its package; an entry is a `RolloutEngine`, which imports
the package's `client` or `launch` module only when asked for clients or a launch."""


def register_rollout_engine(name: str, package: str) -> None:
    """Add an engine; a duplicate name is a bug (two folders claiming one `rollout.engine` value)."""
    if name == "none":
        raise ConfigError("rollout engine 'none' cannot be registered: rollout.engine=none means no engine")
    ROLLOUT_ENGINES.add(name, package)


def rollout_engine(name: str) -> RolloutEngine:
    """The engine `rollout.engine` names; `ConfigError` listing the registered ones otherwise."""
    return ROLLOUT_ENGINES[name]


register_rollout_engine("vllm", "lightning_weightsync.rollout_engines.vllm")
register_rollout_engine("sglang", "lightning_weightsync.rollout_engines.sglang")


__all__ = ["ROLLOUT_ENGINES", "RolloutClient", "RolloutEngine", "register_rollout_engine", "rollout_engine"]
