"""Where a rollout daemon puts each received version, chosen by `rollout.sink.type`.

- `module`: a live torch module built by `rollout.sink.factory` (loaded in place);
- `safetensors`: `<rollout.sink.dir>/step_<version>.safetensors`, the last `keep_last` kept;
- `callable`: `rollout.sink.target(version, iterator of (name, tensor))`.

Each sink is one file here (a `Sink` subclass), its section of `rollout.sink` in `config.py` here (the knobs
it reads), and one line of the sink table `SINKS` (`plugins.py`) naming both; `build_sink(config)` (`build.py`)
imports only the sink it builds. (A rollout engine such as vLLM or SGLang is not a sink: `rollout.engine`.)

Config imports `config.py` here while it is itself being imported, so this package's `__init__` imports
nothing at import time: its names load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "SINKS": "...plugins",
    "Sink": ".base",
    "SinkSettings": ".base",
    "SinkState": ".base",
    "load_callable": ".base",
    "load_object": ".base",
    "build_sink": ".build",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)


__all__ = ["SINKS", "Sink", "SinkSettings", "SinkState", "build_sink", "load_callable", "load_object"]
