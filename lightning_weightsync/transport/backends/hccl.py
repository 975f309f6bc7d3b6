"""HCCL on Ascend NPUs: torch_npu's ProcessGroupHCCL, standalone over our TCPStore.

Not run in this project's CI (no NPU): it shares the store, prefix and broadcast logic with gloo
(`TorchProcessGroupBackend`) and differs only in the group class and the NPU synchronize
discipline: copies into an NPU bucket are asynchronous, so the sender synchronizes the device
before a broadcast reads the bucket, and every rank synchronizes after the last broadcast before
buffers are freed.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from torch.distributed.distributed_c10d import Store

from ..device import import_torch_npu, synchronize
from .base import Backend
from .torch_pg import TorchProcessGroupBackend


class HcclBackend(TorchProcessGroupBackend):
    name = "hccl"
    natural_device = "npu"
    # any contiguous NPU tensor on `device` can be sent / received in place: `wait_fence` covers the
    # work that produced it, and the device is synchronized after each broadcast
    direct_ok = True

    def __init__(self, **kwargs: Any) -> None:
        self._torch_npu = import_torch_npu()
        super().__init__(**kwargs)

    def _new_group(self, store: Store, rank: int, world_size: int, timeout: timedelta) -> Any:
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL

        options = ProcessGroupHCCL.Options()
        options._timeout = timeout
        return ProcessGroupHCCL(store, rank, world_size, options)

    def fence(self, slot: int) -> None:
        synchronize(self.device)

    def broadcast(self, slot: int, nbytes: int, bucket_index: int, buffer: torch.Tensor | None = None) -> None:
        super().broadcast(slot, nbytes, bucket_index, buffer)
        synchronize(self.device)

    # one transfer at a time, each waited for with the device synchronized (the blocking `broadcast`)
    start_broadcast = Backend.start_broadcast

    def close(self) -> None:
        synchronize(self.device)
        super().close()
