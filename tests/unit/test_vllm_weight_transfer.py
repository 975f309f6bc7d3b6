"""Our vLLM engine body with a real `WeightSender` over gloo, in one process (the engine's receiver
runs on its own loop thread, as in a vLLM worker): one version per `update_weights`, loaded tensor by
tensor, bitwise; a failing `load_weights` is nacked with its reason, the rest is drained and the next
version lands (the group stays usable); a version other than the announced one is refused."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from lightning_weightsync import PeerError
from lightning_weightsync.demo.tiny_lm import build_model
from lightning_weightsync.errors import ConfigError, SinkError
from lightning_weightsync.rollout_engines.vllm.worker import worker_identity
from lightning_weightsync.versions.sender import BlockingWeightSender
from tests.support.mp import free_port
from tests.support.transfer import engine_cfg
from tests.support.vllm_standin import StandInEngine, StandInModel, StandInWeightTransferConfig, StandInWorker


class Flaky(StandInModel):
    """`load_weights` fails on one name while `fail_on` is set."""

    fail_on: str | None = None
    calls: int = 0
    most_at_once: int = 0
    rollout_threads: set[int]
    load_threads: set[int]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        weights = list(weights)
        self.load_threads.add(threading.get_ident())
        self.calls += 1
        self.most_at_once = max(self.most_at_once, len(weights))
        if self.fail_on is not None and any(n == self.fail_on for n, _ in weights):
            raise ValueError("shape mismatch (injected)")
        return super().load_weights(weights)


def _setup(tmp_path: Path, **extra: Any) -> tuple[Any, StandInWorker, Flaky, BlockingWeightSender]:
    port = free_port()
    cfg = engine_cfg(port, bucket_size_mb=0.03125, trainer__min_receivers=1, transport__verify="full", **extra)
    path = tmp_path / "sync.yaml"
    path.write_text(OmegaConf.to_yaml(cfg))
    torch.manual_seed(7)
    model = Flaky(build_model().config)
    model.rollout_threads, model.load_threads = set(), set()
    engine = StandInEngine(StandInWeightTransferConfig("lightning_weightsync"), None, torch.device("cpu"), model,
                           str(path))  # fmt: skip
    sender = BlockingWeightSender(cfg)
    sender.start()
    return cfg, StandInWorker(engine), model, sender


def _version(v: int) -> list[tuple[str, torch.Tensor]]:
    model = build_model(seed=v)
    return [(k, t.detach().clone()) for k, t in model.state_dict().items()]


def _update(worker: StandInWorker, sender: BlockingWeightSender, version: int, announced: int | None = None) -> Any:
    """As the trainer does it: the rollout's update_weights runs while the sender broadcasts."""
    errors: list[BaseException] = []

    def rollout() -> None:
        worker.weight_transfer_engine.model.rollout_threads.add(threading.get_ident())
        try:
            worker.update_weights({"version": version if announced is None else announced, "timeout_s": 20})
        except BaseException as exc:
            errors.append(exc)

    worker.start_weight_update()
    thread = threading.Thread(target=rollout)
    thread.start()
    try:
        stats = sender.send_weights(_version(version), version=version)
    except BaseException as exc:
        stats = exc
    thread.join(30)
    assert not thread.is_alive()
    if not errors:
        worker.finish_weight_update()
    return stats, errors


def test_each_update_receives_one_version_bitwise_tensor_by_tensor(tmp_path: Path) -> None:
    _, worker, model, sender = _setup(tmp_path)
    try:
        for v in (1, 2):
            stats, errors = _update(worker, sender, v)
            assert not errors and stats.receivers == 1
            state = model.state_dict()
            for name, t in _version(v):
                assert torch.equal(state[name], t), name
        engine = worker.weight_transfer_engine
        assert engine.version == 2 and not engine.incomplete
        assert model.most_at_once == 1  # streaming: one full tensor at a time, never the whole version
        # the receive loop runs on the receiver's loop thread, the model is only touched from vLLM's
        assert model.load_threads and model.load_threads <= model.rollout_threads, "load_weights off the worker thread"
        assert engine.identity == worker_identity(None, 0) and engine.identity.endswith("-w0")
        # two servers started from one YAML with one rollout.identity: their rank-0 workers still differ
        code = "from lightning_weightsync.rollout_engines.vllm.worker import worker_identity; "
        code += "print(worker_identity('rollout', 0))"
        other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
        assert other.strip().startswith("rollout-") and other.strip() != worker_identity("rollout", 0)
    finally:
        worker.weight_transfer_engine.shutdown()
        sender.close()


