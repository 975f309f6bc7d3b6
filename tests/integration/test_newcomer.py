"""Issue 12, "the newcomer path", end to end with real third-party code: a tiny random-init Hugging
Face `Qwen3ForCausalLM` with tied embeddings (`lm_head.weight` is `model.embed_tokens.weight`), held
by the usual LightningModule as `self.model`, trained on 2 CPU processes with Lightning's
`ModelParallelStrategy` (FSDP2 over gloo) and the README's one-liner `WeightSyncCallback(cfg)`, into
two real `lightning-weightsync rollout` daemons: a module sink building the same class, and a
safetensors sink writing checkpoint directories from a template. Both end on the trainer's final
weights bitwise, the module sink's tie holds, the checkpoint loads with `from_pretrained` as is, and
all of them give the trainer's logits exactly."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("lightning.pytorch")

from safetensors.torch import load_file, load_model

from tests.support.hf_tied import build_qwen3, logits, qwen3_config
from tests.support.mp import PYTHON, free_port, popen

REPO = Path(__file__).resolve().parents[2]
CONSOLE_SCRIPT = Path(sys.executable).with_name("lightning-weightsync")
ENV = {"PYTHONPATH": str(REPO)}
STEPS = 2
RUN_TIMEOUT_S = 150

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def transport(port: int) -> list[str]:
    return [
        f"transport.port={port}",
        "transport.bucket_size_mb=0.0078125",  # 8 KiB: the 16 KiB embedding goes in chunks
        "transport.timeout_s=60",
        "transport.heartbeat_interval_s=0.2",
    ]


@contextlib.contextmanager
def daemon(
    tmp: Path, name: str, port: int, *overrides: str, flags: tuple[str, ...] = ()
) -> Iterator[subprocess.Popen[str]]:
    log = tmp / f"{name}.log"
    cmd = [
        str(CONSOLE_SCRIPT), "rollout", "--stats-jsonl", str(tmp / f"{name}.jsonl"), *flags,
        *transport(port), "rollout.progress=false", f"rollout.identity={name}", *overrides,
    ]  # fmt: skip
    with open(log, "w") as out, popen(cmd, env=ENV, cwd=REPO, stdout=out, stderr=subprocess.STDOUT) as proc:
        proc.log = log  # type: ignore[attr-defined]
        yield proc


def stop(proc: subprocess.Popen[str]) -> None:
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, proc.log.read_text()  # type: ignore[attr-defined]


def test_tied_qwen3_one_liner_into_module_and_safetensors_daemons(tmp_path: Path) -> None:
    port = free_port()
    template = tmp_path / "template"
    qwen3_config().save_pretrained(template)  # what a user's checkpoint directory holds besides weights
    (template / "tokenizer_config.json").write_text("{}")
    ckpts = tmp_path / "ckpts"
    dump = tmp_path / "module_sink.safetensors"
    module_sink = [
        "rollout.sink.type=module",
        "rollout.sink.factory=tests.support.hf_tied:build_qwen3",
        "--dump-on-exit",
        str(dump),
    ]
    st_sink = ["rollout.sink.type=safetensors", f"rollout.sink.dir={ckpts}", f"rollout.sink.template_dir={template}"]
    train = [
        PYTHON, "-m", "tests.support.hf_tied", "--out", str(tmp_path), "--steps", str(STEPS),
        *transport(port), "trainer.min_receivers=2", "trainer.on_failure=raise",
    ]  # fmt: skip
    dump_flag = ("--dump-on-exit", str(dump))
    with (
        daemon(tmp_path, "module", port, *module_sink, flags=dump_flag) as mod,
        daemon(tmp_path, "st", port, *st_sink) as st,
    ):
        with popen(train, env=ENV, cwd=str(tmp_path)) as trainer:
            try:
                out, _ = trainer.communicate(timeout=RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                trainer.kill()
                out, _ = trainer.communicate(timeout=10)
                raise AssertionError(f"training did not finish in {RUN_TIMEOUT_S}s:\n{out[-4000:]}") from None
        assert trainer.returncode == 0, out[-4000:] + mod.log.read_text()[-2000:] + st.log.read_text()[-2000:]
        assert f"hf_tied: {STEPS} steps, last synced version {STEPS}" in out
        time.sleep(0.2)
        stop(mod)
        stop(st)
    for name in ("module", "st"):  # every version applied, none rejected (issue 12 point 2: version 0 was)
        records = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        assert [(r["version"], r["ok"]) for r in records] == [(v, True) for v in range(STEPS + 1)], records
    module_log = (tmp_path / "module.log").read_text()
    assert "keep their old values" not in module_log  # issue 12 point 3: no false warning about the tie

    # the trainer's final weights, as the one-liner sent them: HF names, the tied head sent once
    final = load_file(str(tmp_path / "final.safetensors"))
    assert "model.embed_tokens.weight" in final and "lm_head.weight" not in final
    reference = build_qwen3(seed=2)
    load_model(reference, str(tmp_path / "final.safetensors"), strict=True)  # the tie covers lm_head
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    want = logits(reference)

    # module sink: bitwise, tie intact (lm_head equals the embedding it shares), same logits
    held = load_file(str(dump))
    assert sorted(held) == sorted(reference.state_dict())
    for name, tensor in final.items():
        assert torch.equal(held[name], tensor), name
    assert torch.equal(held["lm_head.weight"], final["model.embed_tokens.weight"])
    rollout_model = build_qwen3(seed=3)
    rollout_model.load_state_dict(held, strict=True)
    assert torch.equal(logits(rollout_model), want)

    # safetensors sink: a checkpoint directory per version that from_pretrained loads as is
    from transformers import AutoModelForCausalLM

    step = ckpts / f"step_{STEPS}"
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= {p.name for p in step.iterdir()}
    written = load_file(str(step / "model.safetensors"))
    assert sorted(written) == sorted(final)
    for name, tensor in final.items():
        assert torch.equal(written[name], tensor), name
    loaded = AutoModelForCausalLM.from_pretrained(step, torch_dtype=torch.float32)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert torch.equal(logits(loaded), want)
