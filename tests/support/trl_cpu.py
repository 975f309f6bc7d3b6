"""TRL's real `AsyncGRPOTrainer` on CPU, one process per rank, with our `WeightSyncTransfer` and `CpuRolloutWorker`.

    python -m tests.support.trl_cpu OUT_DIR MODEL_DIR PORT [--kill-rollout-after-step N] [--steps N]
    (env: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, as a launcher sets them)

Every rank writes OUT_DIR/result-RANK.json: how training ended (the error, when it raised, and the wall
time); rank 0 adds the digest of the trainer's weights for every version it synced (taken in a
callback right before TRL's sync of that step, `weights_digest` over the stream TRL sends) and the digest the
rollout reported for every version it received; or the error training ended with, and how long after the
rollout was killed it surfaced.

Two CPU stand-ins, both outside the weight path (trl 1.16.0):
- `packing._flash_attn` (packing.py:159-165) loads the FA3 kernel from the Hub (CUDA): `varlen_attention` is the
  same function in plain torch (per segment, causal aligned bottom-right, as flash-attn's varlen is);
- `get_peak_flops_per_device` (trainer/utils.py:1811-1831) calls `torch.cuda.get_device_name`: None, its own
  answer for an unknown device (MFU metrics off).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

BOS, EOS, PAD = 10, 11, 12


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    **_: Any,
) -> torch.Tensor:
    """flash-attn's `flash_attn_varlen_func` for what TRL's tree attention asks of it (causal, no window)."""
    assert causal and window_size == (-1, -1)
    out = torch.empty_like(q)
    repeat = q.shape[1] // k.shape[1]  # grouped-query attention
    for s in range(len(cu_seqlens_q) - 1):
        a, b, c, d = (int(x) for x in (cu_seqlens_q[s], cu_seqlens_q[s + 1], cu_seqlens_k[s], cu_seqlens_k[s + 1]))
        qs = q[a:b].transpose(0, 1)
        ks = k[c:d].transpose(0, 1).repeat_interleave(repeat, 0)
        vs = v[c:d].transpose(0, 1).repeat_interleave(repeat, 0)
        mask = torch.ones(b - a, d - c, dtype=torch.bool).tril(diagonal=(d - c) - (b - a))
        out[a:b] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=softmax_scale).transpose(0, 1)
    return out


class _TorchFlashAttn:
    flash_attn_varlen_func = staticmethod(varlen_attention)


def patch_trl_for_cpu() -> None:
    import trl.experimental.async_grpo.async_grpo_trainer as trainer_module
    import trl.experimental.async_grpo.packing as packing

    packing._flash_attn = lambda: _TorchFlashAttn  # type: ignore[assignment]
    trainer_module.get_peak_flops_per_device = lambda *args, **kwargs: None  # type: ignore[assignment]


def write_tiny_model(model_dir: Path, seed: int = 0) -> Path:
    """A tiny Qwen3 (tied embeddings) and a word-level tokenizer of the digits, saved like a Hub checkpoint."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=32, tie_word_embeddings=True,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        Qwen3ForCausalLM(config).save_pretrained(model_dir)
    vocab = {str(i): i for i in range(10)} | {"<bos>": BOS, "<eos>": EOS, "<pad>": PAD, "<unk>": 13}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
        bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
    )  # fmt: skip
    tokenizer.save_pretrained(model_dir)
    return model_dir


def count_up(prompt: list[int], completion: list[int]) -> float:
    """The GRPO example's task: after [BOS, d] the answer counts up d+1, d+2, ... (mod 10)."""
    d = prompt[-1]
    return sum(t == (d + i + 1) % 10 for i, t in enumerate(completion)) / max(len(completion), 1)


PROMPTS = [[BOS, d] for d in range(10)]


def sync_config(port: int) -> Any:
    from lightning_weightsync import load_config

    return load_config(
        overrides=[
            f"transport.port={port}",
            "transport.bucket_size_mb=0.004",  # 4 KiB: the embedding (2 KiB) and MLPs share and cross buckets
            "transport.timeout_s=60",
            "transport.liveness_s=2",
            "transport.heartbeat_interval_s=0.2",
            "rollout.identity=trl-cpu-rollout",
        ]
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("model_dir")
    parser.add_argument("port", type=int)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--kill-rollout-after-step", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    patch_trl_for_cpu()

    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params

    from lightning_weightsync.integrations.trl import WeightSyncTransfer
    from lightning_weightsync.integrations.trl_rollout import CpuRolloutWorker
    from lightning_weightsync.versions.verify import weights_digest

    rank = int(os.environ.get("RANK", "0"))
    cfg = sync_config(args.port)
    worker = None
    if rank == 0:  # before the trainer: its first sync (on train begin) needs a receiver
        worker = CpuRolloutWorker(cfg, args.model_dir, PROMPTS, count_up, num_generations=4, max_new_tokens=3)
    digests: dict[int, str] = {}
    killed_at: list[float] = []

    class Record(TrainerCallback):  # type: ignore[misc]
        """The trainer's digest of what the coming sync sends (runs before TRL's own sync callbacks)."""

        def _record(self, version: int, model: Any) -> None:
            if rank == 0:
                digests[version] = weights_digest(_iter_vllm_named_params(trainer.accelerator.unwrap_model(model)))

        def on_train_begin(self, _args: Any, state: Any, _control: Any, model: Any = None, **_: Any) -> None:
            self._record(1, model)

        def on_step_end(self, _args: Any, state: Any, _control: Any, model: Any = None, **_: Any) -> None:
            self._record(state.global_step + 1, model)
            if worker is not None and state.global_step == args.kill_rollout_after_step:
                worker.process.kill()
                worker.process.join(5)
                killed_at.append(time.monotonic())

    config = AsyncGRPOConfig(
        output_dir=str(Path(args.out_dir) / "trainer"), use_cpu=True, bf16=False, max_steps=args.steps,
        per_device_train_batch_size=2, num_generations=4, gradient_checkpointing=False, token_budget=0,
        report_to=[], save_strategy="no", logging_steps=1, learning_rate=1e-2, max_staleness=8,
        disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = AsyncGRPOTrainer(
        model=args.model_dir,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "0"}]] * 8}),
        processing_class=PreTrainedTokenizerFast.from_pretrained(args.model_dir),
        callbacks=[Record()],
        rollout_worker=worker,
        weight_transfer=WeightSyncTransfer(cfg),  # <- every rank: TRL's LoRA probe is keyed on it (:1323)
    )
    result: dict[str, Any] = {"rank": rank}
    code = 0
    try:
        trainer.train()
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        code = 1
    result["ended"] = time.time()
    if rank == 0:
        assert worker is not None
        if killed_at:
            result["error_after_kill_s"] = time.monotonic() - killed_at[0]
        result["trainer"] = {str(v): d for v, d in digests.items()}
        result["rollout"] = {str(v): d for v, d in worker.versions().items()}
        result["model_version"] = trainer.model_version
    Path(args.out_dir, f"result-{rank}.json").write_text(json.dumps(result))
    return code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
