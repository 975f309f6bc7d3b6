"""End to end against the REAL vLLM (skipped without it; `./dev vllm-contract` runs it on CPU): a real
`WeightSender` (gloo, 127.0.0.1) sends 3 versions of a tiny Qwen3's checkpoint (q/k/v and gate/up separate,
GQA with 1 KV head < TP 2, untied LM head), and of a tiny Llama with tied embeddings, to TWO of our vLLM
engines (`LightningWeightSyncEngine`, built by vLLM's factory through our plugin, driven by vLLM's own base
`update_weights`), one per simulated TP rank.

Both ranks live in one process, each engine on its own thread (as a vLLM worker's thread drives its engine):
vLLM's TP getters are patched to answer the rank of the calling thread (`test_vllm_slices_real.py` patches them
process-wide; two ranks at once need the thread's), and `parallel_state._TP` is set to a stand-in so that our
engine's `_tp_size()` asks the (patched) getter instead of answering 1 as it does outside a vLLM worker. The
sender's port is a free one found first (`free_port`), as test_vllm_real.py does.

Asserted per version and rank: version 1 arrives whole (the engine knows no checkpoint layout yet); at
version 2's `start_weight_update` each engine derives its boxes from vLLM's loaders and declares them, so
versions 2 and 3 arrive sliced (the receiver's `last_stats.nbytes` equals that rank's boxes plus its whole
tensors); and after each version the rank's parameters equal, bitwise, what `load_weights` of that version's
whole checkpoint gives a model built at that rank. Everything runs through vLLM's layerwise reload, as on a
GPU worker. The tied case caught two bugs: inside the reload the tie is undone (parameters on the meta device),
so a sliced version's one-element box of `lm_head.weight` was loaded into the embedding; and vLLM 0.33.0's
`load_weights` raises on `lm_head.weight` alone (the sink loads one tensor a call): the sink now skips names the
model ties to another parameter, found before the reload (`tied_aliases`). Its checkpoints' `lm_head.weight`
differs from the embedding after version 1 (noise added per name): the model must still hold the embedding."""

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
pytest.importorskip("vllm.distributed.weight_transfer.base")

from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from lightning_weightsync.rollout_engines.vllm import plugin
from lightning_weightsync.versions.sender import BlockingWeightSender
from tests.support.mp import free_port
from tests.support.transfer import engine_cfg
from tests.unit.test_vllm_slices_real import PATCHED, NoAttention, build, checkpoint, expected_box, llama, qwen3

WORLD = 2
VERSIONS = 3


class _Rank(threading.local):
    rank = 0


@contextmanager
def tp_per_thread(local: _Rank) -> Iterator[None]:
    """vLLM's TP getters answer the calling thread's `local.rank` of `WORLD`; one pipeline stage; our engine's
    `_tp_size` sees a TP group (a stand-in: it only checks that one exists, then asks the getter)."""
    pp = SimpleNamespace(is_last_rank=True, is_first_rank=True, world_size=1, rank_in_group=0)
    with ExitStack() as stack:
        for name in PATCHED:
            module = importlib.import_module(name)
            for attr, fn in (
                ("get_tensor_model_parallel_rank", lambda: local.rank),
                ("get_tensor_model_parallel_world_size", lambda: WORLD),
                ("get_pp_group", lambda: pp),
            ):
                if hasattr(module, attr):
                    stack.enter_context(mock.patch.object(module, attr, side_effect=fn))
            if hasattr(module, "Attention"):
                stack.enter_context(mock.patch.object(module, "Attention", NoAttention))
        from vllm.distributed import parallel_state

        stack.enter_context(mock.patch.object(parallel_state, "_TP", object()))
        yield


