"""NCCL through cupy's communicator: CUDA buckets, unique id carried by the control plane.

cupy (extra `[nccl]`) is imported lazily. The communicator is independent of torch.distributed,
so the trainer's own NCCL groups are untouched. Stream discipline: the broadcast runs on a
dedicated stream that first waits for the event recorded after the bucket was packed, and the
call returns only after that stream finished, so a slot is never overwritten while NCCL reads it.
Not run in CI (no GPU); shares the group bookkeeping with every other backend via `Backend`.
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import BackendUnavailable
from ...protocol.messages import Plan
from .base import Backend, register_backend


def _import_cupy_nccl() -> tuple[Any, Any]:
    try:
        import cupy  # type: ignore[import-not-found]
        from cupy.cuda import nccl  # type: ignore[import-not-found]
    except ImportError as exc:
        raise BackendUnavailable(
            "transport.backend=nccl needs cupy: pip install 'lightning_weightsync[nccl]' (cupy-cuda13x, for torch "
            "2.11+ / CUDA 13; on CUDA 12 use cupy-cuda12x) on a CUDA host"
        ) from exc
    if not getattr(nccl, "available", True):  # a cupy wheel built without NCCL imports fine, then fails late
        raise BackendUnavailable(
            "transport.backend=nccl: this cupy has no NCCL (cupy.cuda.nccl.available is False); install the cupy "
            "wheel matching your CUDA (pip install cupy-cuda13x, or cupy-cuda12x on CUDA 12) or use "
            "transport.backend=gloo (CPU buckets)"
        )
    return cupy, nccl


@register_backend("nccl", natural_device="cuda")
class NcclBackend(Backend):

    def __init__(self, **kwargs: Any) -> None:
        self._cupy, self._nccl = _import_cupy_nccl()
        super().__init__(**kwargs)
        self._comm: Any = None
        self._stream = torch.cuda.Stream(device=self.device)
        self._unique_id: tuple[int, ...] | None = None
        self._unique_id_generation = -1

    def plan_info(self, generation: int) -> dict[str, str]:
        # One unique id per group generation: a rebuilt group must not reuse the old id.
        if self._unique_id is None or self._unique_id_generation != generation:
            self._unique_id = tuple(self._nccl.get_unique_id())
            self._unique_id_generation = generation
        return {"nccl_unique_id": ",".join(str(b) for b in self._unique_id)}

    def _build_group(self, plan: Plan) -> None:
        raw = plan.info.get("nccl_unique_id", "")
        unique_id = tuple(int(b) for b in raw.split(",")) if raw else None
        if unique_id is None:
            raise BackendUnavailable("plan carries no nccl_unique_id (sender and receiver backends differ?)")
        with torch.cuda.device(self.device):
            self._comm = self._nccl.NcclCommunicator(plan.world_size, unique_id, plan.rank)

    def _drop_group(self) -> None:
        if self._comm is not None:
            self._comm = None

    def broadcast(self, slot: int, nbytes: int, bucket_index: int, buffer: torch.Tensor | None = None) -> None:
        if nbytes == 0:
            return
        bucket = self.buckets[slot]
        event = self._fences[slot]
        if event is not None:  # the compute stream's packing (or copying out) finishes first
            self._stream.wait_event(event)  # type: ignore[arg-type]
            self._fences[slot] = None
        self._comm.bcast(bucket.data_ptr(), nbytes, self._nccl.NCCL_UINT8, 0, self._stream.cuda_stream)
        self._stream.synchronize()
