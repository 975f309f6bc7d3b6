"""Where a rollout daemon puts each received version, chosen by `rollout.sink.type`.

- `module`: a live torch module built by `rollout.sink.factory` (loaded in place);
- `safetensors`: `<rollout.sink.dir>/step_<version>.safetensors`, the last `keep_last` kept;
- `callable`: `rollout.sink.target(version, iterator of (name, tensor))`.

Each sink is one file here (a `Sink` subclass) and one line of the sink table `SINKS` (`config/schema.py`: config
lists the choices and sits below this layer); `build_sink(config)` imports only the sink it builds. (A rollout
engine such as vLLM or SGLang is not a sink: `rollout.engine`, `rollout_engines/__init__.py`.)
"""

from __future__ import annotations

import logging

from ...config import SINKS, SinkSettings, WeightSyncConfig, sink_section, unread_sink_knobs
from .base import Sink, SinkState, load_callable, load_object

logger = logging.getLogger(__name__)


def build_sink(config: WeightSyncConfig) -> Sink:
    """The sink named by `rollout.sink.type`, built from its own section of `rollout.sink` (`SinkSettings`:
    typed, converted at the daemon's edge).

    A knob of another sink that is set is said once here, at start-up, as a warning rather than an error:
    one recipe YAML serves several sinks (`--config recipe.yaml rollout.sink.type=safetensors` keeps the
    recipe's `rollout.sink.factory`), so an unread knob is usually that, not a mistake."""
    ro = config.rollout
    kind = ro.sink.type.value
    unread = unread_sink_knobs(ro.sink)
    if unread:
        logger.warning("rollout.sink.type=%s does not read %s (set for another sink); ignored", kind, ", ".join(unread))
    cls: type[Sink] = SINKS[kind]
    return cls(SinkSettings(sink_section(ro.sink, kind), ro.apply, ro.device, config.transport.timeout_s))


__all__ = ["SINKS", "Sink", "SinkState", "build_sink", "load_callable", "load_object"]
