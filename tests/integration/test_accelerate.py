"""AccelerateWeightSync: the optimizer post-hook counts real steps (not accumulation micro-steps),
explicit sync, and end to end: 2 processes under torchrun (Accelerate's DDP, and FSDP2 applied by
hand) sending every step to a real WeightReceiver whose final weights equal the trainer's bitwise."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

from lightning_weightsync import load_config  # noqa: E402
from lightning_weightsync.demo.tiny_lm import build_model  # noqa: E402
from lightning_weightsync.errors import ConfigError, WeightSyncError  # noqa: E402
from lightning_weightsync.trainer.accelerate import AccelerateWeightSync  # noqa: E402
from tests.support.mp import free_port, output_of, popen, spawned  # noqa: E402
from tests.support.receiver import assert_same_weights, received_versions, receiver_main  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "accelerate_tiny.py"
RUN_TIMEOUT_S = 120


@pytest.fixture
def accelerator() -> Iterator[Any]:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=3)
    yield acc
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _cfg(*overrides: str) -> Any:
    return load_config(overrides=["transport.port=0", "trainer.min_receivers=0", "transport.timeout_s=5", *overrides])


def _train(acc: Any, model: Any, optimizer: Any, micro_batches: int) -> None:
    data = torch.randint(0, 64, (micro_batches, 1, 6), generator=torch.Generator().manual_seed(0))
    for batch in data:
        with acc.accumulate(model):
            logits = model(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), batch[:, 1:].reshape(-1))
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()


def test_hook_counts_optimizer_steps_not_micro_steps(accelerator: Any) -> None:
    model = build_model(vocab_size=64, dim=16, n_layers=1, max_seq_len=8)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with AccelerateWeightSync(accelerator, model, _cfg("trainer.every_n_steps=2")) as sync:
        assert sync.last_synced_version == 0  # sync_on_fit_start
        _train(accelerator, model, optimizer, micro_batches=15)  # 3 micro-steps per optimizer step
        assert sync.step == 5
        assert sync.last_synced_version == 4  # synced at 2 and 4 only
        assert sync.last_stats.version == 4 and sync.last_stats.receivers == 0
        assert sync.sync(100) and sync.last_synced_version == 100  # explicit
        assert sync.state_dict() == {"step": 5, "last_synced_version": 100, "failures": 0}
    # closed: the hook is gone, further steps do nothing
    _train(accelerator, model, optimizer, micro_batches=3)
    assert sync.step == 5


def test_resume_state_and_initial_step(accelerator: Any) -> None:
    model = build_model(vocab_size=64, dim=16, n_layers=1, max_seq_len=8)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    cfg = _cfg("trainer.sync_on_fit_start=false")
    with AccelerateWeightSync(accelerator, model, cfg, initial_step=7) as sync:
        assert sync.last_synced_version is None
        _train(accelerator, model, optimizer, micro_batches=3)
        assert sync.step == 8 and sync.last_synced_version == 8
        state = sync.state_dict()
    with AccelerateWeightSync(accelerator, model, cfg) as resumed:
        resumed.load_state_dict(state)
        assert resumed.step == 8 and resumed.last_synced_version == 8
        _train(accelerator, model, optimizer, micro_batches=3)
        assert resumed.last_synced_version == 9


def test_failure_policy_warn(accelerator: Any) -> None:
    model = build_model(vocab_size=64, dim=16, n_layers=1, max_seq_len=8)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    cfg = _cfg("trainer.min_receivers=1", "transport.timeout_s=0.3", "trainer.on_failure=warn")
    with AccelerateWeightSync(accelerator, model, cfg) as sync:
        _train(accelerator, model, optimizer, micro_batches=3)
        assert sync.step == 1 and sync.failures == 2 and sync.last_synced_version is None
    cfg = _cfg("trainer.min_receivers=1", "transport.timeout_s=0.3", "trainer.sync_on_fit_start=false")
    with AccelerateWeightSync(accelerator, model, cfg) as sync, pytest.raises(WeightSyncError, match="min_receivers"):
        _train(accelerator, model, optimizer, micro_batches=3)


def test_an_fsdp_plugin_that_did_not_shard_the_model_is_a_warning(accelerator: Any, caplog) -> None:
    """Issue 25 item 7: on CPU Accelerate prepares DDP whatever its FSDP plugin says; only the recipes'
    comments said so, and the sync logged "FSDP plugin active" at INFO."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    model = build_model(vocab_size=64, dim=16, n_layers=1, max_seq_len=8)
    model, _optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)  # as `accelerate config` sets it
    with caplog.at_level("INFO", logger="lightning_weightsync"), AccelerateWeightSync(accelerator, model, _cfg()):
        pass
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "FSDP plugin" in r.getMessage()]
    assert len(said) == 1 and "not sharded" in said[0] and "fully_shard" in said[0], said


