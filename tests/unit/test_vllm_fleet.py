"""`RolloutFleet` over real HTTP (a recording server with vLLM's routes): the order of the calls, their
query and body parameters (checked against every supported release's tests/data/vllm_api-<version>.json), update_weights
running while the sender sends, failures named by URL, and resume always."""

from __future__ import annotations

import json
import re
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from lightning_weightsync.config import load_config, settings
from lightning_weightsync.errors import ConfigError, PeerError
from lightning_weightsync.protocol.messages import LoraSpec
from lightning_weightsync.rollout_engines.vllm.client import EngineRolloutClient, HTTPRolloutClient
from lightning_weightsync.rollout_engines.vllm.config import PauseMode
from lightning_weightsync.trainer.fleet import RolloutFleet
from tests.support.mp import free_port
from tests.support.vllm_api import routes_on_every_version

ROUTES = routes_on_every_version()  # what every supported vLLM release's routes declare


class Recorder:
    """An HTTP server answering vLLM's RL routes; records (path, query, body); can fail or block a route."""

    def __init__(
        self,
        fail: str | None = None,
        block_update: threading.Event | None = None,
        world_size: int | None = None,
        reports: list[dict[str, Any]] | None = None,
    ) -> None:
        self.calls: list[tuple[str, dict[str, str], dict[str, Any]]] = []
        self.reports = reports  # what /collective_rpc answers (each worker's weight_report); None: 404 (no dev mode)
        self.fail, self.block_update = fail, block_update
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # vLLM's RL route /get_world_size?include_dp=true
                url = urllib.parse.urlparse(self.path)
                recorder.calls.append((url.path, dict(urllib.parse.parse_qsl(url.query)), {}))
                code = 200 if url.path == "/get_world_size" and world_size is not None else 404
                payload = json.dumps({"world_size": world_size}).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_POST(self) -> None:
                url = urllib.parse.urlparse(self.path)
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else {}
                recorder.calls.append((url.path, dict(urllib.parse.parse_qsl(url.query)), body))
                if url.path == "/update_weights" and recorder.block_update is not None:
                    recorder.block_update.wait(10)
                code = 500 if url.path == recorder.fail else 200
                payload = b"Internal Server Error" if code == 500 else json.dumps({"success": True}).encode()
                if url.path == "/collective_rpc" and code == 200:
                    code = 404 if recorder.reports is None else 200
                    answer = {"results": recorder.reports} if code == 200 else {"detail": "Not Found"}
                    payload = json.dumps(answer).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def paths(self) -> list[str]:
        return [p for p, _, _ in self.calls]

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


def control(
    *recorders: Recorder,
    urls: list[str] | None = None,
    pause_mode: PauseMode = PauseMode.keep,
    reset_prefix_cache: bool = True,
    **kwargs: Any,
) -> RolloutFleet:
    clients = [
        HTTPRolloutClient(u, 10, pause_mode=pause_mode, reset_prefix_cache=reset_prefix_cache)
        for u in (urls or [r.url for r in recorders])
    ]
    return RolloutFleet(clients, timeout_s=10, receive_timeout_s=30, **kwargs)


FULL = ["/pause", "/start_weight_update", "/update_weights", "/finish_weight_update", "/reset_prefix_cache",
        "/collective_rpc", "/resume"]  # fmt: skip


def test_one_version_calls_vllm_routes_in_order_with_their_real_parameters(servers) -> None:
    a, b = servers(block_update=threading.Event()), servers()
    ctl = control(a, b, pause_mode=PauseMode.keep)

    def send() -> str:
        # update_weights is in flight on both rollouts while we send (a's handler waits for us)
        assert "/update_weights" in a.paths() or _eventually(lambda: "/update_weights" in a.paths())
        a.block_update.set()
        return "stats"

    assert ctl.run_version(7, send) == "stats"
    for r in (a, b):
        assert r.paths() == FULL
        calls = {p: (q, body) for p, q, body in r.calls}
        assert calls["/pause"][0] == {"mode": "keep"}
        assert calls["/update_weights"][1] == {"update_info": {"version": 7, "timeout_s": 30.0}}
        assert calls["/finish_weight_update"][1] == {"weight_version": "7"}  # vLLM's weight_version is a str
        # kept requests hold their KV blocks: vLLM resets only if they are preempted and re-prefilled
        assert calls["/reset_prefix_cache"][0] == {"reset_running_requests": "true"}
        for path, query, body in r.calls:  # only parameters every supported vLLM's routes declare
            assert set(query) <= set(ROUTES[path]["query"]) and set(body) <= set(ROUTES[path]["body"]), path
    assert ctl.last_timings is not None and ctl.last_timings.paused_s >= ctl.last_timings.update_s
    ctl.close()