def versions(state: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """VERSIONS distinct checkpoints of the same layout (what a trainer sends after each step)."""
    gen = torch.Generator().manual_seed(11)
    return [
        {name: (t + 0.01 * v * torch.randn(t.shape, generator=gen)).contiguous() for name, t in state.items()}
        for v in range(VERSIONS)
    ]


CASES = {
    "qwen3 GQA kv=1 (TP > KV heads), untied": ("qwen3", qwen3(1)),
    "llama kv=2, tied embeddings": ("llama", llama(True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_tp_ranks_receive_their_slices_from_a_real_sender_bitwise(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plugin.register()
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    from lightning_weightsync.rollout_engines.vllm.weight_transfer import LightningWeightSyncEngine

    if not torch.accelerator.is_available():  # vLLM's base update_weights ends with an accelerator sync
        monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a, **k: None)
    arch, hf = CASES[case]
    checkpoints = versions(checkpoint(arch, hf))
    shapes = {name: tuple(t.shape) for name, t in checkpoints[0].items()}
    model_bytes = sum(t.numel() * t.element_size() for t in checkpoints[0].values())

    port = free_port()
    cfg = engine_cfg(port, bucket_size_mb=0.03125, trainer__min_receivers=WORLD)
    local = _Rank()
    engines: list[Any] = []
    models: list[torch.nn.Module] = []
    vllm_config = SimpleNamespace(  # only the attributes the base __init__ and our engine read
        parallel_config=SimpleNamespace(),
        model_config=SimpleNamespace(quantization=None, enable_sleep_mode=False, dtype=torch.float32),
        speculative_config=None,
        offload_config=None,
    )
    with tp_per_thread(local):
        for rank in range(WORLD):
            local.rank = rank
            model = build(arch, hf, rank)
            record_metadata_for_reloading(model)  # as vLLM's model loader does for every model it builds
            path = tmp_path / f"rank{rank}.yaml"  # one identity per worker (in one process, pid and rank agree)
            path.write_text(OmegaConf.to_yaml(OmegaConf.merge(cfg, {"rollout": {"identity": f"tp{rank}"}})))
            monkeypatch.setenv("LIGHTNING_WEIGHTSYNC_CONFIG", str(path))
            engine = WeightTransferEngineFactory.create_engine(
                WeightTransferConfig(backend="lightning_weightsync"), vllm_config, torch.device("cpu"), model
            )
            assert type(engine) is LightningWeightSyncEngine
            assert engine._tp_size() == WORLD
            engines.append(engine)
            models.append(model)
        local.rank = 0
        # the oracle: each rank's bytes a sliced version (its boxes from the test's table, the other tensors
        # whole) and, per version, what load_weights of the whole checkpoint makes of a model built at that rank
        sliced_bytes = []
        expected: list[list[dict[str, torch.Tensor]]] = []
        for rank in range(WORLD):
            local.rank = rank
            boxes = {name: expected_box(name, shape, hf, rank) for name, shape in shapes.items()}
            if hf.num_key_value_heads < WORLD:  # GQA, kv < TP: both ranks read k_proj and v_proj whole
                assert boxes["model.layers.0.self_attn.k_proj.weight"] is None
            sliced_bytes.append(
                sum((box.numel if box is not None else checkpoints[0][name].numel()) * 4 for name, box in boxes.items())
            )
            reference = build(arch, hf, rank)
            per_version = []
            for state in checkpoints:
                reference.load_weights(list(state.items()))  # type: ignore[operator]
                per_version.append({n: t.clone() for n, t in reference.state_dict().items()})
            expected.append(per_version)
        local.rank = 0
        assert all(t.dtype == torch.float32 for t in checkpoints[0].values())

        # vLLM's layerwise reload keeps process-wide state (0.33.0: reload/layerwise.py LOADING_LAYERS, cleared by
        # every finalize): two models reloading in one process must not begin or finish at once (in a server each
        # TP rank is a process of its own)
        reload_lock = threading.Lock()
        sender = BlockingWeightSender(cfg)
        sender.start()
        try:
            for v, state in enumerate(checkpoints, start=1):
                errors: list[str] = []
                loaded = threading.Barrier(WORLD, timeout=60)

                def rollout(rank: int, version: int = v, errors: list[str] = errors, loaded: Any = loaded) -> None:
                    local.rank = rank
                    try:
                        with reload_lock:
                            engines[rank].start_weight_update()
                        engines[rank].update_weights({"version": version, "timeout_s": 30})  # vLLM's own
                        loaded.wait()
                        with reload_lock:
                            engines[rank].finish_weight_update()
                    except BaseException:
                        errors.append(traceback.format_exc())

                threads = [threading.Thread(target=rollout, args=(rank,)) for rank in range(WORLD)]
                for thread in threads:
                    thread.start()
                stats = sender.send_weights(list(state.items()), version=v)
                for thread in threads:
                    thread.join(60)
                assert not errors, errors[0]
                assert stats.receivers == WORLD
                for rank, engine in enumerate(engines):
                    assert engine.version == v and not engine.incomplete
                    received = engine._worker_receiver.receiver.last_stats.nbytes
                    want = model_bytes if v == 1 else sliced_bytes[rank]
                    assert received == want, (v, rank, received, want, model_bytes)
                    got = models[rank].state_dict()
                    assert got.keys() == expected[rank][v - 1].keys()
                    for name, tensor in expected[rank][v - 1].items():
                        assert torch.equal(got[name], tensor), (v, rank, name)
                    assert not any(p.is_meta for p in models[rank].parameters())
                    print(
                        f"\nversion {v}, TP rank {rank} of {WORLD}: received {received} of the model's "
                        f"{model_bytes} bytes ({100 * received / model_bytes:.1f} %)"
                    )
                if v > 1:
                    assert engines[0]._worker_receiver.receiver.last_stats.nbytes < model_bytes
        finally:
            for engine in engines:
                engine.shutdown()
            sender.close()
