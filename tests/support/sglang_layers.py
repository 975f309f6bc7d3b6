"""SGLang 0.5.23's REAL model layers on CPU (the `./dev sglang-contract` kit): a tiny Qwen3 / Qwen3-MoE built by
SGLang's own classes, unquantized or with SGLang's block-FP8 `Fp8Config` (weight_block_size [128, 128]), at TP 1
or as one rank of TP 2, and FP8 checkpoints made by SGLang's own `per_block_cast_to_fp8`.

What the kit lacks and what stands in (nothing here holds or loads a weight):
- Triton: SGLang's own stub (`sglang/_platform_stubs.py`, what it installs on Apple Silicon).
- torchvision: PyPI's Linux wheel for torch 2.13 (torchvision 0.28.0) is the CUDA build; its `_C.so` needs
  `libc10_cuda.so`, and `torchvision/_meta_registrations.py:163` then raises `RuntimeError: operator
  torchvision::nms does not exist` on the CPU torch. SGLang imports it only for multimodal image preprocessing
  (`sglang/srt/multimodal/internvl_utils.py:5`, reached from `sglang/srt/configs/__init__.py:71` on every model
  import), so a `torchvision` whose every attribute is a stand-in (SGLang's own `_MockModule`) is put in its
  place when the real one does not import, after `import sglang` (transformers has decided by then that it has
  no torchvision).
- Rotary embedding: its constructor takes a kernel reference unless it is told it runs on a CPU
  (`sglang/srt/layers/rotary_embedding/base.py:124`, `_is_cpu`, read only there); without SGLang's CPU engine
  (`SGLANG_USE_CPU_ENGINE=1`, which needs the `sgl_kernel` CPU build: `sglang/kernels/ops/kvcache/cache_move.py:10`
  imports it) it would import `vllm._custom_ops`. `build` sets `_is_cpu` while it constructs (the cos/sin cache
  it computes is not a weight).
- Process groups: SGLang's layers read their TP rank and size from `get_parallel()`'s groups (`rank_in_group`,
  `world_size`); `publish_tp` publishes SGLang's own `ServerArgs(tp_size=...)` for a rank and states each group as
  a one-process stand-in of that rank and size (as SGLang's `_LogicalGroup` does before distributed init), so no
  torch.distributed group is made. Layers that need a collective to load (none of these) would fail loudly.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import platform
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any
from unittest import mock

import torch

from lightning_weightsync.protocol.boxes import Box
from tests.support.checkpoints import per_expert

QUANTIZED = tuple(f"{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
"""The checkpoint tensors a block-FP8 checkpoint holds as FP8 (+ `<name>_scale_inv`): every linear layer's weight but
the MoE router's (SGLang builds `mlp.gate` unquantized), the embedding, the LM head and the norms."""

GROUPS = {
    "tp_group": "tp", "attn_tp_group": "attn_tp", "moe_tp_group": "moe_tp", "moe_ep_group": "moe_ep",
    "moe_dp_group": "moe_dp", "pp_group": "pp", "attn_cp_group": "attn_cp", "dcp_group": "dcp",
}  # fmt: skip


def _root() -> Path:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations
    return Path(spec.submodule_search_locations[0])


def install_triton_stub() -> None:
    """SGLang's own Triton stub (its `install_platform_stubs` acts only on Apple Silicon)."""
    if "sglang_platform_stubs" in sys.modules:
        return
    spec = importlib.util.spec_from_file_location("sglang_platform_stubs", _root() / "_platform_stubs.py")
    assert spec is not None and spec.loader is not None
    stubs: ModuleType = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = stubs
    spec.loader.exec_module(stubs)
    real = (sys.platform, platform.machine, torch.backends.mps.is_available)
    sys.platform, platform.machine, torch.backends.mps.is_available = "darwin", lambda: "arm64", lambda: True  # type: ignore[assignment]
    try:
        stubs.install_platform_stubs()
    finally:
        sys.platform, platform.machine, torch.backends.mps.is_available = real  # type: ignore[assignment]


class _TorchvisionStandIn:
    """A meta-path finder answering `torchvision` and its submodules with SGLang's `_MockModule`."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "torchvision" and not fullname.startswith("torchvision."):
            return None
        if fullname not in sys.modules:
            sys.modules[fullname] = sys.modules["sglang_platform_stubs"]._MockModule(fullname)
        return sys.modules[fullname].__spec__


def prepare() -> None:
    """Make SGLang's model layers importable here (see the module docstring); idempotent."""
    install_triton_stub()
    import sglang  # noqa: F401  # its transformers patches first: transformers then knows there is no torchvision

    try:
        import torchvision  # noqa: F401
    except Exception:
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        if not any(isinstance(f, _TorchvisionStandIn) for f in sys.meta_path):
            sys.meta_path.insert(0, _TorchvisionStandIn())


def blocker() -> str | None:
    """Why SGLang's Qwen3 / Qwen3-MoE layers and its FP8 method do not import here (module: error), or None."""
    if importlib.util.find_spec("sglang") is None:
        return "SGLang is not installed (./dev sglang-contract)"
    name = "sglang"
    try:
        prepare()
        for name in ("sglang.srt.models.qwen3", "sglang.srt.models.qwen3_moe", "sglang.srt.layers.quantization.fp8"):
            importlib.import_module(name)
    except Exception as exc:
        return f"{name}: {type(exc).__name__}: {str(exc)[:200]} (./dev sglang-contract installs what the layers need)"
    return None


def _group(rank: int, size: int) -> SimpleNamespace:
    return SimpleNamespace(
        rank_in_group=rank, world_size=size, is_first_rank=rank == 0, is_last_rank=rank == size - 1, cpu_group=None,
        device_group=SimpleNamespace(size=lambda: size, rank=lambda: rank),
    )  # fmt: skip


