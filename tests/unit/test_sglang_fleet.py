"""The SGLang client over real HTTP (a recording server answering SGLang 0.5.23's routes): the order
of the calls and their bodies (checked against tests/data/sglang_api.json), dp_size refused before
anything is paused, a failed update or send closing the session SGLang leaves open, and the version
checked against the weight_version SGLang reports."""

from __future__ import annotations

import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from lightning_weightsync.config import load_config, settings
from lightning_weightsync.errors import ConfigError, PeerError
from lightning_weightsync.rollout_engines.sglang import api
from lightning_weightsync.rollout_engines.sglang.client import SGLangClient
from lightning_weightsync.rollout_engines.sglang.config import SGLangPauseMode
from lightning_weightsync.trainer.fleet import RolloutFleet

SNAPSHOT = json.loads((Path(__file__).resolve().parents[1] / "data" / "sglang_api.json").read_text())
ROUTES = {r["path"]: r for r in SNAPSHOT["routes"]}


class Recorder:
    """Answers SGLang's routes like a healthy server (weight_version follows the update call); records
    (path, body); `fail` answers that route 400 with SGLang's {"success": false} body."""

    def __init__(self, *, dp_size: int = 1, tp_size: int = 2, fail: str | None = None, stale: bool = False) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.weight_version: str | None = None
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self, method: str) -> None:
                path = urllib.parse.urlparse(self.path).path
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else {}
                recorder.calls.append((path, body))
                code, answer = 200, {"success": True, "message": "Success"}
                if path == api.SERVER_INFO:
                    answer = {"tp_size": tp_size, "pp_size": 1, "dp_size": dp_size}
                elif path == api.MODEL_INFO:
                    answer = {"weight_version": recorder.weight_version}
                elif path == api.UPDATE and path != fail and not stale:
                    recorder.weight_version = body.get("weight_version")
                elif path == api.SET_VERSION:
                    recorder.weight_version = body["new_version"]
                if path == fail:
                    code, answer = 400, {"success": False, "message": "Failed (injected)"}
                payload = json.dumps(answer).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self) -> None:
                self._serve("GET")

            def do_POST(self) -> None:
                self._serve("POST")

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def paths(self) -> list[str]:
        return [p for p, _ in self.calls]

    def body(self, path: str) -> dict[str, Any]:
        return next(b for p, b in self.calls if p == path)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers():
    made: list[Recorder] = []

    def make(**kwargs: Any) -> Recorder:
        made.append(Recorder(**kwargs))
        return made[-1]

    yield make
    for r in made:
        r.close()


def control(*recorders: Recorder, pause_mode: SGLangPauseMode = SGLangPauseMode.retract, **kw: Any) -> RolloutFleet:
    clients = [SGLangClient(r.url, 10, pause_mode=pause_mode) for r in recorders]
    return RolloutFleet(clients, timeout_s=10, receive_timeout_s=30, **kw)


FULL = [api.SERVER_INFO, api.PAUSE, api.BEGIN, api.UPDATE, api.END, api.MODEL_INFO, api.RESUME]


def test_one_version_calls_sglangs_routes_in_order_with_their_real_bodies(servers) -> None:
    a = servers(tp_size=2)
    ctl = control(a, min_receivers=2)
    assert ctl.run_version(7, lambda: "stats") == "stats"
    assert a.paths() == FULL
    assert a.body(api.PAUSE) == {"mode": "retract"}
    assert a.body(api.UPDATE) == {
        "serialized_named_tensors": [api.EMPTY_NAMED_TENSORS] * 2,  # one per TP rank: SGLang indexes by tp_rank
        "load_format": api.LOADER,
        "flush_cache": True,
        "weight_version": "7",
    }
    for path, body in a.calls:  # only routes and body fields SGLang 0.5.23 declares
        route = ROUTES[path]
        assert route["method"] == ("GET" if path in (api.SERVER_INFO, api.MODEL_INFO) else "POST"), path
        assert set(body) <= set(SNAPSHOT["bodies"].get(route["body"] or "", {})), path
    ctl.close()


def test_in_place_pause_never_asks_for_a_flush(servers) -> None:
    a = servers()
    ctl = control(a, pause_mode=SGLangPauseMode.in_place)
    ctl.run_version(1, lambda: None)
    assert a.body(api.PAUSE) == {"mode": "in_place"} and a.body(api.UPDATE)["flush_cache"] is False
    literal = SNAPSHOT["bodies"]["PauseGenerationReqInput"]["mode"]["type"]
    assert all(f"'{m.value}'" in literal for m in SGLangPauseMode)  # our modes are SGLang's Literal
    ctl.close()


