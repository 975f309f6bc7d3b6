"""What the device kit's step modules share (`device_check` runs the steps, `device_nixl` the raw NIXL half of
the nixl_stream step): progress lines the driver echoes, a step's skip and its checks, the deterministic tensors
both sides of a stream regenerate, and the waits between the two processes of a step.

Module level imports are stdlib only, as in `device_check`: its `--install` runs before the package's
dependencies exist.
"""

from __future__ import annotations

import datetime as dt
import math
import queue as queue_mod
from typing import Any

PROGRESS = "[dc]"  # lines a step prints with this prefix are echoed to the console by the driver


def now() -> str:
    return dt.datetime.now().strftime("%H:%M:%S")


def progress(msg: str) -> None:
    """A timestamped progress line (steps: echoed by the driver)."""
    print(f"{PROGRESS} {now()} {msg}", flush=True)


class Skip(Exception):
    """A step that cannot run here; the message is the reason."""


def check_results(checks: dict[str, bool]) -> dict[str, Any]:
    return {"checks": checks, "failed_checks": sorted(k for k, ok in checks.items() if not ok)}


def make_tensor(name: str, shape: tuple[int, ...], dtype: Any, seed: int, device: Any) -> Any:
    """Deterministic random bytes (any bit pattern, compared as bytes) generated on `device`, so a
    15 GiB stream costs milliseconds on a GPU and the receiver can regenerate what was sent."""
    import torch

    transposed = name == "extras.transposed"
    gen_shape = tuple(reversed(shape)) if transposed else shape
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(gen_shape) * itemsize
    if nbytes == 0:
        return torch.empty(gen_shape, dtype=dtype, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=g)
    t = raw.view(dtype).reshape(gen_shape)
    return t.t() if transposed else t


def cuda_sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def queue_get(q: Any, timeout_s: float, what: str) -> Any:
    try:
        return q.get(timeout=timeout_s)
    except queue_mod.Empty:
        raise TimeoutError(f"no {what} within {timeout_s}s") from None
