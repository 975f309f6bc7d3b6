"""`shm`: trainer and rollout on one host; the two bucket slots live in POSIX shared memory that every
process maps, so a "broadcast" is a handshake and no byte crosses a socket (see `shared.py`)."""

from __future__ import annotations

import contextlib
import gc
import os
from typing import Any

import torch

from ...errors import PeerError, ProtocolError
from .base import NUM_SLOTS
from .shared import SharedBucketBackend


class ShmBackend(SharedBucketBackend):
    """Trainer and rollout on one host, CPU buckets in POSIX shared memory."""

    name = "shm"
    natural_device = "cpu"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._segments: list[Any] = []

    def _create_slots(self) -> tuple[list[torch.Tensor], list[str]]:
        from multiprocessing.shared_memory import SharedMemory

        self._segments = [SharedMemory(create=True, size=max(self.bucket_size, 1)) for _ in range(NUM_SLOTS)]
        return [self._view(s, self.bucket_size) for s in self._segments], [s.name for s in self._segments]

    def _attach_slots(self, handles: list[str], nbytes: int) -> list[torch.Tensor]:
        # Map with shm_open + mmap rather than SharedMemory(name=...): the latter registers the
        # segment with the resource tracker, which the sender may share (spawned processes), and
        # would unlink the sender's segment when we exit. The segment is the sender's to unlink.
        import _posixshmem
        import mmap

        self._close_segments()
        self._segments = []
        for name in handles:
            if not name.replace("_", "").isalnum() or len(name) > 64:
                raise ProtocolError(f"shared-memory segment name {name[:64]!r} is malformed")
            try:
                fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
            except OSError as exc:
                raise PeerError(
                    f"cannot map the sender's shared-memory segment {name} ({exc}): the sender is gone or on "
                    "another host (transport.backend=shm needs trainer and rollout on one host; else use gloo)"
                ) from exc
            try:
                size = os.fstat(fd).st_size
                if size < nbytes:
                    raise ProtocolError(f"shared-memory segment {name} has {size} bytes < bucket_size {nbytes}")
                self._segments.append(_Mapped(mmap.mmap(fd, size)))
            finally:
                os.close(fd)
        return [self._view(s, nbytes) for s in self._segments]

    @staticmethod
    def _view(segment: Any, nbytes: int) -> torch.Tensor:
        return (
            torch.frombuffer(segment.buf, dtype=torch.uint8, count=nbytes)
            if nbytes
            else torch.empty(0, dtype=torch.uint8)
        )

    def _close_segments(self) -> None:
        self.buckets = []
        gc.collect()
        for segment in self._segments:
            with contextlib.suppress(BufferError, OSError):
                segment.close()
            if self.is_sender and hasattr(segment, "unlink"):
                with contextlib.suppress(FileNotFoundError):
                    segment.unlink()

    def close(self) -> None:
        super().close()
        self._close_segments()
        self._segments = []


class _Mapped:
    """A receiver's mapping of a sender segment, shaped like SharedMemory (`.buf`, `.close()`)."""

    def __init__(self, mm: Any) -> None:
        self.buf = mm

    def close(self) -> None:
        self.buf.close()