def test_a_worker_stays_registered_between_versions_so_a_restarted_trainer_knows_it_at_once(tmp_path: Path) -> None:
    cfg, worker, model, sender = _setup(tmp_path)
    restarted = None
    try:
        stats, errors = _update(worker, sender, 1)
        assert not errors and stats.receivers == 1
        sender.close()  # the trainer restarts; the worker generates meanwhile (no update is running)
        restarted = BlockingWeightSender(cfg)
        restarted.start()
        identity = worker.weight_transfer_engine.identity
        deadline = time.monotonic() + 10
        while identity not in restarted.sender.registered and time.monotonic() < deadline:
            restarted._run(restarted.sender._control.recv(0.2))  # what the sender reads when a version starts
        assert identity in restarted.sender.registered, "the worker did not register with the restarted trainer"
        assert worker.weight_transfer_engine._worker_receiver.registrations > 0
        stats, errors = _update(worker, restarted, 2)
        assert not errors and stats.receivers == 1
        state = model.state_dict()
        assert all(torch.equal(state[name], t) for name, t in _version(2))
    finally:
        worker.weight_transfer_engine.shutdown()
        sender.close()
        if restarted is not None:
            restarted.close()


@pytest.mark.parametrize("rollback", ["host", "none"])
def test_load_failure_is_nacked_drained_and_the_next_version_lands(tmp_path: Path, rollback: str) -> None:
    _, worker, model, sender = _setup(tmp_path, vllm__rollback=rollback)
    try:
        before = {k: v.clone() for k, v in model.state_dict().items()}
        model.fail_on = "norm.weight"
        stats, errors = _update(worker, sender, 1)
        # the worker's update_weights fails naming the tensor (vLLM makes it an HTTP 500) ...
        assert len(errors) == 1 and isinstance(errors[0], SinkError)
        assert "'norm.weight'" in str(errors[0]) and "shape mismatch" in str(errors[0])
        # ... and the sender's ack carries the same reason
        assert isinstance(stats, PeerError) and "norm.weight" in str(stats)
        assert not worker._weight_update_active
        state = model.state_dict()
        if rollback == "host":  # the model is as it was before the version, bitwise, and says so
            assert "rolled back" in str(errors[0]) and not worker.weight_transfer_engine.incomplete
            assert all(torch.equal(state[k], v) for k, v in before.items())
        else:  # no copy: the tensors loaded before norm.weight stay, and the engine says it is torn
            assert worker.weight_transfer_engine.incomplete and "rollback=none" in str(errors[0])
            assert not all(torch.equal(state[k], v) for k, v in before.items())
        model.fail_on = None
        stats, errors = _update(worker, sender, 2)  # same group, next version: complete
        assert not errors and not isinstance(stats, BaseException)
        state = model.state_dict()
        assert all(torch.equal(state[n], t) for n, t in _version(2))
        assert not worker.weight_transfer_engine.incomplete
    finally:
        worker.weight_transfer_engine.shutdown()
        sender.close()


def test_a_version_other_than_the_announced_one_is_refused(tmp_path: Path) -> None:
    _, worker, model, sender = _setup(tmp_path)
    try:
        before = {k: v.clone() for k, v in model.state_dict().items()}
        _, errors = _update(worker, sender, 3, announced=4)
        assert len(errors) == 1 and "announced version 4 but version 3 arrived" in str(errors[0])
        assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())  # nothing loaded
    finally:
        worker.weight_transfer_engine.shutdown()
        sender.close()


def test_without_a_config_the_engine_says_which_variable_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LIGHTNING_WEIGHTSYNC_CONFIG", raising=False)
    engine = StandInEngine(StandInWeightTransferConfig(), None, torch.device("cpu"), build_model(), "")
    with pytest.raises(ConfigError, match=r"LIGHTNING_WEIGHTSYNC_CONFIG"):
        engine.start_weight_update()


