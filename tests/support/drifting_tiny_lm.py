"""The tiny LM recipe with replicas that drift: after every optimizer step global rank 1 nudges its own
copy of a few tensors it holds whole (ModelParallelStrategy's defaults on 2 devices: every rank a whole
copy). A real run drifts the same way by rounding (1.9e-9 on a norm bias after one step, seen with plain
Lightning); here it is made certain, so the test does not depend on this machine's kernels.

    python -m tests.support.drifting_tiny_lm --config recipes/tiny_lm_cpu.yaml key=value ...
"""

from __future__ import annotations

import sys
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_weightsync.demo.recipe import recipe_main
from lightning_weightsync.demo.tiny_lm import RecipeConfig, train

DRIFTING = ("norm.weight", "lm_head.weight")  # a small tensor sent whole, one striped over the ranks
NUDGE = 1e-6


class DriftOnRankOne(pl.Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_rank != 1:
            return
        params = dict(pl_module.model.named_parameters())
        with torch.no_grad():
            for name in DRIFTING:
                tensor = params[name]
                (tensor.to_local() if hasattr(tensor, "to_local") else tensor).add_(NUDGE)


def main() -> int:
    return recipe_main(lambda recipe, cfg: train(recipe, cfg, [DriftOnRankOne()]), RecipeConfig, sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
