"""Bytes each tensor-parallel worker takes off the wire a version, as a share of the model (issue 46): computed
from the tensor inventories in lightning_weightsync/bench/data/model_inventories.json, not measured.

Three ways to feed a TP worker, for a dense Hugging Face checkpoint (q/k/v and gate/up separate):

- `today`: every worker receives every tensor whole (a broadcast).
- `m2n`: vLLM 0.34's `nccl_m2n` (distributed/weight_transfer/m2n_layout.py): a tensor whose loader is a plain
  TP copy (`o_proj` and `down_proj` row-parallel, the vocab-parallel `embed_tokens` and `lm_head`) comes as the
  worker's shard; one fused into a vLLM parameter (`q/k/v_proj` -> `qkv_proj`, `gate/up_proj` ->
  `gate_up_proj`) whole to every worker; norms whole.
- `slices`: ours (`rollout_engines/vllm/slices.py`, boxes traced from vLLM's loaders; the tests in
  test_vllm_slices_real.py and test_vllm_slices_engine.py check them for Qwen3 and Llama): every TP-split tensor,
  fused or not, as the worker's box; `k_proj`/`v_proj` 1/min(TP, KV heads) of it (with TP > KV heads a rank reads
  its KV head whole); norms whole. The vocabulary is padded to 64 rows before it is split (vLLM's
  `VocabParallelEmbedding`), so the last rank may read fewer rows: the figure is the largest rank's.

The MoE inventory (Qwen3-30B-A3B) holds transformers 5's fused 3-D expert tensors (`mlp.experts.gate_up_proj`
[E, 2I, H]); `quantized` counts them as Hugging Face's per-expert checkpoint tensors split 1/TP each (the boxes
test_vllm_slices_real.py and test_vllm_quantized_real.py check on a tiny Qwen3-MoE); the fused layout itself goes
whole (docs/backends.md).

    python -m tools.slice_bytes              # the Markdown table of docs/backends.md
    python -m tools.slice_bytes quantized    # the online-quantized models' table (Qwen3-8B, Qwen3-30B-A3B)
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
INVENTORIES = REPO / "lightning_weightsync" / "bench" / "data" / "model_inventories.json"
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
COLUMN = ("q_proj.weight", "gate_proj.weight", "up_proj.weight")  # split along rows (dim 0)
KV = ("k_proj.weight", "v_proj.weight")  # rows, by KV head
ROW = ("o_proj.weight", "down_proj.weight")  # split along columns (dim 1)
VOCAB = ("embed_tokens.weight", "lm_head.weight")  # rows of the padded vocabulary
FUSED = COLUMN + KV  # vLLM fuses these into qkv_proj / gate_up_proj
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # transformers 5's fused banks [E, 2I, H], [E, H, I]
ROUTER = ("mlp.gate.weight",)  # replicated


def worker_bytes(
    tensors: list[tuple[str, list[int], str]], tp: int, kv_heads: int, mode: str, vocab_pad: int = 64
) -> int:
    """Bytes the busiest TP rank receives a version, in `mode` (`today`, `m2n`, `slices`)."""
    total = 0
    for name, shape, dtype in tensors:
        numel, size = math.prod(shape), ITEMSIZE[dtype]
        if mode == "today" or len(shape) < 2:
            total += numel * size
        elif name.endswith(EXPERTS):  # per-expert checkpoint names: each expert's rows (gate, up) or columns (down)
            total += numel * size if mode == "m2n" else numel // tp * size
        elif name.endswith(ROUTER):
            total += numel * size
        elif name.endswith(VOCAB):
            padded = math.ceil(shape[0] / vocab_pad) * vocab_pad
            rows = min(padded // tp, shape[0])
            total += rows * math.prod(shape[1:]) * size
        elif name.endswith(ROW):
            total += numel // tp * size
        elif name.endswith(FUSED) and mode == "m2n":
            total += numel * size
        elif name.endswith(COLUMN):
            total += numel // tp * size
        elif name.endswith(KV):
            total += numel // min(tp, kv_heads) * size
        else:
            raise ValueError(f"{name}: no rule (a tensor this computation does not know)")
    return total


def table(model: str = "qwen3-8b", kv_heads: int = 8, tps: tuple[int, ...] = (2, 4, 8)) -> str:
    spec = json.loads(INVENTORIES.read_text())[model]
    tensors = [(n, s, d) for n, s, d in spec["tensors"]]
    whole = worker_bytes(tensors, 1, kv_heads, "today")
    assert whole == spec["total_bytes"], (whole, spec["total_bytes"])
    lines = [
        f"| {model} ({whole / 2**30:.1f} GiB) | TP | today (broadcast) | vLLM 0.34 m2n (fused whole) | slices |",
        "|---|---|---|---|---|",
    ]
    for tp in tps:
        cells = []
        for mode in ("today", "m2n", "slices"):
            got = worker_bytes(tensors, tp, kv_heads, mode)
            cells.append(f"{got / 2**30:.2f} GiB ({100 * got / whole:.1f} %)")
        lines.append(f"| | {tp} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def quantized_table(tps: tuple[int, ...] = (2, 4, 8)) -> str:
    """Online-quantized vLLM models (docs/backends.md): the trainer sends bf16 in checkpoint format, so a worker's
    boxes are the bf16 model's; vLLM's own `nccl_m2n` sends every tensor whole to every worker of a quantized model
    (m2n_engine.py, m2n_layout.py). Qwen3-30B-A3B counted with per-expert checkpoint names (`experts.<e>.gate_proj`,
    as Hugging Face's checkpoints and the contract kit's MoE have them): each expert's slice of the fused bank."""
    header = "| model | TP | broadcast, or vLLM 0.34 m2n (quantized: whole) | slices (bf16 boxes) |"
    lines = [header, "|---|---|---|---|"]
    for model, kv_heads in (("qwen3-8b", 8), ("qwen3-30b-a3b", 4)):
        spec = json.loads(INVENTORIES.read_text())[model]
        tensors = [(n, s, d) for n, s, d in spec["tensors"]]
        whole = worker_bytes(tensors, 1, kv_heads, "today")
        for tp in tps:
            got = worker_bytes(tensors, tp, kv_heads, "slices")
            share = f"{got / 2**30:.2f} GiB ({100 * got / whole:.1f} %)"
            lines.append(f"| {model} | {tp} | {whole / 2**30:.2f} GiB (100 %) | {share} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:] == ["quantized"]:
        print(quantized_table())
    else:
        print(table(sys.argv[1]) if len(sys.argv) > 1 else table())
