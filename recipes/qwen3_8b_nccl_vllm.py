"""Qwen3-8B: FSDP2 over NCCL (Lightning ModelParallelStrategy) streaming weights to vLLM rollouts.

NOT RUN ON HARDWARE in this project (no GPUs in CI): `tests/test_recipes.py` loads this script and
its YAML, validates the config, builds the hardware-free objects and checks names and bucket plan
against the real Qwen3-8B inventory.

Trainer (one node, 8 GPUs; `WEIGHTSYNC_HOST` = an address of this node the rollouts can reach):

    WEIGHTSYNC_HOST=10.0.0.1 python recipes/qwen3_8b_nccl_vllm.py --config recipes/qwen3_8b_nccl_vllm.yaml

Rollout (other GPUs; same YAML; start it first): a `vllm serve` that generates and receives, through
vLLM's weight-transfer API and our engine (`vllm:` section: model, serve_args; docs/backends.md):

    WEIGHTSYNC_HOST=10.0.0.1 lightning-weightsync rollout --config recipes/qwen3_8b_nccl_vllm.yaml

The trainer drives every version through `vllm.urls` (`ROLLOUT_URL=http://<rollout ip>:8000`): pause,
start_weight_update, update_weights while rank 0 broadcasts, finish_weight_update(weight_version=step),
resume; generation runs between versions.

Bucket size: 3072 MB moves the 1.16 GiB embedding in one piece; `transport.bucket_size_mb=128`
(recipes/qwen3_8b_nccl_vllm_128mb.yaml) forces it into ~10 chunks and needs 2 x 128 MiB per side.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from lightning_weightsync.demo.recipe import recipe_main
from lightning_weightsync.trainer.lightning import WeightSyncCallback

CHECKOUT = str(Path(__file__).resolve().parents[1])  # examples/ is in the checkout, not in the wheel
if CHECKOUT not in sys.path:
    sys.path.insert(0, CHECKOUT)

from examples.qwen3 import Qwen3Recipe, lightning_module, synthetic_batches  # noqa: E402


class SyntheticStream(torch.utils.data.IterableDataset):  # placeholder: rollout samples go here
    def __init__(self, recipe: Qwen3Recipe) -> None:
        self.recipe = recipe

    def __iter__(self):  # type: ignore[no-untyped-def]
        r = self.recipe
        for batch in synthetic_batches(1, r.seq_len, r.vocab_size_for_data, r.seed):
            yield batch[0]


def build(recipe: Qwen3Recipe, cfg: DictConfig) -> dict[str, Any]:
    """Everything but the Trainer itself (which needs the GPUs): callback, strategy, module."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    return {
        "callback": WeightSyncCallback(cfg, module_attr=recipe.module_attr),
        "strategy": ModelParallelStrategy(data_parallel_size=recipe.devices * recipe.num_nodes, tensor_parallel_size=1),
        "module": lightning_module(recipe),
    }


def train(recipe: Qwen3Recipe, cfg: DictConfig) -> None:
    import lightning.pytorch as pl

    objs = build(recipe, cfg)
    trainer = pl.Trainer(
        accelerator="cuda",
        devices=recipe.devices,
        num_nodes=recipe.num_nodes,
        strategy=objs["strategy"],
        max_steps=recipe.steps,
        accumulate_grad_batches=recipe.accumulate_grad_batches,
        callbacks=[objs["callback"]],
        enable_checkpointing=False,
        log_every_n_steps=1,
    )
    data = torch.utils.data.DataLoader(SyntheticStream(recipe), batch_size=recipe.batch_size)
    trainer.fit(objs["module"], train_dataloaders=data)


def main(argv: Sequence[str] | None = None) -> int:
    return recipe_main(train, Qwen3Recipe, argv, description=__doc__, config_required=True)


if __name__ == "__main__":
    raise SystemExit(main())
