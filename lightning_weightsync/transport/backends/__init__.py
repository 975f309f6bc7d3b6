"""Data-plane backends, one a file, each registered under its `transport.backend` name by
`@register_backend` (see `base.py`). Importing this package registers them all; the optional
dependencies (cupy for nccl, torch_npu for hccl, a GPU for cuda_ipc) are imported only when a backend
is built, so the registry always lists every name and config validation can read it.
"""

from __future__ import annotations

from . import cuda_ipc, gloo, hccl, nccl, nixl, shm  # noqa: F401 - registration
from .base import BACKENDS, NO_SLOT, NUM_SLOTS, Backend, backend_class, build_backend, next_slot, register_backend

__all__ = [
    "BACKENDS",
    "NO_SLOT",
    "NUM_SLOTS",
    "Backend",
    "backend_class",
    "build_backend",
    "next_slot",
    "register_backend",
]
