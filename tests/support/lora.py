"""A tiny Qwen3 (built from config, no download) with a PEFT LoRA adapter, rank 16 on every linear layer,
for the LoRA tests; and its trainer: Lightning on 2 CPU ranks, `ModelParallelStrategy` (FSDP2 over gloo)
or DDP.

    python -m tests.support.lora --out DIR [--strategy fsdp2|ddp] key=value ...   # Lightning spawns rank 1
    torchrun --standalone --nproc-per-node 2 -m tests.support.lora --out DIR --strategy accelerate ...

The factories are also the rollout's (`rollout.sink.factory=tests.support.lora:build_peft` for
`rollout.sink.lora=keep`, `:build_base` for `merge`): trainer and rollout build the same classes.
After every optimizer step the trainer writes the adapter it holds (`ref_<step>.safetensors`, PEFT's
names, gathered with FSDP2's `full_tensor`, independent of the sync's stream) for the test to compare.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

RANK = 16
TOKENS = torch.tensor([[3, 17, 42, 99, 5, 64, 8, 120], [1, 2, 3, 4, 5, 6, 7, 8]])


def qwen3_config() -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def lora_config(**extra: Any) -> Any:
    from peft import LoraConfig

    fields = {"r": RANK, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear", **extra}
    return LoraConfig(**fields)


def build_base(seed: int = 0) -> torch.nn.Module:
    """Random init from a fixed seed, the global RNG left as it was."""
    from transformers import Qwen3ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3ForCausalLM(qwen3_config())


def build_peft(seed: int = 0, lora_seed: int = 1, **extra: Any) -> torch.nn.Module:
    """The base from `seed`, a LoRA adapter from `lora_seed` (B non-zero, so a merge changes something)."""
    from peft import get_peft_model

    model = build_base(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(lora_seed)
        return get_peft_model(model, lora_config(init_lora_weights=False, **extra))


def build_gpt2_base(seed: int = 0) -> torch.nn.Module:
    """A tiny GPT-2 (its linear layers are `Conv1D`: weights stored [in, out], PEFT's `fan_in_fan_out`)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=1, n_head=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT2LMHeadModel(config)


def build_gpt2_peft(seed: int = 0, lora_seed: int = 1, **extra: Any) -> torch.nn.Module:
    """`build_gpt2_base` with LoRA on c_attn [32, 96], c_proj [32, 32] / [128, 32] and c_fc [32, 128]."""
    from peft import get_peft_model

    model = build_gpt2_base(seed)
    fields = {"target_modules": ["c_attn", "c_proj", "c_fc"], "fan_in_fan_out": True, **extra}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(lora_seed)
        return get_peft_model(model, lora_config(init_lora_weights=False, **fields))


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {n: t.detach().clone() for n, t in get_peft_model_state_dict(model).items()}


def train(out: Path, overrides: list[str], steps: int, strategy: str = "fsdp2") -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from lightning_weightsync import WeightSyncCallback, load_config

    class Policy(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_peft(seed=0, lora_seed=1)

        def configure_model(self) -> None:
            if strategy != "fsdp2":
                return
            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.base_model.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    class SaveAdapter(pl.Callback):
        """The trainer's adapter after every sync (every rank takes part in full_tensor)."""

        def _save(self, trainer: pl.Trainer, version: int) -> None:
            state = get_peft_model_state_dict(trainer.lightning_module.model)
            full = {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone() for n, t in state.items()}
            if trainer.is_global_zero:
                save_file(full, str(out / f"ref_{version}.safetensors"))

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self._save(trainer, 0)

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            self._save(trainer, trainer.global_step)

    cfg = load_config(overrides=overrides)
    sync = WeightSyncCallback(cfg)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.DataLoader(list(torch.randint(0, 128, (2 * steps, 12), generator=g)), batch_size=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if strategy == "fsdp2" else "ddp",
        max_steps=steps,
        callbacks=[sync, SaveAdapter()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
    )
    trainer.fit(Policy(), train_dataloaders=data)
    if trainer.is_global_zero:
        stats = sync.last_stats
        print(f"lora: {trainer.global_step} steps, last version {sync.last_synced_version}, {stats}", flush=True)


def train_accelerate(out: Path, overrides: list[str], steps: int) -> None:
    """The same, in a plain Accelerate loop (run under torchrun: Accelerate's DDP on CPU)."""
    from accelerate import Accelerator
    from safetensors.torch import save_file

    from lightning_weightsync import AccelerateWeightSync, load_config

    acc = Accelerator(cpu=True)
    model = build_peft(seed=0, lora_seed=1)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = acc.prepare(model, optimizer)

    def save(version: int) -> None:
        if acc.is_main_process:
            save_file(adapter_state(acc.unwrap_model(model)), str(out / f"ref_{version}.safetensors"))

    save(0)
    sync = AccelerateWeightSync(acc, model, load_config(overrides=overrides))  # syncs version 0
    g = torch.Generator().manual_seed(acc.process_index)
    for step in range(1, steps + 1):
        batch = torch.randint(0, 128, (1, 12), generator=g)
        acc.backward(model(input_ids=batch, labels=batch).loss)
        optimizer.step()  # the sync runs in the optimizer's post-hook
        optimizer.zero_grad()
        save(step)
    if acc.is_main_process:
        print(f"lora: {sync.step} steps, last version {sync.last_synced_version}, {sync.last_stats}", flush=True)
    sync.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--strategy", choices=("fsdp2", "ddp", "accelerate"), default="fsdp2")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    if args.strategy == "accelerate":
        train_accelerate(Path(args.out), args.overrides, args.steps)
    else:
        train(Path(args.out), args.overrides, args.steps, args.strategy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
