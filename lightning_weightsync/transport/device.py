"""cpu / cuda / npu differences in one place: device choice, synchronize, events.

The sender and receiver call these helpers and never branch on the device kind themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psutil
import torch

from ..errors import BackendUnavailable, ConfigError


def import_torch_npu() -> Any:
    try:
        import torch_npu
    except ImportError as exc:
        raise BackendUnavailable(
            "transport.backend=hccl needs torch_npu: pip install 'lightning_weightsync[npu]' on an Ascend host"
        ) from exc
    return torch_npu


def resolve_device(backend: str, configured: str | None, natural: str | None) -> torch.device:
    """The device that holds buckets: `transport.device` if set, else the backend's natural device
    (`natural`: `backend_class(backend).natural_device`, which the caller looks up: the backends import
    this module)."""
    kind = configured or natural or "cpu"
    if kind.startswith("npu"):
        import_torch_npu()
    device = torch.device(kind)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise BackendUnavailable(
                f"transport.backend={backend} needs a CUDA GPU (transport.device={kind}) but torch sees none; "
                "use transport.backend=gloo (or shm) on CPU machines"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def synchronize(device: torch.device) -> None:
    """Wait for every queued kernel on `device` (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)  # type: ignore[attr-defined]


def record_event(device: torch.device) -> Any | None:
    """An event on the current stream of `device` (not of whatever device is current in this thread:
    with `transport.device=cuda:1` the copies to fence are on cuda:1), or None on CPU (copies there
    are synchronous)."""
    if device.type == "cuda":
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves Event.__init__ unannotated
        event.record(torch.cuda.current_stream(device))
        return event
    if device.type == "npu":
        event = torch.npu.Event()  # type: ignore[attr-defined]
        event.record(torch.npu.current_stream(device))  # type: ignore[attr-defined]
        return event
    return None


def empty_bucket(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 bucket; CPU buckets are pinned when a GPU exists so H2D/D2H copies can overlap. A bucket
    this process cannot hold (two of them: double buffering) is a `ConfigError` naming the knob, not an
    allocator's error (or, on CPU, the OOM killer later: Linux overcommits, so a huge CPU allocation
    succeeds until it is touched)."""
    if device.type == "cpu" and 2 * nbytes > psutil.virtual_memory().total:
        raise ConfigError(
            f"transport.bucket_size_mb: two buckets of {nbytes / 2**20:.0f} MiB do not fit in this host's "
            f"{psutil.virtual_memory().total / 2**30:.1f} GiB of memory; lower transport.bucket_size_mb"
        )
    try:
        if device.type == "cpu" and torch.cuda.is_available():
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    except RuntimeError as exc:  # torch.OutOfMemoryError and the pinned / device allocators' errors
        raise ConfigError(
            f"transport.bucket_size_mb: cannot allocate a bucket of {nbytes / 2**20:.0f} MiB on {device} "
            f"({str(exc).splitlines()[0][:200]}); lower transport.bucket_size_mb (each side holds two)"
        ) from None


def _nothing() -> None:
    return None


def handoff(args: tuple[Any, ...]) -> Callable[[], None]:
    """Hand the accelerator tensors among `args`, made on this thread's current stream, to another
    thread; returns `adopt`, which the consuming thread calls before it touches them.

    Each thread has its own current stream, and a consumer on another one (vLLM's worker after CUDA-graph
    capture) could otherwise read a merged tensor before the copies that fill it ran, or the caching
    allocator could give its memory to the next merge while the consumer still reads it. `adopt` makes
    the consumer's stream wait for an event recorded here and marks each tensor as used on that stream
    (`record_stream`). A no-op on CPU and when both threads use the same stream."""
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.device.type in ("cuda", "npu")]
    if not tensors:
        return _nothing
    device = tensors[0].device
    module: Any = torch.cuda if device.type == "cuda" else torch.npu  # type: ignore[attr-defined]
    producer = module.current_stream(device)
    event = module.Event()
    event.record(producer)

    def adopt() -> None:
        consumer = module.current_stream(device)
        if consumer == producer:
            return
        consumer.wait_event(event)
        for tensor in tensors:
            tensor.record_stream(consumer)

    return adopt