def _eventually(pred: Any, timeout_s: float = 5) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False


def test_verify_asks_every_worker_over_http_and_names_one_that_holds_another_version(servers, caplog) -> None:
    def worker(i: int, version: int, incomplete: bool = False) -> dict[str, Any]:
        return {"identity": f"host-1-w{i}", "version": version, "incomplete": incomplete, "checksums": {}}

    whole = servers(reports=[worker(0, 7), worker(1, 7)])
    ctl = control(whole)
    assert ctl.run_version(7, lambda: "stats") == "stats"
    rpc = [body for path, _, body in whole.calls if path == "/collective_rpc"]
    assert rpc == [{"method": "lightning_weightsync_weight_report"}]  # the worker extension's method, by name
    # the trainer's fingerprints against what every worker verified on arrival, over HTTP too
    whole.reports = [{**r, "checksums": {"w": "00ff"}} for r in whole.reports]
    assert ctl.check_weights(7, {"w": "00ff"}) == []
    problems = ctl.check_weights(7, {"w": "1234"})
    assert len(problems) == 2 and all("does not match" in p and "'w'" in p for p in problems), problems
    ctl.close()
    for reports in ([worker(0, 7), worker(1, 6)], [worker(0, 7), worker(1, 7, incomplete=True)]):
        torn = servers(reports=reports)
        ctl = control(torn)
        with pytest.raises(PeerError, match="host-1-w1 holds version") as err:
            ctl.run_version(7, lambda: "stats")
        assert torn.url in str(err.value) and torn.paths()[-1] == "/resume"
        ctl.close()
    # a server without the route (or without our extension) is judged by its finish call, and says so once
    bare = servers()
    ctl = control(bare)
    with caplog.at_level("WARNING"):
        ctl.run_version(7, lambda: "stats")
        ctl.run_version(8, lambda: "stats")
        assert ctl.check_weights(8, {"w": "00ff"}) == []  # nothing to compare with: skipped, not failed
    said = [r.message for r in caplog.records if "cannot ask its workers" in r.message]
    assert len(said) == 2 and all("--worker-extension-cls" in m for m in said), said
    ctl.close()


def test_a_failed_update_is_named_by_url_others_finish_and_everyone_resumes(servers) -> None:
    good, bad = servers(), servers(fail="/update_weights")
    ctl = control(good, bad)
    with pytest.raises(PeerError, match=rf"version 3: vLLM rollout {bad.url}: POST /update_weights failed: HTTP 500"):
        ctl.run_version(3, lambda: None)
    assert good.paths() == ["/pause", "/start_weight_update", "/update_weights", "/finish_weight_update", "/resume"]
    # vLLM's worker already ended the failed session: finishing it would fail again
    assert bad.paths() == ["/pause", "/start_weight_update", "/update_weights", "/resume"]


def test_an_unreachable_rollout_means_nothing_is_sent_and_the_others_resume(servers) -> None:
    good = servers()
    dead = f"http://127.0.0.1:{free_port()}"
    ctl = control(urls=[good.url, dead])
    sent = []
    with pytest.raises(PeerError, match=rf"not sent: vLLM rollout {dead}: POST /pause: cannot reach the server"):
        ctl.run_version(1, lambda: sent.append(1))
    assert not sent and good.paths() == ["/pause", "/resume"]


def test_a_rollout_whose_start_failed_leaves_the_others_finished_and_resumed(servers) -> None:
    """Issue 25 item 8: when one rollout could not start its update window, the sessions the others had
    opened were never closed (a planted bug passed the suite); vLLM then refuses their next start."""
    good, bad = servers(), servers(fail="/start_weight_update")
    ctl = control(good, bad)
    sent = []
    with pytest.raises(PeerError, match=rf"version 4 not sent: vLLM rollout {bad.url}: POST /start_weight_update"):
        ctl.run_version(4, lambda: sent.append(1))
    assert not sent
    assert good.paths() == ["/pause", "/start_weight_update", "/finish_weight_update", "/resume"]
    assert bad.paths() == ["/pause", "/start_weight_update", "/resume"]  # no session there to finish


