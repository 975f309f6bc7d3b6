"""`cuda_ipc`: trainer and rollout on one GPU; the two bucket slots are CUDA memory shared by IPC handle,
so a "broadcast" is a handshake and the bytes never leave the device (see `shared.py`)."""

from __future__ import annotations

from typing import Any

import torch

from ...errors import ProtocolError
from .base import register_backend
from .shared import SharedBucketBackend


@register_backend("cuda_ipc", natural_device="cuda")
class CudaIpcBackend(SharedBucketBackend):
    """Trainer and rollout on one GPU: CUDA buckets shared by IPC handle (no pickle: the handle's
    fields travel as hex strings). The sender synchronizes the device before a bucket is announced,
    so a receiver never reads a slot whose copies are still queued."""

    def _create_slots(self) -> tuple[list[torch.Tensor], list[str]]:
        slots = [torch.empty(self.bucket_size, dtype=torch.uint8, device=self.device) for _ in range(2)]
        return slots, [_encode_ipc(t) for t in slots]

    def _attach_slots(self, handles: list[str], nbytes: int) -> list[torch.Tensor]:
        return [_decode_ipc(h, nbytes, self.device) for h in handles]

    def fence(self, slot: int) -> None:
        torch.cuda.synchronize(self.device)


def _encode_ipc(tensor: torch.Tensor) -> str:
    fields = tensor.untyped_storage()._share_cuda_()  # type: ignore[attr-defined]
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
        if kind == "b":
            fields.append(bytes.fromhex(body))
        elif kind in ("t", "f"):
            fields.append(kind == "t")
        elif kind == "i":
            fields.append(int(body))
        else:
            raise ProtocolError(f"malformed CUDA IPC handle field {part[:16]!r}")
    storage = torch.UntypedStorage._new_shared_cuda(*fields)  # type: ignore[attr-defined]
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)[:nbytes]
