"""The GRPO recipe's pieces that decide what it learns (examples/grpo.py): the reward, the group-relative
advantages, the clipped surrogate, the weights' fingerprint, the start-up checks, the LoRA policy and what its
rollouts do with adapter versions, the step line and the plot."""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.grpo import (
    BOS,
    GRPORecipe,
    LoraRecipe,
    build_policy,
    figure,
    fingerprint,
    generate,
    group_advantages,
    grpo_loss,
    plot,
    reward,
    rollout_policy,
    step_line,
    uses_lora,
    validate,
)
from lightning_weightsync import load_config, merge_weight_chunks, split_weight_chunks
from lightning_weightsync.demo.tiny_lm import build_model
from lightning_weightsync.errors import ConfigError
from lightning_weightsync.rollout.consume import begin_version
from lightning_weightsync.trainer.driver import SyncDriver


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
        ({"lora": LoraRecipe(r=0)}, "recipe.lora"),
    ],
)
def test_bad_recipes_fail_at_start_up_naming_the_key(changes: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(GRPORecipe(**changes))  # type: ignore[arg-type]


def test_plot_draws_one_curve_per_setting(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    for setting in ("send_mode=gather", "send_mode=gather overlap=true", "send_mode=gather lora=adapter"):
        rows = [
            {"setting": setting, "step": s, "reward_mean": s / 10, "stall_s": 0.01, "sync_version": s, "sync_bytes": 99}
            for s in range(1, 11)
        ]
        (tmp_path / f"{setting}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot(tmp_path).endswith("(3 settings)")
    assert (tmp_path / "grpo.png").stat().st_size > 1000


def test_plot_shows_coinciding_curves_keeps_its_legend_off_the_data_and_scales_the_stall_past_step_one() -> None:
    """gather, sharded and overlap earn the same rewards (the same weights every version): one line, each setting's
    markers at their own steps along it; the legend below the panels; a first sync ten times the others (the
    group's set-up) is marked on the top edge, not the scale of the hundred after it."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    same = [0.1 + 0.006 * s + 0.05 * (s % 3) for s in range(1, 41)]
    runs = {
        name: [{"step": s, "reward_mean": rewards[s - 1], "stall_s": (0.38 if s == 1 else 0.02 + 0.001 * (s % 7)),
                "sync_version": s, "sync_bytes": 70 * 1024} for s in range(1, 41)]
        for name, rewards in (("gather", same), ("sharded", same), ("overlap", list(same)),
                              ("lora", [r / 2 for r in same]))
    }  # fmt: skip
    fig = figure(runs)
    try:
        top, middle, _ = fig.axes
        curves = {line.get_label(): line for line in top.get_lines() if not line.get_label().startswith("_")}
        assert sorted(curves) == ["gather", "lora", "overlap", "sharded"]
        offsets = [curves[name].get_markevery() for name in ("gather", "sharded", "overlap")]
        assert len({start for start, _ in offsets}) == 3, f"the three draw their markers at the same steps: {offsets}"
        assert {len(curves[name].get_xdata()) for name in curves} == {40}

        legend = fig.legends[0]
        assert "gather = sharded = overlap" in legend.get_title().get_text()
        fig.canvas.draw()
        box = legend.get_window_extent()
        assert not any(box.overlaps(axes.get_window_extent()) for axes in fig.axes), "the legend covers a panel"

        assert 0.026 * 1000 <= middle.get_ylim()[1] < 100, middle.get_ylim()  # the later syncs', not step 1's
        assert "380" in middle.get_title(loc="right")
    finally:
        plt.close(fig)


def test_the_step_line_says_the_delivered_version_s_bytes_and_send_seconds() -> None:
    row = {"step": 7, "reward_mean": 0.5, "sample_version": 6, "staleness": 0, "stall_s": 0.004}
    row |= {"wait_samples_s": 0.03, "sync_version": 6, "sync_bytes": 25 * 1024 + 300, "sync_s": 0.0421}
    line = step_line(row, GRPORecipe(steps=10))  # trainer.overlap: version 6 was sent while step 7 ran
    assert "  sync v6 25.3 KiB 0.042s  stall 0.004s  wait 0.030s" in line and line.startswith("step    7/10")
    nothing = step_line(row | {"sync_version": None, "sync_bytes": None, "sync_s": None}, GRPORecipe(steps=10))
    assert "  sync    ?  stall" in nothing  # no version delivered yet (or only failed ones)


# -- LoRA ----------------------------------------------------------------------------------------------
def test_lora_wraps_the_policy_when_trainer_lora_asks_for_adapters_or_when_told() -> None:
    recipe = GRPORecipe()
    assert not uses_lora(recipe, load_config())  # trainer.lora=auto: a plain model is sent as it is
    assert uses_lora(recipe, load_config(overrides=["trainer.lora=adapter"]))
    assert uses_lora(GRPORecipe(lora=LoraRecipe(enabled=True)), load_config())
    assert not uses_lora(GRPORecipe(lora=LoraRecipe(enabled=False)), load_config(overrides=["trainer.lora=adapter"]))
    # the rollouts load adapters into their own PEFT model: plain-weight LoRA versions are refused at start-up
    for refused in ("trainer.lora=merged", "trainer.lora=full", "trainer.lora=adapter rollout.sink.lora=merge"):
        with pytest.raises(ConfigError, match=re.escape("trainer.lora=adapter (or auto) and rollout.sink.lora=keep")):
            uses_lora(recipe, load_config(overrides=refused.split()))


async def test_the_rollouts_keep_the_base_and_load_every_adapter_version() -> None:
    """What `./dev grpo trainer.lora=adapter` sends, into the example's rollout (its module sink, as the
    rollout process builds it): version 0 the base and the adapter, then the adapter alone, and after
    every version the rollout generates with the trainer's policy exactly (its merged weights included)."""
    pytest.importorskip("peft")
    recipe, cfg = GRPORecipe(), load_config(overrides=["trainer.lora=adapter"])
    policy = build_policy(recipe, lora=True)
    assert policy.get_base_model() is not policy and policy.peft_config["default"].r == recipe.lora.r
    adapter_bytes = sum(p.nbytes for p in policy.parameters() if p.requires_grad)
    whole_bytes = sum(t.nbytes for t in policy.state_dict().values())  # the base (buffers too) and the adapter
    rollout, sink = rollout_policy(recipe, cfg)
    with torch.no_grad():  # a rollout that holds other values everywhere until a version lands
        for p in rollout.parameters():
            p.add_(1.0)
    driver = SyncDriver(cfg, rank=0, device=None, prefix=None)
    prompts = torch.tensor([[BOS, d] for d in range(10)])
    for version in range(3):
        sent = {n: t.detach().clone() for n, t in driver.weights(policy)}
        begin_version(sink, version, driver.tied(policy), driver.lora.spec)
        async for name, tensor in merge_weight_chunks(
            split_weight_chunks(sent.items(), 4096), 4096, into=sink.destination
        ):
            sink.accept(name, tensor)
        sink.commit(version)
        driver.record.delivered(version, None)
        assert sum(t.nbytes for t in sent.values()) == (whole_bytes if version == 0 else adapter_bytes)
        assert version == 0 or all(".lora_A." in n or ".lora_B." in n for n in sent), sorted(sent)
        assert fingerprint(rollout.named_parameters()) == fingerprint(policy.named_parameters())
        torch.testing.assert_close(rollout(prompts), policy(prompts), rtol=0, atol=0)
        for name, merged in _merged(policy).items():
            assert torch.equal(_merged(rollout)[name], merged), name
        with torch.no_grad():  # a training step: the adapter moves, the base is frozen
            for p in policy.parameters():
                if p.requires_grad:
                    p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(version)))
    assert adapter_bytes < whole_bytes / 2


def _merged(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's weights that `policy` (a PeftModel) computes with: PEFT's `merge_and_unload` of a copy."""
    return {n: t.detach().clone() for n, t in copy.deepcopy(policy).merge_and_unload().named_parameters()}
