"""The vLLM API we use cannot drift silently: the stand-ins the CPU tests run against have exactly
the signatures and routes of every supported vLLM release (0.33.0 and 0.34.0: tests/data/vllm_api-<version>.json,
taken from its source by tests/support/vllm_api.py); `./dev vllm-contract` re-derives the installed release's
JSON and runs our engine on vLLM's real base class (tests/unit/test_vllm_real.py)."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

from lightning_weightsync.errors import BackendUnavailable
from lightning_weightsync.rollout_engines.vllm.worker import WeightSyncEngineBody
from tests.support.vllm_api import routes_on_every_version, snapshot, supported_versions
from tests.support.vllm_standin import StandInServer, StandInWeightTransferEngine, StandInWorker
from tests.unit.test_vllm_fleet import FakeAsyncLLM

REPO = Path(__file__).resolve().parents[2]
VERSIONS = supported_versions()


def params(fn: object) -> list[str]:
    out = []
    for p in inspect.signature(fn).parameters.values():  # type: ignore[arg-type]
        out.append({p.VAR_POSITIONAL: f"*{p.name}", p.VAR_KEYWORD: f"**{p.name}"}.get(p.kind, p.name))
    return out


def methods(api: dict[str, Any], cls_name: str) -> dict[str, dict]:
    return {m["method"]: m for m in api["methods"] if m["class"] == cls_name}


def test_a_snapshot_for_each_supported_release() -> None:
    assert VERSIONS == ["0.33.0", "0.34.0"]  # a new release: its snapshot, the extra, ./dev's default, the docs
    for version in VERSIONS:
        assert snapshot(version)["vllm_version"] == version


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(
    ("ours", "theirs"),
    [(StandInWeightTransferEngine, "WeightTransferEngine"), (StandInWorker, "Worker"), (FakeAsyncLLM, "AsyncLLM")],
)
def test_stand_ins_have_vllms_signatures(ours: type, theirs: str, version: str) -> None:
    api = methods(snapshot(version), theirs)
    defined = [n for n, v in vars(ours).items() if inspect.isfunction(v) and not n.startswith("_")]
    if ours is StandInWeightTransferEngine:
        defined.append("__init__")  # our engine is constructed exactly as vLLM's factory does it
    assert defined, ours
    for name in defined:
        assert name in api, f"{ours.__name__}.{name}: vLLM's {theirs} has no such method (invented API)"
        assert params(getattr(ours, name)) == api[name]["params"], f"{ours.__name__}.{name}"
        assert inspect.iscoroutinefunction(getattr(ours, name)) == api[name]["async"], name


@pytest.mark.parametrize("version", VERSIONS)
def test_stand_in_server_has_vllms_routes_and_parameters(version: str) -> None:
    api = snapshot(version)
    routes = {r["path"]: (r["query"], r["body"]) for r in api["routes"]}
    assert {p: (q, b) for p, (q, b) in StandInServer.ROUTES.items()} == routes
    assert all(r["method"] == ("GET" if r["path"] == "/get_world_size" else "POST") for r in api["routes"])


@pytest.mark.parametrize("version", VERSIONS)
def test_our_engine_overrides_vllms_abstract_methods_with_their_signatures(version: str) -> None:
    api = methods(snapshot(version), "WeightTransferEngine")
    for name in ("init_transfer_engine", "start_weight_update", "finish_weight_update", "receive_weights", "shutdown"):
        assert params(getattr(WeightSyncEngineBody, name)) == api[name]["params"], name


def test_the_vllm_extra_covers_exactly_the_checked_releases() -> None:
    text = (REPO / "pyproject.toml").read_text()
    pin = re.search(r'^vllm = \["vllm>=([\d.]+),<([\d.]+)"\]', text, re.M)
    assert pin, "pyproject: the vllm extra must be a range"
    low, high = (tuple(int(x) for x in v.split(".")) for v in pin.groups())
    checked = [tuple(int(x) for x in v.split(".")) for v in VERSIONS]
    assert all(low <= v < high for v in checked)
    # the range starts at the oldest checked minor and ends after the newest: no minor in it goes unchecked
    assert low == checked[0][:2] and high == (checked[-1][0], checked[-1][1] + 1)
    assert {v[:2] for v in checked} == {(low[0], minor) for minor in range(low[1], high[1])}
    assert 'lightning_weightsync = "lightning_weightsync.rollout_engines.vllm.plugin:register"' in text
    # ./dev vllm-contract tests the newest supported release unless VLLM_VERSION says another
    assert f'VLLM_VERSION="${{VLLM_VERSION:-{VERSIONS[-1]}}}"' in (REPO / "dev").read_text()


def test_the_engine_module_without_vllm_names_the_extra() -> None:
    try:
        importlib.import_module("vllm.distributed.weight_transfer.base")
        pytest.skip("vLLM is installed here; ./dev vllm-contract tests the real engine")
    except ImportError:
        pass
    with pytest.raises(BackendUnavailable, match=r"lightning_weightsync\[vllm\]"):
        importlib.import_module("lightning_weightsync.rollout_engines.vllm.weight_transfer")


def test_adapter_versions_use_vllms_lora_route_with_its_body() -> None:
    """trainer.lora=adapter: POST /v1/load_lora_adapter (LoadLoRAAdapterRequest's fields as the body) with
    load_inplace, so the served name keeps its lora_int_id and serves the new directory."""
    from lightning_weightsync.rollout_engines.vllm.client import LOAD_LORA, HTTPRolloutClient

    routes = routes_on_every_version()
    assert routes[LOAD_LORA]["method"] == "POST" and routes[LOAD_LORA]["query"] == []
    assert {"lora_name", "lora_path", "load_inplace"} <= set(routes[LOAD_LORA]["body"])
    client = inspect.getsource(HTTPRolloutClient.load_adapter)
    assert '"load_inplace": True' in client and '"lora_path": adapter_path(' in client
