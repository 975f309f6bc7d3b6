"""Online-quantized vLLM models (`--quantization fp8_per_block`, `mxfp8`, `fp8_per_channel`) at tensor parallelism 2,
against the REAL vLLM classes (skipped without vLLM; `./dev vllm-contract` runs it on CPU, vLLM 0.33.0 and 0.34.0): a
real `WeightSender` (gloo, 127.0.0.1) sends bf16 checkpoints of a tiny Qwen3 (and a tiny Qwen3-MoE, per-expert
checkpoint names, block FP8 and MXFP8) to TWO of our vLLM engines (`LightningWeightSyncEngine`, built by vLLM's factory
through our plugin, driven by vLLM's own base `update_weights`), one per simulated TP rank, each on its own thread as
in `test_vllm_slices_engine.py` (whose patches and helpers this reuses).

What is vLLM's own here: the model classes, their layers and loaders, the online quantization config and methods
(`OnlineQuantizationConfig` from vLLM's `--quantization` shorthand table; `Fp8PerBlockOnlineLinearMethod`,
`Mxfp8OnlineLinearMethod`, `Fp8PtpcOnlineLinearMethod`, `Fp8PerBlockOnlineMoEMethod`, `Mxfp8OnlineMoEMethod`), the
quantizers (`per_block_cast_to_fp8`, MXFP8's pure-torch 32-element E8M0 path, per-channel's chunked division), the
layerwise reload that re-quantizes each module, and the cold load the oracle runs (`load_weights`,
`finalize_layerwise_processing`, `process_weights_after_loading`, as `BaseModelLoader.load_model` does).
What is not: vLLM picks a GEMM kernel by platform when it builds a quantized layer, and this kit's platform
(`UnspecifiedPlatform`) has none. `cpu_kernels` answers with vLLM's own kernel classes whose post-load step is pure
torch: `TritonFp8BlockScaledMMKernel` for block FP8 (`process_fp8_weight_block_strategy`: no transpose, no FNUZ
here), `EmulationMxfp8LinearKernel` for MXFP8 (with `VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD=0`, so the model keeps
FP8 bytes and E8M0 scales, as an MX kernel does), and `ChannelWiseTorchFP8ScaledMMLinearKernel` (a no-op post-load
step) for per-channel; the MoE backend TRITON (block FP8) or EMULATION (MXFP8), neither of which changes the quantized
layout, with a stand-in kernel object (it holds no weight). Per-channel FP8 all-reduces each row-parallel weight's
amax over the TP group: `ThreadMax`, a barrier between the two rank threads. A GPU kernel's own repacking (DeepGEMM's
UE8M0 scales, CUTLASS layouts) is not run here.

"Kernel format" below = every parameter and buffer the model serves after vLLM's processing: FP8 weights, their
scales, the bf16 norms and embeddings. Asserted per version and rank: version 1 arrives whole, versions 2 and 3 sliced
(the boxes traced on the checkpoint-format parameters the reload restores, equal to the bf16 model's); each rank's
kernel format, and its `kernel_digest`, equal, bitwise, a cold load of that version's whole bf16 checkpoint by the same
vLLM at that rank. Then what must be refused is refused, naming it, and the previous version is served bitwise.
"""

from __future__ import annotations

import importlib
import threading
import traceback
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
from omegaconf import OmegaConf

pytest.importorskip("vllm.model_executor.models.qwen3")
pytest.importorskip("vllm.model_executor.layers.quantization.online.base")
pytest.importorskip("vllm.distributed.weight_transfer.base")

from transformers import Qwen3Config, Qwen3MoeConfig
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from lightning_weightsync.rollout_engines.host_copy import live_tensors
from lightning_weightsync.rollout_engines.vllm import plugin
from lightning_weightsync.versions.sender import BlockingWeightSender
from lightning_weightsync.versions.verify import tensors_digest
from tests.support.mp import free_port
from tests.support.transfer import engine_cfg
from tests.unit.test_vllm_slices_engine import _Rank, tp_per_thread
from tests.unit.test_vllm_slices_real import PATCHED, checkpoint, expected_box, single_rank_group

