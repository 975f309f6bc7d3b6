"""The shared fixtures do what they promise (and so the tests built on them can trust them)."""

from __future__ import annotations

import asyncio

import pytest

from lightning_weightsync import WeightReceiver, WeightSender
from tests.support.transfer import assert_bitwise, receive_once, stream, with_timeout


async def test_engine_pair_moves_a_chunked_version_bitwise(engine_pair: tuple[WeightSender, WeightReceiver]) -> None:
    sender, receiver = engine_pair
    weights = stream(3, max_tensors=12)
    got, stats = await with_timeout(asyncio.gather(receive_once(receiver), sender.send_weights(weights, version=3)))
    assert_bitwise(got, weights)
    assert receiver.version == 3 and stats.receivers == 1 and stats.num_chunked_tensors > 0


def test_console_script_runs(run_console) -> None:
    result = run_console("config", "show", "transport.backend=shm")
    assert result.returncode == 0, result.stderr
    assert "backend: shm" in result.stdout


@pytest.mark.gpu
def test_gpu_marker_is_skipped_without_a_gpu() -> None:
    import torch

    assert torch.cuda.is_available()  # only runs where the marker's skip did not apply