def test_a_failed_send_still_resumes_every_rollout(servers) -> None:
    a = servers()
    ctl = control(a, reset_prefix_cache=False)

    def send() -> None:
        raise RuntimeError("broadcast failed")

    with pytest.raises(RuntimeError, match="broadcast failed"):
        ctl.run_version(2, send)
    assert a.paths()[0] == "/pause" and a.paths()[-1] == "/resume"
    # this server's update call returned, so its session is closed, but without the failed version
    assert [body for p, _, body in a.calls if p == "/finish_weight_update"] == [{}]


def test_from_config_builds_one_client_per_url() -> None:
    cfg = load_config(overrides=["vllm.urls=[http://a:8000,http://b:8000/]", "vllm.pause_mode=abort"])
    ctl = RolloutFleet.from_config(settings(cfg))
    assert ctl is not None and [c.name for c in ctl.clients] == ["http://a:8000", "http://b:8000"]
    assert all(c.pause_mode is PauseMode.abort for c in ctl.clients)  # type: ignore[attr-defined]
    assert ctl.receive_timeout_s == cfg.transport.timeout_s
    assert RolloutFleet.from_config(settings(load_config())) is None
    with pytest.raises(ConfigError, match=r"vllm\.urls.*not an http"):
        load_config(overrides=["vllm.urls=[rollout-0:8000]"])


