"""An SGLang rank declares its quantization contract and the trainer quantizes to it (skipped without the kit:
`./dev sglang-contract`): SGLang 0.5.23's REAL Qwen3 / Qwen3-MoE classes on CPU, built from a serialized block-FP8
checkpoint (`Fp8Config`, weight_block_size [128, 128], `scale_fmt` none or "ue8m0").

- SGLang's own quantizer (`per_block_cast_to_fp8`, fp8_utils.py) against ours, property-tested: equal bitwise to
  `fp8_block_ue8m0`; `fp8_block` (vLLM's `use_ue8m0=False`) differs from it in the scale's rounding alone.
- The contract learnt from each model (`rollout_engines/sglang/quant_contract.py`) against the test's table, its
  scheme by `scale_fmt`; what it cannot produce refused, naming the module.
- End to end, TP 1: a real `WeightSender` sends bf16 weights, the loader SGLang resolves (`dynamic_import`, as its
  `update_weights_from_tensor` does) declares the contract, the sender quantizes, three versions, each equal bitwise,
  parameter by parameter, to SGLang's own cold load of the FP8 checkpoint of the same weights (made by SGLang's
  `per_block_cast_to_fp8` for "ue8m0", by the test's copy of it without its UE8M0 step otherwise); bytes vs bf16.
- End to end, TP 2: each rank its own process (SGLang's TP state is process-global), one sender; after the first
  version each rank declares its boxes, and the next versions bring it only its box of every FP8 weight and of its
  scales (bytes against the test's table), bitwise SGLang's own TP-2 load of the whole checkpoint.
Bytes are printed (`pytest -s`). Post-load processing is run on neither side (see test_sglang_fp8_real.py)."""

from __future__ import annotations

import math
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from lightning_weightsync.errors import QuantizeError
from lightning_weightsync.protocol.chunks import as_bytes
from lightning_weightsync.quantize import quantize_fp8_block, quantize_fp8_block_ue8m0
from lightning_weightsync.quantize.schemes import ceil_to_ue8m0
from lightning_weightsync.rollout_engines.sglang import api, loader
from lightning_weightsync.rollout_engines.sglang.quant_contract import declared_contract, learn_quant_contract
from lightning_weightsync.rollout_engines.worker import CONFIG_ENV
from lightning_weightsync.versions.sender import BlockingWeightSender
from tests.support import sglang_layers
from tests.support.mp import free_port, run_workers
from tests.support.transfer import engine_cfg

WHY = sglang_layers.blocker()
if WHY is not None:
    pytest.skip(f"SGLang's model layers do not import here: {WHY}", allow_module_level=True)

VERSIONS = (1, 2, 3)
FP8 = torch.float8_e4m3fn


