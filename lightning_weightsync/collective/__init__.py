"""Data-plane backends, one a file; `build_backend` maps `transport.backend` to its class.

Optional ones (nccl: cupy, hccl: torch_npu, cuda_ipc: a GPU) are imported only when chosen.
"""

from __future__ import annotations

import importlib
from typing import Any

from .base import Backend

_BACKENDS = {
    "gloo": ("torch_pg", "GlooBackend"),
    "hccl": ("hccl", "HcclBackend"),
    "nccl": ("nccl", "NcclBackend"),
    "shm": ("shared", "ShmBackend"),
    "cuda_ipc": ("shared", "CudaIpcBackend"),
}


def backend_class(name: str) -> type[Backend]:
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(f".{module}", __name__), cls)  # type: ignore[no-any-return]


def build_backend(name: str, **kwargs: Any) -> Backend:
    return backend_class(name)(**kwargs)


__all__ = ["Backend", "backend_class", "build_backend"]
