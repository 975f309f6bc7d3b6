"""`integrations.trl.WeightSyncTransfer` driven as TRL 1.16.0's AsyncGRPOTrainer drives it
(trl/experimental/async_grpo/async_grpo_trainer.py: `init_weight_transfer` :230-231, `pause` / `send_weights` /
`resume` :1766-1796, `destroy` :1905-1909), over real sockets, against a real `WeightReceiver`.

The whole trainer on 2 CPU ranks is tests/integration/test_trl_async_grpo.py; here, each behaviour alone, fast.
"""

from __future__ import annotations

import inspect
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_weightsync import PeerError, WeightSyncError
from lightning_weightsync.integrations.trl import WeightSyncTransfer
from lightning_weightsync.plugins import RolloutClient
from lightning_weightsync.trainer.fleet import RolloutFleet
from tests.support.mp import LOAD_SLACK_S, spawned
from tests.support.receiver import ThreadReceiver, receiver_main
from tests.support.transfer import assert_bitwise, engine_cfg, stream

trainer_module = pytest.importorskip(
    "trl.experimental.async_grpo.async_grpo_trainer", reason="needs trl (pip install 'lightning_weightsync[trl]')"
)


def transfer(port: int = 0, **extra: Any) -> WeightSyncTransfer:
    return WeightSyncTransfer(engine_cfg(port, bucket_size_mb=1 / 128, **extra))


class Recording:
    """An iterator that records what was pulled from it, in order (TRL's other ranks pull the same, in step)."""

    def __init__(self, items: list[tuple[str, torch.Tensor]]) -> None:
        self.items = items
        self.pulled: list[str] = []

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.items:
            self.pulled.append(name)
            yield name, tensor


def test_methods_are_trls_protocols() -> None:
    from lightning_weightsync.integrations.trl_rollout import CpuRolloutWorker

    for ours, theirs in (
        (WeightSyncTransfer, trainer_module.WeightTransferProtocol),
        (CpuRolloutWorker, trainer_module.RolloutWorkerProtocol),
    ):
        methods = [m for m in vars(theirs) if not m.startswith("_") and callable(getattr(theirs, m))]
        assert methods
        for method in methods:
            want = list(inspect.signature(getattr(theirs, method)).parameters)
            assert list(inspect.signature(getattr(ours, method)).parameters) == want, (ours, method)


def test_a_missing_framework_names_the_extra() -> None:
    from lightning_weightsync.integrations import require

    with pytest.raises(ImportError, match=r"pip install 'lightning_weightsync\[trl\]'"):
        require("trl_is_not_installed_here", "trl", "CpuRolloutWorker")


def test_every_version_arrives_bitwise_numbered_as_trls_model_version() -> None:
    sync = transfer()
    sync.init_weight_transfer()
    assert sync.port
    receiver = ThreadReceiver(sync.port, versions=2)
    sent = [stream(v) for v in (1, 2)]
    try:
        for weights in sent:  # TRL: pause, barrier, send_weights(_streaming_iter()), barrier, resume
            sync.pause()
            sync.send_weights(iter(weights))
            sync.resume()
    finally:
        got = receiver.join()
        sync.destroy()
    assert [v for v, _ in got] == [1, 2]  # TRL's model_version after the 1st and 2nd sync
    for (_, received), weights in zip(got, sent, strict=True):
        assert_bitwise(received, weights)


def test_names_and_dtype_rules_apply_to_trls_stream() -> None:
    weights = [("model.a", torch.randn(3, 4)), ("model.b", torch.randn(5)), ("model.c", torch.arange(4))]
    sync = transfer(trainer__dtype="bfloat16", trainer__names__exclude="[model.b]")
    sync.init_weight_transfer()
    assert sync.port
    receiver = ThreadReceiver(sync.port, versions=1)
    pulled = Recording(weights)
    try:
        sync.send_weights(iter(pulled))
    finally:
        (_, got), *_ = receiver.join()
        sync.destroy()
    assert pulled.pulled == ["model.a", "model.b", "model.c"]  # the excluded one is pulled too: lockstep
    assert list(got) == ["model.a", "model.c"]
    assert got["model.a"].dtype == torch.bfloat16 and torch.equal(got["model.a"], weights[0][1].bfloat16())
    assert torch.equal(got["model.c"], weights[2][1])  # integers are not cast


