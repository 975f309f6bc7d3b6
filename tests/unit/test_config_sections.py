"""The typed views of a config: `settings`, the engine's own sections, and each sink's own section."""

from __future__ import annotations

import logging
from dataclasses import fields

import pytest

from lightning_weightsync.config import (
    SINK_SECTIONS,
    SINKS,
    BackendName,
    ReceiverSettings,
    SenderSettings,
    SinkConfig,
    VerifyMode,
    load_config,
    settings,
    sink_section,
    unread_sink_knobs,
)
from lightning_weightsync.rollout.sinks.config import SafetensorsSinkSection


def test_settings_are_typed_values_not_a_dictconfig() -> None:
    typed = settings(load_config(overrides=["transport.bucket_size_mb=0.5", "transport.verify=full"]))
    assert isinstance(typed.transport.backend, BackendName) and typed.transport.verify is VerifyMode.full
    sender = SenderSettings.of(load_config(overrides=["transport.bucket_size_mb=0.5", "trainer.min_receivers=3"]))
    assert sender.bucket_size == 512 * 1024 and sender.min_receivers == 3 and sender.direct_min == 1024 * 1024
    receiver = ReceiverSettings.of(load_config(overrides=["rollout.identity=r7", "rollout.device=meta"]))
    assert (receiver.identity, receiver.device) == ("r7", "meta")


def test_every_sink_declares_its_section_of_knobs_users_can_write() -> None:
    assert set(SINK_SECTIONS) == set(SINKS)
    knobs = {f.name for f in fields(SinkConfig)}
    for name, section in SINK_SECTIONS.items():
        assert {f.name for f in fields(section)} <= knobs, name


def test_a_sink_gets_only_its_own_section_and_another_sinks_knob_is_named() -> None:
    cfg = load_config(overrides=["rollout.sink.type=safetensors", "rollout.sink.dir=/tmp/x",
                                 "rollout.sink.factory=pkg.mod:fn"])  # fmt: skip
    section = sink_section(cfg.rollout.sink)
    assert isinstance(section, SafetensorsSinkSection) and section.dir == "/tmp/x" and section.keep_last == 3
    assert unread_sink_knobs(cfg.rollout.sink) == ["rollout.sink.factory"]
    assert unread_sink_knobs(load_config(overrides=["rollout.sink.factory=pkg.mod:fn"]).rollout.sink) == []


def test_build_sink_warns_about_another_sinks_knob(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    from lightning_weightsync.rollout.sinks import build_sink

    cfg = load_config(overrides=["rollout.sink.type=safetensors", f"rollout.sink.dir={tmp_path}",
                                 "rollout.sink.target=pkg.mod:fn"])  # fmt: skip
    with caplog.at_level(logging.WARNING):
        build_sink(cfg)
    assert "rollout.sink.type=safetensors does not read rollout.sink.target" in caplog.text


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("rollout.sink.file_mode=292", r"rollout\.sink\.file_mode=444 \(octal\) must be permission bits"),  # 0o444
        ("rollout.sink.keep_last=0", r"rollout\.sink\.keep_last=0 must be >= 1"),
        ("rollout.sink.keep_last=2000000", r"rollout\.sink\.keep_last=2000000 is out of range"),
    ],
)
def test_a_sinks_section_checks_its_own_knobs_whichever_sink_is_chosen(override: str, pattern: str) -> None:
    """The safetensors sink's section validates its knobs (`validate`), at load time, also with the module sink
    chosen: a bad value fails before another sink is picked, as when config checked it by name."""
    from lightning_weightsync.errors import ConfigError

    with pytest.raises(ConfigError, match=pattern):
        load_config(overrides=[override])
    SafetensorsSinkSection(keep_last=5, file_mode=0o600).validate()
