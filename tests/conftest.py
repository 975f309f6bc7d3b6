"""Fixtures for the set-ups tests keep needing, and the hardware markers.

- `engine_pair`: a started `WeightSender` and one registered `WeightReceiver` in this process (gloo,
  a bucket of 8 KiB so that real streams are chunked), closed after the test, also on failure;
- `run_console`: the installed `lightning-weightsync` console script as a subprocess with a timeout;
- `@pytest.mark.gpu` / `@pytest.mark.npu`: skipped, with the reason, where the hardware is missing,
  so a GPU machine runs exactly those with `pytest -m gpu`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import torch

from lightning_weightsync import WeightReceiver, WeightSender
from tests.support.transfer import engine_cfg

REPO = Path(__file__).resolve().parent.parent
CONSOLE_SCRIPT = Path(sys.executable).with_name("lightning-weightsync")


def _has_npu() -> bool:
    try:
        import torch_npu  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        return False
    return bool(torch.npu.is_available())  # type: ignore[attr-defined]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    skip_npu = pytest.mark.skip(reason="needs an Ascend NPU and torch_npu (extra [npu])")
    has_gpu, has_npu = torch.cuda.is_available(), None
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
        if "npu" in item.keywords:
            has_npu = _has_npu() if has_npu is None else has_npu
            if not has_npu:
                item.add_marker(skip_npu)


@pytest.fixture
async def engine_pair() -> AsyncIterator[tuple[WeightSender, WeightReceiver]]:
    sender = WeightSender(engine_cfg(0, bucket_size_mb=1 / 128))
    await sender.start()
    receiver = WeightReceiver(engine_cfg(sender.port, bucket_size_mb=1 / 128), identity="pair-receiver")
    try:
        await receiver.start()
        yield sender, receiver
    finally:
        await receiver.close()
        await sender.close()


@pytest.fixture
def run_console() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run `lightning-weightsync ARGS...` from the repository root (so `tests.*` factories import)."""

    def run(*args: str, timeout_s: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(CONSOLE_SCRIPT), *args],
            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    return run
