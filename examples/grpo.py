"""GRPO on CPU: a Lightning trainer learns a task from rewards its rollouts earn with the weights they received.

    python recipes/grpo_tiny_cpu.py --config recipes/grpo_tiny_cpu.yaml [key=value ...]

One command starts everything on one machine:

1. `recipe.rollouts` rollout processes (`python -m examples.grpo rollout ...`), each
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

LoRA (`recipe.lora`): the policy is the tiny LM wrapped by `peft.get_peft_model` (rank `recipe.lora.r` on
`recipe.lora.target_modules`), on the trainer and in every rollout alike; only the adapter trains. It is on
when `recipe.lora.enabled` says so, or (null, the default) with `trainer.lora=adapter`, so that override
alone runs it: version 0 carries the base and the adapter, every later version the adapter alone, and each
rollout's module sink (`rollout.sink.lora: keep`, rollout/sinks/lora.py) keeps the base and loads each
adapter into its own PEFT model (`merged` / `full`, plain weights, are refused at start-up).

Every step prints one line (reward mean, samples' version and staleness, the last delivered version's bytes
and send seconds, trainer stall) and appends the same numbers to `<recipe.output_dir>/<label>.jsonl`; at the
end `<output_dir>/grpo.png` plots reward, stall and bytes a version against step, one curve per JSONL in the
directory (one per setting: run the recipe again with another `trainer.*` override and the same output_dir to
compare). The JSONL also holds, for every version, the trainer's fingerprint of its policy's parameters after
that optimizer step and the fingerprint each rollout reported for the parameters it generated with (with
LoRA: the base and the adapter); the final line says whether they all matched.

`trainer.*` overrides (`trainer.send_mode=sharded`, `trainer.overlap=true`, ...) go to `WeightSyncCallback`
unchanged; nothing here reads a `trainer.*` key except to name the setting in the plot and `trainer.lora`
(whether the policy is a LoRA model, see above).
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

from lightning_weightsync.demo.recipe import build_parser, load_recipe, recipe_main, setup_logging
from lightning_weightsync.demo.tiny_lm import TinyLM, build_model
from lightning_weightsync.errors import ConfigError, WeightSyncError, WeightSyncTimeout
from lightning_weightsync.rollout.sinks.module import ModuleSink
from lightning_weightsync.trainer.gather import iter_full_parameters
from lightning_weightsync.trainer.lora import import_peft
from lightning_weightsync.versions.stats import SendStats, human_bytes
from lightning_weightsync.versions.verify import weights_digest

# under the package's logger, which setup_logging configures; also when run as __main__
logger = logging.getLogger("lightning_weightsync.examples.grpo")

CHECKOUT = Path(__file__).resolve().parents[1]  # examples/ is no package of the wheel: the rollouts import it from here
BOS = 10  # token ids 0-9 are the digits; 10 starts every sequence
ROLLOUT_ENV = "LWS_GRPO_RESOLVED"  # set by the launching process: ports its Lightning ranks must share
DEFAULT_MODEL = {"vocab_size": 11, "dim": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 8}


@dataclass
class LoraRecipe:
    """`recipe.lora`: the policy as a PEFT LoRA model (`get_peft_model(tiny LM, LoraConfig(...))`)."""

    enabled: bool | None = None  # None: when trainer.lora=adapter
    r: int = 8
    alpha: float = 16.0
    target_modules: list[str] = field(default_factory=lambda: ["qkv", "proj", "up", "down", "lm_head"])


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
    lora: LoraRecipe = field(default_factory=LoraRecipe)


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
    if recipe.lora.r < 1 or not recipe.lora.target_modules:
        raise ConfigError("recipe.lora.r must be >= 1 and recipe.lora.target_modules not empty")
    need = 2 + recipe.completion_len  # BOS, the digit, the answer
    if model_options(recipe).get("max_seq_len", 0) < need or model_options(recipe).get("vocab_size", 0) < BOS + 1:
        raise ConfigError(f"recipe.model: max_seq_len must be >= {need} and vocab_size >= {BOS + 1}")


def model_options(recipe: GRPORecipe) -> dict[str, Any]:
    return {**DEFAULT_MODEL, **recipe.model, "seed": recipe.seed}


def uses_lora(recipe: GRPORecipe, cfg: DictConfig) -> bool:
    """Whether the policy is a PEFT LoRA model: `recipe.lora.enabled`, or (null) whether `trainer.lora=adapter`
    asks for adapter versions (its default, `auto`, sends a plain model as it is and a LoRA one's adapter).

    ConfigError for what the rollouts here cannot load: they hold a PEFT model and load adapters into it
    (`rollout.sink.lora: keep`), so `trainer.lora=merged|full` (plain weights) and `rollout.sink.lora=merge`
    are refused at start-up rather than by the rollout's sink at version 0."""
    mode = str(getattr(cfg.trainer.lora, "value", cfg.trainer.lora))
    lora = recipe.lora.enabled if recipe.lora.enabled is not None else mode == "adapter"
    sink_lora = str(getattr(cfg.rollout.sink.lora, "value", cfg.rollout.sink.lora))
    if mode in ("merged", "full") or (lora and sink_lora != "keep"):
        raise ConfigError(
            f"trainer.lora={mode}, rollout.sink.lora={sink_lora}: the GRPO rollouts load adapter versions into their "
            "own PEFT model; use trainer.lora=adapter (or auto) and rollout.sink.lora=keep"
        )
    return lora


def build_policy(recipe: GRPORecipe, lora: bool) -> torch.nn.Module:
    """The tiny LM, wrapped with PEFT LoRA when `lora`, as a user would. Trainer and rollouts build the same:
    the base from `recipe.seed` (`build_model`), the adapter's lora_A from it too (lora_B starts at zero, so
    the policy starts as the base), the global RNG left as it was."""
    model = build_model(model_options(recipe))
    if not lora:
        return model
    peft = import_peft()
    config = peft.LoraConfig(
        r=recipe.lora.r, lora_alpha=recipe.lora.alpha, target_modules=list(recipe.lora.target_modules), lora_dropout=0.0
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        policy: torch.nn.Module = peft.get_peft_model(model, config)
    return policy


def tiny_lm(policy: torch.nn.Module) -> TinyLM:
    """The tiny LM inside `policy` (itself, or the base model of its PEFT wrapper)."""
    base = getattr(policy, "get_base_model", lambda: policy)()  # peft.PeftModel.get_base_model
    assert isinstance(base, TinyLM), type(base)
    return base


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
    model: torch.nn.Module, prompts: torch.Tensor, length: int, temperature: float, generator: torch.Generator
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


fingerprint = weights_digest  # the library's digest of a set of weights (versions/verify.py), by its name here


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


def rollout_policy(recipe: GRPORecipe, cfg: DictConfig) -> tuple[torch.nn.Module, ModuleSink]:
    """A rollout's policy (in eval mode) and the library's module sink that loads every version into it in
    place. With LoRA (`rollout.sink.lora: keep`) version 0 brings the base and the adapter, and later versions
    the adapter alone, into the PEFT model's own tensors: the base stays, each adapter replaces the last."""
    model = build_policy(recipe, uses_lora(recipe, cfg)).eval()
    return model, ModuleSink(cfg, module=model)


async def rollout_loop(recipe: GRPORecipe, cfg: DictConfig, index: int, samples_address: str) -> None:
    """Receive a version, generate and score this rollout's groups with it, push them; repeat until stopped.

    With `recipe.max_staleness` = k > 0 the rollout generates up to k more batches with the version it
    holds while no newer one has started, so the trainer can train on them while the next version is
    generated (a pipeline k versions deep); with 0 it waits for every new version (on-policy)."""
    import zmq

    from lightning_weightsync.rollout.consume import consume_version
    from lightning_weightsync.versions.receiver import WeightReceiver

    torch.set_num_threads(recipe.threads)
    model, sink = rollout_policy(recipe, cfg)
    groups = recipe.prompts_per_step // recipe.rollouts
    push: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(samples_address)
    timeout_s = float(cfg.transport.timeout_s)
    version: int | None = None
    digest = ""
    batches = 0  # batches generated with the version held
    async with WeightReceiver(cfg, identity=f"grpo-rollout-{index}") as receiver:
        while True:
            poll = version is not None and batches <= recipe.max_staleness
            try:
                record = await consume_version(receiver, sink, wait_s=0.02 if poll else timeout_s)
                version, batches = record.version, 0
                digest = fingerprint(model.named_parameters())  # what it generates with (LoRA: base + adapter)
                logger.debug("rollout %d: version %d received (%d bytes), fingerprint %s", index, version,
                             record.nbytes, digest)  # fmt: skip
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
    """`python -m examples.grpo rollout INDEX SAMPLES_ADDRESS --config ... key=value ...`"""
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
        value = getattr(value, "value", value)
        if value in quiet.get(key, ()):
            continue
        if value is not None and not OmegaConf.is_config(value):
            parts.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")  # as typed: overlap=true
    if recipe.max_staleness:
        parts.append(f"max_staleness={recipe.max_staleness}")
    return " ".join(parts) or "default"


def _lightning_module(recipe: GRPORecipe, lora: bool, channel: Callable[[], SampleChannel | None]) -> Any:
    import lightning.pytorch as pl
    import torch.distributed as dist

    prompt_len, width = 2, 2 + recipe.completion_len
    batch = recipe.prompts_per_step * recipe.group_size

    class GRPOModule(pl.LightningModule):
        """The policy is `self.model` (what the rollouts receive; a PeftModel with LoRA); `self.reference`
        (kl_coef > 0, the initial weights) is not sent."""

        def __init__(self) -> None:
            super().__init__()
            self.model = build_policy(recipe, lora)
            self.reference = build_model(model_options(recipe)).requires_grad_(False) if recipe.kl_coef else None
            self.last: dict[str, Any] = {}  # what the step used, for the per-step line (rank 0)

        def configure_model(self) -> None:
            from torch.distributed.fsdp import FSDPModule, fully_shard

            if self.device_mesh is None or isinstance(self.model, FSDPModule):
                return
            mesh = self.device_mesh["data_parallel"]
            for layer in tiny_lm(self.model).layers:
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
            trainable = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapter alone
            return torch.optim.AdamW(trainable, lr=recipe.lr, weight_decay=0.0)

    return GRPOModule()


def _step_logger(recipe: GRPORecipe, sync: Any, jsonl: Path, label: str) -> Any:
    import lightning.pytorch as pl

    class StepLog(pl.Callback):
        """After each optimizer step (after the sync callback sent that version, or with trainer.overlap began
        to): the trainer's fingerprint of its policy's parameters (every rank gathers), one printed line and
        one JSONL row (rank 0)."""

        def __init__(self) -> None:
            self.trainer_fingerprints: dict[int, str] = {}
            self.sent_bytes: dict[int, int] = {}  # version -> payload bytes, as each version is delivered
            self.mismatches: list[str] = []
            self.rows: list[dict[str, Any]] = []
            self.started = time.monotonic()

        def _fingerprint(self, trainer: pl.Trainer) -> None:
            # the parameters the policy generates with, under the names the rollout's model has (LoRA: the
            # base and the adapter), whatever a version carries; empty on ranks != 0, which join the gathers
            module = trainer.strategy.model  # as the strategy trains it, as WeightSyncCallback gathers it
            assert module is not None
            params = iter_full_parameters(module, include_buffers=False, prefix="model")
            digest = fingerprint(params)
            if trainer.is_global_zero:
                self.trainer_fingerprints[trainer.global_step] = digest

        def _delivered(self) -> SendStats | None:
            """The last delivered version's `SendStats` (trainer.overlap: the one sent in the background)."""
            stats: SendStats | None = sync.last_stats
            if stats is not None:
                self.sent_bytes[stats.version] = int(stats.nbytes)
            return stats

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self._fingerprint(trainer)  # version 0 (sent by WeightSyncCallback.on_train_start, before us)
            if trainer.is_global_zero:
                self._delivered()
                jsonl.parent.mkdir(parents=True, exist_ok=True)
                jsonl.write_text("")

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
            self._fingerprint(trainer)
            if not trainer.is_global_zero:
                return
            step, last = trainer.global_step, pl_module.last
            stats = self._delivered()  # blocking: this step's version; trainer.overlap: the one before
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
                # the last delivered version: which, its payload bytes, its send's seconds (with trainer.overlap,
                # the background send of the version before this step's, which ran while this step computed)
                "sync_version": None if stats is None else stats.version,
                "sync_bytes": None if stats is None else int(stats.nbytes),
                "sync_s": None if stats is None else float(stats.seconds),
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
            print(step_line(row, recipe), flush=True)

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if trainer.is_global_zero:
                self._delivered()  # trainer.overlap: the last version, sent by the sync's on_train_end (before us)

    return StepLog()


def step_line(row: dict[str, Any], recipe: GRPORecipe) -> str:
    """`step   40/100  reward 0.562  samples v39 (staleness 0)  sync v40 69.4 KiB 0.040s  stall 0.041s  wait 0.000s`"""
    sync = (
        "sync    ?"
        if row["sync_version"] is None
        else f"sync v{row['sync_version']} {human_bytes(row['sync_bytes'])} {row['sync_s']:.3f}s"
    )
    return (
        f"step {row['step']:4d}/{recipe.steps}  reward {row['reward_mean']:.3f}  samples v{row['sample_version']} "
        f"(staleness {row['staleness']})  {sync}  stall {row['stall_s']:.3f}s  wait {row['wait_samples_s']:.3f}s"
        + (f"  kl {row['kl']:.4f}" if recipe.kl_coef else "")
    )


def _coinciding(runs: dict[str, list[dict[str, Any]]]) -> list[list[str]]:
    """The settings grouped by their reward curve: gather, sharded and overlap send the same weights every
    version, so they sample, and earn, exactly the same rewards (one group of three), LoRA another."""
    groups: dict[tuple[float, ...], list[str]] = {}
    for name, rows in runs.items():
        groups.setdefault(tuple(r["reward_mean"] for r in rows), []).append(name)
    return list(groups.values())


def _stall_top_ms(runs: dict[str, list[dict[str, Any]]]) -> float | None:
    """The stall panel's top: above every sync but each run's first (its one-off costs: the data-plane group,
    the first bucket's allocation; one 400 ms spike there flattened a hundred 40 ms syncs). None: no data."""
    later = [r["stall_s"] * 1000 for rows in runs.values() for r in rows[1:]]
    return 1.15 * max(later) if later and max(later) > 0 else None


def plot(output_dir: Path) -> str:
    """`<output_dir>/grpo.png`: reward, trainer stall and bytes a version against step, one curve per JSONL
    (setting)."""
    runs: dict[str, list[dict[str, Any]]] = {}
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
    fig = figure(runs)
    path = output_dir / "grpo.png"
    fig.savefig(path, dpi=80, bbox_inches="tight", pil_kwargs={"optimize": True})
    plt.close(fig)
    return f"plot -> {path} ({len(runs)} setting{'s' if len(runs) != 1 else ''})"


def figure(runs: dict[str, list[dict[str, Any]]]) -> Any:
    """The plot's matplotlib figure: three panels sharing the step axis, the legend below them."""
    import matplotlib.pyplot as plt

    fig, (top, middle, bottom) = plt.subplots(
        3, 1, figsize=(6.4, 6.8), sharex=True, gridspec_kw={"height_ratios": [3, 2, 1.4]}
    )
    styles = ("-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 3)))
    markers = ("o", "s", "^", "D", "v", "P")
    # settings with the same reward curve draw one line: each its own markers, staggered along it, so all are seen
    place = {name: (i, len(group)) for group in _coinciding(runs) for i, name in enumerate(group)}
    stall_top = _stall_top_ms(runs)
    off_scale: list[float] = []
    for index, (name, rows) in enumerate(runs.items()):
        style, marker = styles[index % len(styles)], markers[index % len(markers)]
        steps = [r["step"] for r in rows]
        rewards = [r["reward_mean"] for r in rows]
        window = 5  # a running mean: a step's reward is the mean of only prompts_per_step * group_size samples
        smooth = [sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1])
                  for i in range(len(rewards))]  # fmt: skip
        nth, members = place[name]
        every = max(1, len(steps) // 10) * members  # each member of a group: its markers between the others'
        (line,) = top.plot(
            steps, smooth, linestyle=style, marker=marker, markevery=(nth * every // members, every), markersize=5,
            label=name,
        )  # fmt: skip
        top.plot(steps, rewards, color=line.get_color(), alpha=0.2, linewidth=0.8)
        stalls = [r["stall_s"] * 1000 for r in rows]
        middle.plot(steps, stalls, linestyle=style, color=line.get_color())
        if stall_top is not None and stalls and stalls[0] > stall_top:  # off the scale: a mark on the top edge
            middle.plot([steps[0]], [stall_top], marker="^", color=line.get_color(), clip_on=False, markersize=6)
            off_scale.append(stalls[0])
        sent = [(r["sync_version"], r["sync_bytes"] / 1024) for r in rows if r.get("sync_bytes") is not None]
        bottom.plot([v for v, _ in sent], [kib for _, kib in sent], linestyle=style, color=line.get_color())
    top.set_ylabel("reward (5-step mean)")
    top.set_ylim(0, 1)
    middle.set_ylabel("trainer stall\nper sync (ms)")
    middle.set_ylim(0, stall_top)
    if off_scale:
        values = ", ".join(f"{v:.0f}" for v in off_scale)
        middle.set_title(f"\u25b2 first sync, off the scale: {values} ms", loc="right", fontsize="x-small")
    bottom.set_ylabel("KiB sent by\nrank 0 a version")
    bottom.set_ylim(bottom=0)
    bottom.set_xlabel("optimizer step (= weight version)")
    top.set_title("GRPO, tiny LM on CPU: rollouts generate with the weights they received", fontsize="medium")
    same = [group for group in _coinciding(runs) if len(group) > 1]
    title = "; ".join(" = ".join(group) for group in same)
    fig.tight_layout()
    fig.legend(  # below the panels, outside every curve; savefig's tight box keeps it in the picture
        loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2, fontsize="small", title_fontsize="small",
        title=f"same reward curve, one line, markers alternate:\n{title}" if same else None,
    )  # fmt: skip
    return fig


# ------------------------------------------------------------------------------------- the launcher


def _resolve_ports(recipe: GRPORecipe, cfg: DictConfig) -> list[str]:
    """The ports every process must agree on, chosen once by the launching process (0 = a free port)."""
    from lightning_weightsync.transport.process import free_port

    host = str(cfg.transport.host)
    port = int(cfg.transport.port) or free_port(host)
    samples = recipe.samples_port or free_port(host)
    return [f"transport.port={port}", f"recipe.samples_port={samples}"]


@contextlib.contextmanager
def _rollouts(
    recipe: GRPORecipe, argv: Sequence[str], address: str, output_dir: Path
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """The rollout processes (their logs in output_dir), stopped with SIGTERM when training ends."""
    from lightning_weightsync.transport.process import process_group

    with contextlib.ExitStack() as stack:
        procs = []
        for index in range(recipe.rollouts):
            log = stack.enter_context(open(output_dir / f"rollout-{index}.log", "wb"))
            cmd = [sys.executable, "-m", "examples.grpo", "rollout", str(index), address, *argv]
            env = {"PYTHONPATH": os.pathsep.join(filter(None, (str(CHECKOUT), os.environ.get("PYTHONPATH"))))}
            procs.append(stack.enter_context(process_group(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)))
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

    from lightning_weightsync.trainer.lightning import WeightSyncCallback

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
        trainer.fit(_lightning_module(recipe, uses_lora(recipe, cfg), channel), train_dataloaders=steps)
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
        f"  {_sent_summary(step_log.sent_bytes, [r['stall_s'] for r in rows])}",
        f"  per-step numbers -> {jsonl}",
    ]
    if recipe.plot:
        lines.append("  " + plot(output_dir))
    if step_log.mismatches:
        raise WeightSyncError("\n".join(lines))
    return "\n".join(lines)


def _sent_summary(sent_bytes: dict[int, int], stalls: list[float]) -> str:
    """`sent: version 0 69.4 KiB, later versions 13.0 KiB (median of 100); trainer stall a sync: median 0.041s`"""
    later = sorted(n for v, n in sent_bytes.items() if v > 0)
    first = human_bytes(sent_bytes[0]) if 0 in sent_bytes else "?"
    each = f"{human_bytes(later[len(later) // 2])} (median of {len(later)})" if later else "?"
    stall = sorted(stalls)[len(stalls) // 2] if stalls else float("nan")
    return f"sent: version 0 {first}, later versions {each}; trainer stall a sync: median {stall:.3f}s"


def _parse(args: Sequence[str]) -> argparse.Namespace:
    """The recipes' command line (`demo/recipe.py`), logging at WARNING unless told: the per-step line
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
        if uses_lora(recipe, cfg):
            import_peft()  # a ConfigError naming the extra, before any process starts
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
    "LoraRecipe",
    "SampleChannel",
    "build_policy",
    "fingerprint",
    "generate",
    "group_advantages",
    "grpo_loss",
    "main",
    "plot",
    "reward",
    "rollout_main",
    "rollout_policy",
    "step_line",
    "train",
    "uses_lora",
]
