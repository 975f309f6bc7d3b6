"""Where a rollout daemon puts each received version, chosen by `rollout.sink.type`.

- `module`: a live torch module built by `rollout.sink.factory` (loaded in place);
- `safetensors`: `<rollout.sink.dir>/step_<version>.safetensors`, the last `keep_last` kept;
- `vllm`: a vLLM engine whose GPU workers receive and `load_weights` themselves;
- `callable`: `rollout.sink.target(version, iterator of (name, tensor))`.

`build_sink(cfg)` is the registry; sink modules are imported only when chosen, so the optional
`vllm` extra is never imported unless asked for.
"""

from __future__ import annotations

import importlib

from omegaconf import DictConfig

from ...errors import ConfigError
from .base import RemoteSink, Sink, SinkState, VersionReport, load_callable, load_object

SINKS: dict[str, str] = {
    "module": "lightning_weightsync.rollout.sinks.module:ModuleSink",
    "safetensors": "lightning_weightsync.rollout.sinks.safetensors:SafetensorsSink",
    "vllm": "lightning_weightsync.rollout.vllm.sink:VLLMSink",
    "callable": "lightning_weightsync.rollout.sinks.callable:CallableSink",
}


def build_sink(cfg: DictConfig) -> Sink | RemoteSink:
    """The sink named by `rollout.sink.type`, built from the rest of `rollout.sink`."""
    kind = str(cfg.rollout.sink.type)
    path = SINKS.get(kind)
    if path is None:
        raise ConfigError(f"rollout.sink.type={kind!r} is not allowed; choose one of: {', '.join(SINKS)}")
    module_name, _, cls_name = path.partition(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(cfg)


__all__ = ["SINKS", "RemoteSink", "Sink", "SinkState", "VersionReport", "build_sink", "load_callable", "load_object"]
