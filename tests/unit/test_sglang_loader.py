"""Our SGLang weight loader with a real `WeightSender` over gloo, in one process (called as SGLang's
scheduler calls it: `loader(model, named_tensors)` on the thread that owns the model): one version per
call, tensor by tensor on the caller's thread, bitwise; a failing `load_weights` is nacked with its
reason, drained, and never raised into SGLang (its scheduler would quit), and the next version lands."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from lightning_weightsync import PeerError
from lightning_weightsync.demo.tiny_lm import build_model
from lightning_weightsync.rollout_engines.sglang import loader
from lightning_weightsync.rollout_engines.worker import CONFIG_ENV
from lightning_weightsync.versions.sender import BlockingWeightSender
from tests.support.mp import free_port
from tests.support.transfer import engine_cfg
from tests.unit.test_vllm_weight_transfer import Flaky, _version


@pytest.fixture
def rollout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Flaky, BlockingWeightSender]]:
    cfg = engine_cfg(free_port(), bucket_size_mb=0.03125, trainer__min_receivers=1)
    path = tmp_path / "sync.yaml"
    path.write_text(OmegaConf.to_yaml(cfg))
    monkeypatch.setenv(CONFIG_ENV, str(path))  # what launch.py puts in the server's environment
    torch.manual_seed(7)
    model = Flaky(build_model().config)
    model.rollout_threads, model.load_threads = set(), set()
    sender = BlockingWeightSender(cfg)
    sender.start()
    try:
        yield model, sender
    finally:
        sender.close()
        if loader._rank is not None:
            loader._rank.close()
            loader._rank = None


def _update(model: Flaky, sender: BlockingWeightSender, version: int) -> tuple[Any, list[BaseException]]:
    """As SGLang does it: the scheduler thread runs the loader while the trainer's sender broadcasts."""
    errors: list[BaseException] = []

    def scheduler() -> None:
        model.rollout_threads.add(threading.get_ident())
        try:
            loader.load_weights(model, [])
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=scheduler)
    thread.start()
    try:
        stats: Any = sender.send_weights(_version(version), version=version)
    except BaseException as exc:
        stats = exc
    thread.join(30)
    assert not thread.is_alive()
    return stats, errors


def test_each_call_receives_one_version_bitwise_on_the_callers_thread(rollout) -> None:
    model, sender = rollout
    for v in (1, 2):
        stats, errors = _update(model, sender, v)
        assert not errors and stats.receivers == 1
        state = model.state_dict()
        for name, t in _version(v):
            assert torch.equal(state[name], t), name
        assert loader._rank is not None and loader._rank.version == v
    assert model.most_at_once == 1  # streamed: one merged tensor at a time, never the whole version
    assert model.load_threads == model.rollout_threads  # the model is touched on SGLang's thread only


def test_a_failing_load_is_nacked_never_raised_and_the_next_version_lands(rollout) -> None:
    model, sender = rollout
    model.fail_on = "lm_head.weight"
    stats, errors = _update(model, sender, 1)
    assert not errors  # into SGLang's scheduler loop, an exception would quit the server
    assert isinstance(stats, PeerError) and "shape mismatch (injected)" in str(stats)  # the trainer hears why
    assert loader._rank is not None and loader._rank.last_report["ok"] is False
    model.fail_on = None
    stats, errors = _update(model, sender, 2)
    assert not errors and stats.receivers == 1
    for name, t in _version(2):
        assert torch.equal(model.state_dict()[name], t), name


def test_tensors_over_sglangs_own_path_and_a_missing_config_are_refused_without_raising(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model = build_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with caplog.at_level("ERROR", logger=loader.__name__):
        loader.load_weights(model, [("lm_head.weight", torch.zeros(1))])
        monkeypatch.delenv(CONFIG_ENV, raising=False)
        loader.load_weights(model, [])
    assert loader._rank is None
    text = caplog.text
    assert "receives from the trainer's sender only" in text and CONFIG_ENV in text
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
