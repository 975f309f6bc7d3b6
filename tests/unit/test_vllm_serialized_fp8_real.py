"""Serialized block-FP8 vLLM models fed by a bf16 trainer, end to end against the REAL vLLM (skipped without vLLM;
the contract kit runs it on CPU: `.venv-vllm-0.34.0/bin/python -m pytest tests/unit/test_vllm_serialized_fp8_real.py`).

A tiny Qwen3 and a tiny Qwen3-MoE built by vLLM as serialized block-FP8 models (`Fp8Config`, `weight_block_size`
[128, 128], the routers in `ignored_layers`, as `test_vllm_quant_contract_real.py` builds them, with vLLM's reload
metadata recorded as its loader records it), each rank behind our real vLLM engine (`LightningWeightSyncEngine`,
built by vLLM's factory through our plugin, driven by vLLM's own `update_weights` between our
`start_weight_update` / `finish_weight_update`), fed by a real `WeightSender` (gloo, 127.0.0.1) that is handed the
trainer's bf16 weights. Nobody tells the sender to quantize: each engine learns its model's contract at start-up
and declares it, and the sender quantizes to it. After every version each rank's parameters (FP8 weights, their
`weight_scale_inv`, the bf16 norms and embeddings) equal, bitwise, a cold load by the same vLLM at that rank of
the FP8 checkpoint vLLM's own quantizer (`per_block_cast_to_fp8`) makes of the same bf16 weights.

TP 1: every version whole. TP 2 (`transport.slices`, the default; both ranks in one process, each engine on its
own thread as in `test_vllm_quantized_real.py`): version 1 whole, then each rank gets its box of every FP8
weight and the box of its scales its loader reads. Shard edges that are not on a 128 boundary arise here: the
dense model's `k_proj` / `v_proj` (2 KV heads of 64 at TP 2: a rank reads 64 rows of one 128-row block, vLLM's
`allow_fp8_block_shape_mismatch`), and the MoE's experts (intermediate 128, 64 a rank: vLLM refines the scale grid
to 64 x 64 and upsamples the checkpoint's scales at load). The sender quantizes whole tensors before it cuts a
box, so a box of the FP8 bytes is the same bytes whatever its edges, and the scale box is the block rows the
loader reads (both ranks read the same scale row of a half-block shard): asserted bitwise, and the boxes said.
The bytes each worker receives against the bf16 model are printed (`-s`).

Then a refusal end to end: a NaN in a weight the contract quantizes fails the version at the sender, naming the
tensor; each worker keeps serving the version it held, bitwise; the next version lands.
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

pytest.importorskip("vllm.model_executor.layers.quantization.fp8")
pytest.importorskip("vllm.model_executor.layers.quantization.online.base")
pytest.importorskip("vllm.distributed.weight_transfer.base")

from transformers import Qwen3Config, Qwen3MoeConfig
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from lightning_weightsync.errors import QuantizeError
from lightning_weightsync.protocol.boxes import Box
from lightning_weightsync.rollout_engines.vllm import plugin
from lightning_weightsync.versions.sender import BlockingWeightSender
from tests.support.mp import free_port
from tests.support.transfer import engine_cfg
from tests.unit.test_vllm_quant_contract_real import is_fp8_in_checkpoint, vllm_fp8_checkpoint
from tests.unit.test_vllm_quantized_real import (
    ARCHS,
    assert_kernel_equal,
    bf16_versions,
    cpu_kernels,
    kernel_format,
    model_config,
    quant_qwen3,
    quant_qwen3_moe,
    single_rank_groups,
)  # fmt: skip
from tests.unit.test_vllm_slices_real import PATCHED, NoAttention


def dense_tp2() -> Qwen3Config:
    """`quant_qwen3` as vLLM can shard it in 128-row blocks at TP 2: an MLP of 512 (256 a rank; 384 would leave
    `down_proj` 192 columns a rank, which vLLM refuses to build: `validate_fp8_block_shape`) and heads of 128 (2 KV
    heads of 64 give a rank 64 rows of `k_proj`: vLLM builds that layer, `allow_fp8_block_shape_mismatch`, but its
    own cold load then fails narrowing the scale, "start (2) + length (1) exceeds dimension size (2)")."""
    return Qwen3Config(
        vocab_size=100, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, tie_word_embeddings=False,
    )  # fmt: skip


def moe_tp2() -> Qwen3MoeConfig:
    """`quant_qwen3_moe` with `dense_tp2`'s attention; its experts of 128 are 64 rows a rank: not on a 128
    boundary, so vLLM refines the experts' scale grid to 64 x 64 and upsamples the checkpoint's scales at load."""
    return Qwen3MoeConfig(
        vocab_size=100, hidden_size=256, intermediate_size=384, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=128, num_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=False,
    )  # fmt: skip


MODELS = {  # (arch, world): the config
    ("qwen3", 1): quant_qwen3,
    ("qwen3_moe", 1): quant_qwen3_moe,
    ("qwen3", 2): dense_tp2,
    ("qwen3_moe", 2): moe_tp2,
}


class _Rank(threading.local):
    rank = 0


@contextmanager
def tp_threads(local: _Rank, world: int) -> Iterator[None]:
    """vLLM's TP getters answer the calling thread's rank of `world` (as `test_vllm_slices_engine.tp_per_thread`,
    for any world); our engine's `_tp_size` asks them (a stand-in TP group)."""
    pp = SimpleNamespace(is_last_rank=True, is_first_rank=True, world_size=1, rank_in_group=0)
    with ExitStack() as stack:
        for name in (*PATCHED, "vllm.model_executor.layers.quantization.fp8"):
            module = importlib.import_module(name)
            for attr, fn in (
                ("get_tensor_model_parallel_rank", lambda: local.rank),
                ("get_tensor_model_parallel_world_size", lambda: world),
                ("get_pp_group", lambda: pp),
            ):
                if hasattr(module, attr):
                    stack.enter_context(mock.patch.object(module, attr, side_effect=fn))
            if hasattr(module, "Attention"):
                stack.enter_context(mock.patch.object(module, "Attention", NoAttention))
        from vllm.distributed import parallel_state

        stack.enter_context(mock.patch.object(parallel_state, "_TP", object()))
        yield


