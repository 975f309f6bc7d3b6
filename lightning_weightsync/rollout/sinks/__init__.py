"""Where a rollout daemon puts each received version, chosen by `rollout.sink.type`.

- `module`: a live torch module built by `rollout.sink.factory` (loaded in place);
- `safetensors`: `<rollout.sink.dir>/step_<version>.safetensors`, the last `keep_last` kept;
- `callable`: `rollout.sink.target(version, iterator of (name, tensor))`.

Each sink is one file here (a `Sink` subclass) and one line of the sink table `SINKS` (`config.py`: config
lists the choices and sits below this layer); `build_sink(cfg)` imports only the sink it builds. (A rollout
engine such as vLLM or SGLang is not a sink: `rollout.engine`, `rollout_engines/__init__.py`.)
"""

from __future__ import annotations

from omegaconf import DictConfig

from ...config import SINKS
from .base import Sink, SinkState, load_callable, load_object


def build_sink(cfg: DictConfig) -> Sink:
    """The sink named by `rollout.sink.type`, built from the rest of `rollout.sink`."""
    cls: type[Sink] = SINKS[cfg.rollout.sink.type]
    return cls(cfg)


__all__ = ["SINKS", "Sink", "SinkState", "build_sink", "load_callable", "load_object"]
