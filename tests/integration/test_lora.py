"""LoRA end to end with real third-party code: a tiny Qwen3 with a PEFT LoRA adapter (rank 16, every linear
layer), held by a LightningModule as `self.model` and trained on 2 CPU processes with Lightning's
`ModelParallelStrategy` (FSDP2 over gloo) and with DDP, synced by `WeightSyncCallback(cfg)` (`trainer.lora: auto`, so
adapter versions) into a real `lightning-weightsync rollout` daemon: FSDP2 into a module sink whose factory
builds the PEFT model (`rollout.sink.lora=keep`), DDP into one whose factory builds the plain model
(`merge`), both from other seeds, so version 0 must bring the base. Every tensor of every version is
fingerprint-checked on arrival (`transport.verify=full`); at the end the keep rollout holds the trainer's
whole PEFT model bitwise, the merge rollout PEFT's `merge_and_unload()` of it bitwise (same logits), and
the stats say that version 0 carried the base and the adapter, every later one the adapter's bytes alone."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")
pytest.importorskip("lightning.pytorch")

from safetensors.torch import load_file

from tests.integration.test_accelerate import _torchrun
from tests.integration.test_newcomer import ENV, REPO, daemon, stop, transport
from tests.support.lora import TOKENS, adapter_state, build_base, build_peft
from tests.support.mp import PYTHON, free_port, popen

STEPS = 3
RUN_TIMEOUT_S = 150

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


SINKS = {
    "keep": ["rollout.sink.factory=tests.support.lora:build_peft", "rollout.sink.options={seed: 7, lora_seed: 8}"],
    "merge": [
        "rollout.sink.factory=tests.support.lora:build_base", "rollout.sink.options={seed: 7}",
        "rollout.sink.lora=merge",
    ],
}  # fmt: skip


@pytest.mark.parametrize(("strategy", "sink"), [("fsdp2", "keep"), ("ddp", "merge"), ("accelerate", "keep")])
def test_lora_adapter_versions_into_a_module_sink_daemon(tmp_path: Path, strategy: str, sink: str) -> None:
    """One daemon a run (each process start costs seconds on 2 shared cores): FSDP2 into keep, DDP into merge,
    Accelerate into keep."""
    from peft import set_peft_model_state_dict

    port = free_port()
    dump = tmp_path / f"{sink}.safetensors"
    launch = (
        [*_torchrun(), "--standalone", "--nproc-per-node", "2", "-m"] if strategy == "accelerate" else [PYTHON, "-m"]
    )
    train = [
        *launch, "tests.support.lora", "--out", str(tmp_path), "--steps", str(STEPS), "--strategy", strategy,
        *transport(port), "trainer.on_failure=raise", "transport.verify=full",
    ]  # fmt: skip
    with daemon(tmp_path, sink, port, *SINKS[sink], flags=("--dump-on-exit", str(dump))) as rollout_proc:
        with popen(train, env=ENV, cwd=str(REPO)) as trainer:
            try:
                out, _ = trainer.communicate(timeout=RUN_TIMEOUT_S)
            except Exception:
                trainer.kill()
                out, _ = trainer.communicate(timeout=10)
                raise AssertionError(f"training did not finish in {RUN_TIMEOUT_S}s:\n{out[-4000:]}") from None
        assert trainer.returncode == 0, out[-4000:] + rollout_proc.log.read_text()[-3000:]  # type: ignore[attr-defined]
        assert f"lora: {STEPS} steps, last version {STEPS}" in out, out[-2000:]
        time.sleep(0.2)
        stop(rollout_proc)

    # the trainer's PEFT model after the last step, rebuilt from the adapter it wrote (its own full_tensor gather)
    final = build_peft(seed=0, lora_seed=1)
    set_peft_model_state_dict(final, load_file(str(tmp_path / f"ref_{STEPS}.safetensors")))
    adapter, base = adapter_state(final), build_base(seed=0).state_dict()
    assert any(
        not torch.equal(t, build_peft(seed=0, lora_seed=1).state_dict()[n]) for n, t in final.state_dict().items()
    )

    # versions: the base once (in version 0), then only the adapter's bytes
    records = [json.loads(line) for line in (tmp_path / f"{sink}.jsonl").read_text().splitlines()]
    assert [(r["version"], r["ok"]) for r in records] == [(v, True) for v in range(STEPS + 1)], records
    assert records[0]["nbytes"] == nbytes(base) + nbytes(adapter)
    assert all(r["nbytes"] == nbytes(adapter) for r in records[1:]), records
    assert all(r["verified"] == r["num_tensors"] > 0 for r in records), records  # every tensor, every version
    # 2 r (in + out) per layer against in x out: rank 16 on hidden 64 is a third of this tiny model (a few
    # percent at real widths: `python -m lightning_weightsync.bench.lora`)
    assert nbytes(adapter) < 0.4 * nbytes(base)
    held = load_file(str(dump))

    if sink == "keep":  # the rollout's PEFT model is the trainer's, base and adapter, bitwise; same logits
        want = final.state_dict()
        assert sorted(held) == sorted(want)
        assert all(torch.equal(held[n], t) for n, t in want.items())
        rollout = build_peft(seed=3, lora_seed=4)
        rollout.load_state_dict(held)
        assert torch.equal(rollout(input_ids=TOKENS).logits, final(input_ids=TOKENS).logits)
        return
    # merge: the plain rollout holds PEFT's merge_and_unload() of the trainer's model, bitwise; same logits
    merged_model = copy.deepcopy(final).merge_and_unload()
    merged = merged_model.state_dict()
    assert sorted(held) == sorted(merged)
    assert all(torch.equal(held[n], t) for n, t in merged.items())
    rollout = build_base(seed=3)
    rollout.load_state_dict(held)
    assert torch.equal(rollout(input_ids=TOKENS).logits, merged_model(input_ids=TOKENS).logits)
