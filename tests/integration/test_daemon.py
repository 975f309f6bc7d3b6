"""The rollout daemon in-process, against a real WeightSender over real ZeroMQ sockets and gloo.

Sender and daemon share this test's event loop (their blocking collectives run on their own
executor threads), which keeps these tests fast; `test_cli.py` runs the daemon as a real
subprocess with signals, kills and restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from lightning_weightsync import PeerError, WeightSender, WeightSyncError
from lightning_weightsync.rollout.daemon import RolloutDaemon
from lightning_weightsync.rollout.sinks import SinkState
from lightning_weightsync.rollout.sinks.module import ModuleSink
from tests.support.mp import free_port
from tests.support.transfer import engine_cfg
from tests.unit.test_sinks import assert_same, version_weights

pytestmark = pytest.mark.timeout(120)

BUCKET_MB = 1 / 1024  # 1 KiB: the 4 KiB embedding is chunked


def daemon_cfg(port: int, **extra: Any):
    extra.setdefault("rollout__sink__factory", "tests.unit.test_sinks:build_tiny")
    extra.setdefault("rollout__progress", "false")
    extra.setdefault("transport__timeout_s", 10)
    return engine_cfg(port, bucket_size_mb=BUCKET_MB, **extra)


@contextlib.asynccontextmanager
async def running(daemon: RolloutDaemon) -> AsyncIterator[RolloutDaemon]:
    task = asyncio.ensure_future(daemon.run())
    try:
        yield daemon
    finally:
        daemon.stop()
        await asyncio.wait_for(task, 30)


@contextlib.asynccontextmanager
async def sender_on(port: int, **extra: Any) -> AsyncIterator[WeightSender]:
    async with WeightSender(daemon_cfg(port, **extra)) as sender:
        yield sender


async def until(predicate: Any, timeout_s: float = 20) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("apply", ["atomic", "streaming"])
async def test_daemon_applies_several_versions(apply: str) -> None:
    port = free_port()
    daemon = RolloutDaemon(daemon_cfg(port, rollout__apply=apply), handle_signals=False)
    async with running(daemon), sender_on(port) as sender:
        for version in range(3):
            stats = await sender.send_weights(version_weights(version).items(), version=version)
            assert stats.receivers == 1 and stats.num_chunked_tensors > 0
            sink = daemon.sink
            assert isinstance(sink, ModuleSink)
            assert sink.version == version  # acked only after commit
            assert_same(sink.state_dict(), version_weights(version))
    assert [r.version for r in daemon.records] == [0, 1, 2]
    assert all(r.ok and r.num_chunked_tensors == stats.num_chunked_tensors for r in daemon.records)
    assert all(r.nbytes == stats.nbytes and r.num_buckets == stats.num_buckets for r in daemon.records)


async def test_sink_error_is_nacked_named_and_the_daemon_continues() -> None:
    port = free_port()
    daemon = RolloutDaemon(daemon_cfg(port), handle_signals=False)
    async with running(daemon), sender_on(port) as sender:
        await sender.send_weights(version_weights(0).items(), version=0)
        bad = dict(version_weights(1))
        bad["model.proj.weight"] = bad.pop("proj.weight")
        with pytest.raises(PeerError, match=r"'model\.proj\.weight'.*trainer\.names"):
            await sender.send_weights(bad.items(), version=1)
        sink = daemon.sink
        assert isinstance(sink, ModuleSink)
        assert sink.version == 0 and sink.state is SinkState.COMPLETE
        assert_same(sink.state_dict(), version_weights(0))
        await sender.send_weights(version_weights(2).items(), version=2)  # the group is still in step
        assert_same(sink.state_dict(), version_weights(2))
    assert [(r.version, r.outcome) for r in daemon.records] == [(0, "applied"), (1, "failed"), (2, "applied")]


async def test_version_aborted_by_the_sender_is_dropped() -> None:
    port = free_port()
    daemon = RolloutDaemon(daemon_cfg(port), handle_signals=False)

    def dying(version: int):
        for i, item in enumerate(version_weights(version).items()):
            if i == 4:
                raise RuntimeError("trainer crashed mid-gather (test)")
            yield item

    async with running(daemon), sender_on(port) as sender:
        await sender.send_weights(version_weights(0).items(), version=0)
        with pytest.raises(RuntimeError, match="crashed mid-gather"):
            await sender.send_weights(dying(1), version=1)
        await until(lambda: len(daemon.records) == 2)
        assert daemon.records[1].outcome in ("aborted", "failed", "timeout") and not daemon.records[1].ok
        sink = daemon.sink
        assert isinstance(sink, ModuleSink) and sink.version == 0
        assert_same(sink.state_dict(), version_weights(0))
        await sender.send_weights(version_weights(2).items(), version=2)
        assert_same(sink.state_dict(), version_weights(2))


async def test_stop_mid_version_drops_it_and_returns() -> None:
    port = free_port()
    daemon = RolloutDaemon(daemon_cfg(port), handle_signals=False)
    task = asyncio.ensure_future(daemon.run())
    gate = asyncio.Event()

    async def paused(version: int):
        for i, item in enumerate(version_weights(version).items()):
            if i == 3:
                await gate.wait()
            yield item

    async with sender_on(port, transport__timeout_s=3) as sender:
        await sender.send_weights(version_weights(0).items(), version=0)
        send = asyncio.ensure_future(sender.send_weights(paused(1), version=1))
        sink = daemon.sink
        assert isinstance(sink, ModuleSink)
        await until(lambda: sink.in_flight == 1)
        daemon.stop()
        await asyncio.wait_for(task, 20)
        assert sink.in_flight is None and sink.version == 0 and sink.state is SinkState.COMPLETE
        assert_same(sink.state_dict(), version_weights(0))
        gate.set()
        with pytest.raises(WeightSyncError) as info:
            await asyncio.wait_for(send, 30)
    # issue 25 item 1: the daemon said why before it went, the trainer's error names it, and the daemon's
    # record says the version was stopped (it used to report nothing, and the trainer saw a broken link)
    said = "failed: rollout stopped mid-version: the rollout daemon is stopping"
    assert said in str(info.value), info.value
    assert [(r.version, r.outcome) for r in daemon.records] == [(0, "applied"), (1, "stopped")]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


async def test_metrics_and_healthz() -> None:
    port = free_port()
    daemon = RolloutDaemon(daemon_cfg(port, rollout__metrics_port=0), handle_signals=False)
    async with running(daemon):
        await until(lambda: daemon.metrics_port is not None)
        base = f"http://127.0.0.1:{daemon.metrics_port}"
        code, body = await asyncio.to_thread(_get, base + "/healthz")
        health = json.loads(body)
        assert code == 503 and (health["state"], health["version"], health["trainer_connected"]) == (
            "empty",
            None,
            False,
        )
        async with sender_on(port) as sender:
            for version in (4, 5):
                stats = await sender.send_weights(version_weights(version).items(), version=version)
            await until(lambda: daemon._health()[1]["trainer_connected"])
            code, body = await asyncio.to_thread(_get, base + "/healthz")
        health = json.loads(body)
        assert code == 200 and (health["state"], health["version"], health["trainer_connected"]) == (
            "complete",
            5,
            True,
        )
        code, text = await asyncio.to_thread(_get, base + "/metrics")
        assert code == 200
        assert "weightsync_rollout_version 5.0" in text
        assert 'weightsync_rollout_versions_total{outcome="applied"} 2.0' in text
        assert f"weightsync_rollout_bytes_total {2 * stats.nbytes}.0" in text
        assert (await asyncio.to_thread(_get, base + "/nope"))[0] == 404


async def test_a_daemon_without_a_trainer_says_so(monkeypatch, caplog) -> None:
    """Issue 25 item 1: a daemon pointed at the wrong port (or before the trainer starts) waited in
    silence. It now logs that no trainer is connected (after NO_TRAINER_WARN_S, then every
    NO_TRAINER_REPEAT_S), shows it on /healthz and in two gauges, and logs when one connects."""
    from lightning_weightsync.rollout import daemon as daemon_module

    monkeypatch.setattr(daemon_module, "NO_TRAINER_WARN_S", 1.0)
    monkeypatch.setattr(daemon_module, "TRAINER_POLL_S", 0.1)
    port = free_port()
    daemon = RolloutDaemon(daemon_cfg(port, rollout__metrics_port=0), handle_signals=False)
    with caplog.at_level("INFO", logger="lightning_weightsync.rollout.daemon"):
        async with running(daemon):
            await until(lambda: any("no trainer connected" in r.getMessage() for r in caplog.records))
            base = f"http://127.0.0.1:{daemon.metrics_port}"
            health = json.loads((await asyncio.to_thread(_get, base + "/healthz"))[1])
            assert health["trainer_connected"] is False and health["trainer_unseen_s"] >= 1.0, health
            text = (await asyncio.to_thread(_get, base + "/metrics"))[1]
            assert "weightsync_rollout_trainer_connected 0.0" in text
            unseen = float(re.search(r"^weightsync_rollout_trainer_unseen_seconds (\S+)$", text, re.M)[1])
            assert unseen >= 1.0, text
            async with sender_on(port):
                await until(lambda: daemon._health()[1]["trainer_connected"])
                text = (await asyncio.to_thread(_get, base + "/metrics"))[1]
                assert "weightsync_rollout_trainer_connected 1.0" in text
                assert "weightsync_rollout_trainer_unseen_seconds 0.0" in text
    said = [r.getMessage() for r in caplog.records if "trainer" in r.getMessage()]
    assert f"127.0.0.1:{port}" in said[0] and "transport.auth_token" in said[0], said
    assert any(m == f"trainer connected at 127.0.0.1:{port}" for m in said), said


async def test_safetensors_and_callable_sinks_behind_the_daemon(tmp_path) -> None:
    from safetensors.torch import load_file

    port = free_port()
    got: list[tuple[int, dict[str, torch.Tensor]]] = []
    lock = threading.Lock()

    def collect(version: int, tensors) -> None:
        with lock:
            got.append((version, dict(tensors)))

    st = RolloutDaemon(
        daemon_cfg(port, rollout__sink__type="safetensors", rollout__sink__dir=str(tmp_path), rollout__identity="st"),
        handle_signals=False,
    )
    cfg = daemon_cfg(port, rollout__sink__type="callable", rollout__apply="streaming", rollout__identity="cb")
    from lightning_weightsync.rollout.sinks.callable import CallableSink

    cb = RolloutDaemon(cfg, sink=CallableSink(cfg, fn=collect), handle_signals=False)
    async with running(st), running(cb), sender_on(port, trainer__min_receivers=2) as sender:
        for version in (1, 2):
            stats = await sender.send_weights(version_weights(version).items(), version=version)
            assert stats.receivers == 2
    for version in (1, 2):
        assert_same(load_file(str(tmp_path / f"step_{version}.safetensors")), version_weights(version))
    assert [v for v, _ in got] == [1, 2]
    assert_same(got[1][1], version_weights(2))


def test_progress_bar_counts_bytes_of_the_version_in_flight() -> None:
    from lightning_weightsync.rollout.observability import Progress

    off = Progress(enabled=False)
    off.bucket(1, 100)
    assert off.shown is None  # not a terminal: nothing drawn
    bar = Progress(enabled=True)
    bar.bucket(7, 1024)
    bar.bucket(7, 512)
    assert bar.shown == (7, 1536)
    bar.stop()
    assert bar.shown is None


# -- a stop mid-commit, a full disk (issue 25 items 3, 4) --------------------------------------------------


def _weights(version: int, numel: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((numel,), float(version)), "b": torch.arange(7, dtype=torch.int64) + version}


async def _stop_during_commit(daemon: RolloutDaemon, port: int, started: threading.Event) -> Any:
    """Version 0, then version 1 whose commit is slow: the daemon is told to stop while it commits."""
    task = asyncio.ensure_future(daemon.run())
    try:
        async with sender_on(port) as sender:
            await sender.send_weights(_weights(0, 64).items(), version=0)
            started.clear()
            send = asyncio.ensure_future(sender.send_weights(_weights(1, 64).items(), version=1))
            await until(started.is_set)
            daemon.stop("test: stopped mid-commit")
            return await asyncio.wait_for(send, 30)  # the ack: what the rollout holds
    finally:
        daemon.stop()
        await asyncio.wait_for(task, 30)


async def test_a_stop_during_a_slow_callable_commit_lets_it_finish_and_says_so(caplog) -> None:
    """Before: the commit (the user's function, on a thread) went on while the cancelled task aborted the
    version beside it: "version 1 dropped ... stays on version 0", then the function finished version 1
    and the daemon reported "last complete version: 1"; the trainer got no ack."""
    from lightning_weightsync.rollout.sinks.callable import CallableSink

    started, seen = threading.Event(), []

    def slow(version: int, tensors: Any) -> None:
        held = dict(tensors)
        if version == 1:
            started.set()
            threading.Event().wait(1.5)  # a slow apply (a model reload, a copy to devices)
        seen.append((version, sorted(held)))

    port = free_port()
    cfg = daemon_cfg(port, rollout__sink__type="callable", rollout__identity="cb")
    daemon = RolloutDaemon(cfg, sink=CallableSink(cfg, fn=slow), handle_signals=False)
    with caplog.at_level("INFO", logger="lightning_weightsync"):
        stats = await _stop_during_commit(daemon, port, started)
    assert stats.receivers == 1 and not stats.failed  # acked: applied
    assert seen == [(0, ["b", "w"]), (1, ["b", "w"])] and daemon.sink.version == 1
    assert [(r.version, r.outcome) for r in daemon.records] == [(0, "applied"), (1, "applied")]
    said = [r.getMessage() for r in caplog.records if r.name.startswith("lightning_weightsync.rollout")]
    assert not [m for m in said if "dropped" in m], said  # the log agrees with what was applied
    assert "rollout daemon stopped (last complete version: 1)" in said, said


async def test_a_stop_during_a_safetensors_commit_leaves_the_file_whole(tmp_path) -> None:
    """The safetensors sink raced the same way: the abort's temp-file unlink against the commit's rename."""
    from safetensors.torch import load_file

    from lightning_weightsync.rollout.sinks.safetensors import SafetensorsSink, step_path

    started = threading.Event()

    class SlowDisk(SafetensorsSink):
        def _commit(self, version: int) -> None:  # the real commit, on a slow disk
            if version == 1:
                started.set()
                threading.Event().wait(1.0)
            super()._commit(version)

    port = free_port()
    cfg = daemon_cfg(port, rollout__sink__type="safetensors", rollout__sink__dir=str(tmp_path), rollout__identity="st")
    daemon = RolloutDaemon(cfg, sink=SlowDisk(cfg), handle_signals=False)
    stats = await _stop_during_commit(daemon, port, started)
    assert not stats.failed and daemon.sink.version == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0.safetensors", "step_1.safetensors"]  # no temp
    assert_same(load_file(str(step_path(tmp_path, 1))), _weights(1, 64))
    assert [(r.version, r.outcome) for r in daemon.records] == [(0, "applied"), (1, "applied")]


@pytest.fixture
def small_disk(tmp_path: Any) -> Any:
    """A 1 MiB tmpfs (a real full disk: the kernel's ENOSPC); skipped where mounting is not permitted."""
    import os
    import subprocess

    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()[:200]})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
        assert not os.path.ismount(mount)


