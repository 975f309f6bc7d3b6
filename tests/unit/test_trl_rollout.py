"""`integrations.trl_rollout.CpuRolloutWorker` as TRL's `RolloutWorkerProtocol` asks (trl 1.16.0
async_grpo_trainer.py:115-152): `check_health` raises when the worker stalls or its process is gone (TRL calls it
while it waits for samples, :360), `stop` is idempotent. Its samples and versions, with a real trainer:
tests/integration/test_trl_async_grpo.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from lightning_weightsync import WeightSyncError, WeightSyncTimeout
from tests.support.mp import free_port
from tests.support.transfer import engine_cfg

pytest.importorskip("trl.experimental.async_grpo", reason="needs trl (pip install 'lightning_weightsync[trl]')")


def test_check_health_names_a_stall_and_a_dead_process(tmp_path: Path) -> None:
    from examples.trl_async_grpo import PROMPTS, count_up, write_tiny_model
    from lightning_weightsync.integrations.trl_rollout import CpuRolloutWorker

    model_dir = write_tiny_model(tmp_path / "model")
    worker = CpuRolloutWorker(engine_cfg(free_port()), str(model_dir), PROMPTS, count_up)  # no trainer: no version
    try:
        worker.check_health(0.1)  # not started: nothing is expected yet
        worker.start()
        time.sleep(0.3)
        with pytest.raises(WeightSyncTimeout, match="heartbeat_stale_after_s"):
            worker.check_health(0.1)
        worker.check_health(60)
        worker.process.kill()
        worker.process.join(10)
        with pytest.raises(WeightSyncError, match="rollout process is gone"):
            worker.check_health(60)
        assert worker.versions() == {}
    finally:
        worker.stop()
        worker.stop()
    assert not worker.process.is_alive()
