"""GRPO on CPU: a Lightning trainer learns a task from rewards its rollouts earn with the weights they received.

    python recipes/grpo_tiny_cpu.py --config recipes/grpo_tiny_cpu.yaml [key=value ...]

One command starts everything on one machine:

1. `recipe.rollouts` rollout processes (`python -m lightning_weightsync.examples.grpo rollout ...`), each
   with a `WeightReceiver` that receives every version straight into its own copy of the tiny LM;
2. the Lightning trainer (`recipe.devices` CPU processes, FSDP2 over gloo), whose `WeightSyncCallback`
   sends version 0 at start and one version after every optimizer step.

Each rollout loops: receive a version -> sample `recipe.group_size` completions for each of its prompts
with the weights it now holds -> score them -> push them, tagged with the version that produced them and a
fingerprint of the weights it generated with, to the trainer over the example's own channel (one ZeroMQ
PUSH/PULL pair, JSON messages; `SampleChannel`). The library moves weights, never samples.

The task (`reward`): the prompt is one digit d; the answer is the next `recipe.completion_len` digits
counting up, d+1, d+2, ... (mod 10). Reward = the fraction of answer positions right, so a random policy
earns about 1/11 and the optimum is 1.0. A tiny LM learns it from rewards alone in about a hundred steps.

The trainer (`GRPOModule.training_step`) takes `recipe.prompts_per_step` groups whose version is at least
`trainer step - recipe.max_staleness` (older ones are dropped), computes group-relative advantages
((r - mean of the group) / (std of the group + eps)), and minimises the clipped surrogate
-min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps) * A) per completion token, where ratio is the
current policy's probability of the token over the probability the rollout sampled it with; plus, with
`recipe.kl_coef > 0`, a KL penalty (the k3 estimator) to the initial weights.

Every step prints one line (reward mean, samples' version and staleness, sync seconds, trainer stall) and
appends the same numbers to `<recipe.output_dir>/<label>.jsonl`; at the end `<output_dir>/grpo.png` plots
reward and stall against step, one curve per JSONL in the directory (one per setting: run the recipe again
with another `trainer.*` override and the same output_dir to compare). The JSONL also holds, for every
version, the trainer's fingerprint of its weights after that optimizer step and the fingerprint each
rollout reported for the weights it generated with; the final line says whether they all matched.

`trainer.*` overrides (`trainer.send_mode=sharded`, ...) go to `WeightSyncCallback` unchanged; nothing here
reads a `trainer.*` key except to name the setting in the plot.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from ..engine.verify import weights_digest
from ..errors import ConfigError, WeightSyncError, WeightSyncTimeout
from .recipe import build_parser, load_recipe, recipe_main, setup_logging
from .tiny_lm import TinyLM, build_model

logger = logging.getLogger("lightning_weightsync.examples.grpo")  # also when run as __main__

BOS = 10  # token ids 0-9 are the digits; 10 starts every sequence
ROLLOUT_ENV = "LWS_GRPO_RESOLVED"  # set by the launching process: ports its Lightning ranks must share
DEFAULT_MODEL = {"vocab_size": 11, "dim": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 8}


@dataclass
class GRPORecipe:
    """The `recipe:` section (recipes/grpo_tiny_cpu.yaml documents every key)."""

    steps: int = 100  # optimizer steps = weight versions after version 0
    prompts_per_step: int = 8  # groups per optimizer step (split evenly between the rollouts)
    group_size: int = 8  # completions sampled per prompt
    completion_len: int = 4
    lr: float = 5e-3
    clip_eps: float = 0.2
    kl_coef: float = 0.0  # > 0: KL penalty to the initial weights (a frozen reference copy on the trainer)
    temperature: float = 1.0
    max_staleness: int = 0  # accept samples from versions >= trainer step - max_staleness
    rollouts: int = 1  # rollout processes, each with its own WeightReceiver
    devices: int = 2  # trainer processes
    accelerator: str = "cpu"
    strategy: str = "model_parallel"  # model_parallel (FSDP2) | ddp | auto (devices=1)
    seed: int = 0
    threads: int = 1  # torch threads per process (the trainer ranks and the rollouts share the cores)
    samples_port: int = 0  # the trainer's PULL socket for samples; 0: a free port, chosen at start
    sample_timeout_s: float = 120.0  # the trainer gives up waiting for samples after this long
    label: str | None = None  # the curve's name in the plot; None: from the trainer.* settings
    output_dir: str = "runs/grpo"
    plot: bool = True
    model: dict[str, Any] = field(default_factory=dict)  # TinyLMConfig overrides (merged onto DEFAULT_MODEL)


def validate(recipe: GRPORecipe) -> None:
    """The recipe's own consistency, at start-up (the weightsync sections were validated by load_config)."""
    for key in ("prompts_per_step", "group_size", "completion_len", "rollouts"):
        if getattr(recipe, key) < 1:
            raise ConfigError(f"recipe.{key}={getattr(recipe, key)} must be >= 1")
    if recipe.group_size < 2:
        raise ConfigError(f"recipe.group_size={recipe.group_size}: group-relative advantages need >= 2 completions")
    if recipe.prompts_per_step % recipe.rollouts:
        raise ConfigError(
            f"recipe.prompts_per_step={recipe.prompts_per_step} must be a multiple of recipe.rollouts={recipe.rollouts}"
        )
    if (recipe.prompts_per_step * recipe.group_size) % recipe.devices:
        raise ConfigError(
            f"recipe.prompts_per_step * recipe.group_size = {recipe.prompts_per_step * recipe.group_size} "
            f"completions must split evenly over recipe.devices={recipe.devices}"
        )
    if recipe.max_staleness < 0 or recipe.clip_eps <= 0 or recipe.temperature <= 0 or recipe.kl_coef < 0:
        raise ConfigError("recipe.max_staleness and recipe.kl_coef must be >= 0, clip_eps and temperature > 0")
    need = 2 + recipe.completion_len  # BOS, the digit, the answer
    if model_options(recipe).get("max_seq_len", 0) < need or model_options(recipe).get("vocab_size", 0) < BOS + 1:
        raise ConfigError(f"recipe.model: max_seq_len must be >= {need} and vocab_size >= {BOS + 1}")