@contextmanager
def serialized_fp8_moe() -> Iterator[None]:
    """The serialized-FP8 MoE method's backend choice (`quantization/fp8.py` imports it by name) answered TRITON,
    its kernel a stand-in (it holds no weight; built after the weights are final, used only to run the experts)."""
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
    from vllm.model_executor.layers.quantization import fp8

    with ExitStack() as stack:
        stack.enter_context(
            mock.patch.object(fp8, "select_fp8_moe_backend", lambda **kw: (Fp8MoeBackend.TRITON, object))
        )
        if hasattr(fp8, "make_fp8_moe_kernel"):
            stack.enter_context(mock.patch.object(fp8, "make_fp8_moe_kernel", lambda **kw: mock.Mock()))
        yield


def fp8_config(arch: str, hf: Any) -> Any:
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    ignored = [f"model.layers.{i}.mlp.gate" for i in range(hf.num_hidden_layers)] if arch == "qwen3_moe" else []
    return Fp8Config(
        is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", ignored_layers=ignored,
        weight_block_size=[128, 128],
    )  # fmt: skip


def build_fp8(arch: str, hf: Any) -> torch.nn.Module:
    """vLLM's model as a serialized block-FP8 checkpoint configures it, at the calling thread's TP rank, built as
    vLLM's `initialize_model` builds it (reload metadata recorded: the engine's layerwise reload needs it)."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
    from vllm.model_executor.model_loader.utils import configure_quant_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    rotary_embedding._ROPE_DICT.clear()  # one rotary module per model (see test_vllm_quantized_real.build_quantized)
    vllm_config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    vllm_config.model_config = model_config("fp8", hf)
    vllm_config.quant_config = fp8_config(arch, hf)
    module, name = ARCHS[arch].split(":")
    cls = getattr(importlib.import_module(module), name)
    configure_quant_config(vllm_config.quant_config, cls)
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(torch.bfloat16):
        model = cls(vllm_config=vllm_config)
        record_metadata_for_reloading(model)
    return model  # type: ignore[no-any-return]


def cold_load(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """`BaseModelLoader.load_model` after building a serialized-FP8 model: the FP8 checkpoint vLLM's quantizer makes
    of `state`, then post-load processing."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    model.load_weights(vllm_fp8_checkpoint(state))  # type: ignore[operator]
    process_weights_after_loading(model, model_config("fp8", None), torch.device("cpu"))  # type: ignore[arg-type]


def nbytes(items: Any) -> int:
    return sum(t.numel() * t.element_size() for _, t in items)


