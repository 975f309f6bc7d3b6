"""Block-FP8 into SGLang's REAL model classes on CPU (skipped without the kit: `./dev sglang-contract`): a tiny Qwen3
and Qwen3-MoE built by SGLang 0.5.23 with its `Fp8Config` (weight_block_size [128, 128]), three versions of an FP8
checkpoint (each linear weight float8_e4m3fn + `weight_scale_inv` float32, made by SGLang's `per_block_cast_to_fp8`)
delivered by a real sender through the loader SGLang resolves (`dynamic_import(api.LOADER)`, as its
`update_weights_from_tensor` does), and after each version every parameter equal, bitwise, to what SGLang's own
`load_weights` makes of the same tensors in a model loaded cold.

The loader would declare the model's quantization contract (and the trainer would then quantize bf16 to it:
`test_sglang_quant_contract_real.py`); here it is made to declare none, so that the FP8 bytes and scales the test
sends reach `load_weights` as sent: what this holds is SGLang's FP8 load path behind our loader and sink.

What stands in for what the CPU kit lacks (Triton, torchvision, the rotary kernel, process groups) is said in
`tests/support/sglang_layers.py`; none of it holds or loads a weight. Post-load processing
(`process_weights_after_loading`) is not run on either side: on CPU its block-FP8 branch asks for AMX
(`fp8.py:826`) or the CUDA DeepGEMM requantization; it runs on the engine's device, after whichever path fed
`load_weights`."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from lightning_weightsync.protocol.chunks import as_bytes
from lightning_weightsync.rollout_engines.sglang import api, loader, quant_contract
from lightning_weightsync.rollout_engines.worker import CONFIG_ENV
from lightning_weightsync.versions.sender import BlockingWeightSender
from tests.support import sglang_layers
from tests.support.mp import free_port
from tests.support.transfer import engine_cfg

WHY = sglang_layers.blocker()
if WHY is not None:
    pytest.skip(f"SGLang's model layers do not import here: {WHY}", allow_module_level=True)

VERSIONS = (1, 2, 3)


def assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        g = got[name]
        assert (g.dtype, g.shape) == (tensor.dtype, tensor.shape), name
        assert torch.equal(as_bytes(g.contiguous()), as_bytes(tensor.contiguous())), f"{name}: bytes differ"


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_fp8_versions_through_our_loader_equal_sglangs_own_cold_load(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sglang.srt.utils.common import MultiprocessingSerializer, dynamic_import

    hf = sglang_layers.qwen3() if arch == "qwen3" else sglang_layers.qwen3_moe()
    cfg = engine_cfg(free_port(), bucket_size_mb=0.25, trainer__min_receivers=1)
    path = tmp_path / "sync.yaml"
    path.write_text(OmegaConf.to_yaml(cfg))
    monkeypatch.setenv(CONFIG_ENV, str(path))
    monkeypatch.setattr(quant_contract, "declared_contract", lambda model: None)  # FP8 sent as is (docstring)
    served = sglang_layers.build(arch, hf, fp8=True)
    fp8 = {n: p for n, p in served.named_parameters() if p.dtype == torch.float8_e4m3fn}
    scales = [n for n in served.state_dict() if n.endswith("weight_scale_inv")]
    assert fp8 and len(scales) == len(fp8), "SGLang built no block-FP8 layer: the test would prove nothing"
    custom_loader = dynamic_import(api.LOADER)
    sender = BlockingWeightSender(cfg)
    sender.start()
    previous: dict[str, torch.Tensor] | None = None
    try:
        for version in VERSIONS:
            state = sglang_layers.checkpoint(arch, hf, fp8=True, seed=version)
            assert any(t.dtype == torch.float8_e4m3fn for t in state.values())
            named_tensors = MultiprocessingSerializer.deserialize(api.EMPTY_NAMED_TENSORS)
            thread = threading.Thread(target=custom_loader, args=(served, named_tensors))  # as weight_updater.py:376
            thread.start()
            stats = sender.send_weights(list(state.items()), version=version)
            thread.join(60)
            assert not thread.is_alive() and stats.receivers == 1
            assert loader._rank is not None and loader._rank.version == version

            cold = sglang_layers.build(arch, hf, fp8=True)
            cold.load_weights(list(state.items()))  # type: ignore[operator]  # SGLang's own load, cold
            expected = {n: t.clone() for n, t in cold.state_dict().items()}
            assert_same(served.state_dict(), expected)
            if previous is not None:  # every FP8 weight and scale changed: a stale one would have been seen
                for name in [*fp8, *scales]:
                    assert not torch.equal(as_bytes(previous[name]), as_bytes(expected[name])), name
            previous = expected
    finally:
        sender.close()
        if loader._rank is not None:
            loader._rank.close()
            loader._rank = None