def test_a_send_that_cannot_start_drains_the_stream_whole_and_raises() -> None:
    sync = transfer()
    weights = Recording(stream(1))
    with pytest.raises(WeightSyncError, match="before init_weight_transfer"):
        sync.send_weights(iter(weights))
    assert weights.pulled == [n for n, _ in weights.items]


def test_a_rollout_killed_mid_run_fails_the_next_send_within_liveness_draining_in_order(tmp_path: Path) -> None:
    sync = transfer(transport__liveness_s=1.0)
    sync.init_weight_transfer()
    assert sync.port
    try:
        with spawned(receiver_main, sync.port, 5, str(tmp_path)) as rollout:
            sync.send_weights(iter(stream(1)))  # served: the rollout is a member now
            deadline = time.monotonic() + 30
            while not (tmp_path / "versions.json").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert json.loads((tmp_path / "versions.json").read_text()) == [1]
            rollout.kill()
            rollout.join(5)
        weights = Recording(stream(2))
        started = time.monotonic()
        with pytest.raises(WeightSyncError, match="liveness_s") as failure:
            sync.send_weights(iter(weights))
        elapsed = time.monotonic() - started
    finally:
        sync.destroy()
    assert elapsed < 1.0 + LOAD_SLACK_S, elapsed
    assert "rollout-0" in str(failure.value)
    assert weights.pulled == [n for n, _ in weights.items]  # whole and in order
    assert sync.failures == 1


def test_on_failure_warn_returns_after_draining(caplog: pytest.LogCaptureFixture) -> None:
    sync = transfer(transport__timeout_s=1, trainer__on_failure="warn")  # nobody registers
    sync.init_weight_transfer()
    weights = Recording(stream(1))
    try:
        sync.send_weights(iter(weights))  # returns
    finally:
        sync.destroy()
    assert weights.pulled == [n for n, _ in weights.items]
    assert sync.failures == 1 and sync.next_version == 2
    assert "skipped (trainer.on_failure=warn)" in caplog.text


def test_on_failure_warn_still_raises_what_is_not_a_sync_failure() -> None:
    """`warn` skips a version the sync failed (the transport, a rollout); a stream that yields a non-tensor is
    the caller's bug, and raises (after the stream was drained whole: TRL's other ranks are in the same walk)."""
    sync = transfer(trainer__on_failure="warn")
    sync.init_weight_transfer()
    assert sync.port
    receiver = ThreadReceiver(sync.port, versions=1)  # registered: the sender pulls the stream and checks it
    weights = Recording([("model.a", torch.randn(4)), ("model.b", "not a tensor"), ("model.c", torch.randn(2))])
    try:
        with pytest.raises(TypeError, match=r"\(name, tensor\) pairs"):
            sync.send_weights(iter(weights))
    finally:
        sync.destroy()
        receiver._thread.join(60)  # its version was aborted: it stops
    assert weights.pulled == ["model.a", "model.b", "model.c"]
    assert sync.failures == 1


class FakeEngine(RolloutClient):
    """A `RolloutClient` that records the calls `RolloutFleet` makes (a vLLM / SGLang server's steps)."""

    name, engine, timeout_knob = "fake://0", "fake", "fake.request_timeout_s"

    def __init__(self, calls: list[str], fail: str | None = None) -> None:
        self.calls, self.fail = calls, fail

    def _call(self, what: str) -> None:
        self.calls.append(what)
        if what == self.fail:
            raise RuntimeError(f"{what} refused")

    def workers(self) -> int | None:
        return None

    def pause(self) -> None:
        self._call("pause")

    def start_update(self) -> None:
        self._call("start_update")

    def update(self, version: int, receive_timeout_s: float | None) -> None:
        self._call(f"update {version}")

    def finish_update(self, weight_version: str | None) -> None:
        self._call(f"finish {weight_version}")

    def after_update(self, version: int) -> None:
        self._call("after_update")

    def verify(self, version: int) -> None:
        self._call("verify")

    def resume(self) -> None:
        self._call("resume")


