"""`trainer.overlap` end to end: a 2-rank FSDP2 Lightning run (ModelParallelStrategy, gloo) whose versions
are sent in the background while training goes on, into a real WeightReceiver that is slow on purpose
(every version takes longer to receive than a training step, so every send overlaps the next steps).

The trainer keeps a reference copy of its weights right after every optimizer step (a callback ahead of
the sync's, gathering on every rank); every version the rollout holds must equal its step's bitwise: a
send that read the live parameters instead of the snapshot would hold a later step's (or a mix).

The failure paths (issue 43: each of these bugs passed the suite) run in one set of processes of their own,
a case after another, each on `SyncDriver` with real FSDP2 steps in a 2-rank gloo group and its own real
rollout (tests/support/overlap.py): the ranks' agreement on skip or settle under `latest`; a tensor whose
shape or dtype changes between versions; `close()` with a version in flight; a snapshot that fails on one
rank (gathering at the sync point, and in the background); the sending rank's send failing mid-version while
the other rank gathers in the background. Every wait is bounded; a case that hangs fails its own test.
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
from safetensors.torch import load, save

from lightning_weightsync import WeightReceiver, load_config
from tests.support.mp import LOAD_SLACK_S, free_port, run_workers
from tests.support.overlap import (
    TIMEOUT_S,
    Rollout,
    applied,
    fsdp2_net,
    full_weights,
    init_rank,
    overlap_cfg,
    rollouts_main,
    touch,
    train_step,
    wait_for_file,
)

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
    import lightning.pytorch as pl  # here, not at the top: the failure-path workers below do without it
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
    pytest.importorskip("lightning.pytorch")
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


# -- the failure paths: one set of processes, a case after another (SyncDriver, no Lightning) -------------
FAIL_WORKER_TIMEOUT_S = 120.0
GROUP_TIMEOUT_S = 45.0  # the training group's; past the mirror groups' (transport.timeout_s): a hung gather is slow
CASES = ("agree", "staging", "close", "snapshot_sync", "snapshot_background", "send_unpausable", "send_fails")
AGREE_STEPS = 6
AGREE_STEP_S = 0.15  # a step: longer than rank 1's share of the background gather, much shorter than the send
AGREE_DELAY_S = 0.8  # the rollout's time per version


def _driver(port: int, *extra: str) -> Any:
    import torch.distributed as dist

    from lightning_weightsync.trainer.driver import SyncDriver

    driver = SyncDriver(overlap_cfg(port, *extra), rank=dist.get_rank(), device=torch.device("cpu"), prefix=None)
    driver.start()
    return driver


def _outcome(call: Any) -> tuple[str | None, float]:
    """(the exception `call()` raised, as "Type: message", or None; seconds it took)."""
    started = time.monotonic()
    try:
        call()
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    return error, time.monotonic() - started


def _agree(rank: int, port: int, flags: str) -> dict[str, Any]:
    """`latest` with rank 0's background send (slow rollout) outlasting rank 1's part of the gather: at the
    boundaries in between, rank 0 still sends and rank 1 is idle; both must skip (or settle) alike."""
    net = fsdp2_net()
    driver = _driver(port, "trainer.overlap_policy=latest")
    outcomes: list[bool] = []  # what each sync returned: the previous version settled here (True) or not

    def train() -> bool:
        outcomes.append(driver.sync(net, 0))
        for step in range(1, AGREE_STEPS + 1):
            train_step(net, step)
            time.sleep(AGREE_STEP_S)
            outcomes.append(driver.sync(net, step))
        return bool(driver.finish(net, AGREE_STEPS))

    try:
        error, _ = _outcome(train)  # ranks out of step fail in a collective: what each did up to there counts
    finally:
        driver.close()
    record = driver.record
    return {
        "outcomes": outcomes, "error": error, "skipped": record.overlap_skipped, "last": record.last_synced_version,
    }  # fmt: skip


def _staging(rank: int, port: int, flags: str) -> dict[str, Any]:
    """Two buffers change between versions 0 and 1: one its shape ([4, 3] -> [1, 3], which the old staging
    buffer would take by broadcasting), one its dtype (fp32 -> fp64, a value fp32 cannot hold)."""
    net = fsdp2_net()
    net.register_buffer("stat", torch.arange(12.0).reshape(4, 3))
    net.register_buffer("count", torch.zeros(2))
    driver = _driver(port)
    try:
        refs = [full_weights(driver, net)]
        driver.sync(net, 0)
        train_step(net, 1)
        net.stat = torch.full((1, 3), 7.0)
        net.count = torch.tensor([1.0 + 2**-40, 3.0], dtype=torch.float64)
        refs.append(full_weights(driver, net))
        driver.sync(net, 1)
        finished = driver.finish(net, 1)
    finally:
        driver.close()
    return {"refs": refs, "finished": finished}


def _close(rank: int, port: int, flags: str) -> dict[str, Any]:
    """Version 0 handed off; the rollout holds it (after its first tensor) until released; the trainer closes.
    3.5 MiB in 64 KiB buckets: most of the version is still to be sent when the rollout starts holding it."""
    net = fsdp2_net(width=384, depth=6)
    driver = _driver(port, "transport.bucket_size_mb=0.0625")
    try:
        driver.sync(net, 0)
        held = wait_for_file(str(Path(flags, "close-holding")), 30)
    finally:
        started = time.monotonic()
        driver.close()
        close_s = time.monotonic() - started
        if rank == 0:
            touch(str(Path(flags, "close-released")))
    return {"held": held, "close_s": close_s}


def _snapshot_fails(rank: int, port: int, where: str, failing: int) -> dict[str, Any]:
    """The staging memory of rank `failing` runs out at its second tensor of version 0 (the allocation fails,
    as an OOM would); then the memory is back and version 1 goes as usual."""
    from lightning_weightsync.trainer.overlap import Staging

    class BudgetStaging(Staging):
        """Staging memory that runs out after `budget` bytes (None: no limit)."""

        budget: int | None = None

        def _allocate(self, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            need = src.numel() * dtype.itemsize
            if self.budget is not None and self.nbytes + need > self.budget:
                raise torch.OutOfMemoryError(f"staging: {need} more bytes do not fit in {self.budget}")
            return super()._allocate(src, dtype)

    net = fsdp2_net()
    driver = _driver(port, f"trainer.overlap_gather={where}", "trainer.on_failure=raise")
    staging = driver.overlap.staging = BudgetStaging(driver.overlap.staging.kind)
    first = next(iter(net.parameters()))
    if rank == failing:  # what the first item takes: the full tensor (gathered at the sync), or the local shard
        staging.budget = (first.numel() if where == "sync" else first.to_local().numel()) * first.element_size()
    try:
        error, seconds = _outcome(lambda: driver.sync(net, 0))
        staging.budget = None
        train_step(net, 1)
        driver.sync(net, 1)
        finished = driver.finish(net, 1)
    finally:
        driver.close()
    return {"error": error, "seconds": seconds, "finished": finished, "last": driver.record.last_synced_version}


def _send_fails(rank: int, port: int, flags: str) -> dict[str, Any]:
    """3.5 MiB a version in 64 KiB buckets: the rollout dies at version 1's first tensor, long before rank 0's
    sender has taken the last one, so most of the background gather is still to run when the send fails."""
    net = fsdp2_net(width=384, depth=6)
    driver = _driver(port, "trainer.on_failure=raise", "transport.bucket_size_mb=0.0625")
    try:
        driver.sync(net, 0)
        train_step(net, 1)
        driver.sync(net, 1)  # version 0 was delivered; version 1 goes out and its rollout dies in it
        train_step(net, 2)
        error, seconds = _outcome(lambda: driver.sync(net, 2))
    finally:
        driver.close()
    return {"error": error, "seconds": seconds}


def _send_unpausable(rank: int, port: int, dead_url: str) -> dict[str, Any]:
    """Rank 0's rollout (a vLLM server that is not there) cannot be paused: its background send fails before
    the sender takes the stream, so the sender drains nothing of it; rank 1 gathers in the background."""
    net = fsdp2_net()
    driver = _driver(port, "trainer.min_receivers=0", "trainer.on_failure=raise", f"vllm.urls=[{dead_url}]")
    try:
        driver.sync(net, 0)
        train_step(net, 1)
        error, seconds = _outcome(lambda: driver.sync(net, 1))
    finally:
        driver.close()
    return {"error": error, "seconds": seconds}


def _failure_cases(rank: int, master_port: int, ports: dict[str, int], flags: str) -> dict[str, dict[str, Any]]:
    init_rank(rank, master_port, worker_timeout_s=FAIL_WORKER_TIMEOUT_S, group_timeout_s=GROUP_TIMEOUT_S)
    run: dict[str, Any] = {
        "agree": lambda: _agree(rank, ports["agree"], flags),
        "staging": lambda: _staging(rank, ports["staging"], flags),
        "close": lambda: _close(rank, ports["close"], flags),
        "snapshot_sync": lambda: _snapshot_fails(rank, ports["snapshot_sync"], "sync", failing=0),
        "snapshot_background": lambda: _snapshot_fails(rank, ports["snapshot_background"], "background", failing=1),
        "send_unpausable": lambda: _send_unpausable(
            rank, ports["send_unpausable"], f"http://127.0.0.1:{ports['dead']}"
        ),
        "send_fails": lambda: _send_fails(rank, ports["send_fails"], flags),
    }
    results: dict[str, dict[str, Any]] = {}
    broken = None
    for case in CASES:
        if broken is not None:  # the group may be out of step: the later cases would only add noise
            results[case] = {"not_run": f"case {broken} failed first", "seconds_case": 0.0}
            continue
        started = time.monotonic()
        try:
            results[case] = run[case]()
        except Exception:
            import traceback

            results[case], broken = {"crashed": traceback.format_exc()}, case
        finally:
            results[case]["seconds_case"] = time.monotonic() - started
            if rank == 0:
                touch(str(Path(flags, f"{case}.done")))
    return results


def _failure_role(role: int, master_port: int, ports: dict[str, int], flags: str) -> Any:
    """0, 1: the trainer ranks; 2: the rollouts of every case but the last; 3: the last case's, which dies."""
    if role < 2:
        return _failure_cases(role, master_port, ports, flags)
    done = {case: str(Path(flags, f"{case}.done")) for case in CASES}
    if role == 3:
        return rollouts_main([Rollout(ports["send_fails"], "rollout-doomed", done["send_fails"], die_in=1)], 100)
    hold = (str(Path(flags, "close-holding")), str(Path(flags, "close-released")))
    return rollouts_main(
        [
            Rollout(ports["agree"], "rollout-agree", done["agree"], delay_s=AGREE_DELAY_S),
            Rollout(ports["staging"], "rollout-staging", done["staging"], keep=True),
            Rollout(ports["close"], "rollout-close", done["close"], hold=hold),
            Rollout(ports["snapshot_sync"], "rollout-snapshot-sync", done["snapshot_sync"]),
            Rollout(ports["snapshot_background"], "rollout-snapshot-background", done["snapshot_background"]),
        ],
        100,
    )


