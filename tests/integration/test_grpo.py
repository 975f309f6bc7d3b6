"""The GRPO recipe for real (recipes/grpo_tiny_cpu.py): 2 Lightning trainer processes (FSDP2 over gloo),
rollout processes receiving every version with `WeightReceiver` and generating with it, samples back
over the example's ZeroMQ channel. The policy must improve, and every sample must have been generated
with exactly the weights the trainer had after the optimizer step that made its version: the rollout
reports a fingerprint of the tensors it generates with, the trainer takes its own of what it sent."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.mp import PYTHON, output_of, popen

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
RUN = [PYTHON, str(RECIPES / "grpo_tiny_cpu.py"), "--config", str(RECIPES / "grpo_tiny_cpu.yaml")]


def run_recipe(tmp_path: Path, *overrides: str, timeout_s: float = 150) -> tuple[list[dict[str, Any]], str]:
    cmd = [*RUN, f"recipe.output_dir={tmp_path}", "recipe.plot=false", "transport.timeout_s=30", *overrides]
    with popen(cmd, cwd=str(tmp_path)) as proc:
        out = output_of(proc, timeout_s, "the GRPO recipe")
    assert proc.returncode == 0, out[-4000:]
    (jsonl,) = tmp_path.glob("*.jsonl")
    return [json.loads(line) for line in jsonl.read_text().splitlines()], out


def check_fingerprints(rows: list[dict[str, Any]], rollouts: int) -> None:
    """Every message's weights fingerprint is the trainer's of that version; the versions differ."""
    seen: dict[int, set[int]] = {}
    for row in rows:
        for m in row["samples"]:
            assert m["fingerprint"] == row["trainer_fingerprints"][str(m["version"])], (row["step"], m)
            seen.setdefault(m["version"], set()).add(m["rollout"])
    assert all(len(who) == rollouts for who in seen.values()), seen  # on-policy: each rollout, each version
    trainer = [row["trainer_fingerprint"] for row in rows]
    assert len(set(trainer)) == len(trainer), "the weights did not change every step"


@pytest.mark.slow
def test_grpo_learns_from_rollouts_that_generate_with_the_weights_sent(tmp_path: Path) -> None:
    rows, out = run_recipe(tmp_path, "recipe.steps=30", "recipe.seed=0")
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert all(r["sample_version"] == r["step"] - 1 and r["staleness"] == 0 for r in rows)  # on-policy
    check_fingerprints(rows, rollouts=1)
    start = sum(r["reward_mean"] for r in rows[:5]) / 5
    end = sum(r["reward_mean"] for r in rows[-5:]) / 5
    assert end > start + 0.1, f"mean reward {start:.3f} over the first 5 steps, {end:.3f} over the last 5"
    assert "fingerprints equal" in out and all(r["stall_s"] >= 0 for r in rows)


@pytest.mark.slow
def test_grpo_sharded_send_mode_two_rollouts(tmp_path: Path) -> None:
    rows, out = run_recipe(tmp_path, "recipe.steps=6", "recipe.rollouts=2", "trainer.send_mode=sharded")
    assert "not FSDP-sharded" not in out  # the 2 FSDP2 ranks each sent their own shards
    assert rows[0]["setting"] == "send_mode=sharded"
    check_fingerprints(rows, rollouts=2)