class Fp8Servers:
    """`world` engines (TP ranks) on serialized block-FP8 models, a real sender, and the per-rank cold-load oracle."""

    def __init__(
        self, arch: str, world: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stack: ExitStack
    ) -> None:
        plugin.register()
        from lightning_weightsync.rollout_engines.vllm.weight_transfer import LightningWeightSyncEngine

        if not torch.accelerator.is_available():  # vLLM's base update_weights ends with an accelerator sync
            monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a, **k: None)
        self.arch, self.world, self.hf = arch, world, MODELS[(arch, world)]()
        self.local = _Rank()
        stack.enter_context(tp_threads(self.local, world))
        stack.enter_context(single_rank_groups())
        stack.enter_context(cpu_kernels())
        stack.enter_context(serialized_fp8_moe())
        self.cfg = engine_cfg(free_port(), bucket_size_mb=0.25, trainer__min_receivers=world)
        vllm_config = SimpleNamespace(  # what the base __init__ and our engine read
            parallel_config=SimpleNamespace(),
            model_config=model_config("fp8", self.hf),
            quant_config=fp8_config(arch, self.hf),
            speculative_config=None,
            offload_config=None,
        )
        self.engines: list[Any] = []
        self.boxes: list[dict[str, Box]] = []  # what each rank declared
        self.models = self.cold_models(bf16_versions(self.hf, 1, arch)[0])  # a server starts from its checkpoint
        for rank, model in enumerate(self.models):
            self.local.rank = rank
            path = tmp_path / f"rank{rank}.yaml"
            path.write_text(OmegaConf.to_yaml(OmegaConf.merge(self.cfg, {"rollout": {"identity": f"tp{rank}"}})))
            monkeypatch.setenv("LIGHTNING_WEIGHTSYNC_CONFIG", str(path))
            engine = WeightTransferEngineFactory.create_engine(
                WeightTransferConfig(backend="lightning_weightsync"), vllm_config, torch.device("cpu"), model
            )
            assert type(engine) is LightningWeightSyncEngine and engine._tp_size() == world
            self.engines.append(engine)
            self.boxes.append({})
            receiver = engine._worker_receiver.receiver
            declare = receiver.declare_boxes
            receiver.declare_boxes = lambda boxes, declare=declare, seen=self.boxes[-1]: (  # what it declared
                seen.update(boxes or {}),
                declare(boxes),
            )
            stack.callback(engine.shutdown)
        self.local.rank = 0
        self.sender = BlockingWeightSender(self.cfg)
        self.sender.start()
        stack.callback(self.sender.close)
        self.reload_lock = threading.Lock()  # vLLM's layerwise reload keeps process-wide state

    def cold_models(self, state: dict[str, torch.Tensor]) -> list[torch.nn.Module]:
        models = []
        for rank in range(self.world):
            self.local.rank = rank
            model = build_fp8(self.arch, self.hf)
            cold_load(model, state)
            models.append(model)
        self.local.rank = 0
        return models

    def cold(self, state: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        return [kernel_format(model) for model in self.cold_models(state)]

    def send(self, version: int, items: list[tuple[str, torch.Tensor]]) -> tuple[Any, list[str]]:
        """One version to every rank (start, vLLM's update_weights, finish, each on its thread): the sender's stats
        (or its exception) and each rank's error (traceback), if any."""
        errors = ["" for _ in range(self.world)]
        loaded = threading.Barrier(self.world, timeout=60)

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

        threads = [threading.Thread(target=rollout, args=(rank,)) for rank in range(self.world)]
        for thread in threads:
            thread.start()
        stats: Any = None
        try:
            stats = self.sender.send_weights(items, version=version)
        except Exception as exc:  # a refused version fails the send: the caller asserts on it
            stats = exc
        for thread in threads:
            thread.join(60)
        assert not any(t.is_alive() for t in threads), "a rank is still loading"
        return stats, errors


def received(engine: Any) -> int:
    return int(engine._worker_receiver.receiver.last_stats.nbytes)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("world", [1, 2])
def test_a_bf16_trainer_feeds_serialized_fp8_workers_bitwise_as_a_cold_load_of_the_fp8_checkpoint(
    arch: str, world: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with ExitStack() as stack:
        servers = Fp8Servers(arch, world, tmp_path, monkeypatch, stack)
        checkpoints = bf16_versions(servers.hf, 3, arch)
        bf16 = nbytes(checkpoints[0].items())
        fp8 = nbytes(vllm_fp8_checkpoint(checkpoints[0]))
        for engine in servers.engines:  # each declared its contract on its own, learnt from its model
            contract = engine._worker_receiver.receiver.declared_contract
            assert contract is not None
            assert all((contract.rule_for(n) is not None) == is_fp8_in_checkpoint(n) for n in checkpoints[0])
        for v, state in enumerate(checkpoints, start=1):
            expected = servers.cold(state)
            stats, errors = servers.send(v, list(state.items()))
            assert not any(errors), next(e for e in errors if e)
            assert stats.receivers == world and stats.quantized_tensors > 0 and stats.unquantized_bytes == bf16
            for rank, engine in enumerate(servers.engines):
                assert engine.version == v and not engine.incomplete
                got = kernel_format(servers.models[rank])
                assert any(t.dtype == torch.float8_e4m3fn for t in got.values())
                assert_kernel_equal(got, expected[rank], (arch, world, v, rank))
                nb = received(engine)
                if v == 1 or world == 1:
                    assert nb == fp8, (v, rank, nb, fp8)  # the whole FP8 checkpoint
                else:
                    assert nb < fp8 * 0.75, (v, rank, nb, fp8)  # its boxes of it
                print(f"\n{arch} TP {world}, version {v}, rank {rank}: received {nb} bytes, {100 * nb / bf16:.1f} % "
                      f"of the bf16 model's {bf16} ({'sliced' if v > 1 and world > 1 else 'whole'}; the whole FP8 "
                      f"checkpoint: {fp8}, {100 * fp8 / bf16:.1f} %)")  # fmt: skip
        if world > 1:
            expert = "model.layers.0.mlp.experts.0.gate_proj.weight"
            if arch == "qwen3_moe":  # a shard edge inside a 128-row block: the FP8 box is cut there, bitwise above
                assert servers.boxes[1][expert] == Box((64, 0), (64, 256))
                assert f"{expert}_scale_inv" not in servers.boxes[1]  # both ranks read its one block row: whole
            k_scale = "model.layers.0.self_attn.k_proj.weight_scale_inv"
            assert servers.boxes[1][k_scale] == Box((1, 0), (1, 2))  # block-aligned: the box of its scales
            for rank, boxes in enumerate(servers.boxes):
                layer0 = {
                    n.removeprefix("model.layers.0."): (b.offsets, b.sizes) for n, b in boxes.items() if ".0." in n
                }
                print(f"{arch} TP {world} rank {rank} boxes of layer 0: {layer0}")


def test_a_nan_weight_fails_the_version_naming_it_the_workers_keep_the_last_and_the_next_one_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TP 2, sliced from version 2: version 3 carries a NaN in layer 1's `down_proj` (after most of the model was
    sent: the ranks have loaded part of it). The sender's quantizer refuses it, naming the tensor and the element;
    the version is aborted, each rank rolls back to version 2 (its host copy), bitwise; version 4 lands bitwise."""
    bad = "model.layers.1.mlp.down_proj.weight"
    with ExitStack() as stack:
        servers = Fp8Servers("qwen3", 2, tmp_path, monkeypatch, stack)
        checkpoints = bf16_versions(servers.hf, 4)
        for v in (1, 2):
            _, errors = servers.send(v, list(checkpoints[v - 1].items()))
            assert not any(errors), next(e for e in errors if e)
        held = servers.cold(checkpoints[1])
        poisoned = dict(checkpoints[2])
        poisoned[bad] = poisoned[bad].clone()
        poisoned[bad][3, 300] = float("nan")
        failure, errors = servers.send(3, list(poisoned.items()))
        assert isinstance(failure, QuantizeError), failure
        assert f"{bad}: element [3, 300] is nan" in str(failure)
        for rank, engine in enumerate(servers.engines):
            assert "VersionAborted" in errors[rank] and f"{bad}: element [3, 300] is nan" in errors[rank], errors[rank]
            assert engine.last_report["touched"]  # it had loaded part of version 3: the rollback is what holds
            assert engine.version == 2 and not engine.incomplete, errors[rank]
            assert_kernel_equal(kernel_format(servers.models[rank]), held[rank], ("after the NaN", rank))
            print(f"\nrank {rank}: {errors[rank].strip().splitlines()[-1]}")
        expected = servers.cold(checkpoints[3])
        _, errors = servers.send(4, list(checkpoints[3].items()))
        assert not any(errors), next(e for e in errors if e)
        for rank, engine in enumerate(servers.engines):
            assert engine.version == 4
            assert_kernel_equal(kernel_format(servers.models[rank]), expected[rank], ("version 4", rank))