def test_needs_an_optimizer(accelerator: Any) -> None:
    model = build_model(vocab_size=64, dim=16, n_layers=1, max_seq_len=8)
    with pytest.raises(ConfigError, match="prepared 0 optimizers"):
        AccelerateWeightSync(accelerator, model, _cfg())


# ------------------------------------------------------------------ 2 processes under torchrun


def _torchrun() -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("torchrun")
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "fsdp2_by_hand, mode", [(False, "gather"), (True, "gather"), (True, "sharded")],
    ids=["accelerate_ddp", "fsdp2_by_hand", "fsdp2_by_hand-sharded"],
)  # fmt: skip
def test_torchrun_two_processes_to_receiver(tmp_path: Path, fsdp2_by_hand: bool, mode: str) -> None:
    port = free_port()
    steps, accumulate = 3, 2
    final = tmp_path / "final.safetensors"
    cmd = [
        *_torchrun(), "--standalone", "--nproc-per-node", "2", str(RECIPE),
        "--config", str(RECIPE.with_suffix(".yaml")),
        f"transport.port={port}", "transport.timeout_s=60", f"recipe.steps={steps}",
        f"recipe.accumulate_grad_batches={accumulate}", f"recipe.fsdp2_by_hand={str(fsdp2_by_hand).lower()}",
        f"recipe.save_final={final}", f"trainer.send_mode={mode}",
    ]  # fmt: skip
    with spawned(receiver_main, port, steps + 1, str(tmp_path)) as receiver:
        with popen(cmd, cwd=str(tmp_path)) as proc:
            out = output_of(proc, RUN_TIMEOUT_S, "torchrun")
        assert proc.returncode == 0, out[-4000:]
        receiver.join(30)
        assert receiver.exitcode == 0
    # one version per optimizer step (+ version 0); accumulation micro-steps add none
    assert received_versions(tmp_path) == [0, 1, 2, 3]
    assert f"{steps} steps ({steps * accumulate} micro-batches), last synced version {steps}" in out
    # sharded: both ranks sent their own part of every version (gather mode: rank 0 alone)
    assert out.count(f"version {steps} sent:") == (2 if mode == "sharded" else 1), out[-3000:]
    got = assert_same_weights(tmp_path / "received.safetensors", final)
    init = build_model().state_dict()
    assert sorted(got) == sorted(init)  # wrapper names (DDP's `module.`) dropped
    assert not torch.equal(got["embed.weight"], init["embed.weight"])


def test_recipe_module_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("accelerate_tiny", RECIPE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # type hints resolve through sys.modules
    spec.loader.exec_module(mod)
    from lightning_weightsync.demo.recipe import load_recipe

    recipe, cfg = load_recipe(RECIPE.with_suffix(".yaml"), ["recipe.steps=2"], schema=mod.AccelerateRecipe)
    assert recipe.steps == 2 and cfg.transport.bucket_size_mb == 0.03125
    with pytest.raises(ConfigError, match=r"recipe\.nope"):
        load_recipe(RECIPE.with_suffix(".yaml"), ["recipe.nope=1"], schema=mod.AccelerateRecipe)


@pytest.mark.slow
def test_torchrun_with_a_plain_accelerator_has_one_sender(tmp_path: Path) -> None:
    """Issue 12 point 5: under torchrun on CPU a plain `Accelerator()` says process 0 on both ranks;
    both used to start a sender (the second failed binding the port, blaming rank 0). The sending
    rank now comes from torch.distributed: one sender, both ranks finish."""
    port = free_port()
    cmd = [
        *_torchrun(), "--standalone", "--nproc-per-node", "2", str(RECIPE),
        "--config", str(RECIPE.with_suffix(".yaml")), "recipe.cpu=false", "recipe.steps=1",
        f"transport.port={port}", "transport.timeout_s=30", "trainer.min_receivers=0",
    ]  # fmt: skip
    with popen(cmd, cwd=str(tmp_path)) as proc:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, out[-4000:]
    assert out.count("accelerate_tiny: 1 steps") == 1, out[-4000:]  # printed by the one sending rank
    assert out.count("weight sender listening") == 1, out[-4000:]
    assert "did not see the launch" in out  # the warning names the real problem (no gradient sync)


def test_launched_processes_without_torch_distributed_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several launched processes but no process group: every one would be 'rank 0' and bind the
    sender's port; refused up front, naming this process's rank and the fix."""
    from lightning_weightsync.trainer.driver import process_rank

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ConfigError, match=r"RANK=1 of WORLD_SIZE=2.*init_process_group"):
        process_rank(0)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert process_rank(0) == 0