def test_dp_size_above_one_is_refused_before_anything_is_paused(servers) -> None:
    a = servers(dp_size=2)
    ctl = control(a, min_receivers=2)
    with pytest.raises(ConfigError, match=r"dp_size=2.*dp_size 1.*sglang\.urls"):
        ctl.run_version(1, lambda: None)
    assert a.paths() == [api.SERVER_INFO]
    ctl.close()


def test_a_failed_update_closes_the_session_sglang_leaves_open(servers) -> None:
    """SGLang keeps a session open after a failed update (scheduler weight_updater.py:232-262), and the
    next /begin_weight_update would then fail: the client ends it."""
    good, bad = servers(), servers(fail=api.UPDATE)
    ctl = control(good, bad)
    with pytest.raises(PeerError, match=rf"version 3: SGLang rollout {bad.url}: POST {api.UPDATE} failed: HTTP 400"):
        ctl.run_version(3, lambda: None)
    # (no trainer.min_receivers here: the TP size is asked when the session opens)
    assert bad.paths() == [api.PAUSE, api.SERVER_INFO, api.BEGIN, api.UPDATE, api.END, api.RESUME]
    assert good.paths() == [api.PAUSE, api.SERVER_INFO, api.BEGIN, api.UPDATE, api.END, api.RESUME]
    ctl.close()


def test_a_failed_send_closes_the_session_and_marks_the_version_incomplete(servers) -> None:
    """Our loader cannot fail SGLang's update call (that would end the server), so SGLang answers success
    and records the version: after the trainer's send failed, the client closes the session and says
    the weights are not that version."""
    a = servers()
    ctl = control(a)

    def send() -> None:
        raise PeerError("a receiver nacked (injected)")

    with pytest.raises(PeerError, match="injected"):
        ctl.run_version(5, send)
    assert a.paths() == [api.PAUSE, api.SERVER_INFO, api.BEGIN, api.UPDATE, api.END, api.SET_VERSION, api.RESUME]
    assert a.body(api.SET_VERSION) == {"new_version": "5-incomplete", "abort_all_requests": False}
    assert a.weight_version == "5-incomplete"
    ctl.close()


def test_a_server_that_does_not_report_the_version_fails_it(servers) -> None:
    a = servers(stale=True)  # answers the update but keeps its old weight_version
    ctl = control(a)
    with pytest.raises(PeerError, match=r"reports weight_version None after version 2"):
        ctl.run_version(2, lambda: None)
    assert a.paths()[-1] == api.RESUME
    ctl.close()


def test_from_config_builds_clients_of_both_engines() -> None:
    cfg = load_config(overrides=[
        "sglang.urls=[http://s:30000/]", "vllm.urls=[http://v:8000]", "sglang.request_timeout_s=900",
        "sglang.pause_mode=abort",
    ])  # fmt: skip
    ctl = RolloutFleet.from_config(settings(cfg))
    assert ctl is not None
    assert [(c.engine, c.name) for c in ctl.clients] == [("vLLM", "http://v:8000"), ("SGLang", "http://s:30000")]
    assert ctl.timeout_s == 900 and ctl.clients[1].pause_mode is SGLangPauseMode.abort  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match=r"sglang\.urls.*not an http"):
        load_config(overrides=["sglang.urls=[s:30000]"])
    with pytest.raises(ConfigError, match=r"sglang\.pause_mode"):
        load_config(overrides=["sglang.pause_mode=keep"])


@pytest.mark.parametrize("mode", [SGLangPauseMode.retract, SGLangPauseMode.in_place])
def test_adapter_versions_need_the_abort_pause_mode(mode: SGLangPauseMode) -> None:
    """SGLang's unload of the served adapter waits for every request using it (api.py): a request kept by a
    retract / in_place pause never finishes before resume, so the swap would hang until the request timeout."""
    client = SGLangClient("http://127.0.0.1:1", 5, pause_mode=mode, lora_dir="/srv/adapters")
    with pytest.raises(ConfigError, match=r"sglang\.pause_mode=abort"):
        client.check_adapter()
    SGLangClient("http://127.0.0.1:1", 5, pause_mode=SGLangPauseMode.abort, lora_dir="/srv/adapters").check_adapter()
    with pytest.raises(ConfigError, match=r"sglang\.lora_dir"):
        SGLangClient("http://127.0.0.1:1", 5, pause_mode=SGLangPauseMode.abort).check_adapter()
