"""`lightning-weightsync` as users run it: real daemon subprocesses, signals, kill -9, restarts, errors."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from lightning_weightsync import BlockingWeightSender, PeerError, WeightSender, WeightSyncError, cli, load_config
from tests.support.mp import PYTHON, free_port, popen, spawned
from tests.unit.test_sinks import assert_same, version_weights

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parent.parent.parent
CONSOLE_SCRIPT = Path(sys.executable).with_name("lightning-weightsync")
TINY = "tests.unit.test_sinks"  # the tiny module factory the sink tests share
ENV = {"PYTHONPATH": str(REPO)}  # so the daemon can import tests.unit.test_sinks:build_tiny
BUCKET_MB = 1 / 1024


def transport(port: int, timeout_s: float = 5) -> list[str]:
    return [
        f"transport.port={port}",
        f"transport.bucket_size_mb={BUCKET_MB}",
        f"transport.timeout_s={timeout_s}",
        "transport.heartbeat_interval_s=0.2",
        "transport.ready_timeout_s=3",
    ]


@contextlib.contextmanager
def rollout(tmp_path: Path, port: int, *overrides: str, name: str = "daemon", args: tuple[str, ...] = ()):
    """A `lightning-weightsync rollout` subprocess (the console script), its output in a log file."""
    log = tmp_path / f"{name}.log"
    cmd = [str(CONSOLE_SCRIPT), "rollout", *args, *transport(port), "rollout.progress=false", *overrides]
    with open(log, "w") as out, popen(cmd, env=ENV, cwd=REPO, stdout=out, stderr=subprocess.STDOUT) as proc:
        proc.log = log  # type: ignore[attr-defined]
        yield proc


def read_stats(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(predicate: Any, timeout_s: float = 60, what: str = "condition", proc: Any = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"daemon exited ({proc.returncode}) waiting for {what}:\n{proc.log.read_text()}")
        if time.monotonic() > deadline:
            log = proc.log.read_text() if proc is not None else ""
            raise AssertionError(f"timed out waiting for {what}\n{log}")
        time.sleep(0.1)


def sender_cfg(port: int, timeout_s: float = 30):
    return load_config(overrides=transport(port, timeout_s))


async def paused_weights(version: int, gate: asyncio.Event, after: int = 3):
    for i, item in enumerate(version_weights(version).items()):
        if i == after:
            await gate.wait()
        yield item


# --- trainer processes (spawned, so they can be killed) -------------------------------------------


def _hang_after(weights: Any, after: int) -> Iterator[tuple[str, torch.Tensor]]:
    for i, item in enumerate(weights):
        if i == after:
            time.sleep(600)  # a trainer wedged mid-version; the test kills it
        yield item


def trainer(port: int, versions: list[int], hang_at: int | None = None) -> None:
    with BlockingWeightSender(sender_cfg(port)) as sender:
        for version in versions:
            weights: Any = version_weights(version).items()
            if version == hang_at:
                weights = _hang_after(weights, 3)
            sender.send_weights(weights, version=version)


# --- the daemon ----------------------------------------------------------------------------------


async def test_versions_arrive_then_sigterm_mid_version_exits_clean(tmp_path: Path) -> None:
    port, out = free_port(), tmp_path / "steps"
    stats = tmp_path / "stats.jsonl"
    sink = ["rollout.sink.type=safetensors", f"rollout.sink.dir={out}"]
    with rollout(tmp_path, port, *sink, args=("--stats-jsonl", str(stats))) as proc:
        async with WeightSender(sender_cfg(port, timeout_s=5)) as sender:
            for version in (1, 2, 3):
                await sender.send_weights(version_weights(version).items(), version=version)
            gate = asyncio.Event()
            send = asyncio.ensure_future(sender.send_weights(paused_weights(4, gate), version=4))
            await asyncio.to_thread(wait_for, lambda: any(out.glob(".step_4.*.tmp")), 30, "version 4 in flight", proc)
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proc.wait, 30)
            gate.set()
            with pytest.raises(WeightSyncError) as info:
                await asyncio.wait_for(send, 60)
    log = proc.log.read_text()  # type: ignore[attr-defined]
    assert code == 0, log
    assert "SIGTERM: shutting down" in log and "Traceback" not in log
    # issue 25: the daemon said why before it went (its nack), and recorded the version it stopped in
    assert "rollout stopped mid-version: the rollout daemon is stopping (SIGTERM)" in str(info.value), info.value
    outcomes = [(r["version"], r["ok"], r["outcome"]) for r in read_stats(stats)]
    assert outcomes == [(1, True, "applied"), (2, True, "applied"), (3, True, "applied"), (4, False, "stopped")]
    assert all(r["num_chunked_tensors"] > 0 for r in read_stats(stats)[:3])
    assert sorted(p.name for p in out.iterdir()) == [f"step_{v}.safetensors" for v in (1, 2, 3)]  # no temp left
    for version in (1, 2, 3):
        assert_same(load_file(str(out / f"step_{version}.safetensors")), version_weights(version))


@pytest.mark.slow
def test_killed_trainer_then_restarted_trainer_is_served(tmp_path: Path) -> None:
    port = free_port()
    stats, dump = tmp_path / "stats.jsonl", tmp_path / "held.safetensors"
    module = ["rollout.sink.factory=tests.unit.test_sinks:build_tiny"]
    args = ("--stats-jsonl", str(stats), "--dump-on-exit", str(dump))
    with rollout(tmp_path, port, *module, args=args) as proc:
        with spawned(trainer, port, [0, 1], 1) as first:
            wait_for(lambda: len(read_stats(stats)) == 1, 60, "version 0 from the first trainer", proc)
            time.sleep(0.5)  # version 1 is in flight, wedged after 3 tensors
            first.kill()  # kill -9 mid-version
            first.join(10)
        wait_for(lambda: len(read_stats(stats)) == 2, 60, "the daemon to give up on version 1", proc)
        with spawned(trainer, port, [10, 11]) as second:
            second.join(90)
            assert second.exitcode == 0
        wait_for(lambda: len(read_stats(stats)) == 4, 30, "versions 10 and 11", proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.log.read_text()  # type: ignore[attr-defined]
    records = read_stats(stats)
    assert [(r["version"], r["ok"]) for r in records] == [(0, True), (1, False), (10, True), (11, True)]
    assert records[1]["outcome"] in ("timeout", "failed", "aborted")
    held = load_file(str(dump))
    assert_same(held, version_weights(11))


async def test_safetensors_files_stay_whole_after_kill_9_of_the_daemon(tmp_path: Path) -> None:
    port, out = free_port(), tmp_path / "steps"
    sink = ["rollout.sink.type=safetensors", f"rollout.sink.dir={out}", "rollout.sink.keep_last=5"]
    async with WeightSender(sender_cfg(port, timeout_s=5)) as sender:
        with rollout(tmp_path, port, *sink, name="first") as proc:
            for version in (0, 1):
                await sender.send_weights(version_weights(version).items(), version=version)
            gate = asyncio.Event()
            send = asyncio.ensure_future(sender.send_weights(paused_weights(2, gate), version=2))
            await asyncio.to_thread(wait_for, lambda: any(out.glob(".step_2.*.tmp")), 30, "version 2 in flight", proc)
            os.killpg(proc.pid, signal.SIGKILL)
            assert await asyncio.to_thread(proc.wait, 10) == -signal.SIGKILL
        gate.set()
        with pytest.raises(WeightSyncError):
            await asyncio.wait_for(send, 60)
        finals = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
        temps = [p.name for p in out.iterdir() if p.name.startswith(".")]
        assert finals == ["step_0.safetensors", "step_1.safetensors"]
        assert len(temps) == 1 and temps[0].startswith(".step_2.")  # killed mid-write: only a temp file
        for version in (0, 1):  # complete and loadable; the half-written version never got a final name
            assert_same(load_file(str(out / f"step_{version}.safetensors")), version_weights(version))
        gone = set(sender.registered)  # the killed daemon, if the sender has not dropped it yet
        with rollout(tmp_path, port, *sink, name="second") as proc:
            # the daemon's start (a fresh Python importing torch) can take longer than timeout_s=5 on a loaded
            # machine: the version goes once it is registered, not after a guess
            deadline = time.monotonic() + 60
            while not set(sender.registered) - gone:
                assert time.monotonic() < deadline and proc.poll() is None, proc.log.read_text()  # type: ignore[attr-defined]
                await sender._control.recv(0.1)  # as test_hostile_network's _until_registered: admits the Register
            await sender.send_weights(version_weights(3).items(), version=3)
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(proc.wait, 30) == 0
    assert sorted(p.name for p in out.iterdir()) == [f"step_{v}.safetensors" for v in (0, 1, 3)]  # stale temp gone
    assert_same(load_file(str(out / "step_3.safetensors")), version_weights(3))


# --- errors: one line plus the fix, exit code 2 -------------------------------------------------


def run_cli(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CONSOLE_SCRIPT), *args],
        env={**os.environ, **ENV},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def assert_one_line_error(rc: int, stderr: str, pattern: str) -> None:
    import re

    lines = stderr.strip().splitlines()
    assert rc == 2, stderr
    assert "Traceback" not in stderr
    assert len(lines) == 2 and lines[0].startswith("lightning-weightsync: error: "), stderr
    assert lines[1].startswith("  fix: "), stderr
    assert re.search(pattern, lines[0]), lines[0]


def test_bad_factory_path_in_a_real_daemon_process(tmp_path: Path) -> None:
    result = run_cli("rollout", "rollout.sink.factory=tests.unit.test_sinks:no_such_factory")
    assert_one_line_error(result.returncode, result.stderr, r"rollout\.sink\.factory=.*has no attribute")


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["config", "show", "transport.backend=pigeon"], r"transport\.backend='pigeon' is not allowed"),
        (["config", "show", "transport.prot=1"], r"invalid config key 'transport\.prot'"),
        (["config", "show", "--config", "/nonexistent/recipe.yaml"], r"config file not found"),
        (["config", "show", "transport.port"], r"not of the form key=value"),
        (["rollout", "rollout.sink.factory=no_such_pkg.models:build"], r"cannot import module 'no_such_pkg\.models'"),
        (["rollout", f"rollout.sink.factory={TINY}.build_tiny"], r"not of the form package\.module:function"),
        (["rollout", "rollout.sink.type=callable", f"rollout.sink.target={TINY}:BUCKET"], r"not a callable"),
        (["rollout", "rollout.sink.type=safetensors"], r"rollout\.sink\.dir is not set"),
        # issue 25 item 9: a bare `rollout` says what the default sink needs and where the others are listed
        (["rollout"], r"rollout\.sink\.type=module \(the default\) needs rollout\.sink\.factory=.*rollout --help"),
        (
            ["config", "show", "transport.prot=1", "rollout.nope=2"],
            r"invalid config keys transport\.prot \(did you mean transport\.port\?\), rollout\.nope: not fields",
        ),
        # the launcher execs `vllm serve`; without vLLM it names the extra
        (["rollout", "rollout.engine=vllm", "vllm.model=m"], r"no `vllm` executable.*lightning_weightsync\[vllm\]"),
    ],
)
def test_config_errors_are_one_line_with_a_fix(argv: list[str], pattern: str, capsys: pytest.CaptureFixture) -> None:
    rc = cli.main(argv)
    assert_one_line_error(rc, capsys.readouterr().err, pattern)


def test_rollout_help_lists_every_sink_type_with_what_it_needs(capsys: pytest.CaptureFixture) -> None:
    """Issue 25 item 9: `rollout --help` named no sink type, so a new user could not find the knobs."""
    from lightning_weightsync.config import SinkType
    from lightning_weightsync.plugins import ROLLOUT_ENGINES

    with pytest.raises(SystemExit):
        cli.main(["rollout", "--help"])
    text = capsys.readouterr().out
    sinks = text.split("sinks (rollout.sink.type", 1)[-1].split("\nrollout engines")[0].splitlines()[1:]
    listed = {line.split()[0] for line in sinks if line.strip() and line[2:3] != " "}  # one line starts each
    assert listed == {t.value for t in SinkType}, text
    engines = text.split("\nrollout engines", 1)[-1].split("\nexample")[0].splitlines()[1:]
    listed = {line.split()[0] for line in engines if line.strip() and line[2:3] != " "}
    assert listed == set(ROLLOUT_ENGINES), text  # every registered engine, with what it needs
    for knob in ("rollout.sink.factory=", "rollout.sink.dir=", "rollout.sink.target="):
        assert knob in text, knob


def test_metrics_port_in_use_is_one_line(capsys: pytest.CaptureFixture) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc = cli.main(["rollout", f"rollout.sink.factory={TINY}:build_tiny", f"rollout.metrics_port={port}"])
    assert_one_line_error(rc, capsys.readouterr().err, rf"rollout\.metrics_port={port}.*cannot be bound")


def test_config_show_prints_the_resolved_config(tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("transport:\n  bucket_size_mb: 64\nrollout:\n  apply: streaming\n")
    result = run_cli("config", "show", "--config", str(recipe), "transport.port=1234")
    assert result.returncode == 0, result.stderr
    shown = yaml.safe_load(result.stdout)
    assert shown["transport"]["port"] == 1234 and shown["transport"]["bucket_size_mb"] == 64
    assert shown["rollout"]["apply"] == "streaming" and shown["rollout"]["sink"]["keep_last"] == 3


def test_bench_says_when_a_benchmark_is_missing(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(cli, "BENCHMARKS", ("that_does_not_exist",))
    assert cli.main(["bench"]) == 1
    assert "benchmark 'that_does_not_exist' was not found" in capsys.readouterr().out


def test_module_entry_point_matches_console_script() -> None:
    result = subprocess.run([PYTHON, "-m", "lightning_weightsync.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "rollout" in result.stdout and "demo" in result.stdout


# --- the demo ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_demo_runs_and_verifies(tmp_path: Path) -> None:
    result = run_cli("demo", "--steps", "3", "--workdir", str(tmp_path), timeout_s=170)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "OK: rollout holds exactly the trainer's final weights" in out and "version 3" in out
    records = read_stats(tmp_path / "versions.jsonl")
    assert [r["version"] for r in records] == [0, 1, 2, 3] and all(r["ok"] for r in records)
    assert all(r["num_chunked_tensors"] > 0 for r in records)


def test_demo_verification_catches_one_flipped_bit(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from lightning_weightsync.demo.demo import verify

    weights = version_weights(1)
    weights.pop("head.weight")  # tied to embed.weight; safetensors stores each name once
    save_file(weights, str(tmp_path / "trainer.safetensors"), metadata={"last_synced_version": "7"})
    save_file(weights, str(tmp_path / "rollout.safetensors"), metadata={"version": "7", "state": "complete"})
    ok, message = verify(tmp_path / "rollout.safetensors", tmp_path / "trainer.safetensors")
    assert ok, message
    flipped = {k: v.clone() for k, v in weights.items()}
    flipped["proj.weight"].view(torch.int32)[3, 4] ^= 1
    save_file(flipped, str(tmp_path / "rollout.safetensors"), metadata={"version": "7", "state": "complete"})
    ok, message = verify(tmp_path / "rollout.safetensors", tmp_path / "trainer.safetensors")
    assert not ok and "proj.weight: bytes differ" in message
    save_file(weights, str(tmp_path / "rollout.safetensors"), metadata={"version": "6", "state": "complete"})
    ok, message = verify(tmp_path / "rollout.safetensors", tmp_path / "trainer.safetensors")
    assert not ok and "rollout holds version 6, trainer last synced version 7" in message


def test_version_flag() -> None:
    result = subprocess.run([str(CONSOLE_SCRIPT), "--version"], capture_output=True, text=True, timeout=60)
    from lightning_weightsync import __version__

    assert result.returncode == 0 and result.stdout.strip() == f"lightning-weightsync {__version__}"


def test_console_script_imports_a_factory_from_the_current_directory(tmp_path: Path) -> None:
    """Issue 12 point 7: `rollout.sink.factory=my_models:build` with ./my_models.py, no PYTHONPATH,
    is found as `python -m` would find it (the factory raising proves it was imported and called)."""
    (tmp_path / "my_models.py").write_text("def build():\n    raise RuntimeError('imported from the cwd')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    argv = [str(CONSOLE_SCRIPT), "rollout", "rollout.sink.factory=my_models:build", "rollout.progress=false"]
    result = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert_one_line_error(result.returncode, result.stderr, r"my_models:build'? failed: RuntimeError: imported from")
    argv[2] = "rollout.sink.factory=elsewhere_models:build"
    result = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert_one_line_error(result.returncode, result.stderr, r"cannot import module 'elsewhere_models'.*PYTHONPATH")


def slow_apply(version: int, tensors: Any) -> None:
    """A callable sink whose apply takes long (`rollout.sink.target=tests.integration.test_cli:slow_apply`);
    it says when it started in the file named by $LWS_TEST_APPLYING."""
    dict(tensors)
    if version >= 1:
        Path(os.environ["LWS_TEST_APPLYING"]).write_text(str(version))
        time.sleep(60)


async def test_a_daemon_killed_mid_apply_fails_the_version_within_liveness_s(tmp_path: Path) -> None:
    """Issue 25 item 1: a rollout killed while it applied a version (kill -9: no nack, no goodbye) left the
    trainer waiting transport.timeout_s for its ack; the ack wait now asks whether it is still there."""
    port, applying = free_port(), tmp_path / "applying"
    sink = ["rollout.sink.type=callable", "rollout.sink.target=tests.integration.test_cli:slow_apply"]
    log = tmp_path / "daemon.log"
    cmd = [str(CONSOLE_SCRIPT), "rollout", *transport(port, 60), "transport.liveness_s=2", "rollout.progress=false",
           "rollout.identity=slow", *sink]  # fmt: skip
    env = {**ENV, "LWS_TEST_APPLYING": str(applying)}
    cfg = load_config(overrides=[*transport(port, 60), "transport.liveness_s=2"])
    with open(log, "w") as out, popen(cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT) as proc:
        async with WeightSender(cfg) as sender:
            await sender.send_weights(version_weights(0).items(), version=0)
            send = asyncio.ensure_future(sender.send_weights(version_weights(1).items(), version=1))
            await asyncio.to_thread(wait_for, applying.exists, 60, "the apply of version 1")
            proc.kill()
            killed = time.monotonic()
            with pytest.raises(PeerError) as info:
                await asyncio.wait_for(send, 90)
            elapsed = time.monotonic() - killed
    said = "'slow': 'disconnected before acking (its process stopped or the link is down)'"
    assert said in str(info.value), info.value
    quick = elapsed < 2 + 15  # liveness_s (+ load), far below transport.timeout_s=60
    assert quick, f"{elapsed:.1f}s"