def amax_over_448(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The test's oracle of a plain block-FP8 checkpoint: SGLang's `per_block_cast_to_fp8` (fp8_utils.py) op for op,
    its one UE8M0 step (`sf = ceil_to_ue8m0(x_amax / 448.0)`) left as `x_amax / 448.0`."""
    m, n = x.shape
    padded = torch.zeros((math.ceil(m / 128) * 128, math.ceil(n / 128) * 128), dtype=x.dtype)
    padded[:m, :n] = x
    view = padded.view(-1, 128, padded.size(1) // 128, 128)
    amax = view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    sf = amax / 448.0
    scaled = (view * (1.0 / sf)).to(FP8)
    return scaled.view_as(padded)[:m, :n].contiguous(), sf.view(view.size(0), view.size(2))


def sglang_cast(scale_fmt: str | None) -> Any:
    from sglang.srt.layers.quantization.fp8_utils import per_block_cast_to_fp8

    return per_block_cast_to_fp8 if scale_fmt == "ue8m0" else amax_over_448


def fp8_checkpoint(arch: str, hf: Any, scale_fmt: str | None, seed: int) -> dict[str, torch.Tensor]:
    return sglang_layers.quantized(sglang_layers.trainer_weights(arch, hf, seed=seed), sglang_cast(scale_fmt))


def hf_of(arch: str) -> Any:
    return sglang_layers.qwen3() if arch == "qwen3" else sglang_layers.qwen3_moe()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a.contiguous()), as_bytes(b.contiguous()))


def assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert same_bytes(got[name], tensor), f"{name}: dtype, shape or bytes differ"


# -- SGLang's quantizer against ours ------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 300), cols=st.integers(1, 300), exponent=st.integers(-7, 4), seed=st.integers(0, 2**16),
    zero_rows=st.integers(0, 130),
)  # fmt: skip
def test_sglangs_per_block_cast_is_fp8_block_ue8m0_and_differs_from_fp8_block_only_in_the_scales_rounding(
    rows: int, cols: int, exponent: int, seed: int, zero_rows: int
) -> None:
    from sglang.srt.layers.quantization.fp8_utils import per_block_cast_to_fp8

    torch.manual_seed(seed)
    x = (torch.randn(rows, cols) * 10.0**exponent).to(torch.bfloat16)
    x[:zero_rows] = 0  # whole zero blocks: the amax floor
    q_sg, s_sg = per_block_cast_to_fp8(x)
    q_ue, s_ue = quantize_fp8_block_ue8m0("w", x, max_temp_elems=128 * 128)  # tiled: one block a tile
    assert same_bytes(q_ue, q_sg) and same_bytes(s_ue, s_sg)
    q_plain, s_plain = quantize_fp8_block("w", x)
    assert same_bytes(s_sg, ceil_to_ue8m0(s_plain)), "SGLang's scale is not ours rounded up to a power of two"
    exact = s_plain == s_sg  # blocks whose amax / 448 is a power of two already: the same bytes
    for i, j in exact.nonzero().tolist():
        block = (slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128))
        assert same_bytes(q_plain[block], q_sg[block])


def test_ue8m0_rounds_on_the_bits_not_by_a_float_log2() -> None:
    """Just above a power of two a float32 log2 rounds down onto it; DeepGEMM's (SGLang's) bit rounding does not."""
    from sglang.srt.layers.quantization.fp8_utils import ceil_to_ue8m0 as sglang_ceil

    above = torch.tensor([2.0**-20 * (1 + 2**-23), 1.0, 3.0, 2.0**-126 * 1.5, 448.0], dtype=torch.float32)
    assert same_bytes(ceil_to_ue8m0(above), sglang_ceil(above))
    assert ceil_to_ue8m0(above)[0].item() == 2.0**-19


# -- the contract SGLang's model declares --------------------------------------------------------------------------
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_contract_learnt_from_sglangs_model_covers_its_checkpoint(arch: str, scale_fmt: str | None) -> None:
    hf = hf_of(arch)
    contract = declared_contract(sglang_layers.build(arch, hf, fp8=True, scale_fmt=scale_fmt))
    assert contract is not None
    scheme = "fp8_block_ue8m0" if scale_fmt == "ue8m0" else "fp8_block"
    for name in sglang_layers.trainer_weights(arch, hf, seed=0):
        rule = contract.rule_for(name)
        if name.endswith(sglang_layers.QUANTIZED):
            assert rule is not None and (rule.scheme, rule.block) == (scheme, (128, 128)), name
            assert rule.scale_name(name) == f"{name}_scale_inv"
        else:
            assert rule is None, name  # embeddings, norms, the router, the LM head
    assert len(contract.rules) + len(contract.keep) < 20, "names were not folded into patterns"


def test_models_that_take_bf16_declare_nothing() -> None:
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    hf = sglang_layers.qwen3()
    assert declared_contract(sglang_layers.build("qwen3", hf, fp8=False)) is None
    online = sglang_layers.build("qwen3", hf, fp8=False)
    online.quant_config = Fp8Config(is_checkpoint_fp8_serialized=False)  # type: ignore[assignment]
    assert declared_contract(online) is None  # SGLang quantizes the bf16 it is given


@pytest.mark.parametrize(
    ("change", "why"),
    [("per_tensor", "per-tensor FP8"), ("scale_fmt", "scale_fmt 'e8m0_packed'"), ("mxfp8", "MXFP8")],
)
def test_what_the_trainer_cannot_produce_is_refused_naming_the_module(change: str, why: str) -> None:
    hf = sglang_layers.qwen3()
    model = sglang_layers.build("qwen3", hf, fp8=True)
    method = model.model.layers[0].self_attn.qkv_proj.quant_method  # type: ignore[union-attr,index]
    if change == "per_tensor":
        method.block_quant = False
    elif change == "scale_fmt":
        method.quant_config.scale_fmt = "e8m0_packed"
    else:
        method.use_mxfp8 = True
    with pytest.raises(QuantizeError, match=why) as info:
        learn_quant_contract(model)
    assert "model.layers.0.self_attn.qkv_proj" in str(info.value)


# -- end to end, TP 1 ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_bf16_sent_quantized_to_the_declared_contract_equals_sglangs_cold_fp8_load(
    arch: str, scale_fmt: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sglang.srt.utils.common import MultiprocessingSerializer, dynamic_import

    hf = hf_of(arch)
    cfg = engine_cfg(free_port(), bucket_size_mb=0.25, trainer__min_receivers=1)
    path = tmp_path / "sync.yaml"
    path.write_text(OmegaConf.to_yaml(cfg))
    monkeypatch.setenv(CONFIG_ENV, str(path))
    served = sglang_layers.build(arch, hf, fp8=True, scale_fmt=scale_fmt)
    custom_loader = dynamic_import(api.LOADER)
    sender = BlockingWeightSender(cfg)
    sender.start()
    previous: dict[str, torch.Tensor] | None = None
    try:
        for version in VERSIONS:
            weights = sglang_layers.trainer_weights(arch, hf, seed=version)
            assert all(t.dtype == torch.bfloat16 for t in weights.values())
            named_tensors = MultiprocessingSerializer.deserialize(api.EMPTY_NAMED_TENSORS)
            thread = threading.Thread(target=custom_loader, args=(served, named_tensors))  # as weight_updater.py:376
            thread.start()
            stats = sender.send_weights(list(weights.items()), version=version)
            thread.join(60)
            assert not thread.is_alive() and stats.receivers == 1
            assert loader._rank is not None and loader._rank.version == version, (
                loader._rank and loader._rank.last_report
            )

            cold = sglang_layers.build(arch, hf, fp8=True, scale_fmt=scale_fmt)
            cold.load_weights(list(fp8_checkpoint(arch, hf, scale_fmt, version).items()))  # type: ignore[operator]
            expected = {n: t.clone() for n, t in cold.state_dict().items()}
            assert any(t.dtype == FP8 for t in expected.values())
            assert_same(served.state_dict(), expected)
            if previous is not None:  # every FP8 weight and scale changed: a stale one would have been seen
                for name, tensor in expected.items():
                    if tensor.dtype == FP8 or name.endswith("weight_scale_inv"):
                        assert not same_bytes(previous[name], tensor), name
            previous = expected

            bf16 = sum(t.numel() * t.element_size() for t in weights.values())
            assert stats.unquantized_bytes == bf16 and stats.quantized_tensors == sum(
                n.endswith(sglang_layers.QUANTIZED) for n in weights
            )
            assert stats.nbytes < 0.6 * bf16
            print(f"\n{arch} scale_fmt={scale_fmt} v{version}: {stats.nbytes} bytes sent for {bf16} bytes of bf16 "
                  f"({100 * stats.nbytes / bf16:.1f} %), {stats.quantized_tensors} weights quantized")  # fmt: skip
    finally:
        sender.close()
        if loader._rank is not None:
            loader._rank.close()
            loader._rank = None


# -- end to end, TP 2 ----------------------------------------------------------------------------------------------
def _box_bytes(name: str, tensor: torch.Tensor, hf: Any, rank: int) -> int:
    box = sglang_layers.tp2_box(name, tuple(tensor.shape), hf, rank)
    return (box.numel if box is not None else tensor.numel()) * tensor.element_size()


def _tp2_rank(rank: int, arch: str, scale_fmt: str | None, config_path: str) -> dict[str, Any]:
    """One SGLang TP rank, in its own process: three versions through the loader SGLang resolves, each checked
    against SGLang's own TP-2 load of the whole FP8 checkpoint; the bytes it received per version."""
    assert sglang_layers.blocker() is None
    from sglang.srt.utils.common import MultiprocessingSerializer, dynamic_import

    os.environ[CONFIG_ENV] = config_path
    hf = hf_of(arch)
    served = sglang_layers.build(arch, hf, fp8=True, rank=rank, tp_size=2, scale_fmt=scale_fmt)
    custom_loader = dynamic_import(api.LOADER)
    received, expected_boxes, whole = [], 0, 0
    try:
        for version in VERSIONS:
            custom_loader(served, MultiprocessingSerializer.deserialize(api.EMPTY_NAMED_TENSORS))
            rank_rx = loader._rank
            assert rank_rx is not None and rank_rx.version == version, rank_rx and rank_rx.last_report
            assert (rank_rx.rank, rank_rx.tp_size) == (rank, 2)
            state = fp8_checkpoint(arch, hf, scale_fmt, version)
            cold = sglang_layers.build(arch, hf, fp8=True, rank=rank, tp_size=2, scale_fmt=scale_fmt)
            cold.load_weights(list(state.items()))  # type: ignore[operator]
            assert_same(served.state_dict(), cold.state_dict())
            received.append(int(rank_rx.last_report["nbytes"]))
            whole = sum(t.numel() * t.element_size() for t in state.values())
            expected_boxes = sum(_box_bytes(n, t, hf, rank) for n, t in state.items())
            scales = sum(t.numel() * 4 for n, t in state.items() if n.endswith("_scale_inv"))
            scale_boxes = sum(_box_bytes(n, t, hf, rank) for n, t in state.items() if n.endswith("_scale_inv"))
    finally:
        if loader._rank is not None:
            loader._rank.close()
            loader._rank = None
    return {"received": received, "boxes": expected_boxes, "whole": whole, "scales": scales, "scale_boxes": scale_boxes}


