"""The GRPO recipe for real (recipes/grpo_tiny_cpu.py): 2 Lightning trainer processes (FSDP2 over gloo),
rollout processes receiving every version with `WeightReceiver` and generating with it, samples back
over the example's ZeroMQ channel. The policy must improve, and every sample must have been generated
with exactly the weights the trainer had after the optimizer step that made its version: the rollout
reports a fingerprint of the parameters it generates with, the trainer takes its own of its policy's."""

from __future__ import annotations

import json
import re
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


@pytest.mark.slow
def test_grpo_lora_adapter_with_overlap_sends_the_adapter_alone_and_says_the_background_send_s_seconds(
    tmp_path: Path,
) -> None:
    """`trainer.lora=adapter` through the recipe (recipe.lora wraps the policy with PEFT): version 0 carries the
    base and the adapter, later versions the adapter's bytes alone, and the rollout generates with exactly the
    trainer's policy, base and adapter (fingerprints over every parameter). With `trainer.overlap=true` each step
    line shows the previous version's background send: its number, bytes and seconds. One run for both: a run
    costs ~15 s of start-up; blocking adapter versions are checked in tests/unit/test_grpo.py."""
    peft = pytest.importorskip("peft")
    from examples.grpo import GRPORecipe, build_policy

    rows, out = run_recipe(tmp_path, "recipe.steps=3", "trainer.lora=adapter", "trainer.overlap=true")
    assert rows[0]["setting"] == "send_mode=gather overlap=true lora=adapter"
    check_fingerprints(rows, rollouts=1)
    policy = build_policy(GRPORecipe(), lora=True)
    assert isinstance(policy, peft.PeftModel)
    adapter = sum(p.nbytes for p in policy.parameters() if p.requires_grad)
    whole = sum(t.nbytes for t in policy.state_dict().values())
    # overlap: step N's line is version N-1, sent in the background while step N computed. Version 0's delivery is
    # recorded before version 1 is snapshotted (trainer/overlap.py), so version 1 is the adapter alone
    assert [(r["sync_version"], r["sync_bytes"]) for r in rows] == [(0, whole), (1, adapter), (2, adapter)]
    assert all(r["sync_s"] > 0 for r in rows)
    lines = re.findall(r"^step +(\d+)/3 .* sync v(\d+) [\d.]+ KiB (\d+\.\d{3})s  stall", out, re.MULTILINE)
    assert [(int(step), int(version)) for step, version, _ in lines] == [(1, 0), (2, 1), (3, 2)], out[-3000:]
