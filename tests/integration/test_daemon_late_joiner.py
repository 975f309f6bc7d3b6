"""Late joining configured, in real `lightning-weightsync rollout` processes: a daemon serves the version its sink
committed (`rollout.serve_port`), a daemon started later takes it from that peer (`rollout.catch_up_from`) before it
registers with the trainer, which never sends it that version; then both take the trainer's next one, bitwise.
"""

from __future__ import annotations

import asyncio
import re
import signal
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
from safetensors.torch import load_file

from lightning_weightsync import WeightSender, cli, load_config
from tests.integration.test_cli import (
    TINY,
    assert_one_line_error,
    read_stats,
    rollout,
    run_cli,
    transport,
    wait_for,
)
from tests.support.mp import free_port
from tests.unit.test_sinks import assert_same, version_weights

pytestmark = pytest.mark.timeout(180)

SERVING = re.compile(r"serving the installed version to late joiners at (\S+:\d+)")
METRICS_ON = ("rollout.metrics_port=0",)
METRICS = re.compile(r"metrics on (http://\S+/metrics)")


def log_of(proc: object) -> str:
    return proc.log.read_text()  # type: ignore[attr-defined]


def serve_address(proc: object) -> str:
    wait_for(lambda: SERVING.search(log_of(proc)) is not None, 60, "the serve's address", proc)
    found = SERVING.search(log_of(proc))
    assert found is not None
    return found.group(1)


def counters(proc: object) -> dict[str, float]:
    """The late-joining counters a daemon's /metrics says now."""
    found = METRICS.search(log_of(proc))
    assert found is not None, log_of(proc)
    with urllib.request.urlopen(found.group(1), timeout=10) as reply:
        text = reply.read().decode()
    names = ("peer_served", "peer_released", "caught_up")
    return {
        n: float(m.group(1)) for n in names if (m := re.search(rf"^weightsync_rollout_{n}_total (\S+)$", text, re.M))
    }


def stop(proc: object) -> int:
    proc.send_signal(signal.SIGTERM)  # type: ignore[attr-defined]
    code: int = proc.wait(30)  # type: ignore[attr-defined]
    return code


@pytest.mark.parametrize("verify", ["full", "sample"])
async def test_a_daemon_catches_up_from_a_serving_daemon_then_both_take_the_trainers_next_version(
    tmp_path: Path, verify: str
) -> None:
    """`verify`: the trainer's and the rollouts' transport.verify: with full the serve checks every tensor it
    pulls against the trainer's fingerprint, with sample those the trainer fingerprinted (and says so)."""
    port, dump, out, stats = free_port(), tmp_path / "a.safetensors", tmp_path / "b", tmp_path / "b.jsonl"
    both = (f"transport.verify={verify}", *METRICS_ON)
    serving = (*both, f"rollout.sink.factory={TINY}:build_tiny", "rollout.serve_port=0", "rollout.identity=a")
    async with WeightSender(load_config(overrides=[*transport(port, 30), both[0]])) as sender:
        with rollout(tmp_path, port, *serving, name="a", args=("--dump-on-exit", str(dump))) as a:
            stats1 = await sender.send_weights(version_weights(1).items(), version=1)
            assert stats1.receivers == 1 and sender.registered == ["a"]
            peer = await asyncio.to_thread(serve_address, a)
            joiner = (*both, "rollout.sink.type=safetensors", f"rollout.sink.dir={out}", "rollout.identity=b")
            catch_up = (f"rollout.catch_up_from=[{peer}]", "rollout.catch_up_wait_s=10")
            with rollout(tmp_path, port, *joiner, *catch_up, name="b", args=("--stats-jsonl", str(stats))) as b:
                await asyncio.to_thread(wait_for, lambda: "rollout daemon ready" in log_of(b), 60, "b's start", b)
                assert_same(load_file(str(out / "step_1.safetensors")), version_weights(1))  # what a holds, bitwise
                sender.settings = replace(sender.settings, min_receivers=2)  # b registers once it caught up
                stats2 = await sender.send_weights(version_weights(2).items(), version=2)
                assert stats2.receivers == 2 and sender.registered == ["a", "b"]
                joined = await asyncio.to_thread(counters, b)
                assert joined == {"peer_served": 0, "peer_released": 0, "caught_up": 1}, joined
                assert (await asyncio.to_thread(counters, a))["peer_served"] == 1
                assert await asyncio.to_thread(stop, b) == 0, log_of(b)
            assert await asyncio.to_thread(stop, a) == 0, log_of(a)
    assert re.search(rf"caught up with version 1 from the peer at {re.escape(peer)} in [0-9.]+ s", log_of(b)), log_of(b)
    assert "peer served version 1 to 1 joiners" in log_of(a), log_of(a)
    assert [(r["version"], r["outcome"]) for r in read_stats(stats)] == [(2, "applied")]  # the trainer sent b only 2
    assert_same(load_file(str(out / "step_2.safetensors")), version_weights(2))
    assert_same(load_file(str(dump)), version_weights(2))
    assert "Traceback" not in log_of(a) + log_of(b)
    partial = re.search(r"serving version 1 with (\d+) of its (\d+) tensors checked", log_of(a))
    assert (partial is None) == (verify == "full"), log_of(a)


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("rollout.catch_up_from=[no-port-here]", r"rollout\.catch_up_from: 'no-port-here' is not host:port"),
        ("rollout.catch_up_from=[10.0.0.7:70000]", r"rollout\.catch_up_from: '10\.0\.0\.7:70000'"),
        ("rollout.serve_port=65536", r"rollout\.serve_port=65536 is out of range"),
        ("rollout.catch_up_wait_s=0", r"rollout\.catch_up_wait_s=0"),
    ],
)
def test_bad_late_joining_knobs_fail_at_start_up_naming_the_key(
    override: str, pattern: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = cli.main(["rollout", override, f"rollout.sink.factory={TINY}:build_tiny"])
    assert_one_line_error(rc, capsys.readouterr().err, pattern)


def test_serving_from_a_sink_that_keeps_no_tensors_fails_at_start_up(tmp_path: Path) -> None:
    sink = ["rollout.sink.type=safetensors", f"rollout.sink.dir={tmp_path}", "rollout.progress=false"]
    result = run_cli("rollout", "rollout.serve_port=0", *sink, timeout_s=30)  # a real daemon process
    pattern = r"rollout\.serve_port=0: the safetensors sink keeps no tensors to serve .*rollout\.serve_port=-1"
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert re.search(rf"lightning-weightsync: error: {pattern}", result.stderr), result.stderr
