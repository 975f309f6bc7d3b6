"""LoRA adapter versions into rollout engines, end to end on CPU: a real trainer (`SyncDriver`: its
`RolloutFleet` and `WeightSender`) sends `trainer.lora=adapter` versions of a PEFT model to a STAND-IN
vLLM / SGLang server (tests/support/*_standin.py: the routes tests/data/*_api.json pins, running OUR
engine body / loader). The server's worker writes each adapter version to `<engine>.lora_dir`, the
trainer's client has the server load it under the served name, and the adapter the server ends up serving
is the trainer's, bitwise, under PEFT's names with the trainer's adapter config."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("peft")

from lightning_weightsync.config import load_config
from lightning_weightsync.trainer.driver import SyncDriver
from tests.integration.test_vllm import _wait_ready
from tests.support.lora import RANK, adapter_state, build_peft
from tests.support.mp import free_port, spawned
from tests.support.sglang_standin import standin_sglang_main
from tests.support.vllm_standin import standin_server_main

ENGINES = {"vllm": standin_server_main, "sglang": standin_sglang_main}


def _server_config(tmp: Path, port: int, engine: str) -> Path:
    """The rollout side's YAML (`$LIGHTNING_WEIGHTSYNC_CONFIG` of the server's workers)."""
    path = tmp / "rollout.yaml"
    path.write_text(
        f"transport:\n  port: {port}\n  timeout_s: 60\n  heartbeat_interval_s: 0.2\n  bucket_size_mb: 0.03125\n"
        f"{engine}:\n  lora_dir: {tmp / 'adapters'}\n"
    )
    return path


def _trainer(tmp: Path, port: int, http: int, engine: str, *extra: str) -> SyncDriver:
    cfg = load_config(
        overrides=[
            f"transport.port={port}", "transport.timeout_s=60", "transport.bucket_size_mb=0.03125",
            f"{engine}.urls=[http://127.0.0.1:{http}]", f"{engine}.lora_dir={tmp / 'adapters'}",
            f"{engine}.lora_name=policy", f"{engine}.request_timeout_s=60", "trainer.min_receivers=1",
            "trainer.lora=adapter", "trainer.lora_base=rollout_has", *extra,
        ]
    )  # fmt: skip
    return SyncDriver(cfg, rank=0, device=None, prefix=None)


def _train_step(model: torch.nn.Module, step: int) -> None:
    """Change every trainable (adapter) tensor, as an optimizer step would."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.01 * (step + 1))


@pytest.mark.slow
@pytest.mark.parametrize(("engine", "overlap"), [("vllm", False), ("sglang", False), ("vllm", True)])
def test_each_adapter_version_replaces_the_served_adapter_bitwise(tmp_path: Path, engine: str, overlap: bool) -> None:
    """With `trainer.overlap` the version is sent (and the adapter loaded) by the background thread, from
    the snapshot: the engine still gets the version's LoRA spec and loads it."""
    port, http, out = free_port(), free_port(), tmp_path / "server"
    out.mkdir()
    extra = ["sglang.pause_mode=abort"] if engine == "sglang" else []
    extra.append(f"trainer.overlap={overlap}")
    model = build_peft()
    with spawned(ENGINES[engine], http, str(_server_config(tmp_path, port, engine)), str(out)):
        _wait_ready([out])
        driver = _trainer(tmp_path, port, http, engine, *extra)
        driver.start()
        try:
            for version in range(2):
                delivered = driver.sync(model, version)  # with overlap: the previous version's
                assert delivered or (overlap and version == 0), f"version {version - overlap} not delivered"
                if version == 0:
                    _train_step(model, version)
            if overlap:
                assert driver.finish(model, 1), "the last version not delivered before finish returned"
        finally:
            driver.close()
        state = json.loads((out / "state.json").read_text())
    # every version was loaded under the one served name, from the directory its worker wrote, after the
    # engine recorded the version (the trainer's weight_version)
    loads = state["lora_loads"]
    assert [(x["lora_name"], x["lora_path"], x["weight_version"]) for x in loads] == [
        ("policy", str(tmp_path / "adapters" / f"step_{v}"), str(v)) for v in range(2)
    ], loads
    if engine == "vllm":  # in place: the name keeps its lora_int_id
        assert [(x["load_inplace"], x["lora_int_id"]) for x in loads] == [(True, 1), (True, 1)]
    served = load_file(str(out / "served_adapter.safetensors"))
    want = adapter_state(model)  # PEFT's save_pretrained names and tensors: what the trainer holds now
    assert sorted(served) == sorted(want)
    for name, tensor in want.items():
        assert served[name].dtype == tensor.dtype and torch.equal(served[name], tensor), name
    config = json.loads((out / "served_adapter_config.json").read_text())
    lora = model.peft_config["default"]
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", RANK, lora.lora_alpha)
    assert sorted(config["target_modules"]) == sorted(lora.target_modules)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_server_without_runtime_lora_fails_the_first_adapter_version_naming_the_flag(
    tmp_path: Path, engine: str
) -> None:
    port, http, out = free_port(), free_port(), tmp_path / "server"
    out.mkdir()
    extra = ["sglang.pause_mode=abort"] if engine == "sglang" else []
    no_lora = functools.partial(ENGINES[engine], lora=False)  # vLLM: no runtime LoRA routes; SGLang: no --enable-lora
    with spawned(no_lora, http, str(_server_config(tmp_path, port, engine)), str(out)):
        _wait_ready([out])
        driver = _trainer(tmp_path, port, http, engine, *extra)
        driver.start()
        try:
            with pytest.raises(Exception, match="--enable-lora") as failed:
                driver.sync(build_peft(), 0)
        finally:
            driver.close()
    assert f"http://127.0.0.1:{http}" in str(failed.value)