@dataclass
class Failures:
    ranks: list[dict[str, dict[str, Any]]]
    rollouts: dict[str, list[Any]]

    def case(self, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
        broken = [
            f"rank {rank}: {result[name].get('crashed') or result[name]['not_run']}"
            for rank, result in enumerate(self.ranks)
            if "crashed" in result[name] or "not_run" in result[name]
        ]
        if broken:
            pytest.fail(f"case {name} did not run to its end:\n" + "\n".join(broken))
        return self.ranks[0][name], self.ranks[1][name]


@pytest.fixture(scope="module")
def failures(tmp_path_factory: pytest.TempPathFactory) -> Failures:
    flags = str(tmp_path_factory.mktemp("overlap-failures"))
    master = free_port()
    ports = {case: free_port() for case in (*CASES, "dead")}  # "dead": where no vLLM server listens
    started = time.monotonic()
    rank0, rank1, rollouts, _ = run_workers(
        _failure_role, [(r, master, ports, flags) for r in range(4)], timeout_s=FAIL_WORKER_TIMEOUT_S, doomed=[3]
    )
    print(f"failure cases: {time.monotonic() - started:.1f} s;", {c: round(rank0[c]["seconds_case"], 1) for c in CASES})
    return Failures([rank0, rank1], rollouts)


def test_latest_ranks_agree_on_skip_or_settle_while_only_the_sending_rank_still_sends(failures: Failures) -> None:
    r0, r1 = failures.case("agree")
    assert r0["outcomes"] == r1["outcomes"], (r0["outcomes"], r1["outcomes"])  # settled (True) or not, alike
    assert r0["skipped"] == r1["skipped"] > 0, (r0["skipped"], r1["skipped"])
    assert r0["error"] is None and r1["error"] is None, (r0["error"], r1["error"])  # finish(): both, in step
    assert r0["last"] == r1["last"] == AGREE_STEPS
    events = failures.rollouts["rollout-agree"]
    versions = applied(events)
    assert len(versions) == len(events), events  # nothing half-sent
    assert versions[0] == 0 and versions[-1] == AGREE_STEPS and versions == sorted(set(versions)), versions
    assert len(versions) + r0["skipped"] == AGREE_STEPS + 1, (versions, r0["skipped"])


def test_a_tensor_that_changes_shape_or_dtype_between_versions_gets_new_staging_and_arrives_bitwise(
    failures: Failures,
) -> None:
    r0, r1 = failures.case("staging")
    assert r0["finished"] is True and r1["finished"] is True
    events = failures.rollouts["rollout-staging"]
    assert applied(events) == [0, 1], events
    for version, (_, _, blob) in enumerate(events):
        got, want = load(blob), load(r0["refs"][version])
        assert sorted(got) == sorted(want)
        for name, tensor in want.items():
            assert (got[name].dtype, got[name].shape) == (tensor.dtype, tensor.shape), (version, name)
            assert torch.equal(got[name], tensor), (version, name)
    assert load(events[1][2])["count"].dtype == torch.float64 and load(events[1][2])["stat"].shape == (1, 3)


def test_close_with_a_version_in_flight_interrupts_it_at_once_and_the_rollout_never_applies_it(
    failures: Failures,
) -> None:
    from lightning_weightsync.trainer.overlap import CLOSE_JOIN_S

    r0, r1 = failures.case("close")
    assert r0["held"] and r1["held"], "the rollout never held version 0: the case did not run as planned"
    assert r0["close_s"] < CLOSE_JOIN_S / 2 and r1["close_s"] < CLOSE_JOIN_S / 2, (r0["close_s"], r1["close_s"])
    events = failures.rollouts["rollout-close"]
    assert applied(events) == [] and [v for v, _, _ in events] == [0], events  # v0 ended there, never applied


@pytest.mark.parametrize("where", ["sync", "background"])
def test_a_snapshot_that_fails_on_one_rank_fails_the_sync_on_every_rank_at_once_then_the_next_version_goes(
    failures: Failures, where: str
) -> None:
    r0, r1 = failures.case(f"snapshot_{where}")
    failing, other = (r0, r1) if where == "sync" else (r1, r0)  # sync: rank 0 stages full tensors; else every rank
    assert failing["error"] is not None and failing["error"].startswith("OutOfMemoryError"), failing["error"]
    assert other["error"] is not None and other["error"].startswith("SyncFailed"), other["error"]
    assert "snapshot of version 0 failed" in other["error"], other["error"]
    assert max(r0["seconds"], r1["seconds"]) < TIMEOUT_S / 2, (r0["seconds"], r1["seconds"])  # no rank waited it out
    # the ranks stayed in step: the next version goes, on every rank alike
    assert r0["finished"] is True and r1["finished"] is True and r0["last"] == r1["last"] == 1
    assert applied(failures.rollouts[f"rollout-snapshot-{where}"]) == [1]


@pytest.mark.parametrize("when", ["mid_version", "before_it_takes_the_stream"])
def test_the_sending_ranks_send_failing_drains_the_background_gather_and_every_rank_fails_in_seconds(
    failures: Failures, when: str
) -> None:
    """Mid-version (its rollout killed): the sender drains the rest of the stream itself. Before the sender
    takes the stream (its rollout cannot be paused): the overlap send drains it (`send.send_version`)."""
    failed = 1 if when == "mid_version" else 0
    r0, r1 = failures.case("send_fails" if when == "mid_version" else "send_unpausable")
    assert r0["error"] is not None and f"version {failed}" in r0["error"], r0["error"]
    assert r1["error"] is not None and r1["error"].startswith("SyncFailed"), r1["error"]
    assert f"version {failed} failed" in r1["error"], r1["error"]
    # the rank that only gathered finished its part (the stream was drained): no mirror-group timeout
    assert max(r0["seconds"], r1["seconds"]) < TIMEOUT_S / 2, (r0["seconds"], r1["seconds"])
