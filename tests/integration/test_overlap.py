"""`trainer.overlap` end to end: a 2-rank FSDP2 Lightning run (ModelParallelStrategy, gloo) whose versions
are sent in the background while training goes on, into a real WeightReceiver that is slow on purpose
(every version takes longer to receive than a training step, so every send overlaps the next steps).

The trainer keeps a reference copy of its weights right after every optimizer step (a callback ahead of
the sync's, gathering on every rank); every version the rollout holds must equal its step's bitwise: a
send that read the live parameters instead of the snapshot would hold a later step's (or a mix).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from safetensors.torch import load, save  # noqa: E402

from lightning_weightsync import WeightReceiver, load_config  # noqa: E402
from tests.support.mp import free_port, run_workers  # noqa: E402

pytestmark = pytest.mark.slow

RECEIVE_DELAY_S = 0.4  # per version, in the receiver: much longer than one training step of this model
WORKER_TIMEOUT_S = 150.0


def _cfg(port: int, *extra: str) -> Any:
    return load_config(
        overrides=[
            f"transport.port={port}",
            "transport.timeout_s=60",
            "transport.liveness_s=3",
            "transport.heartbeat_interval_s=0.2",
            "transport.bucket_size_mb=0.01",  # several buckets a version
            "trainer.overlap=true",
            "trainer.min_receivers=1",
            *extra,
        ]
    )


def _fit(rank: int, port: int, steps: int, extra: list[str]) -> dict[str, Any]:
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from lightning_weightsync import WeightSyncCallback

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = torch.nn.Sequential(
                torch.nn.Linear(16, 96),
                torch.nn.ReLU(),
                torch.nn.Linear(96, 96),
                torch.nn.ReLU(),
                torch.nn.Linear(96, 8),
            )

        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            for layer in self.model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(batch).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    sync = WeightSyncCallback(_cfg(port, *extra))
    refs: dict[int, bytes] = {}
    step_started: dict[int, float] = {}  # wall time each step began (after `global_step` steps)

    class Reference(pl.Callback):
        """The weights right after each optimizer step (every rank gathers; rank 0 keeps them)."""

        def keep(self, trainer: pl.Trainer) -> None:
            full = {n: t.detach().clone() for n, t in sync.weights(trainer)}
            if trainer.is_global_zero:
                refs[trainer.global_step] = save(full)

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.keep(trainer)

        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
            step_started.setdefault(trainer.global_step, time.time())

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
            self.keep(trainer)

    g = torch.Generator().manual_seed(rank)
    data = torch.utils.data.DataLoader(list(torch.randn(4 * steps, 16, generator=g)), batch_size=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=steps,
        callbacks=[Reference(), sync],  # the reference first: it sees the step before the sync does
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    error = None
    try:
        trainer.fit(Net(), train_dataloaders=data)
    except Exception as exc:  # the raise-policy case: the failure is the result
        error = f"{type(exc).__name__}: {exc}"
    return {
        "refs": refs,
        "last_synced": sync.last_synced_version,
        "failures": sync.failures,
        "skipped": sync.record.overlap_skipped,
        "step_started": step_started,
        "error": error,
        "step": trainer.global_step,
    }


def _trainer(rank: int, master_port: int, port: int, fits: list[tuple[int, list[str]]]) -> list[dict[str, Any]]:
    import faulthandler

    faulthandler.dump_traceback_later(WORKER_TIMEOUT_S - 10, exit=True)
    # Lightning sees an external launcher (LOCAL_RANK set) and joins this process as rank `rank`
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port), WORLD_SIZE="2", RANK=str(rank),
        LOCAL_RANK=str(rank), NODE_RANK="0",
    )  # fmt: skip
    torch.set_num_threads(1)
    return [_fit(rank, port, steps, extra) for steps, extra in fits]


def _receiver(port: int, sessions: int, last_versions: list[int], die_in: tuple[int, int] | None) -> list[list[Any]]:
    """Receive versions (slowly) until session `i` delivered `last_versions[i]`, for `sessions` sessions (one
    per fit: versions restart at 0). `die_in=(session, version)`: exit hard in the middle of that version."""
    cfg = load_config(
        overrides=[f"transport.port={port}", "transport.timeout_s=60", "transport.heartbeat_interval_s=0.2",
                   "rollout.identity=rollout-0"]
    )  # fmt: skip

    async def main() -> list[list[Any]]:
        got: list[list[Any]] = [[] for _ in range(sessions)]
        session, previous = 0, -1
        async with WeightReceiver(cfg) as receiver:
            while True:
                one: dict[str, torch.Tensor] = {}
                async for name, tensor in receiver.receive_weights():
                    version = int(receiver.version)  # type: ignore[arg-type]
                    if not one:
                        if version <= previous:
                            session += 1
                        if die_in == (session, version):
                            os._exit(17)  # mid-version: the trainer's background send fails
                        await asyncio.sleep(RECEIVE_DELAY_S)
                    one[name] = tensor.clone()
                previous = int(receiver.version)  # type: ignore[arg-type]
                got[session].append((previous, save(one), time.time()))
                if previous == last_versions[session] and session == sessions - 1:
                    return got

    return asyncio.run(asyncio.wait_for(main(), WORKER_TIMEOUT_S - 20))


def _role(role: int, master_port: int, port: int, fits: list[tuple[int, list[str]]], die_in: Any) -> Any:
    if role < 2:
        return _trainer(role, master_port, port, fits)
    return _receiver(port, len(fits), [steps for steps, _ in fits], die_in)


def _assert_versions_are_their_steps(received: list[tuple[int, bytes, float]], fit: dict[str, Any]) -> list[int]:
    versions = [v for v, _, _ in received]
    assert versions == sorted(set(versions)), f"not increasing: {versions}"
    for version, blob, _ in received:
        got, want = load(blob), load(fit["refs"][version])
        assert sorted(got) == sorted(want)
        for name, tensor in want.items():
            assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
            assert torch.equal(got[name], tensor), f"version {version}: {name} is not step {version}'s"
    return versions


def test_background_versions_equal_their_steps_bitwise_gather_wait_and_sharded_latest() -> None:
    steps = 5
    fits = [
        (steps, ["trainer.send_mode=gather", "trainer.overlap_policy=wait"]),
        (steps + 1, ["trainer.send_mode=sharded", "trainer.overlap_policy=latest"]),
    ]
    started = time.monotonic()
    master, port = free_port(), free_port()
    rank0, _rank1, received = run_workers(
        _role, [(r, master, port, fits, None) for r in range(3)], timeout_s=WORKER_TIMEOUT_S
    )
    elapsed = time.monotonic() - started
    wait_fit, latest_fit = rank0
    # wait: every version, each its own step's weights, although training went on during each send
    assert _assert_versions_are_their_steps(received[0], wait_fit) == list(range(steps + 1))
    assert wait_fit["last_synced"] == steps and wait_fit["failures"] == 0 and wait_fit["skipped"] == 0
    # training went on: step v+1 began before the rollout had all of version v
    overlapped = [v for v, _, done in received[0] if wait_fit["step_started"].get(v, float("inf")) < done]
    assert len(overlapped) >= steps // 2, (overlapped, wait_fit["step_started"], [(v, t) for v, _, t in received[0]])
    # latest: versions were skipped (counted) while one was in flight; the final one is sent before fit returns
    versions = _assert_versions_are_their_steps(received[1], latest_fit)
    assert versions[0] == 0 and versions[-1] == steps + 1
    assert latest_fit["skipped"] > 0
    assert latest_fit["skipped"] + len(versions) == steps + 2, (versions, latest_fit["skipped"])
    assert latest_fit["last_synced"] == steps + 1 and latest_fit["failures"] == 0
    assert elapsed < WORKER_TIMEOUT_S
