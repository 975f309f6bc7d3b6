"""Trainer-side block-FP8 quantization against the REAL vLLM (skipped without vLLM; run in the contract kit:
`.venv-vllm-0.34.0/bin/python -m pytest tests/unit/test_vllm_quant_contract_real.py`).

(a) `quantize_fp8_block` / `quantize_mxfp8` equal, bitwise, vLLM's own `per_block_cast_to_fp8` and
`_mxfp8_e4m3_quantize_torch` over random shapes (not divisible by the block, all-zero blocks, outliers), at any
tile size. (b) A tiny Qwen3 and a tiny Qwen3-MoE built by vLLM as a serialized block-FP8 model (`Fp8Config`,
`weight_block_size` [128, 128], the routers in `ignored_layers`), at TP 1: the contract `learn_quant_contract`
reads off the model says which checkpoint tensors are FP8 (with `weight_scale_inv`) and which stay bf16, as the
test's table does; then, for 3 versions of bf16 weights, `quantize_stream` of the bf16 checkpoint through that
contract, fed to the model's `load_weights` and vLLM's post-load processing, gives every parameter bitwise equal
to a cold load of the FP8 checkpoint vLLM's own quantizer makes of the same weights. The bytes sent (FP8 +
scales) against bf16 are printed (`-s`).

The kernel choice is `test_vllm_quantized_real.cpu_kernels`'s (vLLM's pure-torch block-FP8 post-load step;
MoE backend TRITON, which keeps the checkpoint layout); attention is a stand-in without parameters, as in
`test_vllm_slices_real.py`. Everything that holds or loads a weight is vLLM's.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

import pytest
import torch

pytest.importorskip("vllm.model_executor.layers.quantization.fp8")
pytest.importorskip("vllm.model_executor.layers.quantization.online.base")

from vllm.model_executor.layers.quantization.utils.mxfp8_utils import _mxfp8_e4m3_quantize_torch
from vllm.utils.deep_gemm import per_block_cast_to_fp8

from lightning_weightsync.errors import QuantizeError
from lightning_weightsync.quantize import quantize_fp8_block, quantize_mxfp8, quantize_stream
from lightning_weightsync.rollout_engines.vllm.quant_contract import learn_quant_contract
from tests.unit.test_vllm_quantized_real import (
    ARCHS, HF, assert_kernel_equal, bf16_versions, cpu_kernels, kernel_format, model_config,
)  # fmt: skip
from tests.unit.test_vllm_slices_real import tp_rank

SHAPES = [(128, 128), (300, 200), (1, 1), (257, 1000), (129, 96), (1000, 64), (2, 4096)]


def _equal(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_our_quantizers_equal_vllms_bitwise(shape: tuple[int, int], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    for trial in range(4):
        x = (torch.randn(shape, generator=gen) * 0.02 * (10**trial)).to(dtype)
        if trial == 1:
            x[: min(128, shape[0]), : min(128, shape[1])] = 0  # an all-zero block (and, for MXFP8, rows of them)
        if trial == 2:
            x.view(-1)[torch.randint(x.numel(), (3,), generator=gen)] = torch.tensor([3e4, -2e-3, 1e-30]).to(dtype)
        want = per_block_cast_to_fp8(x, [128, 128], use_ue8m0=False)
        for tile in (1, 128 * 128 * 3, 1 << 22):
            assert _equal(quantize_fp8_block("w", x, (128, 128), tile), want), (shape, trial, tile)
        if shape[1] % 32 == 0:
            want = _mxfp8_e4m3_quantize_torch(x)
            for tile in (32, 1000, 1 << 22):
                assert _equal(quantize_mxfp8("w", x, (1, 32), tile), want), (shape, trial, tile)
    bank = torch.randn((3, *shape), generator=gen).to(dtype)  # vLLM's MoE methods: expert by expert
    q, s = quantize_fp8_block("bank", bank)
    assert all(_equal((q[e], s[e]), per_block_cast_to_fp8(bank[e], [128, 128])) for e in range(3))
