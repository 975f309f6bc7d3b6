"""SGLang TP ranks take their slices (skipped without the kit: `./dev sglang-contract`): at tensor parallelism 2,
each rank built by SGLang 0.5.23's own Qwen3 / Qwen3-MoE classes (bf16, and block-FP8 with its `Fp8Config`) as that
rank (`tests/support/sglang_layers.py` publishes SGLang's runtime context for it, as `test_vllm_slices_real.py`
patches vLLM's getters), each rank: the boxes `derive_boxes` learns from SGLang's own loaders (FP8 weights and their
block scales included) against the test's table, the model after a version of box-expanded tensors through our sink
equal to SGLang's `load_weights` of the whole tensors (bitwise), and the bytes the rank receives against the
model's (printed: `pytest -s`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_weightsync.protocol.boxes import Box
from lightning_weightsync.protocol.chunks import TensorMeta, as_bytes
from lightning_weightsync.rollout_engines.sglang.slices import derive_boxes
from lightning_weightsync.rollout_engines.worker import ModelLoadSink
from tests.support import sglang_layers

WHY = sglang_layers.blocker()
if WHY is not None:
    pytest.skip(f"SGLang's model layers do not import here: {WHY}", allow_module_level=True)

WORLD = 2
BLOCK = 128
CASES = {
    "qwen3 bf16": ("qwen3", False),
    "qwen3 block-FP8": ("qwen3", True),
    "qwen3 MoE bf16 (EP off)": ("qwen3_moe", False),
    "qwen3 MoE block-FP8 (EP off)": ("qwen3_moe", True),
}


def expected_box(name: str, shape: tuple[int, ...], hf: Any, rank: int) -> Box | None:
    """The test's oracle (`sglang_layers.tp2_box`, a table; the library learns it from SGLang's loaders)."""
    assert WORLD == 2
    return sglang_layers.tp2_box(name, shape, hf, rank)


@pytest.mark.parametrize("case", list(CASES))
def test_each_sglang_rank_derives_its_boxes_and_loads_bitwise_what_whole_tensors_load(case: str) -> None:
    arch, fp8 = CASES[case]
    hf = sglang_layers.qwen3() if arch == "qwen3" else sglang_layers.qwen3_moe()
    state = sglang_layers.checkpoint(arch, hf, fp8=fp8, seed=7)
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    if fp8:
        fp8_weights = sum(t.dtype == torch.float8_e4m3fn for t in state.values())
        assert fp8_weights and sum(n.endswith("_scale_inv") for n in state) == fp8_weights
    for rank in range(WORLD):
        probe = sglang_layers.build(arch, hf, fp8=fp8, rank=rank, tp_size=WORLD)
        probe.load_weights(list(state.items()))  # type: ignore[operator]
        before = {n: t.clone() for n, t in probe.state_dict().items()}
        slices = derive_boxes(probe, shapes)
        after = probe.state_dict()
        assert all(torch.equal(as_bytes(after[n]), as_bytes(t)) for n, t in before.items()), "the trace wrote the model"

        # (a) the boxes, against the test's table: every FP8 weight and its scale sliced
        for name, shape in shapes.items():
            assert slices.boxes.get(name) == expected_box(name, shape, hf, rank), (name, slices.whole.get(name))
        assert all(why == "read whole" for why in slices.whole.values()) and not slices.unread

        # (b) a sliced version through our sink equals SGLang's load_weights of the whole tensors, bitwise
        whole_model = sglang_layers.build(arch, hf, fp8=fp8, rank=rank, tp_size=WORLD)
        sliced_model = sglang_layers.build(arch, hf, fp8=fp8, rank=rank, tp_size=WORLD)
        whole_model.load_weights(list(state.items()))  # type: ignore[operator]
        sink = ModelLoadSink(sliced_model, expected=1)
        sink.begin(1)
        for name, tensor in state.items():
            box = slices.boxes.get(name)
            meta = TensorMeta(name, tuple(tensor.shape), tensor.dtype, 0, 0, box=box)
            assert sink.destination(meta) is None
            sink.accept(name, box.of(tensor).contiguous() if box is not None else tensor)
        expected, got = whole_model.state_dict(), sliced_model.state_dict()
        assert expected.keys() == got.keys()
        for name, tensor in expected.items():
            assert got[name].dtype == tensor.dtype and torch.equal(as_bytes(got[name]), as_bytes(tensor)), name

        # (c) the bytes this rank receives a version, against the model's
        received = slices.nbytes(shapes, lambda name: state[name].element_size())
        scales = sum(state[n].numel() * 4 for n in shapes if n.endswith("_scale_inv"))
        print(
            f"\n{case}, SGLang TP rank {rank} of {WORLD}: {len(slices.boxes)} tensors sliced, {len(slices.whole)} read "
            f"whole; receives {received} of the model's {model_bytes} bytes ({100 * received / model_bytes:.1f} %)"
            + (f" (the block scales: {scales} of the model's bytes)" if fp8 else "")
        )
        assert received < model_bytes