def model_options(recipe: GRPORecipe) -> dict[str, Any]:
    return {**DEFAULT_MODEL, **recipe.model, "seed": recipe.seed}


# ------------------------------------------------------------------------------------- the task


def prompts_for(n: int, generator: torch.Generator) -> torch.Tensor:
    """`n` prompts [BOS, d], d a random digit."""
    digits = torch.randint(0, 10, (n, 1), generator=generator)
    return torch.cat([torch.full((n, 1), BOS), digits], dim=1)


def reward(prompts: torch.Tensor, completions: torch.Tensor) -> torch.Tensor:
    """The verifiable reward: the fraction of positions i where completion[i] == (d + i + 1) % 10."""
    steps = torch.arange(1, completions.shape[1] + 1)
    target = (prompts[:, 1:2] + steps) % 10
    return (completions == target).float().mean(dim=1)


@torch.no_grad()
def generate(
    model: TinyLM, prompts: torch.Tensor, length: int, temperature: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample `length` tokens after each prompt: (completions, the log-probability each was sampled with)."""
    seq, logprobs = prompts, []
    for _ in range(length):
        logits = model(seq)[:, -1].float() / temperature
        token = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
        logprobs.append(F.log_softmax(logits, dim=-1).gather(1, token))
        seq = torch.cat([seq, token], dim=1)
    return seq[:, prompts.shape[1] :], torch.cat(logprobs, dim=1)


def token_logprobs(
    model: torch.nn.Module, sequences: torch.Tensor, prompt_len: int, temperature: float
) -> torch.Tensor:
    """Log-probabilities of the completion tokens of `sequences` (prompt + completion) under `model`."""
    logits = model(sequences[:, :-1])[:, prompt_len - 1 :].float() / temperature
    return F.log_softmax(logits, dim=-1).gather(2, sequences[:, prompt_len:].unsqueeze(-1)).squeeze(-1)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate (+ kl_coef * k3 KL to the reference), averaged over completion tokens."""
    ratio = (logprobs - old_logprobs).exp()
    adv = advantages.unsqueeze(1)
    surrogate = torch.min(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    loss = -surrogate.mean()
    stats = {"clip_frac": float(((ratio - 1).abs() > clip_eps).float().mean()), "kl": 0.0}
    if ref_logprobs is not None and kl_coef > 0:
        log_r = ref_logprobs - logprobs
        kl = (log_r.exp() - log_r - 1).mean()
        loss = loss + kl_coef * kl
        stats["kl"] = float(kl.detach())
    return loss, stats


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """(r - mean of its group) / (std of its group + eps); a group whose rewards are all equal teaches nothing."""
    groups = rewards.view(-1, group_size)
    return ((groups - groups.mean(dim=1, keepdim=True)) / (groups.std(dim=1, keepdim=True) + eps)).view(-1)


fingerprint = weights_digest  # the library's digest of a set of weights (engine/verify.py), by its name here


# ------------------------------------------------------------------------------------- the sample channel


class SampleChannel:
    """The example's own way back from the rollouts: one ZeroMQ PULL socket on trainer rank 0, JSON messages.

    A message is one rollout's groups for one version: {"rollout", "version", "fingerprint", "prompts",
    "completions", "logprobs", "rewards", "generate_s"}. JSON, not pickle: a sample is a few lists of numbers.
    """

    def __init__(self, host: str, port: int, alive: Callable[[], str | None] = lambda: None) -> None:
        import zmq

        self._zmq = zmq
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.PULL)
        self.socket.bind(f"tcp://{host}:{port}")
        self.alive = alive  # a reason when a rollout is gone (checked while waiting)
        self.dropped = 0  # completions older than max_staleness allows

    def take(self, rows: int, min_version: int, timeout_s: float) -> list[dict[str, Any]]:
        """Messages holding `rows` completions, each of version >= min_version, in arrival order."""
        taken: list[dict[str, Any]] = []
        have = 0
        deadline = time.monotonic() + timeout_s
        while have < rows:
            if not self.socket.poll(200):
                gone = self.alive()
                if gone:
                    raise WeightSyncError(f"grpo: {gone}")
                if time.monotonic() > deadline:
                    raise WeightSyncTimeout(
                        f"grpo: no samples of version >= {min_version} within recipe.sample_timeout_s={timeout_s}s"
                    )
                continue
            message = json.loads(self.socket.recv())
            n = len(message["prompts"])
            if message["version"] < min_version:
                self.dropped += n
                continue
            taken.append(message)
            have += n
        return taken

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


# ------------------------------------------------------------------------------------- the rollout


def held_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The rollout's own tensors by the names the trainer sends them under (its state dict, in place)."""
    return {name: t for name, t in model.state_dict(keep_vars=True).items()}


async def receive_into(receiver: Any, held: dict[str, torch.Tensor], wait_s: float | None) -> list[str]:
    """One version straight into the rollout's model; the names received (WeightSyncTimeout when none came)."""
    names: list[str] = []

    def into(meta: Any) -> torch.Tensor | None:
        return held[meta.name].data if meta.name in held else None

    async for name, tensor in receiver.receive_weights(into=into, wait_s=wait_s):
        if name not in held:
            raise ConfigError(f"grpo rollout: the trainer sent {name!r}, which the rollout's model does not have")
        dest = held[name].data
        if tensor.data_ptr() != dest.data_ptr():  # not received in place (e.g. another dtype): copy it in
            dest.copy_(tensor)
        names.append(name)
    return names


async def rollout_loop(recipe: GRPORecipe, cfg: DictConfig, index: int, samples_address: str) -> None:
    """Receive a version, generate and score this rollout's groups with it, push them; repeat until stopped.

    With `recipe.max_staleness` = k > 0 the rollout generates up to k more batches with the version it
    holds while no newer one has started, so the trainer can train on them while the next version is
    generated (a pipeline k versions deep); with 0 it waits for every new version (on-policy)."""
    import zmq

    from ..engine.receiver import WeightReceiver

    torch.set_num_threads(recipe.threads)
    model = build_model(model_options(recipe)).eval()
    held = held_tensors(model)
    groups = recipe.prompts_per_step // recipe.rollouts
    push: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(samples_address)
    timeout_s = float(cfg.transport.timeout_s)
    version: int | None = None
    names: list[str] = []
    digest = ""
    batches = 0  # batches generated with the version held
    async with WeightReceiver(cfg, identity=f"grpo-rollout-{index}") as receiver:
        while True:
            poll = version is not None and batches <= recipe.max_staleness
            try:
                names = await receive_into(receiver, held, 0.02 if poll else timeout_s)
                assert receiver.version is not None  # receive_into returned: a version landed
                version, batches = int(receiver.version), 0
                digest = fingerprint((n, held[n]) for n in names)
                logger.debug("rollout %d: version %d received, fingerprint %s", index, version, digest)
            except WeightSyncTimeout:
                if not poll:
                    raise
            assert version is not None
            generator = torch.Generator().manual_seed(
                ((recipe.seed * 1_000_003 + index) * 100_003 + version) * 101 + batches
            )
            started = time.perf_counter()
            prompts = prompts_for(groups, generator).repeat_interleave(recipe.group_size, dim=0)
            completions, logprobs = generate(model, prompts, recipe.completion_len, recipe.temperature, generator)
            rewards = reward(prompts, completions)
            message = {
                "rollout": index,
                "version": version,
                "fingerprint": digest,
                "prompts": prompts.tolist(),
                "completions": completions.tolist(),
                "logprobs": logprobs.tolist(),
                "rewards": rewards.tolist(),
                "generate_s": time.perf_counter() - started,
            }
            push.send(json.dumps(message).encode())
            batches += 1


def rollout_main(argv: Sequence[str]) -> int:
    """`python -m lightning_weightsync.examples.grpo rollout INDEX SAMPLES_ADDRESS --config ... key=value ...`"""
    index, address, parsed = int(argv[0]), argv[1], _parse(argv[2:])
    setup_logging(parsed.log_level)
    recipe, cfg = load_recipe(parsed.config, parsed.overrides, schema=GRPORecipe)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the launcher stops us when training is done
    try:
        asyncio.run(rollout_loop(recipe, cfg, index, address))
    except WeightSyncTimeout as exc:
        print(f"grpo rollout {index}: {exc}", file=sys.stderr)
        return 1
    return 0


# ------------------------------------------------------------------------------------- the trainer


def setting_label(recipe: GRPORecipe, cfg: DictConfig) -> str:
    """The plot's name for this run: recipe.label, else the trainer.* settings an RL user compares."""
    if recipe.label:
        return recipe.label
    parts = []
    quiet = {"overlap": (False,), "lora": ("auto",)}  # at their defaults they are not what a curve compares
    for key in ("send_mode", "overlap", "lora"):  # present or not: nothing else depends on them
        value = cfg.trainer.get(key) if key in cfg.trainer else None
        if getattr(value, "value", value) in quiet.get(key, ()):
            continue
        if value is not None and not OmegaConf.is_config(value):
            parts.append(f"{key}={getattr(value, 'value', value)}")
    if recipe.max_staleness:
        parts.append(f"max_staleness={recipe.max_staleness}")
    return " ".join(parts) or "default"


def _lightning_module(recipe: GRPORecipe, channel: Callable[[], SampleChannel | None]) -> Any:
    import lightning.pytorch as pl
    import torch.distributed as dist

    prompt_len, width = 2, 2 + recipe.completion_len
    batch = recipe.prompts_per_step * recipe.group_size

    class GRPOModule(pl.LightningModule):
        """The policy is `self.model` (what the rollouts receive); `self.reference` (kl_coef > 0) is not sent."""

        def __init__(self) -> None:
            super().__init__()
            self.model = build_model(model_options(recipe))
            self.reference = build_model(model_options(recipe)).requires_grad_(False) if recipe.kl_coef else None
            self.last: dict[str, Any] = {}  # what the step used, for the per-step line (rank 0)

        def configure_model(self) -> None:
            from torch.distributed.fsdp import FSDPModule, fully_shard

            if self.device_mesh is None or isinstance(self.model, FSDPModule):
                return
            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def _samples(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            """(sequences [N, prompt + completion], old logprobs [N, L], rewards [N]) on every rank: rank 0
            takes them from the channel, the others receive them (one broadcast of each)."""
            sequences = torch.zeros(batch, width, dtype=torch.long)
            floats = torch.zeros(batch, recipe.completion_len + 1)
            source = channel() if self.global_rank == 0 else None
            if source is not None:
                step = self.trainer.global_step
                started = time.perf_counter()
                messages = source.take(batch, step - recipe.max_staleness, recipe.sample_timeout_s)
                waited = time.perf_counter() - started
                rows = [
                    (p + c, lp, r)
                    for m in messages
                    for p, c, lp, r in zip(m["prompts"], m["completions"], m["logprobs"], m["rewards"], strict=True)
                ][:batch]
                sequences = torch.tensor([r[0] for r in rows], dtype=torch.long)
                floats = torch.tensor([[*r[1], r[2]] for r in rows], dtype=torch.float32)
                versions = [m["version"] for m in messages]
                self.last = {
                    "sample_version": min(versions),
                    "staleness": step - min(versions),
                    "wait_samples_s": waited,
                    "generate_s": max(m["generate_s"] for m in messages),
                    "samples": [{k: m[k] for k in ("rollout", "version", "fingerprint")} for m in messages],
                    "dropped_groups": source.dropped // recipe.group_size,
                }
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast(sequences, src=0)
                dist.broadcast(floats, src=0)
            return sequences, floats[:, :-1], floats[:, -1]

        def training_step(self, _: Any, batch_idx: int) -> torch.Tensor:
            sequences, old_logprobs, rewards = self._samples()
            advantages = group_advantages(rewards, recipe.group_size)
            rank, world = (self.global_rank, self.trainer.world_size)
            mine = slice(rank * batch // world, (rank + 1) * batch // world)  # data parallel: a slice each
            logprobs = token_logprobs(self.model, sequences[mine], prompt_len, recipe.temperature)
            ref = None
            if self.reference is not None:
                with torch.no_grad():
                    ref = token_logprobs(self.reference, sequences[mine], prompt_len, recipe.temperature)
            loss, stats = grpo_loss(
                logprobs, old_logprobs[mine], advantages[mine], recipe.clip_eps, ref, recipe.kl_coef
            )
            self.last.update(reward_mean=float(rewards.mean()), loss=float(loss.detach()), **stats)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.model.parameters(), lr=recipe.lr, weight_decay=0.0)

    return GRPOModule()


def _step_logger(recipe: GRPORecipe, sync: Any, jsonl: Path, label: str) -> Any:
    import lightning.pytorch as pl

    class StepLog(pl.Callback):
        """After each optimizer step (after the sync callback sent that version): the trainer's fingerprint of
        the weights it just sent (every rank gathers), one printed line and one JSONL row (rank 0)."""

        def __init__(self) -> None:
            self.trainer_fingerprints: dict[int, str] = {}
            self.mismatches: list[str] = []
            self.rows: list[dict[str, Any]] = []
            self.started = time.monotonic()

        def _fingerprint(self, trainer: pl.Trainer) -> None:
            digest = fingerprint(sync.weights(trainer))  # empty on ranks != 0: every rank joins the gathers
            if trainer.is_global_zero:
                self.trainer_fingerprints[trainer.global_step] = digest

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self._fingerprint(trainer)  # version 0 (sent by WeightSyncCallback.on_train_start, before us)
            if trainer.is_global_zero:
                jsonl.parent.mkdir(parents=True, exist_ok=True)
                jsonl.write_text("")

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
            self._fingerprint(trainer)
            if not trainer.is_global_zero:
                return
            step, last = trainer.global_step, pl_module.last
            stats = getattr(sync, "last_stats", None)
            sync_s = float(stats.seconds) if stats is not None and stats.version == step else None
            versions = sorted({m["version"] for m in last["samples"]})
            for m in last["samples"]:
                ours = self.trainer_fingerprints.get(m["version"])
                if ours != m["fingerprint"]:
                    self.mismatches.append(f"version {m['version']}: trainer {ours}, rollout {m['rollout']} {m}")
            row = {
                "setting": label,
                "step": step,
                "reward_mean": last["reward_mean"],
                "sample_version": last["sample_version"],
                "staleness": last["staleness"],
                "sync_s": sync_s,
                "stall_s": float(sync.last_stall_seconds),
                "wait_samples_s": last["wait_samples_s"],
                "generate_s": last["generate_s"],
                "loss": last["loss"],
                "kl": last["kl"],
                "clip_frac": last["clip_frac"],
                "dropped_groups": last["dropped_groups"],
                "trainer_fingerprint": self.trainer_fingerprints[step],  # of the version this step sent
                # the samples' versions: the trainer's fingerprint of each (taken right after it was sent),
                # and per message the one its rollout reported for the weights it generated with
                "trainer_fingerprints": {str(v): self.trainer_fingerprints.get(v) for v in versions},
                "samples": last["samples"],
                "elapsed_s": time.monotonic() - self.started,
            }
            self.rows.append(row)
            with jsonl.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(
                f"step {step:4d}/{recipe.steps}  reward {row['reward_mean']:.3f}  samples v{row['sample_version']} "
                f"(staleness {row['staleness']})  sync {_seconds(sync_s)}  stall {row['stall_s']:.3f}s  "
                f"wait {row['wait_samples_s']:.3f}s" + (f"  kl {row['kl']:.4f}" if recipe.kl_coef else ""),
                flush=True,
            )

    return StepLog()


def _seconds(value: float | None) -> str:
    return "   ?  " if value is None else f"{value:.3f}s"


def plot(output_dir: Path) -> str:
    """`<output_dir>/grpo.png`: reward and trainer stall against step, one curve per JSONL (setting)."""
    runs = {}
    for path in sorted(output_dir.glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if rows:
            runs[rows[0].get("setting", path.stem)] = rows
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install 'lightning_weightsync[plot]'); the JSONL has it"
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 5.2), sharex=True)
    styles = ("-", "--", ":", "-.")  # two settings that learn identically (gather, sharded) stay both visible
    for index, (name, rows) in enumerate(runs.items()):
        style = styles[index % len(styles)]
        steps = [r["step"] for r in rows]
        rewards = [r["reward_mean"] for r in rows]
        window = 5  # a running mean: a step's reward is the mean of only prompts_per_step * group_size samples
        smooth = [sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1])
                  for i in range(len(rewards))]  # fmt: skip
        (line,) = top.plot(steps, smooth, style, label=name)
        top.plot(steps, rewards, color=line.get_color(), alpha=0.2, linewidth=0.8)
        bottom.plot(steps, [r["stall_s"] * 1000 for r in rows], style, color=line.get_color(), label=name)
    top.set_ylabel("reward (5-step mean)")
    top.set_ylim(0, 1)
    top.legend(loc="lower right", fontsize="small")
    bottom.set_ylabel("trainer stall per sync (ms)")
    bottom.set_ylim(bottom=0)
    bottom.set_xlabel("optimizer step (= weight version)")
    top.set_title("GRPO, tiny LM on CPU: rollouts generate with the weights they received", fontsize="medium")
    fig.tight_layout()
    path = output_dir / "grpo.png"
    fig.savefig(path, dpi=80, pil_kwargs={"optimize": True})
    plt.close(fig)
    return f"plot -> {path} ({len(runs)} setting{'s' if len(runs) != 1 else ''})"