def publish_tp(rank: int, tp_size: int) -> None:
    """SGLang's runtime context as on TP rank `rank` of `tp_size` (one pipeline stage, expert parallelism off)."""
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    publish(ServerArgs(model_path="dummy", tp_size=tp_size, ep_size=1, pp_size=1), role="test",
            ranks=SpawnRanks(world_rank=rank))  # fmt: skip
    parallel = get_parallel()

    def rank_size(kind: str) -> tuple[int, int]:
        try:
            return getattr(parallel, f"{kind}_rank"), getattr(parallel, f"{kind}_size")
        except RuntimeError:  # a dimension SGLang leaves unwritten at this topology (decode context parallelism)
            return 0, 1

    parallel.override_permanently(**{group: _group(*rank_size(kind)) for group, kind in GROUPS.items()})
    assert (parallel.tp_rank, parallel.tp_size) == (rank, tp_size)


def qwen3() -> Any:
    from transformers import Qwen3Config

    # sizes that split into whole 128x128 blocks at TP 2 (SGLang refuses a block-FP8 partition that does not)
    return Qwen3Config(
        vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, tie_word_embeddings=False,
    )  # fmt: skip


def qwen3_moe() -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=300, hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=128, num_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=False,
    )  # fmt: skip


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def build(
    arch: str,
    hf: Any,
    *,
    fp8: bool,
    rank: int = 0,
    tp_size: int = 1,
    scale_fmt: str | None = None,
    weight_block_size: list[int] | None = None,
) -> torch.nn.Module:
    """SGLang's own model class for `arch` at TP rank `rank` of `tp_size`, bf16, block-FP8 with `fp8` (its checkpoint's
    `scale_fmt`, e.g. "ue8m0"; `weight_block_size` [128, 128] unless given)."""
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.layers.rotary_embedding import base as rotary

    module, name = {
        "qwen3": ("sglang.srt.models.qwen3", "Qwen3ForCausalLM"),
        "qwen3_moe": ("sglang.srt.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    }[arch]
    quant = Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic",
                      weight_block_size=weight_block_size or [128, 128], scale_fmt=scale_fmt)  # fmt: skip
    publish_tp(rank, tp_size)
    with default_dtype(torch.bfloat16), mock.patch.object(rotary, "_is_cpu", True):
        model: torch.nn.Module = getattr(importlib.import_module(module), name)(hf, quant_config=quant if fp8 else None)
    return model


def trainer_weights(arch: str, hf: Any, *, seed: int) -> dict[str, torch.Tensor]:
    """The trainer's bf16 tensors (Hugging Face names, each MoE expert its own), random per `seed`, every weight a
    block-FP8 checkpoint quantizes (`QUANTIZED`) times 4**seed, so that each version's scales differ too (scales
    that are powers of two, SGLang's, would be shared across versions by weights of one init scale)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with default_dtype(torch.bfloat16):
        model = AutoModelForCausalLM.from_config(hf)
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    if arch == "qwen3_moe":
        state = per_expert(state)
    return {name: t * 4.0**seed if name.endswith(QUANTIZED) else t for name, t in state.items()}


def quantized(state: dict[str, torch.Tensor], cast: Any) -> dict[str, torch.Tensor]:
    """`state` as a block-FP8 checkpoint holds it: each `QUANTIZED` weight `cast(weight)` -> float8_e4m3fn +
    `<name>_scale_inv` float32, in the order given."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(QUANTIZED):
            out[name], out[f"{name}_scale_inv"] = cast(tensor)
        else:
            out[name] = tensor
    return out


def checkpoint(arch: str, hf: Any, *, fp8: bool, seed: int) -> dict[str, torch.Tensor]:
    """The trainer's tensors, bf16 and unscaled; with `fp8` `trainer_weights` as SGLang's `per_block_cast_to_fp8`
    makes a block-FP8 checkpoint of them (one power-of-two scale a 128x128 block)."""
    from sglang.srt.layers.quantization.fp8_utils import per_block_cast_to_fp8

    if not fp8:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        with default_dtype(torch.bfloat16):
            model = AutoModelForCausalLM.from_config(hf)
        state = {name: t.detach().clone() for name, t in model.state_dict().items()}
        return per_expert(state) if arch == "qwen3_moe" else state
    return quantized(trainer_weights(arch, hf, seed=seed), per_block_cast_to_fp8)


def tp2_box(name: str, shape: tuple[int, ...], hf: Any, rank: int) -> Box | None:
    """The tests' oracle of what TP rank `rank` of 2 reads of a checkpoint tensor (a table; the library learns it from
    SGLang's loaders). A block scale (`<weight>_scale_inv`, one a 128x128 block) is cut where its weight is: the sizes
    here split into whole blocks."""
    world = 2
    half = lambda n: (rank * n // world, n // world)  # noqa: E731
    weight = name.removesuffix("_scale_inv")
    if weight.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")):
        start, size = half(shape[0])  # column-parallel (KV heads 2 = TP: one each), an expert's TP slice too
        return Box((start, 0), (size, shape[1]))
    if weight.endswith(("o_proj.weight", "down_proj.weight")):
        start, size = half(shape[1])
        return Box((0, start), (shape[0], size))
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        per_rank = math.ceil(hf.vocab_size / 64) * 64 // world  # SGLang pads the vocab to 64 rows
        start = rank * per_rank
        return Box((start, 0), (min(hf.vocab_size, start + per_rank) - start, shape[1]))
    return None  # norms, the MoE router `mlp.gate.weight`: replicated
