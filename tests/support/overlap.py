"""What the overlap failure-path tests share (tests/integration/test_overlap.py, test_side_gather.py).

The trainer side: a rank of a real 2-process gloo group that drives `SyncDriver` with `trainer.overlap` on a
small FSDP2 net and takes real optimizer steps between syncs (no Lightning: its start-up would dominate).
The rollout side: real `WeightReceiver`s, each on its own sender port (one per case), several served
concurrently by one process, each with a behaviour: slow, holding a version until told, or dying in one.
Flags between the processes are files: a case's trainer touches `done` when it is over.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save

from lightning_weightsync import WeightReceiver, load_config

WORLD = 2
HOLD_MAX_S = 20.0  # a rollout holding a version lets go after this even if never released
LIVENESS_S = 3.0
TIMEOUT_S = 30.0  # transport.timeout_s of both sides: every "noticed at once" check is < TIMEOUT_S / 2

Event = tuple[int | None, str, bytes | None]
"""What a rollout saw of one version: (its number, "applied" or the exception that ended it, the tensors
(safetensors bytes) when the rollout keeps them)."""


def overlap_cfg(port: int, *extra: str) -> Any:
    return load_config(
        overrides=[
            f"transport.port={port}",
            f"transport.timeout_s={TIMEOUT_S}",
            f"transport.liveness_s={LIVENESS_S}",
            "transport.heartbeat_interval_s=0.2",
            "transport.bucket_size_mb=0.01",  # several buckets a version
            "trainer.overlap=true",
            "trainer.min_receivers=1",
            *extra,
        ]
    )


def touch(path: str) -> None:
    Path(path).touch()


def wait_for_file(path: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# -- the trainer side ---------------------------------------------------------------------------------
def init_rank(rank: int, master_port: int, *, worker_timeout_s: float, group_timeout_s: float) -> None:
    """Join the 2-rank gloo training group; a rank stuck past `worker_timeout_s` dumps its stacks and exits."""
    faulthandler.dump_traceback_later(worker_timeout_s - 10, exit=True)
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", master_port, WORLD, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=group_timeout_s)
    )


def fsdp2_net(width: int = 32, depth: int = 3, seed: int = 0) -> torch.nn.Module:
    """Linear layers, each its own FSDP2 unit on the whole world (same initial weights on every rank)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    net = torch.nn.Sequential(*layers)
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    return fully_shard(net)


def train_step(net: torch.nn.Module, step: int) -> None:
    """One real optimizer step (plain SGD) on each rank's own batch: FSDP2 all-gathers and reduce-scatters."""
    first = next(m for m in net.modules() if isinstance(m, torch.nn.Linear))
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    net(torch.randn(4, first.in_features, generator=g)).square().mean().backward()
    with torch.no_grad():
        for p in net.parameters():
            if p.grad is not None:
                p.sub_(0.05 * p.grad)
                p.grad = None


def full_weights(driver: Any, net: torch.nn.Module) -> bytes:
    """The stream a version of `net` sends now (every rank gathers; bytes on the sending rank, b"" elsewhere)."""
    full = {name: t.detach().clone() for name, t in driver.weights(net)}
    return save(full) if full else b""


# -- the rollout side ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rollout:
    """One rollout of a case: a `WeightReceiver` on `port` that serves until the case's `done` flag exists
    and no version is in its hands."""

    port: int
    identity: str
    done: str
    delay_s: float = 0.0  # sleep at each version's first tensor (longer than a training step: overlap)
    hold: tuple[str, str] | None = None  # (holding, release): at the first tensor touch one, wait for the other
    die_in: int | None = None  # exit the process hard at this version's first tensor (a rollout killed)
    keep: bool = False  # return the tensors of every version applied


async def _serve(spec: Rollout, timeout_s: float) -> list[Event]:
    cfg = load_config(
        overrides=[
            f"transport.port={spec.port}", f"transport.timeout_s={TIMEOUT_S}", f"transport.liveness_s={LIVENESS_S}",
            "transport.heartbeat_interval_s=0.2", f"rollout.identity={spec.identity}",
        ]
    )  # fmt: skip
    events: list[Event] = []
    busy = False

    async def first_tensor(version: int) -> None:
        if version == spec.die_in:
            os._exit(17)
        if spec.hold is not None:
            holding, release = spec.hold
            touch(holding)
            deadline = time.monotonic() + HOLD_MAX_S
            while not os.path.exists(release) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        await asyncio.sleep(spec.delay_s)

    async with WeightReceiver(cfg) as receiver:

        async def receive() -> None:
            nonlocal busy
            while True:
                got: dict[str, torch.Tensor] = {}
                version: int | None = None
                try:
                    async for name, tensor in receiver.receive_weights():
                        if version is None:
                            busy, version = True, int(receiver.version)  # type: ignore[arg-type]
                            await first_tensor(version)
                        got[name] = tensor.clone()
                    events.append((int(receiver.version), "applied", save(got) if spec.keep else None))  # type: ignore[arg-type]
                except Exception as exc:  # the version failed here: what the rollout saw is the result
                    events.append((version, f"{type(exc).__name__}: {exc}", None))
                finally:
                    busy = False

        task = asyncio.create_task(receive())
        deadline = time.monotonic() + timeout_s
        while not task.done() and (busy or not os.path.exists(spec.done)):
            if time.monotonic() > deadline:
                events.append((None, f"the case did not end within {timeout_s}s", None))
                break
            await asyncio.sleep(0.05)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return events


def rollouts_main(specs: list[Rollout], timeout_s: float) -> dict[str, list[Event]]:
    """Serve every rollout of `specs` at once in this process; what each saw, by identity."""

    async def main() -> list[list[Event]]:
        return list(await asyncio.gather(*(_serve(spec, timeout_s) for spec in specs)))

    return dict(zip([s.identity for s in specs], asyncio.run(main()), strict=True))


def applied(events: list[Event]) -> list[int]:
    return [v for v, outcome, _ in events if outcome == "applied" and v is not None]
