"""rollout_engines/adapter.py: an engine worker's sink writes adapter versions as PEFT adapter directories
(one worker of the server), drains them on the others, refuses what an engine cannot serve, and sends
every other version to `model.load_weights` as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_weightsync.demo.tiny_lm import build_model
from lightning_weightsync.errors import SinkError
from lightning_weightsync.protocol.lora import adapter_path
from lightning_weightsync.protocol.messages import LoraSpec
from lightning_weightsync.rollout_engines.adapter import AdapterDirectory, EngineVersionSink
from tests.support.vllm_standin import StandInModel

ADAPTER = {
    "base_model.model.layers.0.q_proj.lora_A.weight": torch.arange(8, dtype=torch.float32).reshape(2, 4),
    "base_model.model.layers.0.q_proj.lora_B.weight": torch.ones(4, 2, dtype=torch.bfloat16),
}


def _spec(mode: str = "adapter", base: bool = False) -> LoraSpec:
    return LoraSpec(mode=mode, base=base, r=2, lora_alpha=4.0, target_modules=["q_proj"])


def _run(sink: EngineVersionSink, version: int, tensors: dict[str, torch.Tensor], lora: LoraSpec | None) -> None:
    sink.begin(version, lora=lora)
    for name, tensor in tensors.items():
        sink.accept(name, tensor)
    sink.commit(version)


def _model() -> StandInModel:
    return StandInModel(build_model().config)


def test_worker_zero_writes_the_adapter_directory_and_leaves_the_model_alone(tmp_path: Path) -> None:
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sink = EngineVersionSink(model, 5, AdapterDirectory(str(tmp_path), "vllm.lora_dir", writes=True))
    _run(sink, 5, ADAPTER, _spec())
    written = Path(adapter_path(str(tmp_path), 5))
    got = load_file(str(written / "adapter_model.safetensors"))
    assert sorted(got) == sorted(ADAPTER) and all(torch.equal(got[n], t) for n, t in ADAPTER.items())
    config = json.loads((written / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 2, 4.0)
    assert not sink.touched and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_other_workers_drain_adapter_versions(tmp_path: Path) -> None:
    sink = EngineVersionSink(_model(), None, AdapterDirectory(str(tmp_path), "vllm.lora_dir", writes=False))
    _run(sink, 0, ADAPTER, _spec())
    assert list(tmp_path.iterdir()) == [] and not sink.touched


@pytest.mark.parametrize(
    ("spec", "lora_dir", "knob"),
    [(_spec(base=True), "dir", "trainer.lora_base=rollout_has"), (_spec(), None, "sglang.lora_dir")],
)
def test_what_an_engine_cannot_serve_is_refused_at_begin(
    tmp_path: Path, spec: LoraSpec, lora_dir: str | None, knob: str
) -> None:
    directory = AdapterDirectory(str(tmp_path / lora_dir) if lora_dir else None, "sglang.lora_dir", writes=True)
    sink = EngineVersionSink(_model(), None, directory)
    with pytest.raises(SinkError, match=knob.replace(".", r"\.")):
        sink.begin(1, lora=spec)
    assert not (tmp_path / "dir").exists() or list((tmp_path / "dir").iterdir()) == []


def test_merged_versions_go_to_load_weights(tmp_path: Path) -> None:
    model = _model()
    name, tensor = next(iter(model.state_dict().items()))
    sink = EngineVersionSink(model, 2, AdapterDirectory(str(tmp_path), "vllm.lora_dir", writes=True))
    _run(sink, 2, {name: torch.full_like(tensor, 3.0)}, _spec("merged"))
    assert sink.touched and torch.equal(model.state_dict()[name], torch.full_like(tensor, 3.0))
    assert list(tmp_path.iterdir()) == []