async def test_a_full_disk_fails_the_version_names_enospc_and_the_daemon_keeps_serving(small_disk) -> None:
    """Before: ENOSPC surfaced as a raw OSError the daemon did not catch: exit 1 with a traceback (a
    crash loop under a supervisor), and the trainer saw only "broadcast of bucket 9 failed"."""
    port = free_port()
    cfg = daemon_cfg(port, rollout__sink__type="safetensors", rollout__sink__dir=str(small_disk))
    daemon = RolloutDaemon(cfg, handle_signals=False)
    async with running(daemon), sender_on(port) as sender:
        await sender.send_weights(_weights(0, 25_000).items(), version=0)  # 100 KB: fits
        with pytest.raises(PeerError) as info:
            await sender.send_weights(_weights(1, 600_000).items(), version=1)  # 2.4 MB on a 1 MiB disk
        assert "ENOSPC: No space left on device" in str(info.value) and "next one retries" in str(info.value)
        stats = await sender.send_weights(_weights(2, 25_000).items(), version=2)  # space is back: it retries
        assert not stats.failed and daemon.sink.version == 2
    assert [(r.version, r.outcome) for r in daemon.records] == [(0, "applied"), (1, "failed"), (2, "applied")]
    assert "ENOSPC" in (daemon.records[1].error or "")
    assert sorted(p.name for p in small_disk.iterdir()) == ["step_0.safetensors", "step_2.safetensors"]


