"""The GRPO recipe's pieces that decide what it learns (examples/grpo.py): the reward, the group-relative
advantages, the clipped surrogate, the weights' fingerprint, the start-up checks and the plot."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lightning_weightsync.errors import ConfigError
from lightning_weightsync.examples.grpo import (
    BOS,
    GRPORecipe,
    fingerprint,
    generate,
    group_advantages,
    grpo_loss,
    plot,
    reward,
    validate,
)
from lightning_weightsync.examples.tiny_lm import build_model


def test_reward_is_the_fraction_of_the_count_up_that_is_right() -> None:
    prompts = torch.tensor([[BOS, 8], [BOS, 8], [BOS, 3]])
    completions = torch.tensor([[9, 0, 1, 2], [9, 0, 5, 5], [3, 3, 3, 3]])
    assert reward(prompts, completions).tolist() == [1.0, 0.5, 0.0]  # mod 10: 8 -> 9, 0, 1, 2


def test_advantages_are_relative_to_the_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.2, 0.2, 0.2])
    adv = group_advantages(rewards, group_size=4)
    assert adv[:4].sum().abs() < 1e-6 and adv[0] > 0 > adv[1]
    assert torch.equal(adv[4:], torch.zeros(4))  # equal rewards: nothing to learn from that group


def test_the_surrogate_clips_the_ratio() -> None:
    old = torch.zeros(2, 1)
    new = torch.tensor([[math.log(2.0)], [math.log(2.0)]], requires_grad=True)  # ratio 2 on both tokens
    loss, stats = grpo_loss(new, old, torch.tensor([1.0, -1.0]), clip_eps=0.2)
    # positive advantage: min(2 * 1, 1.2 * 1) = 1.2 (clipped, no gradient); negative: min(-2, -1.2) = -2
    assert loss.item() == pytest.approx(-(1.2 - 2.0) / 2)
    loss.backward()
    assert new.grad is not None and new.grad[0, 0] == 0 and new.grad[1, 0] != 0
    assert stats["clip_frac"] == 1.0
    same, stats = grpo_loss(old.clone(), old, torch.tensor([1.0, -1.0]), 0.2, ref_logprobs=old, kl_coef=0.1)
    assert stats["kl"] == 0.0 and same.item() == 0.0  # on-policy, at the reference: ratio 1, no KL


def test_fingerprint_sees_one_changed_weight_and_not_the_order() -> None:
    model = build_model(vocab_size=11, dim=32, n_layers=1, n_heads=2, max_seq_len=8)
    named = list(model.state_dict().items())
    before = fingerprint(named)
    assert fingerprint(reversed(named)) == before
    with torch.no_grad():
        model.lm_head.weight[3, 4] += 1e-6
    assert fingerprint(model.state_dict().items()) != before


def test_generate_samples_what_it_reports_the_logprobs_of() -> None:
    model = build_model(vocab_size=11, dim=32, n_layers=1, n_heads=2, max_seq_len=8).eval()
    prompts = torch.tensor([[BOS, 1]] * 3)
    completions, logprobs = generate(model, prompts, 4, 1.0, torch.Generator().manual_seed(0))
    assert completions.shape == logprobs.shape == (3, 4) and bool((logprobs <= 0).all())
    logits = model(torch.cat([prompts, completions], 1)[:, :-1])[:, 1:]
    again = torch.log_softmax(logits, -1).gather(2, completions.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(again, logprobs)  # the trainer's ratio is 1 on-policy


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"group_size": 1}, "recipe.group_size"),
        ({"prompts_per_step": 3, "rollouts": 2}, "recipe.rollouts"),
        ({"prompts_per_step": 3, "group_size": 3, "devices": 2}, "recipe.devices"),
        ({"completion_len": 9}, "max_seq_len"),
    ],
)
def test_bad_recipes_fail_at_start_up_naming_the_key(changes: dict[str, int], key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(GRPORecipe(**changes))  # type: ignore[arg-type]


def test_plot_draws_one_curve_per_setting(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    for setting in ("send_mode=gather", "send_mode=sharded"):
        rows = [{"setting": setting, "step": s, "reward_mean": s / 10, "stall_s": 0.01} for s in range(1, 11)]
        (tmp_path / f"{setting}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot(tmp_path).endswith("(2 settings)")
    assert (tmp_path / "grpo.png").stat().st_size > 1000