WORLD = 2
METHODS = ("fp8_per_block", "mxfp8", "fp8_per_channel")
# per-channel MoE quantizes with `ops.scaled_fp8_quant`, a compiled vLLM op (`vllm._C`): not on this CPU kit
CASES = [f"qwen3:{method}" for method in METHODS] + ["qwen3_moe:fp8_per_block", "qwen3_moe:mxfp8"]
LAYER0_Q = "model.layers.0.self_attn.q_proj.weight"
MISSING = {  # arch: (the checkpoint tensor a version leaves out, the vLLM parameter it fills part of)
    "qwen3": (LAYER0_Q, "model.layers.0.self_attn.qkv_proj.weight"),
    "qwen3_moe": (
        "model.layers.0.mlp.experts.1.up_proj.weight",
        "model.layers.0.mlp.experts.routed_experts.w13_weight",
    ),
}


def quant_qwen3(vocab_size: int = 100) -> Qwen3Config:
    """A tiny Qwen3 whose quantized layers hold more than one 128 x 128 block (block FP8) and whose per-rank input
    sizes divide by 32 (MXFP8 requires it): hidden 256, 4 heads of 64 (2 KV heads), MLP 384, 2 layers. The default
    vocabulary of 100 is padded to 128 rows, so rank 1's embedding and LM head are left short by a whole version."""
    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, tie_word_embeddings=False,
    )  # fmt: skip


def quant_qwen3_moe() -> Qwen3MoeConfig:
    """A tiny Qwen3-MoE as `quant_qwen3`, with 4 experts of intermediate size 128 (64 a rank, which block FP8 rounds up
    to 128: vLLM's MoE layer is then one that a whole version leaves short, processed when the update finishes)."""
    return Qwen3MoeConfig(
        vocab_size=100, hidden_size=256, intermediate_size=384, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=False,
    )  # fmt: skip


HF = {"qwen3": quant_qwen3, "qwen3_moe": quant_qwen3_moe}
ARCHS = {"qwen3": "vllm.model_executor.models.qwen3:Qwen3ForCausalLM",
         "qwen3_moe": "vllm.model_executor.models.qwen3_moe:Qwen3MoeForCausalLM"}  # fmt: skip


@contextmanager
def cpu_kernels() -> Iterator[None]:
    """vLLM's kernel choice answered with its pure-torch kernel classes (see the module docstring)."""
    import vllm.model_executor.kernels.linear as linear
    from vllm.model_executor.kernels.linear.mxfp8.emulation import EmulationMxfp8LinearKernel
    from vllm.model_executor.kernels.linear.scaled_mm.pytorch import ChannelWiseTorchFP8ScaledMMLinearKernel
    from vllm.model_executor.kernels.linear.scaled_mm.triton import TritonFp8BlockScaledMMKernel
    from vllm.platforms import current_platform

    def choose(config: Any, possible_kernels: Any, quantization: str | None = None, **kwargs: Any) -> type[Any]:
        block = quantization == "fp8_block_w8a8"
        return TritonFp8BlockScaledMMKernel if block else ChannelWiseTorchFP8ScaledMMLinearKernel

    from vllm.model_executor.layers.fused_moe.oracle import fp8 as moe_oracle
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend

    supported = classmethod(lambda cls, compute_capability=None: (True, None))
    # MoE: the backend vLLM picks by platform answered TRITON (no load-time layout change: convert_to_fp8_moe_kernel_
    # format leaves TRITON's weights as quantized), its kernel object a stand-in (it holds no weight; built after the
    # weights are final, used only to run the experts)
    kernel = SimpleNamespace(fused_experts=SimpleNamespace(keep_constants=lambda layer: None))
    with ExitStack() as stack:
        stack.enter_context(
            mock.patch.object(online_fp8(), "select_fp8_moe_backend", lambda **kw: (Fp8MoeBackend.TRITON, object))
        )
        stack.enter_context(mock.patch.object(moe_oracle, "make_fp8_moe_kernel", lambda **kw: kernel))
        emulation = (Fp8MoeBackend.EMULATION, object)  # MXFP8 MoE: weights as quantized, dequantized when run
        stack.enter_context(mock.patch.object(online_mxfp8(), "select_mxfp8_moe_backend", lambda **kw: emulation))
        stack.enter_context(mock.patch.object(linear, "choose_scaled_mm_linear_kernel", choose))
        stack.enter_context(mock.patch.object(ChannelWiseTorchFP8ScaledMMLinearKernel, "is_supported", supported))
        stack.enter_context(
            mock.patch.dict(linear._POSSIBLE_MXFP8_KERNELS, {current_platform._enum: [EmulationMxfp8LinearKernel]})
        )
        yield


