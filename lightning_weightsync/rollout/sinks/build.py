"""`build_sink`: the sink `rollout.sink.type` names, built from its own section of `rollout.sink`."""

from __future__ import annotations

import logging

from ...config import WeightSyncConfig, sink_section, unread_sink_knobs
from ...plugins import SINKS
from .base import Sink, SinkSettings

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


__all__ = ["build_sink"]
