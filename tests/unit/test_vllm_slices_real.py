"""Against the REAL vLLM model classes (skipped without vLLM; `./dev vllm-contract` runs it on CPU): at tensor
parallelism 2, simulated in one process by patching vLLM's TP rank / world-size getters where its layers and
parameters import them (its layers read them when built; the loaders read what the layer stored), for a tiny
Qwen3 (fused qkv and gate_up, GQA with TP > KV heads and TP = KV heads), a tiny Llama (untied and tied
embeddings) and a tiny Qwen3-MoE (4 experts, per-expert checkpoint tensors `mlp.experts.<e>.gate_proj.weight`,
... as Hugging Face's Qwen3-MoE checkpoints name them, the router `mlp.gate.weight`; expert parallelism off), each
rank: the boxes `derive_boxes` learns from vLLM's own loaders, the model after a version of box-expanded tensors
through our sink equal to `load_weights` of the whole tensors (bitwise), and the bytes the rank would receive
against the model's (printed: `pytest -s`, with the tensors of the first layer that go whole).

vLLM's attention layer is replaced by a module without parameters (it has none to load, and building it needs a
device platform this CPU kit lacks). For the MoE, vLLM's choice of the unquantized MoE kernel backend
(`select_unquantized_moe_backend`, by platform) is answered "TRITON, no kernel class": on this kit's platform
(`UnspecifiedPlatform`, neither CUDA nor CPU) it raises `UnboundLocalError` (`_get_priority_backends` sets no backend
list); TRITON is the one that pads no size, and the kernel class is used only by post-load processing, which neither
path here runs. The expert-parallel, data-parallel and context-parallel groups are single-rank stand-ins (EP off).
Everything that holds or loads a weight is vLLM's own: the `FusedMoE` runner, its `RoutedExperts` with `w13_weight`
/ `w2_weight` and their `weight_loader`, the router's `GateLinear`."""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch

pytest.importorskip("vllm.model_executor.models.qwen3")

from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

from lightning_weightsync.protocol.boxes import Box
from lightning_weightsync.protocol.chunks import TensorMeta
from lightning_weightsync.rollout_engines.vllm.slices import derive_boxes
from lightning_weightsync.rollout_engines.worker import ModelLoadSink
from tests.support.checkpoints import per_expert

WORLD = 2
PATCHED = (
    "vllm.distributed",
    "vllm.distributed.parallel_state",
    "vllm.model_executor.layers.linear",
    "vllm.model_executor.layers.vocab_parallel_embedding",
    "vllm.model_executor.parameter",
    "vllm.model_executor.models.qwen2",
    "vllm.model_executor.models.qwen3",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.models.qwen3_moe",
    "vllm.model_executor.layers.fused_moe.layer",
    "vllm.model_executor.layers.fused_moe.config",
)


class NoAttention(torch.nn.Module):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()


def single_rank_group() -> SimpleNamespace:
    """A one-rank process group as vLLM's layers read one (pipeline, expert, data, context parallelism)."""
    return SimpleNamespace(
        is_last_rank=True, is_first_rank=True, world_size=1, rank_in_group=0,
        device_group=SimpleNamespace(size=lambda: 1, rank=lambda: 0),
    )  # fmt: skip


@contextmanager
def tp_rank(rank: int, world: int = WORLD) -> Iterator[None]:
    """vLLM's TP getters answer `rank` of `world` wherever the layers read them; one pipeline stage, and one rank
    of expert, data and context parallelism; the MoE kernel backend chosen (see the module docstring)."""
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    single = single_rank_group()
    with ExitStack() as stack:
        for name in PATCHED:
            module = importlib.import_module(name)
            for attr, value in (
                ("get_tensor_model_parallel_rank", rank),
                ("get_tensor_model_parallel_world_size", world),
                ("get_pp_group", single),
                ("get_ep_group", single),
                ("get_dp_group", single),
                ("get_pcp_group", single),
            ):
                if hasattr(module, attr):
                    stack.enter_context(mock.patch.object(module, attr, return_value=value))
            if hasattr(module, "Attention"):
                stack.enter_context(mock.patch.object(module, "Attention", NoAttention))
        stack.enter_context(
            mock.patch.object(
                unquantized_fused_moe_method,
                "select_unquantized_moe_backend",
                return_value=(UnquantizedMoeBackend.TRITON, None),
            )
        )
        yield


def build(arch: str, hf: Any, rank: int) -> torch.nn.Module:
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    cls = {
        "qwen3": "vllm.model_executor.models.qwen3:Qwen3ForCausalLM",
        "llama": "vllm.model_executor.models.llama:LlamaForCausalLM",
        "qwen3_moe": "vllm.model_executor.models.qwen3_moe:Qwen3MoeForCausalLM",
    }[arch]
    module, name = cls.split(":")
    vllm_config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    vllm_config.model_config = SimpleNamespace(  # what the model's layers read of it
        hf_config=hf, hf_text_config=hf, dtype=torch.float32, head_dtype=torch.float32, get_text_config=lambda: hf
    )
    with tp_rank(rank), set_current_vllm_config(vllm_config):
        return getattr(importlib.import_module(module), name)(vllm_config=vllm_config)  # type: ignore[no-any-return]


def qwen3(kv_heads: int) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, head_dim=8, tie_word_embeddings=False,
    )  # fmt: skip


def llama(tied: bool) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=tied,
    )  # fmt: skip


