"""Data-plane backends, one a file, each named by one line of `BACKENDS` (`plugins.py`: its `transport.backend`
value -> where its class lives). A backend's module is imported only when that backend is built, so
config validation lists every name without importing cupy (nccl), torch_npu (hccl) or nixl, and the rest
of the package never imports a backend's module (tests/unit/test_layers.py): it asks this package.

Adding a backend: its file here (a `Backend` subclass with `name`, `natural_device`, `join_type`), one
line in `plugins.py`, and, when it needs a rendezvous of its own, its join kind (`protocol/joins/`, one file and
one line in `plugins.py` too). docs/concepts.md, "Adding a backend".
"""

from __future__ import annotations

from typing import Any

from ...plugins import BACKENDS
from .base import NO_SLOT, NUM_SLOTS, Backend, next_slot


def backend_class(name: str) -> type[Backend]:
    """The class `transport.backend=name` builds (imports its module); `ConfigError` listing the names
    otherwise."""
    cls: type[Backend] = BACKENDS[name]
    return cls


def build_backend(name: str, **kwargs: Any) -> Backend:
    return backend_class(name)(**kwargs)


def groups_draining() -> int:
    """Groups, of any backend built in this process, given up after a failure whose transfer is still stuck
    in a thread of its own (at most `transport.timeout_s`). A process that exits meanwhile must not run C++
    exit handlers beside them (libstdc++ aborts: "terminate called without an active exception"): the
    rollout CLI ends with `os._exit` then, once everything of its own is closed. Asks only the backends
    whose modules are loaded (a backend never built has no group)."""
    loaded: list[type[Backend]] = list(BACKENDS.loaded().values())
    counts = {cls.draining.__func__: cls.draining() for cls in loaded}  # type: ignore[attr-defined]
    return sum(counts.values())


__all__ = [
    "BACKENDS",
    "NO_SLOT",
    "NUM_SLOTS",
    "Backend",
    "backend_class",
    "build_backend",
    "groups_draining",
    "next_slot",
]
