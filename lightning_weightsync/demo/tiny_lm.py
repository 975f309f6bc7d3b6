"""A tiny causal LM trained with Lightning + FSDP2 on CPU, syncing its weights after every step.

Run (2 CPU processes over gloo; Lightning launches the second one itself)::

    python -m lightning_weightsync.demo.tiny_lm [--config recipes/tiny_lm_cpu.yaml] [key=value ...]

The YAML is one weightsync config with a ``recipe:`` section (`RecipeConfig`); `key=value`
overrides reach either part (``recipe.steps=8``, ``transport.port=29600``) and everything is
validated once at start-up (`demo/recipe.py`, the one `main()` of every recipe). This command
line is stable: the rollout demo runs it as a subprocess.

On the rollout side, serve the same network with the module sink::

    lightning-weightsync rollout transport.port=29600 rollout.sink.type=module \\
        rollout.sink.factory=lightning_weightsync.demo.tiny_lm:build_model

`build_model()` is deterministic (seeded, without touching the global RNG), so trainer and rollout
start from identical weights; the trainer sends `version 0` at start anyway (`trainer.sync_on_fit_start`).

The model: an embedding (`vocab_size x dim`, the biggest tensor by far, so a small
`transport.bucket_size_mb` chunks it), learned positions, `n_layers` pre-norm transformer blocks,
an untied LM head, a persistent integer buffer (`steps_seen`, counts training forwards) and a
non-persistent one (`causal_mask`, never sent). With `recipe.save_final: path.safetensors`, global
rank 0 writes the final full weights, named exactly as sent, for comparison with what a rollout holds.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from ..errors import ConfigError
from .recipe import recipe_main

logger = logging.getLogger("lightning_weightsync.demo.tiny_lm")  # also when run as __main__


# ------------------------------------------------------------------------------------- the model


@dataclass
class TinyLMConfig:
    vocab_size: int = 512
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 2
    mlp_ratio: int = 2
    max_seq_len: int = 32
    seed: int = 0


class Block(nn.Module):
    def __init__(self, c: TinyLMConfig) -> None:
        super().__init__()
        self.n_heads = c.n_heads
        self.attn_norm = nn.RMSNorm(c.dim)
        self.qkv = nn.Linear(c.dim, 3 * c.dim, bias=False)
        self.proj = nn.Linear(c.dim, c.dim)
        self.mlp_norm = nn.RMSNorm(c.dim)
        self.up = nn.Linear(c.dim, c.mlp_ratio * c.dim)
        self.down = nn.Linear(c.mlp_ratio * c.dim, c.dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.down(F.gelu(self.up(self.mlp_norm(x))))  # a Module call is Any to mypy
        return out


class TinyLM(nn.Module):
    steps_seen: torch.Tensor  # buffers (register_buffer), typed for the checker
    causal_mask: torch.Tensor

    def __init__(self, c: TinyLMConfig) -> None:
        super().__init__()
        if c.dim % c.n_heads:
            raise ConfigError(f"tiny_lm: dim={c.dim} must be divisible by n_heads={c.n_heads}")
        self.config = c
        self.embed = nn.Embedding(c.vocab_size, c.dim)
        self.pos_embed = nn.Parameter(torch.randn(c.max_seq_len, c.dim) * 0.02)
        self.layers = nn.ModuleList([Block(c) for _ in range(c.n_layers)])
        self.norm = nn.RMSNorm(c.dim)
        self.lm_head = nn.Linear(c.dim, c.vocab_size, bias=False)
        self.register_buffer("steps_seen", torch.zeros((), dtype=torch.int64))
        mask = torch.ones(c.max_seq_len, c.max_seq_len, dtype=torch.bool).tril()
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.config.max_seq_len:
            raise ValueError(f"sequence length {t} > max_seq_len={self.config.max_seq_len}")
        if self.training:
            self.steps_seen += 1
        x = self.embed(tokens) + self.pos_embed[:t]
        mask = self.causal_mask[:t, :t]
        for layer in self.layers:
            x = layer(x, mask)
        logits: torch.Tensor = self.lm_head(self.norm(x))
        return logits


def build_model(cfg: Mapping[str, Any] | None = None, **options: Any) -> TinyLM:
    """The tiny LM with deterministic weights (seeded; the global RNG is left untouched).

    `cfg` and `options` (keyword arguments, what `rollout.sink.options` passes) override
    `TinyLMConfig` fields. This is the module sink factory:
    `rollout.sink.factory=lightning_weightsync.demo.tiny_lm:build_model`.
    """
    merged = {**dict(cfg or {}), **options}
    known = {f.name for f in fields(TinyLMConfig)}
    unknown = sorted(set(merged) - known)
    if unknown:
        raise ConfigError(f"tiny_lm model: unknown option(s) {unknown}; known: {sorted(known)}")
    c = TinyLMConfig(**merged)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(c.seed)
        return TinyLM(c)


# ------------------------------------------------------------------------------------- data


class SyntheticTokens(torch.utils.data.Dataset[torch.Tensor]):
    """Deterministic sequences with structure to learn: token[i+1] = (a * token[i] + b) % vocab."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int = 0) -> None:
        self.num_samples, self.seq_len, self.vocab_size, self.seed = num_samples, seq_len, vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start, a, b = (int(v) for v in torch.randint(0, self.vocab_size, (3,), generator=g))
        seq = [start]
        for _ in range(self.seq_len):
            seq.append((seq[-1] * (a | 1) + b) % self.vocab_size)
        return torch.tensor(seq, dtype=torch.long)


# ------------------------------------------------------------------------------------- recipe


