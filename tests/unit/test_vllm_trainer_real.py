"""vLLM's trainer-side API selects our engine by name, on vLLM's REAL classes (the contract venv:
`./dev vllm-contract tests/unit/test_vllm_trainer_real.py`; skipped where vLLM is not installed, since it pins
torch). `WeightTransferTrainerFactory.trainer_init` builds `LightningWeightSyncTrainerEngine` from vLLM's own
`ModuleSource`, and its `send_weights` syncs into our worker engine, built by vLLM's `WeightTransferEngineFactory`
and driven as vLLM's GPU worker drives it (v1/worker/gpu_worker.py `init_weight_transfer_engine`,
`start_weight_update`, `update_weights`, `finish_weight_update`), bitwise, version after version."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

pytest.importorskip(
    "vllm.distributed.weight_transfer.factory",
    reason="needs vLLM, which pins torch: runs in its contract venv "
    "(./dev vllm-contract tests/unit/test_vllm_trainer_real.py)",
)

from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import ModuleSource, VLLMWeightSyncClient, WeightSource
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from lightning_weightsync import ConfigError
from lightning_weightsync.demo.tiny_lm import build_model
from lightning_weightsync.integrations import vllm_trainer
from lightning_weightsync.rollout_engines.vllm import plugin
from lightning_weightsync.rollout_engines.vllm.worker import BACKEND_NAME
from tests.support.mp import free_port
from tests.support.transfer import engine_cfg
from tests.support.vllm_standin import StandInModel


class WorkerClient:
    """A `VLLMWeightSyncClient` that does what vLLM's server routes make each GPU worker do, in process."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.finished: list[str | None] = []

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def start_weight_update(self) -> None:
        self.engine.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.engine.update_weights(update_info)  # vLLM's own base method: parse, then receive_weights

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.engine.finish_weight_update()
        self.finished.append(weight_version)


class Untouchable:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"a non-sender rank called the client's {name}")


def worker_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, port: int) -> tuple[Any, torch.nn.Module]:
    """Our worker engine through vLLM's factory, on a CPU stand-in model (as tests/unit/test_vllm_real.py)."""
    plugin.register()
    path = tmp_path / "sync.yaml"
    path.write_text(OmegaConf.to_yaml(engine_cfg(port, bucket_size_mb=0.03125)))
    monkeypatch.setenv("LIGHTNING_WEIGHTSYNC_CONFIG", str(path))
    if not torch.accelerator.is_available():  # vLLM's base update_weights synchronizes the accelerator
        monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a, **k: None)
    torch.manual_seed(3)
    model = StandInModel(build_model().config)
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    record_metadata_for_reloading(model)
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(),
        model_config=SimpleNamespace(quantization=None, enable_sleep_mode=False, dtype=torch.float32),
        speculative_config=None,
        offload_config=None,
    )
    engine = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend=BACKEND_NAME), vllm_config, torch.device("cpu"), model
    )
    return engine, model


def test_the_factory_builds_our_trainer_engine_and_it_syncs_bitwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert vllm_trainer.BACKEND_NAME == BACKEND_NAME  # one name for both halves
    assert BACKEND_NAME in WeightTransferTrainerFactory._registry  # registered by the import above
    vllm_trainer.register()  # idempotent (the factory raises on a duplicate)
    port = free_port()
    worker, model = worker_engine(tmp_path, monkeypatch, port)
    client = WorkerClient(worker)
    assert isinstance(client, VLLMWeightSyncClient)
    trainer_model = build_model(seed=5)
    info = vllm_trainer.LightningWeightSyncTrainerInitInfo(
        rank=0, overrides=[f"transport.port={port}", "transport.bucket_size_mb=0.03125", "transport.timeout_s=20"]
    )
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(trainer_model))
    try:
        assert type(engine) is vllm_trainer.LightningWeightSyncTrainerEngine and engine.is_sender
        for version in (1, 2):
            engine.send_weights()
            state = model.state_dict()
            sent = dict(trainer_model.named_parameters())
            assert sent and all(torch.equal(state[name], p.detach()) for name, p in sent.items()), version
            assert worker.version == version
            with torch.no_grad():
                for p in trainer_model.parameters():
                    p.add_(1.0)
        assert client.finished == ["1", "2"]
    finally:
        engine.shutdown()
        worker.shutdown()


def test_other_ranks_walk_the_source_and_never_touch_the_client() -> None:
    trainer_model = build_model(seed=5)
    walked: list[str] = []

    class Counting(ModuleSource):
        def iter_full(self) -> Any:
            for name, tensor in super().iter_full():
                walked.append(name)
                yield name, tensor

    info = vllm_trainer.LightningWeightSyncTrainerInitInfo(rank=1)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=Untouchable(), source=Counting(trainer_model))
    engine.send_weights()
    engine.shutdown()
    assert walked == [name for name, _ in trainer_model.named_parameters()]


def test_a_source_without_full_tensors_is_refused_naming_why() -> None:
    class LocalOnly(ModuleSource):
        iter_full = WeightSource.iter_full  # not implemented: vLLM's implements_iter_full() says False

        def iter_local(self) -> Any:
            return super().iter_local()

    info = vllm_trainer.LightningWeightSyncTrainerInitInfo(rank=0)
    with pytest.raises(ConfigError, match="iter_full"):
        WeightTransferTrainerFactory.trainer_init(info, client=Untouchable(), source=LocalOnly(build_model()))