class FakeAsyncLLM:
    """STAND-IN for `AsyncLLM`'s weight-update methods (coroutines, names and parameters as in vLLM 0.33.0 and
    0.34.0, vllm/v1/engine/async_llm.py, lines cited per method as 0.33.0 / 0.34.0; test_vllm_contract checks
    them against every snapshot)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    # async_llm.py:989 / 1003
    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        self.calls.append(("pause_generation", mode))

    # async_llm.py:1026 / 1040
    async def resume_generation(self) -> None:
        self.calls.append(("resume_generation", None))

    # async_llm.py:1413 / 1436
    async def start_weight_update(self) -> None:
        self.calls.append(("start_weight_update", None))

    # async_llm.py:1421 / 1444
    async def update_weights(self, request: Any) -> None:
        self.calls.append(("update_weights", request.update_info))

    # async_llm.py:1432 / 1455
    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish_weight_update", weight_version))

    # async_llm.py:1188 / 1202
    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.calls.append(("reset_prefix_cache", reset_running_requests))
        return True


def test_in_process_async_engine_is_driven_through_its_methods() -> None:
    engine = FakeAsyncLLM()
    ctl = RolloutFleet([EngineRolloutClient(engine, pause_mode=PauseMode.wait)])
    ctl.run_version(5, lambda: None)
    assert engine.calls == [
        ("pause_generation", "wait"),
        ("start_weight_update", None),
        ("update_weights", {"version": 5}),
        ("finish_weight_update", "5"),
        ("reset_prefix_cache", False),  # pause_mode=wait: nothing runs, a plain reset
        ("resume_generation", None),
    ]


def test_min_receivers_below_the_servers_workers_stops_before_anything_is_paused(servers) -> None:
    """Each vLLM worker receives: with fewer receivers required than workers exist, a late worker is
    left out and its server holds tensor-parallel shards of two versions. Checked against what the
    servers report (vLLM's /get_world_size with DP), before the first version, naming the number to set."""
    a, b = servers(world_size=4), servers(world_size=8)  # TP2 x PP2; TP2 x PP2 x DP2
    ctl = control(a, b, min_receivers=4)
    with pytest.raises(ConfigError, match=r"trainer\.min_receivers=4.* run 12 workers.*set trainer\.min_receivers=12"):
        ctl.run_version(1, lambda: None)
    assert a.paths() == ["/get_world_size"] and b.paths() == ["/get_world_size"]  # nothing paused, nothing sent
    assert a.calls[0][1] == {"include_dp": "true"}
    ctl.close()
    ok = control(a, b, min_receivers=12)
    ok.run_version(1, lambda: None)
    ok.run_version(2, lambda: None)
    assert a.paths().count("/get_world_size") == 2 and a.paths()[-1] == "/resume"  # asked once per control
    ok.close()


def test_a_server_that_does_not_say_is_not_guessed(servers) -> None:
    a = servers()  # no /get_world_size (an older vLLM, or dev routes off): a warning, the version runs
    ctl = control(a, min_receivers=1)
    ctl.run_version(1, lambda: None)
    assert a.paths()[-1] == "/resume"
    ctl.close()


def test_after_a_failed_send_the_servers_updates_are_awaited_together_not_in_turn(servers) -> None:
    """A failed send leaves every server's update_weights hanging until its worker gives up; the
    trainer waits for all of them within one vllm.request_timeout_s, not that bound once per server."""
    import time

    never = threading.Event()
    rollouts = [servers(block_update=never) for _ in range(3)]
    ctl = RolloutFleet([HTTPRolloutClient(r.url, 10) for r in rollouts], timeout_s=1.5, receive_timeout_s=30)

    def send() -> None:
        raise PeerError("the send failed (injected)")

    t0 = time.monotonic()
    with pytest.raises(PeerError, match="injected"):
        ctl.run_version(1, send)
    elapsed = time.monotonic() - t0
    never.set()
    ctl.close()
    assert elapsed < 3.0, f"waited {elapsed:.1f}s: the 1.5 s bound was applied per server (3 servers)"


def test_a_transfer_longer_than_the_request_timeout_is_not_cut_off(servers) -> None:
    """/update_weights answers when the version is in: the request lasts the whole transfer, which
    vllm.request_timeout_s (a bound on each control call) must not cap."""
    import time

    a = servers(block_update=threading.Event())
    ctl = RolloutFleet([HTTPRolloutClient(a.url, 1.0)], timeout_s=1.0, receive_timeout_s=30)

    def send() -> str:
        time.sleep(2.0)  # a transfer twice as long as the request timeout
        a.block_update.set()
        return "sent"

    assert ctl.run_version(1, send) == "sent"
    assert a.paths()[-1] == "/resume"
    ctl.close()


def _spec(mode: str = "adapter", base: bool = False) -> LoraSpec:
    return LoraSpec(mode=mode, base=base, r=16, lora_alpha=32.0, target_modules=["q_proj", "v_proj"])


def _lora_control(*recorders: Recorder, lora_dir: str | None = "/srv/adapters/") -> RolloutFleet:
    clients = [HTTPRolloutClient(r.url, 10, lora_name="policy", lora_dir=lora_dir) for r in recorders]
    return RolloutFleet(clients, timeout_s=10, receive_timeout_s=30)


def test_an_adapter_version_is_loaded_in_place_after_the_finish_and_a_merged_one_is_not(servers) -> None:
    """trainer.lora=adapter: after /finish_weight_update (the model whole again, the version recorded), the
    directory worker 0 wrote is loaded under the served name with load_inplace, before the prefix cache is
    reset (the name keeps its lora_int_id, so cached blocks of the old adapter would match) and resume.
    trainer.lora=merged: plain weights, the ordinary session only."""
    adapter, merged = servers(), servers()
    _lora_control(adapter).run_version(7, lambda: None, lora=_spec("adapter"))
    _lora_control(merged).run_version(7, lambda: None, lora=_spec("merged"))
    want = [*FULL[:4], "/v1/load_lora_adapter", *FULL[4:]]
    assert adapter.paths() == want and merged.paths() == FULL
    body = next(b for p, _, b in adapter.calls if p == "/v1/load_lora_adapter")
    assert body == {"lora_name": "policy", "lora_path": "/srv/adapters/step_7", "load_inplace": True}
    assert set(body) <= set(ROUTES["/v1/load_lora_adapter"]["body"])


@pytest.mark.parametrize(
    ("spec", "lora_dir", "knob"),
    [(_spec(base=True), "/srv/adapters", "trainer.lora_base=rollout_has"), (_spec(), None, "vllm.lora_dir")],
)
def test_an_adapter_version_the_rollouts_cannot_serve_is_refused_before_anything_is_paused(
    servers, spec: LoraSpec, lora_dir: str | None, knob: str
) -> None:
    r = servers()
    sent = []
    with pytest.raises(PeerError, match=re.escape(knob)):
        _lora_control(r, lora_dir=lora_dir).run_version(3, lambda: sent.append(1), lora=spec)
    assert sent == [] and r.paths() == []  # the caller drains its stream; nothing was paused


def test_an_in_process_engine_is_refused_adapter_versions_naming_merged() -> None:
    ctl = RolloutFleet([EngineRolloutClient(FakeAsyncLLM())], timeout_s=10)
    with pytest.raises(PeerError, match=r"trainer\.lora=merged"):
        ctl.run_version(0, lambda: None, lora=_spec())
    ctl.close()