def qwen3_moe() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=100, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=False,
    )  # fmt: skip


CASES = {
    "qwen3 GQA kv=1 (TP > KV heads)": ("qwen3", qwen3(1)),
    "qwen3 GQA kv=2": ("qwen3", qwen3(2)),
    "llama untied": ("llama", llama(False)),
    "llama tied": ("llama", llama(True)),
    "qwen3 MoE 4 experts (EP off)": ("qwen3_moe", qwen3_moe()),
}


def checkpoint(arch: str, hf: Any) -> dict[str, torch.Tensor]:
    """The trainer's tensors (Hugging Face names: q_proj, k_proj, ... separate), random and distinct."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(hf)
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    return per_expert(state) if arch == "qwen3_moe" else state


def expected_box(name: str, shape: tuple[int, ...], hf: Any, rank: int) -> Box | None:
    """The test's oracle (a table; the library learns it from vLLM's loaders): TP rank `rank` of 2."""
    head = hf.head_dim
    half = lambda n: (rank * n // WORLD, n // WORLD)  # noqa: E731
    # an expert's gate_proj / up_proj (into `w13_weight`) and down_proj (`w2_weight`): its TP slice of the expert's
    # intermediate dimension, like a dense MLP's
    if name.endswith(("q_proj.weight", "gate_proj.weight", "up_proj.weight")):
        start, size = half(shape[0])
        return Box((start, 0), (size, shape[1]))
    if name.endswith(("k_proj.weight", "v_proj.weight")):
        if hf.num_key_value_heads < WORLD:
            return None  # each rank reads the KV head whole (replicated)
        start, size = half(shape[0])
        return Box((start, 0), (size, shape[1]))
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        start, size = half(shape[1])
        return Box((0, start), (shape[0], size))
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        if name.startswith("lm_head") and hf.tie_word_embeddings:
            return Box((0, 0), (1, 1))  # vLLM ties it to the embedding and skips it: one element
        per_rank = math.ceil(hf.vocab_size / 64) * 64 // WORLD  # vLLM pads the vocab to 64 rows
        start = rank * per_rank
        return Box((start, 0), (min(hf.vocab_size, start + per_rank) - start, shape[1]))
    assert head > 0
    return None  # norms, the MoE router `mlp.gate.weight`: replicated


def first_layer(boxes: dict[str, Box]) -> list[tuple[str, Box]]:
    return [(n, b) for n, b in boxes.items() if ".layers.1." not in n]


@pytest.mark.parametrize("case", list(CASES))
def test_each_rank_derives_its_boxes_and_loads_bitwise_what_whole_tensors_load(case: str) -> None:
    arch, hf = CASES[case]
    state = checkpoint(arch, hf)
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    for rank in range(WORLD):
        probe = build(arch, hf, rank)
        with tp_rank(rank):
            probe.load_weights(list(state.items()))  # type: ignore[operator]
            before = {n: t.clone() for n, t in probe.state_dict().items()}
            slices = derive_boxes(probe, shapes)
        after = probe.state_dict()
        assert all(torch.equal(after[n], t) for n, t in before.items()), "the trace changed the model"

        # (a) the boxes, against the test's table
        for name, shape in shapes.items():
            assert slices.boxes.get(name) == expected_box(name, shape, hf, rank), (name, slices.whole.get(name))
        if hf.num_key_value_heads < WORLD:
            assert slices.whole["model.layers.0.self_attn.k_proj.weight"] == "read whole"
        assert slices.unread == (["lm_head.weight"] if hf.tie_word_embeddings else [])
        assert all(why == "read whole" for why in slices.whole.values())

        # (b) a sliced version through our sink equals load_weights of the whole tensors, bitwise
        whole_model, sliced_model = build(arch, hf, rank), build(arch, hf, rank)
        sink = ModelLoadSink(sliced_model, expected=1)
        with tp_rank(rank):
            whole_model.load_weights(list(state.items()))  # type: ignore[operator]
            sink.begin(1)
            for name, tensor in state.items():
                box = slices.boxes.get(name)
                meta = TensorMeta(name, tuple(tensor.shape), tensor.dtype, 0, 0, box=box)
                assert sink.destination(meta) is None
                sink.accept(name, box.of(tensor).contiguous() if box is not None else tensor)
        expected, got = whole_model.state_dict(), sliced_model.state_dict()
        assert expected.keys() == got.keys()
        for name, tensor in expected.items():
            assert torch.equal(got[name], tensor), name

        # (c) the bytes this rank receives a version, against the model's
        received = slices.nbytes(shapes, lambda name: state[name].element_size())
        print(
            f"\n{case}, TP rank {rank} of {WORLD}: {len(slices.boxes)} tensors sliced, "
            f"{sum(w == 'read whole' for w in slices.whole.values())} read whole, "
            f"{sum(w != 'read whole' for w in slices.whole.values())} whole for another reason "
            f"({ {n: w for n, w in slices.whole.items() if w != 'read whole'} }); "
            f"receives {received} of the model's {model_bytes} bytes ({100 * received / model_bytes:.1f} %); "
            f"boxes: { {n.removeprefix('model.'): (b.offsets, b.sizes) for n, b in first_layer(slices.boxes)} }"
            f"; whole: {[n.removeprefix('model.') for n in slices.whole if '.layers.1.' not in n]}"
        )
        assert received < model_bytes
