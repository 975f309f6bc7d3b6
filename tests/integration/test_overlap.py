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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from safetensors.torch import load, save  # noqa: E402

from lightning_weightsync import WeightReceiver, load_config  # noqa: E402
from tests.support.mp import LOAD_SLACK_S, free_port, run_workers  # noqa: E402

pytestmark = pytest.mark.slow

RECEIVE_DELAY_S = 0.4  # per version, in the receiver: much longer than one training step of this model
WORKER_TIMEOUT_S = 150.0
STEPS = 5


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
    began = time.monotonic()
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
        "seconds": time.monotonic() - began,
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


def _receiver(port: int, last_versions: list[int], done: str) -> list[list[Any]]:
    """Receive versions (slowly) until session `i` (one per fit: versions restart at 0) delivered
    `last_versions[i]`, for every session; then leave, touching `done`."""
    cfg = load_config(
        overrides=[f"transport.port={port}", "transport.timeout_s=60", "transport.heartbeat_interval_s=0.2",
                   "rollout.identity=rollout-main"]
    )  # fmt: skip
    sessions = len(last_versions)

    async def main() -> list[list[Any]]:
        got: list[list[Any]] = [[] for _ in range(sessions)]
        session, previous = 0, -1
        async with WeightReceiver(cfg) as receiver:
            while True:
                one: dict[str, torch.Tensor] = {}
                async for name, tensor in receiver.receive_weights():
                    if not one:
                        if int(receiver.version) <= previous:  # type: ignore[arg-type]
                            session += 1
                        await asyncio.sleep(RECEIVE_DELAY_S)
                    one[name] = tensor.clone()
                previous = int(receiver.version)  # type: ignore[arg-type]
                got[session].append((previous, save(one), time.time()))
                if previous == last_versions[session] and session == sessions - 1:
                    return got

    try:
        return asyncio.run(asyncio.wait_for(main(), WORKER_TIMEOUT_S - 20))
    finally:
        Path(done).touch()


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


def _flaky_receiver(port: int, identity: str, die_in: tuple[int, int], after: str | None, dying: str) -> None:
    """Connect once `after` exists (None: at once), receive (slowly) and exit hard in the middle of version
    `die_in=(session, version)` (a session a fit: versions restart at 0), touching `dying` first: a rollout
    killed while the trainer sends that version in the background."""
    while after is not None and not os.path.exists(after):
        time.sleep(0.05)
    cfg = load_config(
        overrides=[f"transport.port={port}", "transport.timeout_s=60", "transport.liveness_s=3",
                   "transport.heartbeat_interval_s=0.2", f"rollout.identity={identity}"]
    )  # fmt: skip

    async def main() -> None:
        session, previous = 0, -1
        async with WeightReceiver(cfg) as receiver:
            while True:
                first = True
                async for _name, _tensor in receiver.receive_weights():
                    if first:
                        first, version = False, int(receiver.version)  # type: ignore[arg-type]
                        session, previous = session + (version <= previous), version
                        if (session, version) == die_in:
                            Path(dying).touch()
                            os._exit(17)
                        await asyncio.sleep(RECEIVE_DELAY_S)

    asyncio.run(asyncio.wait_for(main(), WORKER_TIMEOUT_S - 20))


def _role(role: int, master_port: int, port: int, fits: list[tuple[int, list[str]]], flags: str) -> Any:
    """0, 1: the trainer ranks (every fit); 2: the slow rollout of the first two fits; 3: rollout-0, which
    serves the third fit and dies in its version 2; 4: rollout-1, which takes over from there and dies in
    the fourth fit's version 2 (its session 1)."""
    if role < 2:
        return _trainer(role, master_port, port, fits)
    main_done, r0_dies = str(Path(flags, "main-done")), str(Path(flags, "r0-dies"))
    if role == 2:
        return _receiver(port, [steps for steps, _ in fits[:2]], main_done)
    if role == 3:
        return _flaky_receiver(port, "rollout-0", (0, 2), main_done, r0_dies)
    return _flaky_receiver(port, "rollout-1", (1, 2), r0_dies, str(Path(flags, "r1-dies")))


