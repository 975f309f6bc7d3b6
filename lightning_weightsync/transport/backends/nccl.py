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

from ...errors import BackendUnavailable, PeerError
from ...protocol.joins.nccl import NcclJoin
from ...protocol.messages import GroupSpec
from .base import NO_SLOT, Backend


def _import_cupy_nccl() -> tuple[Any, Any]:
    try:
        import cupy
        from cupy.cuda import nccl
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


class NcclBackend(Backend):
    name = "nccl"
    natural_device = "cuda"
    join_type = NcclJoin
    direct_ok = True  # any contiguous CUDA tensor on `device` can be sent / received in place
    own_receiver_slots = True  # a receiver broadcasts into its own two device tensors

    def __init__(self, **kwargs: Any) -> None:
        self._cupy, self._nccl = _import_cupy_nccl()
        super().__init__(**kwargs)
        self._comm: Any = None
        self._stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]  # unannotated in torch
        self._unique_id: tuple[int, ...] | None = None
        self._unique_id_generation = -1

    def join_spec(self, generation: int) -> NcclJoin:
        # One unique id per group generation: a rebuilt group must not reuse the old id.
        if self._unique_id is None or self._unique_id_generation != generation:
            self._unique_id = tuple(self._nccl.get_unique_id())
            self._unique_id_generation = generation
        return NcclJoin(list(self._unique_id))

    def _build_group(self, group: GroupSpec, rank: int) -> None:
        assert isinstance(group.join, NcclJoin)  # checked by Backend.join
        try:
            with torch.cuda.device(self.device):
                self._comm = self._communicator(group.world_size, group.join.unique_id, rank)
        except RuntimeError as exc:  # cupy's NcclError
            raise PeerError(
                f"{self.name} group (generation {group.generation}, {group.world_size} ranks) did not form: {exc}"
            ) from exc

    def _communicator(self, world_size: int, unique_id: list[int], rank: int) -> Any:
        """cupy up to 13 takes the unique id as the tuple of 128 chars `get_unique_id()` returns; cupy 14
        (seen on the GPU machine: `TypeError: Argument 'commId' has incorrect type (expected bytes, got
        tuple)`) takes bytes (where its `get_unique_id()` returns bytes, the wire carries 0..255). Feature, not
        version: the tuple first, bytes when cupy refuses it."""
        try:
            return self._nccl.NcclCommunicator(world_size, tuple(unique_id), rank)
        except TypeError:
            return self._nccl.NcclCommunicator(world_size, bytes(b & 0xFF for b in unique_id), rank)

    def _drop_group(self) -> None:
        if self._comm is not None:
            self._comm = None

    def broadcast(self, slot: int, nbytes: int, bucket_index: int, buffer: torch.Tensor | None = None) -> None:
        """On NCCL's own stream, after the compute stream's work on what it reads (the event recorded
        by `fence`: the packing copies, or the gather/cast that produced a direct chunk); returns when
        that stream finished, so the slot may be repacked and a direct source tensor released."""
        if nbytes == 0:
            return
        target = self.buckets[slot][:nbytes] if buffer is None else buffer
        if target.device != self.device or target.numel() != nbytes or not target.is_contiguous():
            raise PeerError(f"nccl broadcast of {nbytes} bytes from a {target.numel()}-byte {target.device} tensor")
        event = self._fences[slot] if slot != NO_SLOT else None
        if event is not None:
            self._stream.wait_event(event)  # type: ignore[arg-type]
            self._fences[slot] = None
        if buffer is not None:  # a caller's tensor: whatever the compute stream still does with it comes first
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        self._comm.bcast(target.data_ptr(), nbytes, self._nccl.NCCL_UINT8, 0, self._stream.cuda_stream)
        self._stream.synchronize()
