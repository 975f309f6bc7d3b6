"""Qwen3 (e.g. Qwen3-8B) trainer pieces for the GPU (NCCL -> vLLM) and Ascend NPU (HCCL) recipes.

NOT RUN ON HARDWARE in this project's CI (no GPU/NPU, no model downloads there): the tests load the
recipes, validate their configs, build the objects that need no hardware, and check the names and
the bucket plan against the real Qwen3-8B tensor inventory. Everything here uses public APIs only:
transformers (`AutoConfig`, `AutoModelForCausalLM.from_config`), accelerate's `init_empty_weights`,
torch FSDP2 (`fully_shard`, `MixedPrecisionPolicy`) and `torch.distributed.checkpoint.state_dict`.

Loading: the model is created with empty (meta) parameters on every rank, sharded, materialised on
the device, and the Hugging Face safetensors weights are read on global rank 0 only and broadcast
into the shards (`set_model_state_dict(..., broadcast_from_rank0=True)`), so no rank ever holds a
second full copy. Master weights stay fp32; compute is bf16 (FSDP2 mixed precision); the weight
sync casts to bf16 per tensor (`trainer.dtype: bfloat16`) for vLLM.

The training step is a placeholder (next-token loss on synthetic tokens) marking where an RL loss
(GRPO/PPO on rollout samples) goes; the weight sync does not care what the loss is.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger("lightning_weightsync.examples.qwen3")  # under the package's logger (setup_logging)


@dataclass
class Qwen3Recipe:
    """The `recipe:` section of the Qwen3 recipes."""

    model_path: str = "Qwen/Qwen3-8B"  # local directory or Hugging Face id (resolved by huggingface_hub)
    steps: int = 100
    batch_size: int = 1  # per rank, per micro-batch
    seq_len: int = 2048
    lr: float = 1e-6
    seed: int = 0
    devices: int = 8  # accelerators per node
    num_nodes: int = 1
    accumulate_grad_batches: int = 1
    activation_checkpointing: bool = True
    module_attr: str = "model"  # the LightningModule attribute holding the HF model
    vocab_size_for_data: int = 151_936  # synthetic data only


def resolve_weights_dir(model_path: str) -> str:
    """A local directory with `config.json` and `*.safetensors` (downloads only if given an HF id)."""
    if os.path.isdir(model_path):
        return model_path
    from huggingface_hub import snapshot_download

    return str(snapshot_download(model_path, allow_patterns=["*.json", "*.safetensors"]))


def build_empty_qwen3(model_dir: str) -> nn.Module:
    """The HF model with meta parameters and real (CPU) buffers, e.g. rotary `inv_freq`."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with init_empty_weights(include_buffers=False):
        model: nn.Module = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
        return model


def shard_qwen3(model: nn.Module, mesh: Any, *, activation_checkpointing: bool) -> nn.Module:
    """FSDP2: one unit per decoder layer plus the root (embedding, final norm, LM head)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layers = model.get_submodule("model.layers")
    assert isinstance(layers, nn.ModuleList)  # a HF decoder's layer stack
    for i, layer in enumerate(layers):
        if activation_checkpointing:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            layer = checkpoint_wrapper(layer)
            layers[i] = layer
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def materialize_and_load(model: nn.Module, model_dir: str, device: torch.device) -> None:
    """Allocate the shards on `device`, keep the real buffers, load HF weights from rank 0."""
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, ValueType, set_model_state_dict

    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in buffers:
                b.copy_(buffers[name])
    full: dict[str, ValueType] = {}
    if dist.get_rank() == 0:
        for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
            full.update(load_file(path))
        logger.info("loaded %d tensors from %s", len(full), model_dir)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(model, full, options=options)


def synthetic_batches(batch_size: int, seq_len: int, vocab_size: int, seed: int) -> Iterator[torch.Tensor]:
    """Placeholder data (replace with rollout samples)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=g)


def next_token_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Placeholder loss where the RL objective goes."""
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def lightning_module(recipe: Qwen3Recipe) -> Any:
    """A LightningModule holding the HF model as `self.model`, sharded in `configure_model`."""
    import lightning.pytorch as pl

    class Qwen3Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.recipe = recipe
            self.model: nn.Module | None = None

        def configure_model(self) -> None:
            if self.model is not None:
                return
            model_dir = resolve_weights_dir(recipe.model_path)
            model = build_empty_qwen3(model_dir)
            mesh = self.device_mesh
            assert mesh is not None  # ModelParallelStrategy sets it before configure_model
            shard_qwen3(model, mesh["data_parallel"], activation_checkpointing=recipe.activation_checkpointing)
            materialize_and_load(model, model_dir, self.device)
            self.model = model

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            assert self.model is not None
            loss = next_token_loss(self.model, batch)
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=recipe.lr, weight_decay=0.0)

    return Qwen3Module()
