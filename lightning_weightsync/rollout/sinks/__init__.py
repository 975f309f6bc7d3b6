"""Where a rollout daemon puts each received version, chosen by `rollout.sink.type`.

- `module`: a live torch module built by `rollout.sink.factory` (loaded in place);
- `safetensors`: `<rollout.sink.dir>/step_<version>.safetensors`, the last `keep_last` kept;
- `callable`: `rollout.sink.target(version, iterator of (name, tensor))`.

Each sink registers itself under its `SinkType` with `@register_sink` (base.py); `build_sink(cfg)`
reads that registry, and a unit test keeps it equal to the `SinkType` choices. (A rollout engine such
as vLLM or SGLang is not a sink: `rollout.engine`, `rollout_engines.py`.)
"""

from __future__ import annotations

from omegaconf import DictConfig

from ...config import SinkType
from ...errors import ConfigError
from . import callable, module, safetensors  # noqa: F401 - registration
from .base import SINKS, Sink, SinkState, load_callable, load_object, register_sink


def build_sink(cfg: DictConfig) -> Sink:
    """The sink named by `rollout.sink.type`, built from the rest of `rollout.sink`."""
    kind = SinkType(cfg.rollout.sink.type)
    cls = SINKS.get(kind)
    if cls is None:
        raise ConfigError(f"rollout.sink.type={kind} has no sink; choose one of: {', '.join(map(str, SINKS))}")
    return cls(cfg)


__all__ = ["SINKS", "Sink", "SinkState", "build_sink", "load_callable", "load_object", "register_sink"]