# ------------------------------------------------------------------------------------- the launcher


def _resolve_ports(recipe: GRPORecipe, cfg: DictConfig) -> list[str]:
    """The ports every process must agree on, chosen once by the launching process (0 = a free port)."""
    from ..transport.process import free_port

    host = str(cfg.transport.host)
    port = int(cfg.transport.port) or free_port(host)
    samples = recipe.samples_port or free_port(host)
    return [f"transport.port={port}", f"recipe.samples_port={samples}"]


@contextlib.contextmanager
def _rollouts(
    recipe: GRPORecipe, argv: Sequence[str], address: str, output_dir: Path
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """The rollout processes (their logs in output_dir), stopped with SIGTERM when training ends."""
    from ..transport.process import process_group

    with contextlib.ExitStack() as stack:
        procs = []
        for index in range(recipe.rollouts):
            log = stack.enter_context(open(output_dir / f"rollout-{index}.log", "wb"))
            cmd = [sys.executable, "-m", "lightning_weightsync.examples.grpo", "rollout", str(index), address, *argv]
            procs.append(stack.enter_context(process_group(cmd, stdout=log, stderr=subprocess.STDOUT)))
        try:
            yield procs
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)


def argv_value(argv: Sequence[str], key: str, default: str | None = None) -> str | None:
    """The last `key=value` among `argv`."""
    found = [a.split("=", 1)[1] for a in argv if a.startswith(f"{key}=")]
    return found[-1] if found else default


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"


