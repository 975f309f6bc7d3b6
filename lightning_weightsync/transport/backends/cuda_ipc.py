"""`cuda_ipc`: trainer and rollout on one GPU; the two bucket slots are CUDA memory shared by IPC handle,
so a "broadcast" is a handshake and the bytes never leave the device (see `shared.py`)."""

from __future__ import annotations

from typing import Any

import torch

from ...errors import PeerError, ProtocolError
from .base import NUM_SLOTS
from .shared import SharedBucketBackend


class CudaIpcBackend(SharedBucketBackend):
    """Trainer and rollout on one GPU: CUDA buckets shared by IPC handle (no pickle: the handle's
    fields travel as hex strings). The sender synchronizes the device before a bucket is announced,
    so a receiver never reads a slot whose copies are still queued."""

    name = "cuda_ipc"
    natural_device = "cuda"

    def _create_slots(self) -> tuple[list[torch.Tensor], list[str]]:
        slots = [torch.empty(self.bucket_size, dtype=torch.uint8, device=self.device) for _ in range(NUM_SLOTS)]
        return slots, [_encode_ipc(t) for t in slots]

    def _attach_slots(self, handles: list[str], nbytes: int) -> list[torch.Tensor]:
        try:
            return [_decode_ipc(h, nbytes, self.device) for h in handles]
        except ProtocolError:
            raise
        except RuntimeError as exc:  # torch could not open the handle
            raise PeerError(
                f"cannot open the sender's CUDA IPC buckets ({exc}): the sender is gone or on another GPU host "
                "(transport.backend=cuda_ipc needs trainer and rollout on one host; else use nccl or gloo)"
            ) from exc

    def fence(self, slot: int) -> None:
        torch.cuda.synchronize(self.device)


def _encode_ipc(tensor: torch.Tensor) -> str:
    fields = tensor.untyped_storage()._share_cuda_()  # type: ignore[no-untyped-call]  # unannotated in torch
    parts = []
    for f in fields:
        if isinstance(f, bytes):
            parts.append("b" + f.hex())
        elif isinstance(f, bool):
            parts.append("t" if f else "f")
        else:
            parts.append("i" + str(int(f)))
    return ":".join(parts)


def _decode_ipc(handle: str, nbytes: int, device: torch.device) -> torch.Tensor:
    fields: list[Any] = []
    for part in handle.split(":"):
        kind, body = part[:1], part[1:]
        try:
            if kind == "b":
                fields.append(bytes.fromhex(body))
            elif kind in ("t", "f") and not body:
                fields.append(kind == "t")
            elif kind == "i":
                fields.append(int(body))
            else:
                raise ValueError(kind)
        except ValueError:
            raise ProtocolError(f"malformed CUDA IPC handle field {part[:16]!r}") from None
    try:
        storage = torch.UntypedStorage._new_shared_cuda(*fields)
    except TypeError as exc:  # a well-formed field list of the wrong shape
        raise ProtocolError(f"malformed CUDA IPC handle ({len(fields)} fields): {exc}") from None
    if storage.nbytes() < nbytes:
        raise ProtocolError(f"CUDA IPC bucket has {storage.nbytes()} bytes < bucket_size {nbytes}")
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)[:nbytes]