TOKEN_A, TOKEN_B = "a" * 8 + "-trainer-token", "b" * 8 + "-rollout-token"


# each side names the token; which words depends on what libzmq tells that end (a mechanism mismatch, a failed
# CURVE box, or only a connection broken off mid-handshake), which varies with timing: every variant is true
OTHER_OR_NONE = "another transport.auth_token, or none"


@pytest.mark.parametrize(
    ("trainer_token", "rollout_token", "trainer_says", "rollout_says"),
    [
        (TOKEN_A, TOKEN_B, ("it uses another transport.auth_token", OTHER_OR_NONE), (OTHER_OR_NONE,)),
        (
            TOKEN_A,
            None,
            ("no transport.auth_token, and this trainer has one", OTHER_OR_NONE),
            ("a transport.auth_token, and this rollout has none",),
        ),
        (
            None,
            TOKEN_B,
            ("a transport.auth_token, and this trainer has none",),
            (OTHER_OR_NONE, "no transport.auth_token, and this rollout has one"),
        ),
    ],
    ids=["other-token", "trainer-only", "rollout-only"],
)
async def test_a_token_mismatch_is_named_on_both_sides_within_seconds(
    trainer_token: str | None,
    rollout_token: str | None,
    trainer_says: tuple[str, ...],
    rollout_says: tuple[str, ...],
    caplog,
) -> None:
    """A rollout with another `transport.auth_token` (or one on one side only) fails the handshake at once;
    both sides say so within 10 s, each naming the token, and the trainer's give-up names the refused address
    instead of asking for a rollout that is there."""
    port = free_port()
    daemon = RolloutDaemon(daemon_cfg(port, transport__auth_token=rollout_token), handle_signals=False)
    caplog.set_level("INFO", logger="lightning_weightsync")

    def said(level: str, text: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelname == level and text in r.getMessage()]

    def trainer_lines() -> list[str]:
        return said("WARNING", "refused a control connection from ") + said("WARNING", "handshakes refused from ")

    async with running(daemon), sender_on(port, transport__auth_token=trainer_token, transport__timeout_s=6) as sender:
        send = asyncio.ensure_future(sender.send_weights(version_weights(0).items(), version=0))
        try:
            # its own line names the peer's address where the kernel still tells it; on a loopback shared by a busy
            # test run another test's closed connections can make it ambiguous, and then the line waits for a retry
            # that names it, while the wait for receivers already says whose handshakes were refused and why
            await until(lambda: trainer_lines(), timeout_s=10)
            await until(
                lambda: said("ERROR", f"control handshake refused from the trainer at tcp://127.0.0.1:{port}"), 10
            )
        finally:
            with pytest.raises(WeightSyncError) as failed:
                await asyncio.wait_for(send, 30)
    trainer_side = trainer_lines()[0]
    assert any(words in trainer_side for words in trainer_says), trainer_side
    assert "set the same transport.auth_token" in trainer_side, trainer_side
    rollout_side = said("ERROR", "control handshake refused")[0]
    assert any(words in rollout_side for words in rollout_says), rollout_side
    assert "set the same transport.auth_token" in rollout_side, rollout_side
    message = str(failed.value)
    assert "handshakes refused from " in message and "set the same transport.auth_token" in message, message
    assert "start a rollout daemon" not in message, message