@dataclass
class Run:
    rank0: list[dict[str, Any]]
    rank1: list[dict[str, Any]]
    received: list[list[Any]]
    seconds: float


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One set of processes for every case (process start-up dominates on a loaded machine): four fits."""
    fits = [
        (STEPS, ["trainer.send_mode=gather", "trainer.overlap_policy=wait"]),
        (STEPS + 1, ["trainer.send_mode=sharded", "trainer.overlap_policy=latest"]),
        (STEPS, ["trainer.on_failure=warn", "trainer.send_mode=sharded"]),
        (STEPS, ["trainer.on_failure=raise"]),
    ]
    flags = str(tmp_path_factory.mktemp("overlap-flags"))
    master, port = free_port(), free_port()
    started = time.monotonic()
    rank0, rank1, received, _, _ = run_workers(
        _role, [(r, master, port, fits, flags) for r in range(5)], timeout_s=WORKER_TIMEOUT_S, doomed=[3, 4]
    )
    print("overlap fits:", [{k: v for k, v in f.items() if k not in ("refs", "step_started")} for f in rank0])
    return Run(rank0, rank1, received, time.monotonic() - started)


def test_wait_every_background_version_is_its_steps_weights_bitwise_although_training_went_on(run: Run) -> None:
    received, wait_fit = run.received[0], run.rank0[0]
    assert _assert_versions_are_their_steps(received, wait_fit) == list(range(STEPS + 1))
    assert wait_fit["last_synced"] == STEPS and wait_fit["failures"] == 0 and wait_fit["skipped"] == 0
    # training went on: step v+1 began before the rollout had all of version v
    overlapped = [v for v, _, done in received if wait_fit["step_started"].get(v, float("inf")) < done]
    assert len(overlapped) >= STEPS // 2, (overlapped, wait_fit["step_started"], [(v, t) for v, _, t in received])


def test_latest_skips_and_counts_versions_never_a_mix_and_sends_the_last_before_fit_returns(run: Run) -> None:
    received, latest_fit = run.received[1], run.rank0[1]
    versions = _assert_versions_are_their_steps(received, latest_fit)  # sharded: every rank sent its shards
    assert versions[0] == 0 and versions[-1] == STEPS + 1
    assert latest_fit["skipped"] > 0
    assert latest_fit["skipped"] + len(versions) == STEPS + 2, (versions, latest_fit["skipped"])
    assert latest_fit["last_synced"] == STEPS + 1 and latest_fit["failures"] == 0


def test_a_rollout_killed_during_a_background_version_warn_trains_on_raise_stops_every_rank_at_the_next_step(
    run: Run,
) -> None:
    (warned, raised), rank1 = run.rank0[2:], run.rank1[2:]
    # warn: version 2 failed in the background, was counted at the next step and training went on; the
    # later versions went to the other rollout, the last one before fit returned
    assert warned["error"] is None and warned["step"] == STEPS, warned["error"]
    assert warned["failures"] == 1 and warned["last_synced"] == STEPS
    assert rank1[0]["error"] is None and rank1[0]["failures"] == 1
    # raise: the rollout died in version 2's send; the failure stopped training at the next step boundary,
    # on every rank (rank 0 names the failure, rank 1 the failing rank), within transport.liveness_s
    assert raised["error"] is not None and rank1[1]["error"] is not None
    assert raised["step"] == 3 and rank1[1]["step"] == 3, (raised["step"], rank1[1]["step"])
    assert "version 2" in raised["error"] and "rollout-1" in raised["error"], raised["error"]
    assert "SyncFailed" in rank1[1]["error"] and "version 2" in rank1[1]["error"], rank1[1]["error"]
    assert raised["last_synced"] == 1
    assert raised["seconds"] < 3 + LOAD_SLACK_S  # transport.liveness_s, not transport.timeout_s (60 s)