def test_the_slots_are_taken_when_the_engine_is_built_and_used_by_every_version(tmp_path: Path) -> None:
    """vLLM sizes its KV cache from the memory free after the engine is built: the receiver's two
    slots must exist by then (not appear at the first sync) and be the ones every version uses."""
    from lightning_weightsync.config import bucket_size_bytes

    cfg, worker, _, sender = _setup(tmp_path)
    try:
        receiver = worker.weight_transfer_engine._worker_receiver.receiver
        backend = receiver._lane.backend
        assert backend is not None, "no slots before the first version"
        slots = [b.data_ptr() for b in backend.buckets]
        assert len(slots) == 2 and receiver.preallocated_bytes == 2 * bucket_size_bytes(cfg)
        for v in (1, 2):
            _, errors = _update(worker, sender, v)
            assert not errors
        assert receiver._lane.backend is backend and [b.data_ptr() for b in backend.buckets] == slots
    finally:
        worker.weight_transfer_engine.shutdown()
        sender.close()


class _InProcessLLM:
    """What `EngineRolloutClient` needs of `vllm.LLM` to ask its workers: `collective_rpc` with a callable."""

    def __init__(self, worker: StandInWorker) -> None:
        self.worker = worker

    def collective_rpc(self, method: Any) -> list[Any]:
        return [method(self.worker)]

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """The stand-in worker finished it already (`_update`)."""


def test_the_engine_says_which_version_it_holds_and_rollout_control_checks_it(tmp_path: Path) -> None:
    """Issue 22: through the engine, comparable with vLLM's /weight_checker; `RolloutFleet` asks after a version."""
    from lightning_weightsync.errors import PeerError
    from lightning_weightsync.rollout_engines.vllm.client import EngineRolloutClient, worker_weight_report
    from lightning_weightsync.trainer.fleet import RolloutFleet

    _, worker, _, sender = _setup(tmp_path)
    client = EngineRolloutClient(_InProcessLLM(worker))
    control = RolloutFleet([client])
    try:
        assert worker_weight_report(worker)["version"] is None
        stats, errors = _update(worker, sender, 1)
        assert not errors and stats.checksums
        report = worker_weight_report(worker)
        assert report["version"] == 1 and report["complete"] and report["verify"] == "full", report
        assert report["checksums"] == stats.checksums and report["verified"] == stats.num_tensors
        assert control.check_weights(1, stats.checksums) == []
        client.finish_update("1")
        client.verify(1)  # the hook RolloutFleet.run_version calls after every version: every worker holds 1
        client.finish_update("2")  # as if the server said 2 but its workers hold 1
        with pytest.raises(PeerError, match=r"holds version 1 .*not 2"):
            client.verify(2)
        name = next(iter(stats.checksums))
        wrong = {**stats.checksums, name: "0" * 16}
        problems = control.check_weights(1, wrong)
        assert len(problems) == 1 and name in problems[0], problems
        problems = control.check_weights(2, stats.checksums)
        assert len(problems) == 1 and "holds version 1" in problems[0] and "not 2" in problems[0], problems
        assert "not lightning_weightsync" in worker_weight_report(object())["error"]
    finally:
        control.close()
        worker.weight_transfer_engine.shutdown()
        sender.close()


class Slow(Flaky):
    """Each `load_weights` takes a while and notes how often the worker had registered by then."""

    seen_registrations: list[int]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        self.seen_registrations.append(self.engine._worker_receiver.registrations)
        time.sleep(0.05)
        return super().load_weights(weights)


def test_no_registration_interleaves_with_a_version(tmp_path: Path) -> None:
    """A `Register` in the middle of a version resets what the sender knows of the worker (its group, its
    ready state): the keeper re-registers between versions only, however short its interval."""
    port = free_port()
    cfg = engine_cfg(port, bucket_size_mb=0.03125, trainer__min_receivers=1, transport__heartbeat_interval_s=0.01)
    path = tmp_path / "sync.yaml"
    path.write_text(OmegaConf.to_yaml(cfg))
    model = Slow(build_model().config)
    model.rollout_threads, model.load_threads, model.seen_registrations = set(), set(), []
    engine = StandInEngine(StandInWeightTransferConfig("lightning_weightsync"), None, torch.device("cpu"), model,
                           str(path))  # fmt: skip
    model.engine = engine
    worker = StandInWorker(engine)
    sender = BlockingWeightSender(cfg)
    sender.start()
    try:
        stats, errors = _update(worker, sender, 1)
        assert not errors and stats.receivers == 1
        seen = model.seen_registrations
        assert len(seen) >= 5, seen  # the version lasted many heartbeat intervals
        assert len(set(seen)) == 1, f"the worker re-registered during the version: {seen}"
        deadline = time.monotonic() + 10  # between versions it does, every interval
        while engine._worker_receiver.registrations <= seen[-1] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine._worker_receiver.registrations > seen[-1]
    finally:
        engine.shutdown()
        sender.close()