def test_pause_and_resume_drive_the_rollout_engines_around_the_send() -> None:
    calls: list[str] = []
    sync = transfer(trainer__min_receivers=0)
    sync.init_weight_transfer()
    sync.rollouts = RolloutFleet([FakeEngine(calls)])  # what vllm.urls / sglang.urls would build
    try:
        sync.pause()
        assert calls == ["pause"]  # at TRL's pause(), before its barrier
        sync.send_weights(iter(stream(1)))
        assert "resume" not in calls  # TRL resumes after its second barrier
        sync.resume()
    finally:
        sync.destroy()
    assert calls == ["pause", "start_update", "update 1", "finish 1", "after_update", "verify", "resume"]


def test_a_rollout_that_cannot_pause_fails_the_send_after_draining_and_is_resumed() -> None:
    calls: list[str] = []
    sync = transfer(trainer__min_receivers=0)
    sync.init_weight_transfer()
    sync.rollouts = RolloutFleet([FakeEngine(calls, fail="pause")])
    weights = Recording(stream(1))
    try:
        sync.pause()  # never raises: TRL calls it on rank 0 alone, before a barrier
        with pytest.raises(PeerError, match="pause refused"):
            sync.send_weights(iter(weights))
        sync.resume()
    finally:
        sync.destroy()
    assert weights.pulled == [n for n, _ in weights.items]
    assert calls == ["pause", "resume"]


def test_with_on_failure_warn_a_failed_pause_is_cleared_by_the_next_successful_one() -> None:
    """A pause that failed skips its version (warn); the next pause succeeds, and its version goes out: the
    earlier failure is not carried into it."""
    calls: list[str] = []
    engine = FakeEngine(calls, fail="pause")
    sync = transfer(trainer__min_receivers=0, trainer__on_failure="warn")
    sync.init_weight_transfer()
    sync.rollouts = RolloutFleet([engine])
    try:
        sync.pause()
        sync.send_weights(iter(stream(1)))  # skipped: the pause failed
        sync.resume()
        engine.fail = None  # the engine answers again
        sync.pause()
        sync.send_weights(iter(stream(2)))
        sync.resume()
    finally:
        sync.destroy()
    assert sync.failures == 1 and sync.last_stats is not None and sync.last_stats.version == 2
    assert calls == ["pause", "resume", "pause", "start_update", "update 2", "finish 2", "after_update", "verify",
                     "resume"]  # fmt: skip


def test_destroy_frees_the_port_and_is_idempotent() -> None:
    sync = transfer()
    sync.init_weight_transfer()
    port = sync.port
    assert port
    sync.destroy()
    sync.destroy()
    assert sync.port is None and sync.sender is None
    with socket.socket() as again:  # the control port is free again
        again.bind(("127.0.0.1", port))
    weights = Recording(stream(1))
    with pytest.raises(WeightSyncError, match="after destroy"):
        sync.send_weights(iter(weights))
    assert weights.pulled == [n for n, _ in weights.items]


def test_a_peft_model_reaches_the_rollout_merged_under_base_names() -> None:
    """TRL with a custom weight_transfer merges the adapter, streams `_iter_vllm_named_params` and unmerges
    (:1775-1788): the rollout gets the merged base weights, bitwise; the adapter never reaches send_weights."""
    from tests.support.lora import build_peft

    model = build_peft()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()  # a trained adapter (PEFT starts B at 0)
    sync = transfer()
    sync.init_weight_transfer()
    assert sync.port
    receiver = ThreadReceiver(sync.port, versions=1)
    try:
        model.merge_adapter()
        merged = [(n, p.detach().clone()) for n, p in trainer_module._iter_vllm_named_params(model)]
        sync.send_weights((n, p.detach()) for n, p in trainer_module._iter_vllm_named_params(model))
        model.unmerge_adapter()
    finally:
        (_, got), *_ = receiver.join()
        sync.destroy()
    assert_bitwise(got, merged)
    assert not any("lora_" in n or "base_layer" in n for n in got)
    base = dict(model.get_base_model().named_parameters())
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(got[q], base[q.replace("q_proj.weight", "q_proj.base_layer.weight")])  # merged
