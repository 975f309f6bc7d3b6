"""A tensor made on one thread's CUDA stream and used on another thread's stream (the receive loop's
merge on its loop thread, vLLM's `load_weights` on its worker thread, which runs on vLLM's own stream
after CUDA-graph capture): `transport.device.handoff` orders the two. The race is real: the first test
shows an unfenced consumer reading the tensor before the producer's kernels filled it."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from lightning_weightsync.transport.device import handoff

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the race is between two CUDA streams"),
]

SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU time queued before the fill on the producer's stream


def _produce() -> tuple[torch.Tensor, Callable[[], None]]:
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # the producer's stream is busy: the fill below lands late
    x.fill_(1.0)
    return x, handoff((x,))


def _consume(x: torch.Tensor, adopt: Callable[[], None] | None) -> torch.Tensor:
    out: list[torch.Tensor] = []

    def run() -> None:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):  # another thread, another stream: as vLLM's worker
            if adopt is not None:
                adopt()
            out.append(x.clone())
        stream.synchronize()

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    return out[0]


def test_without_the_handoff_the_consumer_reads_before_the_producer_wrote() -> None:
    x, _ = _produce()
    seen = _consume(x, None)
    torch.cuda.synchronize()
    assert not bool(torch.all(seen == 1.0)), "no race observed: the test below would prove nothing"


def test_the_handoff_orders_the_consumer_after_the_producer() -> None:
    x, adopt = _produce()
    seen = _consume(x, adopt)
    assert bool(torch.all(seen == 1.0))
