"""The newcomer's set-up from issue 12, with real third-party code: a tiny random-init Hugging Face
`Qwen3ForCausalLM` with tied embeddings (built from config, no download), held by the usual
LightningModule as `self.model`, trained with Lightning's `ModelParallelStrategy` (FSDP2 over gloo)
on 2 CPU processes, synced with the README's one-liner `WeightSyncCallback(cfg)`.

    python -m tests.support.hf_tied --out DIR key=value ...   # the trainer (Lightning spawns rank 1)

`build_qwen3` is also the rollout's module-sink factory (`tests.support.hf_tied:build_qwen3`):
trainer and rollout build the same class the same way.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

TOKENS = torch.tensor([[3, 17, 42, 99, 5, 64, 8, 120], [1, 2, 3, 4, 5, 6, 7, 8]])


def qwen3_config() -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )


def build_qwen3(seed: int = 0) -> torch.nn.Module:
    """Random init from a fixed seed, the global RNG left as it was."""
    from transformers import Qwen3ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(qwen3_config())
    return model


def logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


def train(out: Path, overrides: list[str], steps: int) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from safetensors.torch import save_file
    from torch.distributed.fsdp import fully_shard

    from lightning_weightsync import WeightSyncCallback, load_config

    class Policy(pl.LightningModule):
        """The usual LightningModule: the HF model as `self.model`, FSDP2 in configure_model."""

        def __init__(self) -> None:
            super().__init__()
            self.model = build_qwen3(seed=1)  # the rollout starts from seed 0: version 0 must overwrite it

        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    class SaveFinal(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            final = {n: t.detach().clone() for n, t in sync.weights(trainer)}  # every rank gathers
            if trainer.is_global_zero:
                save_file(final, str(out / "final.safetensors"))

    cfg = load_config(overrides=overrides)
    sync = WeightSyncCallback(cfg)  # <- the README's one-liner
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.DataLoader(list(torch.randint(0, 128, (8 * steps, 12), generator=g)), batch_size=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=steps,
        callbacks=[sync, SaveFinal()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
    )
    trainer.fit(Policy(), train_dataloaders=data)
    if trainer.is_global_zero:
        print(f"hf_tied: {trainer.global_step} steps, last synced version {sync.last_synced_version}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    train(Path(args.out), args.overrides, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