def online_fp8() -> Any:
    from vllm.model_executor.layers.quantization.online import fp8

    return fp8


def online_mxfp8() -> Any:
    from vllm.model_executor.layers.quantization.online import mxfp8

    return mxfp8


class ThreadMax:
    """vLLM's `amax_for_tp_weight_quant` for TP ranks that are threads of one process: the MAX all-reduce of a
    sharded weight's amax over the ranks (quant_utils.py: `all_reduce(amax, MAX, group=tp_group)`), through a barrier
    instead of a process group. Each rank calls it in the same order (its modules, in stream order), as vLLM's
    collective requires of its ranks."""

    def __init__(self, local: Any) -> None:
        self.local = local
        self.barrier = threading.Barrier(WORLD, timeout=60)
        self.slots: list[torch.Tensor | None] = [None] * WORLD
        self.reduced = 0  # all-reduces run (per-channel FP8's row-parallel weights)

    def __call__(self, amax: torch.Tensor, is_sharded: bool) -> torch.Tensor:
        if not is_sharded:
            return amax
        self.reduced += self.local.rank == 0
        self.slots[self.local.rank] = amax.clone()
        self.barrier.wait()
        reduced = torch.stack([slot for slot in self.slots if slot is not None]).amax(0)
        self.barrier.wait()
        amax.copy_(reduced)
        return amax


@contextmanager
def single_rank_groups() -> Iterator[None]:
    """One rank of expert, data and context parallelism (expert parallelism off), wherever vLLM's MoE layers ask (as
    `test_vllm_slices_real.tp_rank` answers them; the TP getters are the thread's, `tp_per_thread`)."""
    single = single_rank_group()
    with ExitStack() as stack:
        for name in PATCHED:
            module = importlib.import_module(name)
            for attr in ("get_ep_group", "get_dp_group", "get_pcp_group"):
                if hasattr(module, attr):
                    stack.enter_context(mock.patch.object(module, attr, return_value=single))
        yield


def model_config(method: str, hf: Any) -> SimpleNamespace:
    """What vLLM's layers, its reload and our engine read of a `ModelConfig`."""
    return SimpleNamespace(
        hf_config=hf, hf_text_config=hf, dtype=torch.bfloat16, head_dtype=torch.bfloat16, get_text_config=lambda: hf,
        quantization=method, quantization_config=None, word_embeddings_untied_by_checkpoint=False,
        enable_sleep_mode=False,
    )  # fmt: skip


def build_quantized(method: str, hf: Any, arch: str = "qwen3") -> torch.nn.Module:
    """vLLM's Qwen3 with the online quantization `--quantization <method>` configures, at the TP rank the caller's
    patches answer, built as vLLM's loader builds it (the model's dtype the default, reload metadata recorded)."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.config.quantization import _ONLINE_SHORTHANDS
    from vllm.model_executor.layers import rotary_embedding
    from vllm.model_executor.layers.quantization.online.base import OnlineQuantizationConfig
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
    from vllm.model_executor.model_loader.utils import configure_quant_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    # vLLM shares one rotary embedding module between models built alike in a process (`get_rope`'s cache); two TP
    # ranks in one process must not: the reload of one would put the other's cache on the meta device
    rotary_embedding._ROPE_DICT.clear()
    vllm_config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    vllm_config.model_config = model_config(method, hf)
    vllm_config.quant_config = OnlineQuantizationConfig(_ONLINE_SHORTHANDS[method])
    module, name = ARCHS[arch].split(":")
    cls = getattr(importlib.import_module(module), name)
    configure_quant_config(vllm_config.quant_config, cls)
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(torch.bfloat16), cpu_kernels():
        model = cls(vllm_config=vllm_config)
        record_metadata_for_reloading(model)
    return model


def cold_load(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """What vLLM's `BaseModelLoader.load_model` does after building a model with online quantization."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_processing
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    config = model_config("", None)
    with cpu_kernels():
        model.load_weights(list(state.items()))  # type: ignore[operator]
        finalize_layerwise_processing(model, config)  # type: ignore[arg-type]
        process_weights_after_loading(model, config, torch.device("cpu"))  # type: ignore[arg-type]


