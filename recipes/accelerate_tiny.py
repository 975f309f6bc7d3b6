"""Tiny causal LM trained with Hugging Face Accelerate, syncing its weights every optimizer step.

    torchrun --standalone --nproc-per-node 2 recipes/accelerate_tiny.py --config recipes/accelerate_tiny.yaml

Launch with torchrun on CPU: `accelerate launch --cpu --num_processes 2` starts ONE process
(Accelerate's CPU launcher ignores --num_processes unless multi-CPU is set up with mpirun or
`accelerate config`). Under torchrun even a plain `Accelerator()` that does not see the launch
(process_index 0 everywhere) works: the sending rank is taken from torch.distributed.

The one weightsync line is `AccelerateWeightSync(accelerator, model, cfg)` after `prepare`.
On CPU Accelerate uses DDP (it ignores the FSDP plugin); `recipe.fsdp2_by_hand=true` shards the
model with `fully_shard` instead and lets Accelerate prepare only the optimizer and the data.
On GPUs, configure FSDP through `accelerate config` / the FSDP plugin as usual; nothing changes here.
Serve it with the same rollout command as recipes/tiny_lm_cpu.yaml.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from lightning_weightsync.demo.recipe import recipe_main
from lightning_weightsync.demo.tiny_lm import SyntheticTokens, build_model
from lightning_weightsync.trainer.accelerate import AccelerateWeightSync

logger = logging.getLogger("lightning_weightsync.recipes.accelerate_tiny")


@dataclass
class AccelerateRecipe:
    steps: int = 4  # optimizer steps; one weight version each (+ version 0 at start)
    batch_size: int = 4  # per process, per micro-batch
    seq_len: int = 16
    lr: float = 3e-3
    seed: int = 0
    accumulate_grad_batches: int = 1
    cpu: bool = True  # Accelerator(cpu=...)
    fsdp2_by_hand: bool = False  # fully_shard the model ourselves (Accelerate prepares optimizer + data only)
    save_final: str | None = None  # safetensors path: final full weights, named as sent (rank 0)
    model: dict[str, Any] = field(default_factory=dict)  # TinyLMConfig overrides


def batches(loader: Any) -> Iterator[torch.Tensor]:
    while True:
        yield from loader


def train(recipe: AccelerateRecipe, cfg: DictConfig) -> str | None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=recipe.cpu, gradient_accumulation_steps=recipe.accumulate_grad_batches)
    model = build_model(recipe.model, seed=recipe.seed)
    c = model.config
    world = accelerator.num_processes
    samples = recipe.steps * recipe.accumulate_grad_batches * recipe.batch_size * world
    data = torch.utils.data.DataLoader(
        SyntheticTokens(samples, min(recipe.seq_len, c.max_seq_len - 1), c.vocab_size, recipe.seed),
        batch_size=recipe.batch_size,
    )
    if recipe.fsdp2_by_hand:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(accelerator.device.type, (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
        optimizer, data = accelerator.prepare(optimizer, data)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
        model, optimizer, data = accelerator.prepare(model, optimizer, data)

    weight_sync = AccelerateWeightSync(accelerator, model, cfg)  # <- the one line

    model.train()
    micro_batches = 0
    for batch in batches(data):
        if weight_sync.step >= recipe.steps:
            break
        with accelerator.accumulate(model):
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            accelerator.backward(loss)
            optimizer.step()  # the sync happens in the step post-hook
            optimizer.zero_grad()
        micro_batches += 1

    if recipe.save_final:
        tensors = {name: t.detach().cpu().clone() for name, t in weight_sync.weights()}  # every rank gathers
        if weight_sync.is_sender:
            Path(recipe.save_final).parent.mkdir(parents=True, exist_ok=True)
            from safetensors.torch import save_file

            save_file(tensors, recipe.save_final, metadata={"step": str(weight_sync.step)})
    line = (
        f"accelerate_tiny: {weight_sync.step} steps ({micro_batches} micro-batches), "
        f"last synced version {weight_sync.last_synced_version}, {weight_sync.failures} failed syncs"
    )
    is_main = weight_sync.is_sender  # not accelerator.is_main_process: a plain Accelerator() may say so everywhere
    weight_sync.close()
    accelerator.wait_for_everyone()
    # destroy the process group before the interpreter exits: left to static destructors, gloo's
    # threads can still be running and abort a rank ("terminate called without an active exception")
    accelerator.end_training()
    return line if is_main else None


def main(argv: Sequence[str] | None = None) -> int:
    return recipe_main(train, AccelerateRecipe, argv, description=__doc__)


if __name__ == "__main__":
    raise SystemExit(main())