@pytest.mark.parametrize(("arch", "scale_fmt"), [("qwen3", "ue8m0"), ("qwen3_moe", None)])
def test_each_tp_rank_declares_its_boxes_and_gets_only_its_box_of_the_fp8_weights_and_scales(
    arch: str, scale_fmt: str | None, tmp_path: Path
) -> None:
    hf = hf_of(arch)
    cfg = engine_cfg(free_port(), bucket_size_mb=0.25, trainer__min_receivers=2, transport__timeout_s=120)
    path = tmp_path / "sync.yaml"
    path.write_text(OmegaConf.to_yaml(cfg))
    outcome: dict[str, Any] = {}

    def ranks() -> None:
        try:
            outcome["ranks"] = run_workers(
                _tp2_rank, [(r, arch, scale_fmt, str(path)) for r in range(2)], timeout_s=300
            )
        except BaseException as exc:
            outcome["error"] = exc

    sender = BlockingWeightSender(cfg)
    sender.start()
    thread = threading.Thread(target=ranks)
    thread.start()
    sent: list[int] = []
    failure: BaseException | None = None
    try:
        for version in VERSIONS:
            weights = sglang_layers.trainer_weights(arch, hf, seed=version)
            stats = sender.send_weights(list(weights.items()), version=version)
            assert stats.receivers == 2
            sent.append(stats.unquantized_bytes)
    except BaseException as exc:
        failure = exc
    finally:
        sender.close()
        thread.join(320)
    if "error" in outcome:  # a rank's own failure says more than the sender's view of it
        raise outcome["error"] from failure
    if failure is not None:
        raise failure
    for rank, report in enumerate(outcome["ranks"]):
        first, *later = report["received"]
        assert first == report["whole"], "the first version comes whole (no boxes are known before it)"
        assert later == [report["boxes"]] * len(later), "a rank received more (or less) than its boxes"
        assert report["boxes"] < report["whole"] and report["scale_boxes"] < report["scales"]
        print(f"\n{arch} scale_fmt={scale_fmt} TP rank {rank} of 2: {later[0]} bytes a version after its boxes "
              f"(FP8 whole: {report['whole']}, bf16: {sent[-1]}; its scales {report['scale_boxes']} of "
              f"{report['scales']})")  # fmt: skip
