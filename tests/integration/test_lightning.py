"""WeightSyncCallback: when it syncs (optimizer steps, not micro-batches), failure policy, resume, and
end to end: a 2-process CPU Lightning run (ModelParallelStrategy = FSDP2 over gloo, and DDP) sending
every step to a real WeightReceiver in another process, whose final weights equal the trainer's bitwise."""

from __future__ import annotations

import csv
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.loggers import Logger  # noqa: E402

from lightning_weightsync import WeightSyncTimeout, load_config  # noqa: E402
from lightning_weightsync.demo.tiny_lm import build_model  # noqa: E402
from lightning_weightsync.trainer.lightning import WeightSyncCallback  # noqa: E402
from lightning_weightsync.trainer.record import SyncRecord  # noqa: E402
from tests.support.mp import PYTHON, free_port, output_of, popen, spawned  # noqa: E402
from tests.support.receiver import assert_same_weights, received_versions, receiver_main  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "tiny_lm_cpu.yaml"
RUN_TIMEOUT_S = 150  # one training subprocess


# ------------------------------------------------------------------ single process: the schedule


@pytest.fixture(autouse=True)
def one_torch_thread() -> Any:
    """The in-process fits use a model of a few KiB: with torch's default intra-op threads they spend
    their time in thread hand-offs, and on a busy machine a fit takes seconds instead of ~0.1 s. The
    schedule does not depend on it; the subprocess runs below are not affected."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


class MemoryLogger(Logger):
    """Keeps what the callback logs (a real Lightning logger, in memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))

    def synced_versions(self) -> list[int]:
        return [int(m["weightsync/version"]) for _, m in self.rows if "weightsync/version" in m]