@dataclass
class RecipeConfig:
    """The `recipe:` section: what to train and how. The weightsync sections are separate."""

    steps: int = 4  # optimizer steps (trainer.max_steps)
    batch_size: int = 4  # per process, per micro-batch
    seq_len: int = 16
    lr: float = 3e-3
    devices: int = 2  # processes (CPU) or accelerators
    accelerator: str = "cpu"
    strategy: str = "model_parallel"  # model_parallel (FSDP2 via fully_shard) | model_parallel_defaults | ddp
    seed: int = 0
    accumulate_grad_batches: int = 1
    module_attr: str | None = None  # LightningModule attribute synced; None: its one child holding tensors
    save_final: str | None = None  # safetensors path: final full weights, named as sent (rank 0)
    save_checkpoint: str | None = None  # Lightning checkpoint written after training (resume with ckpt_path)
    ckpt_path: str | None = None  # resume from this checkpoint
    output_dir: str = "runs/tiny_lm"  # CSV logs (weightsync/* metrics)
    model: dict[str, Any] = field(default_factory=dict)  # TinyLMConfig overrides


def _lightning_module(recipe: RecipeConfig) -> Any:
    import lightning.pytorch as pl

    class TinyLMModule(pl.LightningModule):
        """Holds the network as `self.model`; FSDP2 is applied in `configure_model`."""

        def __init__(self) -> None:
            super().__init__()
            self.model = build_model(recipe.model, seed=recipe.seed)

        def configure_model(self) -> None:
            from torch.distributed.fsdp import FSDPModule, fully_shard

            if self.device_mesh is None or isinstance(self.model, FSDPModule):
                return  # not under ModelParallelStrategy, or already sharded
            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            logits = self.model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            self.log("train/loss", loss, prog_bar=False)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=recipe.lr, weight_decay=0.0)

    return TinyLMModule()


def _save_final_callback(path: str, sync: Any) -> Any:
    import lightning.pytorch as pl
    from safetensors.torch import save_file

    class SaveFinalWeights(pl.Callback):
        """At the end of training: the full weights as a sync sends them, to `path` (global rank 0)."""

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            tensors = {name: t.detach().cpu().clone() for name, t in sync.weights(trainer)}  # every rank gathers
            if trainer.is_global_zero:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                meta = {"global_step": str(trainer.global_step), "last_synced_version": str(sync.last_synced_version)}
                save_file(tensors, path, metadata=meta)
                logger.info("final weights (%d tensors) -> %s", len(tensors), path)

    return SaveFinalWeights()


def _strategy(recipe: RecipeConfig) -> Any:
    """The Lightning strategy `recipe.strategy` names (FSDP2 on one data-parallel axis by default)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    if recipe.strategy == "model_parallel":
        return ModelParallelStrategy(
            data_parallel_size=recipe.devices,
            tensor_parallel_size=1,
            save_distributed_checkpoint=False,  # one file: simple to resume from, small model
        )
    if recipe.strategy == "model_parallel_defaults":  # as a new user writes it: on 2 devices, 1 (dp) x 2 (tp)
        return ModelParallelStrategy()
    if recipe.strategy == "ddp":
        return "ddp"
    raise ConfigError(
        f"recipe.strategy={recipe.strategy!r} is not allowed; choose model_parallel, model_parallel_defaults or ddp"
    )


def _data(recipe: RecipeConfig) -> torch.utils.data.DataLoader[torch.Tensor]:
    """Synthetic tokens for every step on every device, no shorter than one sample."""
    model_cfg = TinyLMConfig(**{**recipe.model, "seed": recipe.seed})
    samples = recipe.steps * recipe.accumulate_grad_batches * recipe.batch_size * recipe.devices
    return torch.utils.data.DataLoader(
        SyntheticTokens(
            max(samples, 1), min(recipe.seq_len, model_cfg.max_seq_len - 1), model_cfg.vocab_size, recipe.seed
        ),
        batch_size=recipe.batch_size,
        shuffle=False,
    )


def train(recipe: RecipeConfig, cfg: DictConfig, extra_callbacks: Sequence[Any] = ()) -> str | None:
    """Fit the tiny LM with the weight sync callback; the summary line on global rank 0, else None.
    `extra_callbacks` run before the sync's at every hook (a test's fault injection, your own logging)."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from ..trainer.lightning import WeightSyncCallback

    sync = WeightSyncCallback(cfg, module_attr=recipe.module_attr)
    callbacks: list[pl.Callback] = [*extra_callbacks, sync]
    if recipe.save_final:
        callbacks.append(_save_final_callback(recipe.save_final, sync))
    strategy = _strategy(recipe)
    trainer = pl.Trainer(
        accelerator=recipe.accelerator,
        devices=recipe.devices,
        strategy=strategy,
        max_steps=recipe.steps,
        accumulate_grad_batches=recipe.accumulate_grad_batches,
        callbacks=callbacks,
        logger=CSVLogger(recipe.output_dir, name="tiny_lm"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=recipe.output_dir,
    )
    data = _data(recipe)
    trainer.fit(_lightning_module(recipe), train_dataloaders=data, ckpt_path=recipe.ckpt_path)
    if recipe.save_checkpoint:
        trainer.save_checkpoint(recipe.save_checkpoint)
    if not trainer.is_global_zero:
        return None
    return (
        f"tiny_lm: {trainer.global_step} steps, last synced version {sync.last_synced_version}, "
        f"{sync.failures} failed syncs" + (f", final weights -> {recipe.save_final}" if recipe.save_final else "")
    )


def main(argv: Sequence[str] | None = None) -> int:
    return recipe_main(
        train, RecipeConfig, argv, description=__doc__, prog="python -m lightning_weightsync.demo.tiny_lm"
    )


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["RecipeConfig", "SyntheticTokens", "TinyLM", "TinyLMConfig", "build_model", "main", "train"]
