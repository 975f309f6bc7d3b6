"""`gloo`: a standalone gloo process group over our TCPStore; CPU buckets, any hosts. The reference
backend that every CI run exercises."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .base import register_backend
from .torch_pg import TorchProcessGroupBackend


@register_backend("gloo", natural_device="cpu")
class GlooBackend(TorchProcessGroupBackend):
    """CPU buckets broadcast with gloo; also the reference implementation tested on every CI run."""

    direct_ok = True  # CPU tensors: any contiguous chunk can be sent / received in place

    def _new_group(self, store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> Any:
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
