"""Tiny causal LM on CPU (2 processes, FSDP2 over gloo) syncing its weights after every step.

    python recipes/tiny_lm_cpu.py --config recipes/tiny_lm_cpu.yaml recipe.steps=4 transport.port=29600

Everything lives in `lightning_weightsync.demo.tiny_lm` (model, data, LightningModule, trainer);
this script is the same as `python -m lightning_weightsync.demo.tiny_lm`.
"""

from lightning_weightsync.demo.tiny_lm import main

if __name__ == "__main__":
    raise SystemExit(main())
