"""Qwen3-8B on Ascend NPUs: FSDP2 over HCCL, weights streamed over HCCL to vLLM-Ascend rollouts.

NOT RUN ON HARDWARE in this project (no NPUs in CI): `tests/test_recipes.py` loads this script and
its YAML, validates the config and checks names and bucket plan against the Qwen3-8B inventory.

Lightning has no Ascend accelerator of its own, so this recipe trains with Accelerate (which drives
NPUs through torch_npu and an HCCL process group) and `AccelerateWeightSync`:

    WEIGHTSYNC_HOST=<trainer ip> torchrun --nproc-per-node 8 recipes/qwen3_8b_npu_hccl.py \\
        --config recipes/qwen3_8b_npu_hccl.yaml
    WEIGHTSYNC_HOST=<trainer ip> lightning-weightsync rollout --config recipes/qwen3_8b_npu_hccl.yaml
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from omegaconf import DictConfig

from lightning_weightsync.demo.recipe import recipe_main
from lightning_weightsync.trainer.accelerate import AccelerateWeightSync

CHECKOUT = str(Path(__file__).resolve().parents[1])  # examples/ is in the checkout, not in the wheel
if CHECKOUT not in sys.path:
    sys.path.insert(0, CHECKOUT)

from examples.qwen3 import (  # noqa: E402
    Qwen3Recipe,
    build_empty_qwen3,
    materialize_and_load,
    next_token_loss,
    resolve_weights_dir,
    shard_qwen3,
    synthetic_batches,
)


def train(recipe: Qwen3Recipe, cfg: DictConfig) -> None:
    import torch_npu  # noqa: F401  (registers the "npu" device and HCCL)
    from accelerate import Accelerator
    from torch.distributed.device_mesh import init_device_mesh

    accelerator = Accelerator(gradient_accumulation_steps=recipe.accumulate_grad_batches)
    mesh = init_device_mesh("npu", (accelerator.num_processes,))
    model_dir = resolve_weights_dir(recipe.model_path)
    model = build_empty_qwen3(model_dir)
    shard_qwen3(model, mesh, activation_checkpointing=recipe.activation_checkpointing)
    materialize_and_load(model, model_dir, accelerator.device)
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0))

    weight_sync = AccelerateWeightSync(accelerator, model, cfg)  # <- the one line

    model.train()
    batches = synthetic_batches(recipe.batch_size, recipe.seq_len, recipe.vocab_size_for_data, recipe.seed)
    while weight_sync.step < recipe.steps:
        with accelerator.accumulate(model):
            loss = next_token_loss(model, next(batches).to(accelerator.device))
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    weight_sync.close()


def main(argv: Sequence[str] | None = None) -> int:
    return recipe_main(train, Qwen3Recipe, argv, description=__doc__, config_required=True)


if __name__ == "__main__":
    raise SystemExit(main())
