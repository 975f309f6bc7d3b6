"""vLLM rollouts end to end on CPU: a 2-process Lightning trainer drives two STAND-IN `vllm serve`
processes (tests/support/vllm_standin.py: vLLM's real routes and engine base, checked against
tests/data/vllm_api-<version>.json) that each run OUR engine body. Generation keeps running between versions,
is paused only around each transfer, the final weights equal the trainer's bitwise, and the version
number reaches vLLM's `weight_version`."""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("lightning.pytorch")

from tests.support.mp import PYTHON, free_port, output_of, popen, spawned
from tests.support.vllm_standin import standin_server_main

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "tiny_lm_cpu.yaml"
RUN_TIMEOUT_S = 150
PER_VERSION = ["/pause", "/start_weight_update", "/update_weights", "/finish_weight_update", "/reset_prefix_cache",
               "/collective_rpc",
               "/resume"]  # fmt: skip


def _rollout_config(tmp: Path, port: int) -> Path:
    path = tmp / "rollout.yaml"
    path.write_text(
        f"transport:\n  port: {port}\n  timeout_s: 60\n  heartbeat_interval_s: 0.2\n  bucket_size_mb: 0.03125\n"
    )
    return path


def _wait_ready(dirs: list[Path], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not all((d / "ready").exists() for d in dirs):
        assert time.monotonic() < deadline, "stand-in vLLM servers did not start"
        time.sleep(0.1)


def _train(tmp: Path, *extra: str) -> str:
    cmd = [PYTHON, "-m", "lightning_weightsync.demo.tiny_lm", "--config", str(RECIPE),
           "transport.timeout_s=60", f"recipe.output_dir={tmp / 'runs'}", *extra]  # fmt: skip
    with popen(cmd, cwd=str(tmp)) as proc:
        out = output_of(proc, RUN_TIMEOUT_S, "training")
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.mark.slow
def test_trainer_drives_two_vllm_rollouts_that_generate_between_versions(tmp_path: Path) -> None:
    port, steps = free_port(), 3
    http = [free_port(), free_port()]
    dirs = [tmp_path / "r0", tmp_path / "r1"]
    for d in dirs:
        d.mkdir()
    cfg = _rollout_config(tmp_path, port)
    with spawned(standin_server_main, http[0], str(cfg), str(dirs[0])), \
         spawned(standin_server_main, http[1], str(cfg), str(dirs[1])):  # fmt: skip
        _wait_ready(dirs)
        urls = ",".join(f"http://127.0.0.1:{p}" for p in http)
        out = _train(
            tmp_path, f"transport.port={port}", f"vllm.urls=[{urls}]", "trainer.min_receivers=2",
            f"recipe.steps={steps}", "recipe.strategy=ddp", f"recipe.save_final={tmp_path / 'final.safetensors'}",
        )  # fmt: skip
    # pause_mode=keep (the default): the kept requests' KV is dropped with the cache, not left stale
    assert "prefix cache was not reset" not in out, out[-3000:]
    final = load_file(str(tmp_path / "final.safetensors"))
    rows = list(csv.DictReader(next((tmp_path / "runs").rglob("metrics.csv")).open()))
    send_s = sum(float(r["weightsync/seconds"]) for r in rows if r.get("weightsync/seconds"))
    identities = set()
    for d in dirs:
        state = json.loads((d / "state.json").read_text())
        # vLLM's weight_version is the trainer's step; our engine holds that version, whole
        assert state["weight_version"] == str(steps) and state["engine_version"] == steps
        identities.add(state["identity"])
        # every version went through the whole session, in order, and generation was resumed
        assert state["calls"] == PER_VERSION * (steps + 1)
        # generation ran between versions: steps were taken on every version's weights
        assert all(state["steps_by_version"].get(str(v), 0) > 0 for v in range(steps)), state["steps_by_version"]
        received = load_file(str(d / "received.safetensors"))
        assert sorted(received) == sorted(final)
        for name, t in final.items():
            assert received[name].dtype == t.dtype and torch.equal(received[name], t), name
        # how much of the training window (first /pause .. last /resume) generation was paused
        fraction = state["paused_s"] / state["window_s"]
        print(
            f"{d.name}: paused {state['paused_s']:.2f}s over {steps + 1} versions, {fraction:.1%} of the "
            f"{state['window_s']:.1f}s training window (the sends themselves: {send_s:.2f}s); "
            f"{state['steps']} generation steps"
        )
        assert 0 < fraction < 1
    assert len(identities) == 2 and all(i.endswith("-w0") for i in identities)  # unique per server


@pytest.mark.slow
def test_an_unreachable_rollout_fails_the_version_by_url_and_the_other_is_resumed(tmp_path: Path) -> None:
    port, dead = free_port(), free_port()
    live_dir = tmp_path / "r0"
    live_dir.mkdir()
    live = free_port()
    with spawned(standin_server_main, live, str(_rollout_config(tmp_path, port)), str(live_dir)):
        _wait_ready([live_dir])
        out = _train(
            tmp_path, f"transport.port={port}", f"vllm.urls=[http://127.0.0.1:{live},http://127.0.0.1:{dead}]",
            "trainer.min_receivers=1", "trainer.on_failure=warn", "recipe.steps=1", "recipe.strategy=ddp",
            "vllm.request_timeout_s=5",
        )  # fmt: skip
    assert f"http://127.0.0.1:{dead}" in out and "cannot reach the server" in out
    assert "2 failed syncs" in out  # versions 0 and 1, skipped (trainer.on_failure=warn); training went on
    # nothing was sent; the live rollout was paused and resumed again for each attempted version
    state = json.loads((live_dir / "state.json").read_text())
    assert state["calls"] == ["/pause", "/resume"] * 2 and state["weight_version"] is None
