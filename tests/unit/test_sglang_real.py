"""Against the REAL SGLang package (skipped without it; `./dev sglang-contract` runs it in .venv-sglang on
CPU, installed with --no-deps): the API snapshot equals what the installed source says; SGLang's own
code decodes our payload, resolves our loader by its import path and parses our launcher's flags; the
loader SGLang resolves receives a real version from a real sender, bitwise.

SGLang's GPU stack does not import here: Triton is replaced by SGLang's own stub (sglang/_platform_stubs.py,
what it installs on Apple Silicon); io_struct, the tensor-update path (model_runner_components/
weight_updater.py, tp_worker.py) and the HTTP server do not import (their imports reach torchvision's
compiled ops and SGLang's kernels), so the snapshot pins them from source instead."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import threading
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (./dev sglang-contract)", allow_module_level=True)

from lightning_weightsync.config import load_config, settings
from lightning_weightsync.demo.tiny_lm import build_model
from lightning_weightsync.rollout_engines.sglang import api, loader
from lightning_weightsync.rollout_engines.sglang.launch import serve_command
from lightning_weightsync.rollout_engines.worker import CONFIG_ENV
from lightning_weightsync.versions.sender import BlockingWeightSender
from tests.support.mp import free_port
from tests.support.sglang_api import extract
from tests.support.sglang_layers import install_triton_stub
from tests.support.transfer import engine_cfg
from tests.unit.test_vllm_weight_transfer import Flaky, _version

REPO = Path(__file__).resolve().parents[2]
ROOT = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])  # type: ignore[union-attr,index]


def _sglang() -> None:
    install_triton_stub()


def test_snapshot_matches_the_installed_sglang_source() -> None:
    snapshot = json.loads((REPO / "tests" / "data" / "sglang_api.json").read_text())
    version = importlib.metadata.version("sglang")
    assert {"sglang_version": version, **extract(ROOT)} == snapshot, (
        f"SGLang {version} differs from the snapshot of {snapshot['sglang_version']}: re-check rollout_engines/sglang, "
        "then regenerate tests/data/sglang_api.json (python -m tests.support.sglang_api <sglang dir> <version>)"
    )


def test_sglang_decodes_our_payload_and_resolves_our_loader() -> None:
    _sglang()
    from sglang.srt.utils.common import (
        MultiprocessingSerializer,
        dynamic_import,
        normalize_serialized_named_tensor_payloads,
    )

    payloads = normalize_serialized_named_tensor_payloads([api.EMPTY_NAMED_TENSORS] * 2)  # what the route does
    assert [MultiprocessingSerializer.deserialize(p) for p in payloads] == [[], []]  # each TP rank's list
    assert dynamic_import(api.LOADER) is loader.load_weights


def test_sglangs_parser_takes_our_launch_flags() -> None:
    _sglang()
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    cfg = load_config(overrides=["sglang.model=m", "sglang.serve_args=[--tp-size,2,--dp-size,1]"])
    argv, _ = serve_command(settings(cfg).sglang, "p", "sglang")
    args = parser.parse_args(argv[2:])  # after `sglang serve`
    assert args.model_path == "m" and args.custom_weight_loader == [api.LOADER]
    assert (args.tp_size, args.dp_size) == (2, 1)


def test_the_loader_sglang_resolves_receives_a_version_bitwise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _sglang()
    from sglang.srt.utils.common import MultiprocessingSerializer, dynamic_import

    cfg = engine_cfg(free_port(), bucket_size_mb=0.03125, trainer__min_receivers=1)
    path = tmp_path / "sync.yaml"
    path.write_text(OmegaConf.to_yaml(cfg))
    monkeypatch.setenv(CONFIG_ENV, str(path))
    model = Flaky(build_model().config)
    model.rollout_threads, model.load_threads = set(), set()
    sender = BlockingWeightSender(cfg)
    sender.start()
    custom_loader = dynamic_import(api.LOADER)
    named_tensors = MultiprocessingSerializer.deserialize(api.EMPTY_NAMED_TENSORS)
    try:
        thread = threading.Thread(target=custom_loader, args=(model, named_tensors))  # as weight_updater.py:376
        thread.start()
        stats = sender.send_weights(_version(3), version=3)
        thread.join(30)
        assert not thread.is_alive() and stats.receivers == 1
        for name, t in _version(3):
            assert torch.equal(model.state_dict()[name], t), name
    finally:
        sender.close()
        if loader._rank is not None:
            loader._rank.close()
            loader._rank = None


def test_what_does_not_import_on_cpu_is_said() -> None:
    """Listed, so a newer SGLang that imports here gets its real update path tested: then extend this file."""
    _sglang()
    missing = []
    for name in ("sglang.srt.managers.io_struct", "sglang.srt.model_executor.model_runner_components.weight_updater",
                 "sglang.srt.managers.tp_worker", "sglang.srt.entrypoints.http_server"):  # fmt: skip
        try:
            importlib.import_module(name)
        except Exception as exc:
            missing.append(f"{name}: {type(exc).__name__}: {str(exc)[:120]}")
    if missing:
        pytest.skip("not importable on CPU without SGLang's GPU dependencies: " + "; ".join(missing))
