"""The TRL example as a user runs it (`python examples/trl_async_grpo.py --config examples/sync.yaml`): TRL's real
`AsyncGRPOTrainer` (trl 1.16.0) on CPU, 2 ranks (DDP over gloo through Accelerate, the environment a launcher
sets), with our `WeightSyncTransfer` as its `weight_transfer` and our `CpuRolloutWorker` as its `rollout_worker`.

One run shows both (one run, since each costs three processes' imports):
- the trainer trains and syncs after every step; every version the rollout received (and generated with) has,
  bitwise, the digest of the trainer's weights for that version (`versions.verify.weights_digest`);
- then the rollout process is killed: the next sync fails on rank 0 within `transport.liveness_s` (2 s here)
  with an error naming the lost rollout, and rank 1 is released (it leaves its barrier with an error once rank 0
  is gone), never a hang.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.mp import LOAD_SLACK_S, PYTHON, free_port, output_of, popen

pytest.importorskip("trl.experimental.async_grpo", reason="needs trl (pip install 'lightning_weightsync[trl]')")

pytestmark = pytest.mark.slow  # three processes import torch, transformers and trl: ~35 s on 2 loaded cores

STEPS_BEFORE_KILL = 3  # versions 1 (train begin) .. 3 (after step 2) are delivered; version 4 finds no rollout
RUN_TIMEOUT_S = 240.0
EXAMPLE = "examples/trl_async_grpo.py"
REPO = Path(__file__).resolve().parents[2]


def test_async_grpo_trains_syncs_bitwise_and_fails_fast_when_the_rollout_dies(tmp_path: Path) -> None:
    port, master = free_port(), free_port()
    cmd = [PYTHON, EXAMPLE, "--config", "examples/sync.yaml", f"transport.port={port}", "--out", str(tmp_path)]
    cmd += ["--steps", "6", "--kill-rollout-after-step", str(STEPS_BEFORE_KILL)]  # rank 0 writes the tiny model
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master), "OMP_NUM_THREADS": "1"}
    with (
        popen(cmd, env={**env, "RANK": "0", "LOCAL_RANK": "0"}, cwd=REPO) as rank0,
        popen(cmd, env={**env, "RANK": "1", "LOCAL_RANK": "1"}, cwd=REPO) as rank1,
    ):
        out0 = output_of(rank0, RUN_TIMEOUT_S, "rank 0")
        out1 = output_of(rank1, 60, "rank 1 after rank 0 ended")  # released, not hung in a barrier
    results = [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in (0, 1)]
    first, second = results
    assert "error" in first, f"rank 0 should fail once its rollout is gone:\n{out0[-3000:]}"

    # every version the rollout received is the trainer's, bitwise; all before the kill arrived
    trainer, rollout = first["trainer"], first["rollout"]
    delivered = [str(v) for v in range(1, STEPS_BEFORE_KILL + 1)]
    assert sorted(rollout, key=int) == delivered, (rollout, out0[-3000:])
    assert {v: rollout[v] for v in delivered} == {v: trainer[v] for v in delivered}
    assert len(set(rollout.values())) == len(delivered), "training changed the weights at every step"
    assert first["model_version"] == STEPS_BEFORE_KILL
    assert "rollout generated with versions [1, 2, 3]: all bitwise the trainer's" in out0, out0[-3000:]

    # the lost rollout: named, within liveness_s, and rank 1 ended too, soon after
    assert "trl-cpu-rollout" in first["error"] and "liveness_s" in first["error"], first["error"]
    assert first["error_after_kill_s"] < 2.0 + LOAD_SLACK_S
    assert "error" in second, f"rank 1 should end with rank 0's departure:\n{out1[-3000:]}"
    assert abs(second["ended"] - first["ended"]) < 30.0
    assert rank0.returncode == 1 and rank1.returncode == 1
