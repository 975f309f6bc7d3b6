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
    ARCHS,
    HF,
    assert_kernel_equal,
    bf16_versions,
    cpu_kernels,
    kernel_format,
    model_config,
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


@contextmanager
def serialized_fp8_kernels() -> Iterator[None]:
    """`cpu_kernels`, and the serialized-FP8 MoE method's own backend choice (`quantization/fp8.py` imports it by
    name) answered TRITON with a stand-in kernel object (it holds no weight)."""
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
    from vllm.model_executor.layers.quantization import fp8

    with ExitStack() as stack:
        stack.enter_context(tp_rank(0, 1))
        stack.enter_context(cpu_kernels())
        backend = (Fp8MoeBackend.TRITON, object)
        stack.enter_context(mock.patch.object(fp8, "select_fp8_moe_backend", lambda **kw: backend))
        if hasattr(fp8, "make_fp8_moe_kernel"):
            kernel = mock.Mock()  # run only to serve the experts, after every weight is final
            stack.enter_context(mock.patch.object(fp8, "make_fp8_moe_kernel", lambda **kw: kernel))
        yield


def build_fp8(arch: str, hf: Any) -> torch.nn.Module:
    """vLLM's model as a serialized block-FP8 checkpoint configures it (`Fp8Config`, block 128 x 128, the routers
    kept bf16 through `ignored_layers`)."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.model_loader.utils import configure_quant_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    rotary_embedding._ROPE_DICT.clear()
    vllm_config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    vllm_config.model_config = model_config("fp8", hf)
    ignored = [f"model.layers.{i}.mlp.gate" for i in range(hf.num_hidden_layers)] if arch == "qwen3_moe" else []
    vllm_config.quant_config = Fp8Config(
        is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", ignored_layers=ignored,
        weight_block_size=[128, 128],
    )  # fmt: skip
    module, name = ARCHS[arch].split(":")
    cls = getattr(importlib.import_module(module), name)
    configure_quant_config(vllm_config.quant_config, cls)
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(torch.bfloat16):
        return cls(vllm_config=vllm_config)  # type: ignore[no-any-return]


def is_fp8_in_checkpoint(name: str) -> bool:
    """The test's table: every projection (attention, MLP, each expert's) is FP8; embeddings, norms, the LM head
    and the (ignored) router stay bf16."""
    return name.endswith("_proj.weight")


def vllm_fp8_checkpoint(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The serialized checkpoint vLLM's own quantizer makes of bf16 weights (as DeepSeek-V3 / Qwen3-FP8 ship)."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, tensor in state.items():
        if is_fp8_in_checkpoint(name):
            q, scale = per_block_cast_to_fp8(tensor, [128, 128], use_ue8m0=False)
            out += [(name, q), (f"{name}_scale_inv", scale)]
        else:
            out.append((name, tensor))
    return out


def load(model: torch.nn.Module, items: Any) -> dict[str, torch.Tensor]:
    """`load_weights`, then vLLM's post-load processing, as `BaseModelLoader.load_model` runs them."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    model.load_weights(items)  # type: ignore[operator]
    process_weights_after_loading(model, model_config("fp8", None), torch.device("cpu"))  # type: ignore[arg-type]
    return kernel_format(model)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_the_contract_learnt_from_a_serialized_fp8_model_and_our_stream_load_what_its_checkpoint_loads(
    arch: str,
) -> None:
    hf = HF[arch]()
    versions = bf16_versions(hf, 3, arch)
    with serialized_fp8_kernels():
        contract = learn_quant_contract(build_fp8(arch, hf))
        for name in versions[0]:
            rule = contract.rule_for(name)
            assert (rule is not None) == is_fp8_in_checkpoint(name), (name, rule)
            if rule is not None:
                assert (rule.scheme, rule.block, rule.scale_name(name)) == (
                    "fp8_block",
                    (128, 128),
                    f"{name}_scale_inv",
                )
        print(f"\n{arch}: contract {contract.digest()[:12]}, {len(contract.rules)} rules, kept {list(contract.keep)}")
        for v, state in enumerate(versions, start=1):
            cold = load(build_fp8(arch, hf), vllm_fp8_checkpoint(state))
            stream = quantize_stream(state.items(), contract)
            ours = load(build_fp8(arch, hf), stream)
            assert any(t.dtype == torch.float8_e4m3fn for t in ours.values())
            assert_kernel_equal(ours, cold, (arch, v))
            stats = stream.stats
            print(f"{arch} version {v}: sent {stats.bytes_out} bytes (FP8 + scales, {stats.quantized} tensors "
                  f"quantized, {stats.kept} kept) for {stats.bytes_in} bf16 ({100 * stats.ratio:.1f} %)")  # fmt: skip
            assert 0.5 < stats.ratio < 0.7


def test_a_per_tensor_fp8_layer_is_refused_naming_the_module() -> None:
    """A per-tensor FP8 checkpoint's scale is the amax of the whole fused, unsharded weight: not produced here.
    (Its kernel cannot be built on this CPU kit, so layer 0's `qkv_proj` gets vLLM's own `Fp8LinearMethod` of a
    per-tensor `Fp8Config`, built as vLLM builds it, in place of the block one.)"""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod

    with serialized_fp8_kernels():
        model = build_fp8("qwen3", HF["qwen3"]())
        qkv = model.get_submodule("model.layers.0.self_attn.qkv_proj")
        with set_current_vllm_config(mock.Mock(model_config=model_config("fp8", HF["qwen3"]()))):
            qkv.quant_method = Fp8LinearMethod(Fp8Config(activation_scheme="dynamic"))
    with pytest.raises(QuantizeError, match=r"model\.layers\.0\.self_attn\.qkv_proj: a per-tensor FP8 checkpoint"):
        learn_quant_contract(model)