class Small(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = build_model(vocab_size=64, dim=16, n_layers=1, max_seq_len=8)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(batch[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 64), batch[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader(n: int) -> torch.utils.data.DataLoader:
    data = torch.randint(0, 64, (n, 6), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(list(data), batch_size=1)


def _cfg(*overrides: str) -> Any:
    return load_config(overrides=["transport.port=0", "trainer.min_receivers=0", "transport.timeout_s=5", *overrides])


def _fit(cb: WeightSyncCallback, *, steps: int, accumulate: int = 1, ckpt_path: str | None = None, tmp: Path) -> Any:
    logger = MemoryLogger()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        callbacks=[cb],
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp),
    )
    trainer.fit(Small(), train_dataloaders=_loader(64), ckpt_path=ckpt_path)
    return trainer, logger


class DeliveryLog(SyncRecord):
    """The callback's real record, also keeping every delivered version: counts what was sent and
    acknowledged, not what was logged, so a sync that logs nothing is still counted."""

    def __init__(self) -> None:
        super().__init__()
        self.versions: list[int] = []

    def delivered(self, version: int, stats: Any) -> None:
        self.versions.append(version)
        super().delivered(version, stats)


def expected_versions(*, max_steps: int, every_n_steps: int, sync_on_fit_start: bool) -> list[int]:
    """The documented schedule (sync_on_train_end=true), from the rule rather than from a run: 0 at
    start if enabled, every multiple of every_n_steps among the optimizer steps, the final step at the
    end unless it was just sent. Micro-batches never count."""
    versions = [0] if sync_on_fit_start else []
    versions += [step for step in range(1, max_steps + 1) if step % every_n_steps == 0]
    if versions[-1:] != [max_steps]:
        versions.append(max_steps)
    return versions


@pytest.mark.parametrize("sync_on_fit_start", [True, False], ids=["fit_start", "no_fit_start"])
@pytest.mark.parametrize("every_n_steps", [1, 2], ids=["every1", "every2"])
@pytest.mark.parametrize("accumulate", [1, 3], ids=["acc1", "acc3"])
def test_syncs_per_optimizer_step_not_per_micro_batch(
    tmp_path: Path, accumulate: int, every_n_steps: int, sync_on_fit_start: bool
) -> None:
    """Exactly the scheduled versions, whatever the accumulation: with accumulate=3 the 15 micro-batches
    add nothing (in particular none before the first optimizer step when there is no fit-start sync),
    and max_steps=5 is not a multiple of 2, so every_n_steps=2 ends with the train-end sync."""
    max_steps = 5
    cfg = _cfg(
        f"trainer.every_n_steps={every_n_steps}",
        f"trainer.sync_on_fit_start={str(sync_on_fit_start).lower()}",
        "trainer.sync_on_train_end=true",
    )
    cb = WeightSyncCallback(cfg, module_attr="model")
    cb.record = delivered = DeliveryLog()
    trainer, logger = _fit(cb, steps=max_steps, accumulate=accumulate, tmp=tmp_path)
    assert trainer.global_step == max_steps
    want = expected_versions(max_steps=max_steps, every_n_steps=every_n_steps, sync_on_fit_start=sync_on_fit_start)
    assert delivered.versions == want  # what was sent
    assert logger.synced_versions() == want  # what was logged
    assert cb.last_synced_version == max_steps and cb.failures == 0
    assert cb.last_stats is not None and cb.last_stats.receivers == 0 and cb.port is None  # sender closed after fit
    # every sync logs how long it blocked the training loop; it contains the send it waited for
    stalls = [m["weightsync/stall_seconds"] for _, m in logger.rows if "weightsync/stall_seconds" in m]
    sends = [m["weightsync/seconds"] for _, m in logger.rows if "weightsync/seconds" in m]
    assert len(stalls) == len(want) and all(st >= se > 0 for st, se in zip(stalls, sends, strict=True))
    assert cb.last_stall_seconds == stalls[-1]


def test_resume_restores_last_synced_version(tmp_path: Path) -> None:
    cb = WeightSyncCallback(_cfg("trainer.every_n_steps=3", "trainer.sync_on_train_end=false"), module_attr="model")
    trainer, _ = _fit(cb, steps=4, tmp=tmp_path)
    assert cb.last_synced_version == 3  # step 4 is not a multiple of 3
    ckpt = tmp_path / "a.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)["callbacks"]
    assert [v for k, v in saved.items() if "WeightSyncCallback" in k] == [{"last_synced_version": 3, "failures": 0}]

    class Probe(WeightSyncCallback):
        restored: int | None = None

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            Probe.restored = self.last_synced_version  # before the fit-start sync overwrites it
            super().on_train_start(trainer, pl_module)

    resumed = Probe(_cfg("trainer.every_n_steps=3"), module_attr="model")
    trainer, logger = _fit(resumed, steps=7, ckpt_path=str(ckpt), tmp=tmp_path)
    assert Probe.restored == 3
    # the restored weights are re-sent at start (version = restored global_step), then 6, then the
    # final step 7 when training ends
    assert logger.synced_versions() == [4, 6, 7]
    assert resumed.last_synced_version == 7


def test_dead_rollout_warn_keeps_training(tmp_path: Path) -> None:
    # one receiver required, none running: every sync times out after transport.timeout_s
    cfg = _cfg("trainer.min_receivers=1", "transport.timeout_s=0.5", "trainer.on_failure=warn")
    cb = WeightSyncCallback(cfg)
    trainer, logger = _fit(cb, steps=2, tmp=tmp_path)
    assert trainer.global_step == 2  # training went on
    assert cb.failures == 3 and cb.last_synced_version is None and logger.synced_versions() == []


def test_dead_rollout_raise_stops_training(tmp_path: Path) -> None:
    cfg = _cfg("trainer.min_receivers=1", "transport.timeout_s=0.5", "trainer.on_failure=raise")
    cb = WeightSyncCallback(cfg)
    with pytest.raises(WeightSyncTimeout, match="min_receivers"):
        _fit(cb, steps=2, tmp=tmp_path)
    assert cb.port is None  # sender closed on the exception


def test_weights_outside_fit_is_an_error() -> None:
    from lightning_weightsync.errors import WeightSyncError

    with pytest.raises(WeightSyncError, match=r"outside trainer\.fit"):
        WeightSyncCallback(_cfg()).sync(None, 1)  # type: ignore[arg-type]


# ------------------------------------------------------------------ 2 processes + a real receiver


def _train(tmp: Path, port: int, *extra: str) -> str:
    cmd = [
        PYTHON, "-m", "lightning_weightsync.demo.tiny_lm", "--config", str(RECIPE),
        f"transport.port={port}", "transport.timeout_s=60", f"recipe.output_dir={tmp / 'runs'}", *extra,
    ]  # fmt: skip
    with popen(cmd, cwd=str(tmp)) as proc:
        out = output_of(proc, RUN_TIMEOUT_S, "training")
    assert proc.returncode == 0, out[-4000:]
    return out


def _wait(proc: Any, timeout_s: float = 30) -> None:
    proc.join(timeout_s)
    assert proc.exitcode == 0, f"receiver exit code {proc.exitcode}"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["model_parallel", "ddp", "model_parallel-sharded"])
def test_two_process_run_every_step_to_receiver(tmp_path: Path, strategy: str) -> None:
    port = free_port()
    steps, accumulate = 3, 2
    strategy, _, mode = strategy.partition("-")  # sharded: every FSDP2 rank sends its own shards
    with spawned(receiver_main, port, steps + 1, str(tmp_path)) as receiver:
        out = _train(
            tmp_path, port, f"recipe.steps={steps}", f"recipe.accumulate_grad_batches={accumulate}",
            f"recipe.save_final={tmp_path / 'final.safetensors'}", f"recipe.strategy={strategy}",
            f"trainer.send_mode={mode or 'gather'}",
        )  # fmt: skip
        _wait(receiver)
    # every optimizer step (plus version 0), no extra sync for the accumulation micro-batches
    assert received_versions(tmp_path) == [0, 1, 2, 3]
    final = assert_same_weights(tmp_path / "received.safetensors", tmp_path / "final.safetensors")
    # names are what the rollout model expects; the weights moved away from the initial ones
    init = build_model().state_dict()
    assert sorted(final) == sorted(init)
    assert not torch.equal(final["embed.weight"], init["embed.weight"])
    assert int(final["steps_seen"]) == steps * accumulate  # an int buffer, synced too
    assert f"{steps} steps, last synced version {steps}" in out
    # sharded: both ranks sent their own part of every version (gather mode: rank 0 alone)
    assert out.count(f"version {steps} sent:") == (2 if mode else 1), out[-3000:]
    rows = list(csv.DictReader((next((tmp_path / "runs").rglob("metrics.csv"))).open()))
    logged = [int(float(r["weightsync/version"])) for r in rows if r.get("weightsync/version")]
    assert logged == [0, 1, 2, 3]
    assert all(float(r["weightsync/receivers"]) == 1 for r in rows if r.get("weightsync/receivers"))


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
def test_model_parallel_defaults_sharded_with_drifting_replicas_trains_to_the_end_bitwise(
    tmp_path: Path, overlap: bool
) -> None:
    """ModelParallelStrategy() untouched on 2 CPU devices (1 x 2: every rank a whole copy), sharded mode,
    replicas that drift (rank 1 nudges its copies after every step, as rounding does in real runs): training
    ends, every version arrives, the rollout's last version is the trainer's final weights bitwise (global
    rank 0's, as gather mode sends), one warning per drifted tensor, and the metrics count the drift."""
    from tests.support.drifting_tiny_lm import DRIFTING

    port = free_port()
    steps = 3
    with spawned(receiver_main, port, steps + 1, str(tmp_path)) as receiver:
        cmd = [
            PYTHON, "-m", "tests.support.drifting_tiny_lm", "--config", str(RECIPE), f"transport.port={port}",
            "transport.timeout_s=60", f"recipe.output_dir={tmp_path / 'runs'}", f"recipe.steps={steps}",
            "recipe.strategy=model_parallel_defaults", "trainer.send_mode=sharded", f"trainer.overlap={overlap}",
            "trainer.overlap_policy=wait", f"recipe.save_final={tmp_path / 'final.safetensors'}",
        ]  # fmt: skip
        with popen(cmd, cwd=str(REPO)) as proc:
            out = output_of(proc, RUN_TIMEOUT_S, "training")
        assert proc.returncode == 0, out[-4000:]
        _wait(receiver)
    assert received_versions(tmp_path) == [0, 1, 2, 3]
    assert_same_weights(tmp_path / "received.safetensors", tmp_path / "final.safetensors")
    for name in DRIFTING:
        said = [ln for ln in out.splitlines() if f"{name!r}, which every trainer rank holds whole, differs" in ln]
        assert len(said) == 1 and "ranks [0], ranks [1]" in said[0], (name, said, out[-3000:])
    rows = list(csv.DictReader((next((tmp_path / "runs").rglob("metrics.csv"))).open()))
    drift = [int(float(r["weightsync/replica_drift"])) for r in rows if r.get("weightsync/replica_drift")]
    # version 0 in step; version 1 the nudged tensors; later ones more (rank 1 trains on its nudged copy: no
    # collective keeps two whole copies in step, so the drift spreads through the gradients)
    assert drift[:2] == [0, len(DRIFTING)] and all(n >= len(DRIFTING) for n in drift[2:]), drift


@pytest.mark.slow
def test_two_process_resume_from_checkpoint(tmp_path: Path) -> None:
    port = free_port()
    ckpt = tmp_path / "tiny.ckpt"
    with spawned(receiver_main, port, 3 + 3, str(tmp_path)) as receiver:
        _train(tmp_path, port, "recipe.steps=2", f"recipe.save_checkpoint={ckpt}")
        state = torch.load(ckpt, weights_only=True)["callbacks"]
        assert [v["last_synced_version"] for k, v in state.items() if "WeightSyncCallback" in k] == [2]
        time.sleep(0.5)
        out = _train(
            tmp_path, port, "recipe.steps=4", f"recipe.ckpt_path={ckpt}",
            f"recipe.save_final={tmp_path / 'final.safetensors'}",
        )  # fmt: skip
        _wait(receiver)
    # first run: 0, 1, 2; the resumed run re-sends its restored step-2 weights, then 3, 4
    assert received_versions(tmp_path) == [0, 1, 2, 2, 3, 4]
    assert "4 steps, last synced version 4" in out
    assert_same_weights(tmp_path / "received.safetensors", tmp_path / "final.safetensors")


class Capture(pl.Callback):
    def __init__(self, sync: WeightSyncCallback) -> None:
        self.sync, self.names = sync, []

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.names = [name for name, _ in self.sync.weights(trainer)]


@pytest.mark.parametrize(
    ("module_attr", "prefix"), [(None, ""), ("model", ""), ("", "model.")], ids=["rule", "explicit", "whole"]
)
def test_one_liner_sends_the_served_child_under_its_own_names(tmp_path: Path, module_attr: Any, prefix: str) -> None:
    """Issue 12 point 2: `WeightSyncCallback(cfg)` on `self.model = network` used to send
    `model.embed.weight`, which the rollout's copy of the network does not have."""
    cb = WeightSyncCallback(_cfg(), module_attr=module_attr)
    capture = Capture(cb)
    logger = MemoryLogger()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=1, callbacks=[cb, capture], logger=logger,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(Small(), train_dataloaders=_loader(4))
    network = build_model(vocab_size=64, dim=16, n_layers=1, max_seq_len=8)
    assert sorted(capture.names) == sorted(prefix + n for n in network.state_dict())