def train(recipe: GRPORecipe, cfg: DictConfig, rollouts: Sequence[subprocess.Popen[bytes]] = ()) -> str | None:
    """Fit with GRPO; `rollouts`: the processes `main` started (on the launching process, rank 0), watched
    while rank 0 waits for samples so that a crashed rollout fails the run at once, with its log."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    from ..trainer.lightning import WeightSyncCallback

    validate(recipe)
    torch.set_num_threads(recipe.threads)
    output_dir = Path(recipe.output_dir)
    label = setting_label(recipe, cfg)
    jsonl = output_dir / f"{label.replace(' ', '_').replace('=', '-')}.jsonl"
    sync = WeightSyncCallback(cfg, module_attr="model")
    step_log = _step_logger(recipe, sync, jsonl, label)
    strategy: Any = recipe.strategy
    if recipe.strategy == "model_parallel":
        strategy = ModelParallelStrategy(
            data_parallel_size=recipe.devices, tensor_parallel_size=1, save_distributed_checkpoint=False
        )
    elif recipe.strategy not in ("ddp", "auto"):
        raise ConfigError(f"recipe.strategy={recipe.strategy!r} is not allowed; choose model_parallel, ddp or auto")
    channel_holder: dict[str, SampleChannel] = {}

    def channel() -> SampleChannel:
        """Rank 0's channel, bound at its first step (the other ranks never ask)."""
        if "c" not in channel_holder:
            channel_holder["c"] = SampleChannel(str(cfg.transport.host), recipe.samples_port, alive=rollouts_gone)
        return channel_holder["c"]

    def rollouts_gone() -> str | None:
        for index, proc in enumerate(rollouts):
            if proc.poll() is not None:
                log = output_dir / f"rollout-{index}.log"
                return f"rollout {index} exited with {proc.returncode}:\n{_tail(log)}"
        return None

    trainer = pl.Trainer(
        accelerator=recipe.accelerator,
        devices=recipe.devices,
        strategy=strategy,
        max_steps=recipe.steps,
        callbacks=[sync, step_log],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,  # the step indices below are a clock, not data to shard
        default_root_dir=str(output_dir),
    )
    # the samples come from the channel; torch's stub wants a Dataset, and any indexable sequence serves
    steps: torch.utils.data.DataLoader[int] = torch.utils.data.DataLoader(
        range(recipe.steps),  # type: ignore[arg-type]
        batch_size=None,
    )
    try:
        trainer.fit(_lightning_module(recipe, channel), train_dataloaders=steps)
    finally:
        if "c" in channel_holder:
            channel_holder["c"].close()
    if not trainer.is_global_zero:
        return None
    rows = step_log.rows
    head = rows[: max(1, min(10, len(rows) // 5))]
    tail = rows[-len(head) :]
    start, end = (sum(r["reward_mean"] for r in part) / len(part) for part in (head, tail))
    checked = sorted({m["version"] for r in rows for m in r["samples"]})
    verdict = (
        f"the rollouts generated every one of {len(checked)} sample versions with exactly the trainer's weights of "
        "that version (fingerprints equal)"
        if not step_log.mismatches
        else f"FINGERPRINT MISMATCH in {len(step_log.mismatches)} sample messages: {step_log.mismatches[:3]}"
    )
    lines = [
        f"grpo [{label}]: {len(rows)} steps; mean reward of the first {len(head)} steps {start:.3f}, "
        f"of the last {len(tail)} steps {end:.3f}",
        f"  {verdict}",
        f"  per-step numbers -> {jsonl}",
    ]
    if recipe.plot:
        lines.append("  " + plot(output_dir))
    if step_log.mismatches:
        raise WeightSyncError("\n".join(lines))
    return "\n".join(lines)


def _parse(args: Sequence[str]) -> argparse.Namespace:
    """The recipes' command line (examples/recipe.py), logging at WARNING unless told: the per-step line
    says it all, INFO would add a "version N sent" line a step."""
    parser = build_parser("grpo_tiny_cpu.py", "GRPO on CPU")
    parser.set_defaults(log_level="WARNING")
    return parser.parse_args(args)


def _argv(parsed: argparse.Namespace, extra: Sequence[str] = ()) -> list[str]:
    """The same command line, options first, with `extra` overrides last (they win)."""
    config = ["--config", parsed.config] if parsed.config else []
    return [*config, "--log-level", parsed.log_level, *parsed.overrides, *extra]


def main(argv: Sequence[str] | None = None) -> int:
    """The launching process starts the rollouts, then trains; the ranks Lightning starts only train."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["rollout"]:
        return rollout_main(args[1:])
    parsed = _parse(args)
    resolved = os.environ.get(ROLLOUT_ENV)
    if resolved is not None:  # a rank Lightning launched: the same ports as the launching process
        return recipe_main(train, GRPORecipe, _argv(parsed, json.loads(resolved)), description=__doc__)
    try:
        recipe, cfg = load_recipe(parsed.config, parsed.overrides, schema=GRPORecipe)
        validate(recipe)  # before any process starts
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ports = _resolve_ports(recipe, cfg)
    os.environ[ROLLOUT_ENV] = json.dumps(ports)  # the ranks Lightning starts inherit it
    output_dir = Path(recipe.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    full = _argv(parsed, ports)
    address = f"tcp://{cfg.transport.host}:{argv_value(ports, 'recipe.samples_port')}"
    with _rollouts(recipe, full, address, output_dir) as procs:
        return recipe_main(functools.partial(train, rollouts=procs), GRPORecipe, full, description=__doc__)


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = [
    "GRPORecipe",
    "SampleChannel",
    "fingerprint",
    "generate",
    "group_advantages",
    "grpo_loss",
    "main",
    "plot",
    "reward",
    "rollout_main",
    "train",
]
