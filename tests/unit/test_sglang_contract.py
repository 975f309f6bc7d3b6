"""The SGLang API we use cannot drift silently: our client, loader, launcher and the stand-in server use
exactly what SGLang 0.5.23's source says (tests/data/sglang_api.json, read from its source by
tests/support/sglang_api.py); `./dev sglang-contract` re-derives the JSON from an installed SGLang and
runs what imports on CPU (tests/unit/test_sglang_real.py)."""

from __future__ import annotations

import base64
import inspect
import json
import pickletools
import re
from pathlib import Path

from lightning_weightsync.rollout_engines.sglang import api
from lightning_weightsync.rollout_engines.sglang.client import SGLangClient
from lightning_weightsync.rollout_engines.sglang.launch import DP_FLAGS, OWN_FLAGS
from lightning_weightsync.rollout_engines.sglang.loader import load_weights
from tests.support.sglang_standin import StandInSGLang

REPO = Path(__file__).resolve().parents[2]
API = json.loads((REPO / "tests" / "data" / "sglang_api.json").read_text())
SOURCE = {f"{Path(s['file']).stem}.{s['function']}": s["found"] for s in API["source"]}
FLAGS = {field: flags for fields in API["server_args"].values() for field, flags in fields.items()}


def test_every_route_we_call_is_sglangs_with_its_method() -> None:
    routes = {r["path"]: r["method"] for r in API["routes"]}
    ours = {api.PAUSE, api.RESUME, api.BEGIN, api.UPDATE, api.END, api.SET_VERSION, api.MODEL_INFO, api.SERVER_INFO,
            api.LOAD_LORA, api.UNLOAD_LORA}  # fmt: skip
    assert ours == set(routes)
    assert {p for p, m in routes.items() if m == "GET"} == {api.MODEL_INFO, api.SERVER_INFO}
    assert {p: (m, b) for p, (m, b) in StandInSGLang.ROUTES.items()} == {r["path"]: (r["method"], r["body"])
                                                                        for r in API["routes"]}  # fmt: skip
    assert "weight_version" in API["model_info_keys"]


def test_our_loader_has_the_signature_sglang_calls() -> None:
    """weight_updater.py: `if load_format in self.custom_weight_loaders: custom_loader(self.get_model(),
    named_tensors)`, the loader found by its dotted import path (utils/common.py dynamic_import)."""
    found = SOURCE["weight_updater.WeightUpdater.update_weights_from_tensor"]
    assert "custom_loader(self.get_model(), named_tensors)" in found
    assert "load_format in self.custom_weight_loaders" in found
    assert list(inspect.signature(load_weights).parameters) == ["model", "named_tensors"]
    assert f"{load_weights.__module__}.{load_weights.__name__}" == api.LOADER


def test_the_payload_is_one_empty_list_per_tp_rank_and_nothing_else() -> None:
    """SGLang unpickles `serialized_named_tensors[tp_rank]` on each rank (tp_worker.py): ours is the
    protocol-2 pickle of `[]`, read here opcode by opcode (never unpickled)."""
    assert SOURCE["tp_worker.deserialize_own_rank"] == [
        "MultiprocessingSerializer.deserialize(serialized_named_tensors[get_parallel().tp_rank])"
    ]
    ops = [op.name for op, _, _ in pickletools.genops(base64.b64decode(api.EMPTY_NAMED_TENSORS))]
    assert ops == ["PROTO", "EMPTY_LIST", "BINPUT", "STOP"]


def test_the_limits_we_check_are_sglangs() -> None:
    assert SOURCE["tokenizer_control_mixin.update_weights_from_tensor"] == ["get_parallel().dp_size == 1"]  # asserted
    # an update outside begin/end is refused (the session our client opens and always closes)
    assert SOURCE["weight_updater.update_weights_from_tensor"] == ["self._session is None"]
    assert set(DP_FLAGS) == set(FLAGS["dp_size"])
    assert {"--custom-weight-loader"} == set(FLAGS["custom_weight_loader"])
    assert set(OWN_FLAGS) == {"--custom-weight-loader", *FLAGS["model_path"]}


def test_the_sglang_extra_covers_the_checked_version() -> None:
    text = (REPO / "pyproject.toml").read_text()
    pin = re.search(r'^sglang = \["sglang>=([\d.]+),<([\d.]+)"\]', text, re.M)
    assert pin, "pyproject: the sglang extra must be a range"
    low, high = (tuple(int(x) for x in v.split(".")) for v in pin.groups())
    assert low <= tuple(int(x) for x in API["sglang_version"].split(".")) < high


def test_adapter_versions_use_sglangs_lora_routes_with_their_bodies() -> None:
    """trainer.lora=adapter: SGLang loads adapters by path only (no in-place option, a fresh lora_id each load),
    so the client unloads the served name and loads the new directory, sending only fields SGLang has; the
    unload waits for the requests using the adapter (tokenizer_control_mixin.py), hence pause_mode=abort."""
    bodies = API["bodies"]
    routes = {r["path"]: r["body"] for r in API["routes"]}
    assert set(bodies[routes[api.LOAD_LORA]]) == {"lora_name", "lora_path", "pinned", "lora_id"}
    assert set(bodies[routes[api.UNLOAD_LORA]]) == {"lora_name", "lora_id"}
    unload = SOURCE["tokenizer_control_mixin._unload_lora_adapter_locked"]
    assert "self.lora_registry.wait_for_unload(lora_id)" in unload
    client = inspect.getsource(SGLangClient.load_adapter)
    assert '{"lora_name": self.lora_name}' in client and '"lora_path": adapter_path(' in client