def kernel_format(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer the model serves (as the engine's host copy and `kernel_digest` see them)."""
    return {name: tensor.detach().clone() for name, tensor in live_tensors(model).items()}


def assert_kernel_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: Any) -> None:
    """Bitwise: names, dtypes, shapes and bytes (FP8 compared as bytes)."""
    assert got.keys() == want.keys(), where
    for name, tensor in want.items():
        g = got[name]
        assert (g.dtype, g.shape) == (tensor.dtype, tensor.shape), (where, name, g.dtype, g.shape, tensor.dtype)
        assert torch.equal(g.contiguous().view(torch.uint8), tensor.contiguous().view(torch.uint8)), (where, name)


def bf16_versions(hf: Any, count: int, arch: str = "qwen3") -> list[dict[str, torch.Tensor]]:
    """`count` distinct bf16 checkpoints of one layout (what a bf16 trainer sends after each step)."""
    state = checkpoint(arch, hf)
    gen = torch.Generator().manual_seed(11)
    return [
        {
            n: (t + 0.01 * v * torch.randn(t.shape, generator=gen)).to(torch.bfloat16).contiguous()
            for n, t in state.items()
        }
        for v in range(count)
    ]


class Servers:
    """Two engines (TP ranks 0 and 1) on quantized models, a real sender, and the per-rank cold-load oracle."""

    def __init__(
        self, method: str, hf: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stack: ExitStack, arch: str
    ) -> None:
        plugin.register()
        from lightning_weightsync.rollout_engines.vllm.weight_transfer import LightningWeightSyncEngine

        if not torch.accelerator.is_available():  # vLLM's base update_weights ends with an accelerator sync
            monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a, **k: None)
        monkeypatch.setenv("VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD", "0")
        self.method, self.hf, self.arch = method, hf, arch
        self.local = _Rank()
        stack.enter_context(tp_per_thread(self.local))
        stack.enter_context(single_rank_groups())
        stack.enter_context(cpu_kernels())  # process-wide: kernels' post-load steps run inside the reload
        port = free_port()
        self.cfg = engine_cfg(port, bucket_size_mb=0.25, trainer__min_receivers=WORLD)
        vllm_config = SimpleNamespace(  # only the attributes the base __init__ and our engine read
            parallel_config=SimpleNamespace(),
            model_config=model_config(method, hf),
            speculative_config=None,
            offload_config=None,
        )
        self.amax = ThreadMax(self.local)
        stack.enter_context(mock.patch.object(online_fp8(), "amax_for_tp_weight_quant", self.amax))
        self.engines: list[Any] = []
        self.models = self.cold_models(bf16_versions(hf, 1, arch)[0])  # a server starts from a checkpoint
        for rank, model in enumerate(self.models):
            self.local.rank = rank
            path = tmp_path / f"rank{rank}.yaml"
            path.write_text(OmegaConf.to_yaml(OmegaConf.merge(self.cfg, {"rollout": {"identity": f"tp{rank}"}})))
            monkeypatch.setenv("LIGHTNING_WEIGHTSYNC_CONFIG", str(path))
            engine = WeightTransferEngineFactory.create_engine(
                WeightTransferConfig(backend="lightning_weightsync"), vllm_config, torch.device("cpu"), model
            )
            assert type(engine) is LightningWeightSyncEngine and engine._tp_size() == WORLD
            self.engines.append(engine)
            stack.callback(engine.shutdown)
        self.local.rank = 0
        self.sender = BlockingWeightSender(self.cfg)
        self.sender.start()
        stack.callback(self.sender.close)
        # vLLM's layerwise reload keeps process-wide state: two models reloading in one process must not begin or
        # finish at once (in a server each TP rank is a process of its own)
        self.reload_lock = threading.Lock()

    def cold_models(self, state: dict[str, torch.Tensor]) -> list[torch.nn.Module]:
        """Each rank's model after a cold load of `state` by the same vLLM: built one rank after the other, loaded
        by both ranks at once (per-channel FP8 agrees each row-parallel weight's amax across the ranks)."""
        models = []
        for rank in range(WORLD):
            self.local.rank = rank
            models.append(build_quantized(self.method, self.hf, self.arch))
        self.local.rank = 0
        errors: list[str] = []

        def load(rank: int) -> None:
            self.local.rank = rank
            try:
                cold_load(models[rank], state)
            except BaseException:
                errors.append(traceback.format_exc())

        threads = [threading.Thread(target=load, args=(rank,)) for rank in range(WORLD)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not errors, errors[0]
        return models

    def cold(self, state: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Each rank's kernel format after a cold load of `state` by the same vLLM."""
        return [kernel_format(model) for model in self.cold_models(state)]

    def send(self, version: int, items: list[tuple[str, torch.Tensor]]) -> tuple[Any, list[str]]:
        """One version to both ranks: start, vLLM's update_weights, finish, each rank on its thread; the sender's
        stats and each rank's error (traceback), if any."""
        errors: list[str] = ["" for _ in range(WORLD)]
        loaded = threading.Barrier(WORLD, timeout=60)

        def rollout(rank: int) -> None:
            self.local.rank = rank
            engine = self.engines[rank]
            try:
                with self.reload_lock:
                    engine.start_weight_update()
                try:
                    engine.update_weights({"version": version, "timeout_s": 30})  # vLLM's own
                finally:
                    loaded.wait()
                with self.reload_lock:
                    engine.finish_weight_update()
            except BaseException:
                errors[rank] = traceback.format_exc()

        threads = [threading.Thread(target=rollout, args=(rank,)) for rank in range(WORLD)]
        for thread in threads:
            thread.start()
        stats = None
        try:
            stats = self.sender.send_weights(items, version=version)
        except Exception as exc:  # a refused version fails the send: the caller asserts on the ranks' errors
            stats = exc
        for thread in threads:
            thread.join(60)
        assert not any(t.is_alive() for t in threads), "a rank is still loading"
        return stats, errors


def sliced_bytes(shapes: dict[str, tuple[int, ...]], hf: Any, rank: int) -> int:
    """Bytes (bf16) rank `rank` receives a sliced version: its boxes (the test's table), the other tensors whole."""
    total = 0
    for name, shape in shapes.items():
        box = expected_box(name, shape, hf, rank)
        total += (box.numel if box is not None else torch.Size(shape).numel()) * 2
    return total


@pytest.mark.parametrize("case", CASES)
def test_quantized_ranks_take_their_bf16_slices_and_requantize_bitwise_as_a_cold_load(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    arch, method = case.split(":")
    hf = HF[arch]()
    checkpoints = bf16_versions(hf, 3, arch)
    shapes = {name: tuple(t.shape) for name, t in checkpoints[0].items()}
    model_bytes = sum(t.numel() * t.element_size() for t in checkpoints[0].values())
    with ExitStack() as stack:
        servers = Servers(method, hf, tmp_path, monkeypatch, stack, arch)
        cold = [servers.cold(state) for state in checkpoints]
        expected = [[cold[v][rank] for v in range(len(checkpoints))] for rank in range(WORLD)]
        quantized = [n for n, t in expected[0][0].items() if t.dtype == torch.float8_e4m3fn]
        # FP8 bytes: qkv, o, gate_up, down of 2 layers; MoE: qkv, o, the router (a GateLinear, quantized too; the
        # experts hold the same module), w13 and w2 of the 4 experts
        assert len(quantized) == (10 if arch == "qwen3_moe" else 8), quantized
        if method == "fp8_per_channel":  # kernel layout (K, N), and the amax of o_proj, down_proj agreed over TP
            assert expected[0][0]["model.layers.0.self_attn.o_proj.weight"].shape == (128, 256)
            assert servers.amax.reduced == 4 * 2 * 2  # 4 cold loads (start, 3 oracles) x 2 layers x (o, down)
        for v, state in enumerate(checkpoints, start=1):
            stats, errors = servers.send(v, list(state.items()))
            assert not any(errors), next(e for e in errors if e)
            assert stats.receivers == WORLD
            for rank, engine in enumerate(servers.engines):
                assert engine.version == v and not engine.incomplete
                received = engine._worker_receiver.receiver.last_stats.nbytes
                want = model_bytes if v == 1 else sliced_bytes(shapes, hf, rank)
                assert received == want, (case, v, rank, received, want, model_bytes)
                assert_kernel_equal(kernel_format(servers.models[rank]), expected[rank][v - 1], (case, v, rank))
                assert engine.kernel_digest()["digest"] == tensors_digest(expected[rank][v - 1])  # what verify compares
                report = engine.last_report
                print(
                    f"\n{case}, version {v}, TP rank {rank} of {WORLD}: received {received} of the bf16 model's "
                    f"{model_bytes} bytes ({100 * received / model_bytes:.1f} %); vLLM's reload buffered at most "
                    f"{report['buffered_modules_peak']} modules, {report['buffered_bytes_peak']} bytes (largest "
                    f"module in checkpoint format: {report['largest_module_bytes']} bytes)"
                )
            if v > 1:
                assert all(e._worker_receiver.receiver.last_stats.nbytes < model_bytes for e in servers.engines)


@pytest.mark.parametrize("case", CASES)
def test_a_version_missing_a_tensor_is_refused_by_name_and_the_last_version_still_served_bitwise(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Version 3 lacks a tensor: layer 0's `q_proj` (vLLM's reload would process the fused `qkv_proj` with zeros for
    q), or for the MoE expert 1's `up_proj` (its expert bank `w13_weight` with zeros there). Both ranks refuse it,
    naming the tensor (it arrived in version 2) and vLLM's parameter (the rest of it arrived), and roll back to
    version 2's kernel format, bitwise. Version 4, whole, is then taken."""
    arch, method = case.split(":")
    hf = HF[arch]()
    checkpoints = bf16_versions(hf, 4, arch)
    dropped, param = MISSING[arch]
    with ExitStack() as stack:
        servers = Servers(method, hf, tmp_path, monkeypatch, stack, arch)
        cold = [servers.cold(checkpoints[v]) for v in (1, 3)]
        expected = [[cold[0][rank], cold[1][rank]] for rank in range(WORLD)]
        for v in (1, 2):
            _, errors = servers.send(v, list(checkpoints[v - 1].items()))
            assert not any(errors), next(e for e in errors if e)
        partial = [(n, t) for n, t in checkpoints[2].items() if n != dropped]
        _, errors = servers.send(3, partial)
        for rank, engine in enumerate(servers.engines):
            assert "SinkError" in errors[rank], errors[rank]
            assert dropped in errors[rank], errors[rank]  # by the checkpoint's name
            assert param in errors[rank], errors[rank]  # by vLLM's parameter
            assert "rolled back to version 2" in errors[rank], errors[rank]
            assert engine.version == 2 and not engine.incomplete
            assert_kernel_equal(kernel_format(servers.models[rank]), expected[rank][0], (case, 3, rank))
        _, errors = servers.send(4, list(checkpoints[3].items()))
        assert not any(errors), next(e for e in errors if e)
        for rank, engine in enumerate(servers.engines):
            assert engine.version == 4
            assert_kernel_equal(kernel_format(servers.models[rank]), expected[rank][1], (case, 4, rank))


def poisoned(state: dict[str, torch.Tensor], name: str, value: float) -> dict[str, torch.Tensor]:
    out = dict(state)
    tensor = state[name].clone()
    tensor[0, 0] = value  # in rank 0's box of a row- or column-split tensor
    tensor[-1, -1] = value  # in rank 1's
    out[name] = tensor
    return out


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_version_whose_requantization_breaks_a_scale_is_refused_by_name_and_rolled_back(
    method: str, value: float, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Version 2 carries a NaN (or inf) in layer 1's `down_proj`, at an element each rank reads: block FP8 makes that
    block's scale NaN (inf); MXFP8 writes NaN bytes (its E8M0 scale of a NaN block is 0, of an inf block 254, neither
    a NaN code). Each rank refuses, naming vLLM's tensor, and rolls back to version 1, bitwise. (The two ranks share
    no process group here, so each decides alone; a server's workers agree through vLLM's world group.)"""
    hf = quant_qwen3()
    checkpoints = bf16_versions(hf, 2)
    bad = "model.layers.1.mlp.down_proj"
    with ExitStack() as stack:
        servers = Servers(method, hf, tmp_path, monkeypatch, stack, "qwen3")
        expected = servers.cold(checkpoints[0])
        _, errors = servers.send(1, list(checkpoints[0].items()))
        assert not any(errors), next(e for e in errors if e)
        _, errors = servers.send(2, list(poisoned(checkpoints[1], f"{bad}.weight", value).items()))
        for rank, engine in enumerate(servers.engines):
            assert f"{bad}.weight" in errors[rank] and "quantized tensors broken" in errors[rank], errors[rank]
            assert "rolled back to version 1" in errors[rank], errors[rank]
            assert engine.version == 1 and not engine.incomplete
            assert_kernel_equal(kernel_format(servers.models[rank]), expected[rank], (method, value, rank))


@pytest.mark.parametrize("method", METHODS)
def test_tensors_reach_each_worker_in_parent_module_order_one_module_buffered_at_a_time(
    method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer sends Hugging Face's order (a layer's q, k, v, o, norms, gate, up, down): every module vLLM fuses
    (`qkv_proj`, `gate_up_proj`) gets its tensors back to back, so the reload holds one module buffered at a time,
    on each rank, sliced or whole. Measured per version (`last_report`): modules buffered at once, and the bytes
    buffered against the largest module in checkpoint format (vLLM's budget is 3 x that). A vocabulary that is a
    multiple of 64 x TP (128), so no module is left short by padding (which vLLM holds until the update ends). The
    same stream with layer 0's `q_proj` moved to the end holds two modules at once (the test's own check that the
    measure can fail)."""
    hf = quant_qwen3(vocab_size=128)
    checkpoints = bf16_versions(hf, 3)
    with ExitStack() as stack:
        servers = Servers(method, hf, tmp_path, monkeypatch, stack, "qwen3")
        for v in (1, 2):
            _, errors = servers.send(v, list(checkpoints[v - 1].items()))
            assert not any(errors), next(e for e in errors if e)
            for engine in servers.engines:
                report = engine.last_report
                assert report["buffered_modules_peak"] == 1, (v, report)
                assert 0 < report["buffered_bytes_peak"] <= 3 * report["largest_module_bytes"], (v, report)
        items = list(checkpoints[2].items())
        reordered = [item for item in items if item[0] != LAYER0_Q] + [(LAYER0_Q, checkpoints[2][LAYER0_Q])]
        _, errors = servers.send(3, reordered)
        assert not any(errors), next(e for e in errors if e)
        assert all(engine.last_report["buffered_modules_peak"] >= 2 for engine in servers.engines)


def test_a_moe_layer_processed_at_finish_with_a_broken_scale_fails_the_finish_and_rolls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Block FP8 rounds a rank's expert sizes up to 128, so vLLM processes the MoE layer only when the update
    finishes (after the ack): a NaN in expert 0's `gate_proj` (at an element each rank reads) is found then, and the
    finish call fails naming vLLM's expert bank scale, each rank back on version 1, bitwise."""
    hf = quant_qwen3_moe()
    checkpoints = bf16_versions(hf, 2, "qwen3_moe")
    with ExitStack() as stack:
        servers = Servers("fp8_per_block", hf, tmp_path, monkeypatch, stack, "qwen3_moe")
        expected = servers.cold(checkpoints[0])
        _, errors = servers.send(1, list(checkpoints[0].items()))
        assert not any(errors), next(e for e in errors if e)
        bad = poisoned(checkpoints[1], "model.layers.1.mlp.experts.0.gate_proj.weight", float("nan"))
        stats, errors = servers.send(2, list(bad.items()))
        assert stats.receivers == WORLD  # acknowledged: the layer is processed only at the finish
        for rank, engine in enumerate(servers.engines):
            assert "finish_weight_update" in errors[rank], errors[rank]
            assert "model.layers.1.mlp.experts.routed_experts.w13_weight_scale_inv: scale holds NaN" in errors[rank]
            assert "rolled back to version 1" in errors[rank], errors[rank]
            assert engine.version == 1 and not engine.incomplete
            assert_kernel_equal(kernel_format(servers.models[rank]), expected[rank], ("moe nan", rank))
