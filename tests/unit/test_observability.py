"""Metrics in base units, every label series from the start, a staleness gauge, readable log units."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import generate_latest

from lightning_weightsync.rollout.observability import OUTCOMES, Metrics, VersionRecord, human_bytes, log_version
from lightning_weightsync.rollout.sinks import SinkState


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _text(metrics: Metrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_outcome_series_exist_before_any_event() -> None:
    text = _text(Metrics())
    for outcome in OUTCOMES:
        assert f'weightsync_rollout_versions_total{{outcome="{outcome}"}} 0.0' in text


def test_rate_is_in_bytes_per_second_and_no_gb_gauge_remains() -> None:
    metrics = Metrics()
    metrics.record(VersionRecord(3, True, nbytes=4 << 20, seconds=2.0, bytes_per_second=2 << 20), SinkState.COMPLETE)
    text = _text(metrics)
    assert "weightsync_rollout_last_bytes_per_second 2.097152e+06" in text
    assert "gbps" not in text.lower()
    assert "weightsync_rollout_version 3.0" in text


def test_staleness_counts_from_start_then_from_the_last_applied_version() -> None:
    clock = Clock()
    metrics = Metrics(clock=clock)
    clock.now += 30
    assert metrics.staleness_seconds() == pytest.approx(30)
    metrics.record(VersionRecord(1, False, outcome="failed"), SinkState.EMPTY)  # a failure is not fresh weights
    assert metrics.staleness_seconds() == pytest.approx(30)
    metrics.record(VersionRecord(1, True, nbytes=1, seconds=1.0), SinkState.COMPLETE)
    clock.now += 5
    assert metrics.staleness_seconds() == pytest.approx(5)
    assert "weightsync_rollout_staleness_seconds 5.0" in _text(metrics)


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [(0, "0 B"), (1000, "1000 B"), (16 << 20, "16 MiB"), (16.78e6, "16 MiB"), (1.16 * (1 << 30), "1.16 GiB")],
)
def test_human_bytes_picks_a_unit_that_fits(nbytes: float, text: str) -> None:
    assert human_bytes(nbytes) == text


def test_log_line_uses_fitting_units(caplog: pytest.LogCaptureFixture) -> None:
    rec = VersionRecord(7, True, nbytes=16_780_000, seconds=4.098, bytes_per_second=16_780_000 / 4.098)
    with caplog.at_level(logging.INFO, logger="lightning_weightsync.rollout.observability"):
        log_version(rec, SinkState.COMPLETE, 7)
    assert "16 MiB in 4.098 s (3.9 MiB/s)" in caplog.text


def test_idle_connections_cost_the_metrics_server_no_threads() -> None:
    """Issue 24 item 6: a thread per connection, so 1000 idle connections made 1000 threads. Real sockets:
    300 connections that never send a request; the server keeps one thread and still answers /healthz."""
    import socket
    import threading
    import urllib.request

    from lightning_weightsync.rollout.observability import HealthServer

    server = HealthServer("127.0.0.1", 0, Metrics(), lambda: (True, {"ok": True}))
    idle: list[socket.socket] = []
    try:
        before = threading.active_count()
        for _ in range(300):
            idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=10) as reply:
            assert reply.status == 200 and b'"ok": true' in reply.read()
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as reply:
            assert b"weightsync_" in reply.read()
        assert threading.active_count() <= before, f"{threading.active_count() - before} threads for idle connections"
    finally:
        for sock in idle:
            sock.close()
        server.close()
