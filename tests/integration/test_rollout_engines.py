"""Two rollout engines driven by one trainer: a 2-process Lightning trainer drives two STAND-IN SGLang
servers (tests/support/sglang_standin.py: SGLang's routes and loader hook as tests/data/sglang_api.json
pins them, running OUR loader) and two STAND-IN vLLM servers (running OUR engine body) in one run.
Generation runs between versions on every server, every server ends bitwise equal to the trainer, and
the version reaches each engine's weight_version."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("lightning.pytorch")

from tests.integration.test_vllm import PER_VERSION, _rollout_config, _train, _wait_ready
from tests.support.mp import free_port, spawned
from tests.support.sglang_standin import standin_sglang_main
from tests.support.vllm_standin import standin_server_main

SGLANG_PER_VERSION = ["/server_info", "/pause_generation", "/begin_weight_update", "/update_weights_from_tensor",
                      "/end_weight_update", "/model_info", "/continue_generation"]  # fmt: skip


@pytest.mark.slow
def test_one_trainer_drives_two_sglang_and_two_vllm_rollouts(tmp_path: Path) -> None:
    port, steps = free_port(), 2
    http = [free_port() for _ in range(4)]
    dirs = [tmp_path / f"r{i}" for i in range(4)]
    for d in dirs:
        d.mkdir()
    cfg = str(_rollout_config(tmp_path, port))
    with spawned(standin_sglang_main, http[0], cfg, str(dirs[0])), \
         spawned(standin_sglang_main, http[1], cfg, str(dirs[1])), \
         spawned(standin_server_main, http[2], cfg, str(dirs[2])), \
         spawned(standin_server_main, http[3], cfg, str(dirs[3])):  # fmt: skip
        _wait_ready(dirs)
        sglang = ",".join(f"http://127.0.0.1:{p}" for p in http[:2])
        vllm = ",".join(f"http://127.0.0.1:{p}" for p in http[2:])
        out = _train(
            tmp_path, f"transport.port={port}", f"sglang.urls=[{sglang}]", f"vllm.urls=[{vllm}]",
            "trainer.min_receivers=4", f"recipe.steps={steps}", "recipe.strategy=ddp",
            f"recipe.save_final={tmp_path / 'final.safetensors'}",
        )  # fmt: skip
    final = load_file(str(tmp_path / "final.safetensors"))
    problems = []
    for i, d in enumerate(dirs):
        state = json.loads((d / "state.json").read_text())
        if state["weight_version"] != str(steps):
            problems.append(f"{d.name}: weight_version {state['weight_version']!r}, not {steps!r}")
        if i < 2:  # SGLang: the session per version, dp/tp asked once before the first (by min_receivers)
            want = SGLANG_PER_VERSION[:1] + SGLANG_PER_VERSION[1:] * (steps + 1)
            if state["calls"] != want or state["loader_version"] != steps:
                problems.append(f"{d.name}: calls {state['calls']} loader version {state['loader_version']}")
        elif state["calls"] != PER_VERSION * (steps + 1):
            problems.append(f"{d.name}: calls {state['calls']}")
        if not all(state["steps_by_version"].get(str(v), 0) > 0 for v in range(steps)):
            problems.append(f"{d.name}: no generation on some version: {state['steps_by_version']}")
        received = load_file(str(d / "received.safetensors"))
        if sorted(received) != sorted(final):
            problems.append(f"{d.name}: names differ")
        for name, t in final.items():
            if name in received and not (received[name].dtype == t.dtype and torch.equal(received[name], t)):
                problems.append(f"{d.name}: {name} differs")
    assert not problems, "\n".join(problems) + "\n" + out[-3000:]
