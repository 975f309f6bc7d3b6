"""Chaos over real links: every process in its own network namespace behind a veth link, links cut
and degraded under a running sender and receivers, with `transport.auth_token` set (CURVE, sealed
messages, rendezvous over the control plane). Correctness is bitwise; every fault is bounded.

Skipped, with the reason, where network namespaces cannot be created (not root, no `ip`).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lightning_weightsync.transport.process import process_group
from tools.chaos_roles import TIMEOUT_S
from tools.netlab import REPO, Lab, netlab, skip_reason

ROLES = "tools.chaos_roles"  # what each namespace runs (shared with tools/soak.py)
_SKIP = skip_reason()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_SKIP is not None, reason=f"network namespaces unavailable: {_SKIP}"),
]

# -- the harness ---------------------------------------------------------------------------------------


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait(what: str, predicate: Callable[[], Any], timeout_s: float, logs: list[Path]) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    tails = "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text().splitlines()[-15:]) for p in logs if p.exists())
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}\n{tails}")


@pytest.fixture
def lab() -> Iterator[Lab]:
    with netlab() as lab:
        yield lab


def _start(
    lab: Lab, names: list[str], slow_s: float = 0.01, min_receivers: int = 1, pace_s: float = 0.05
) -> dict[str, Path]:
    for name in ("s", *names):
        lab.add(name)
    files = {name: lab.workdir / f"{name}.jsonl" for name in ("s", *names)}
    s_ip = lab.nodes["s"].ip
    lab.spawn("s", f"from {ROLES} import chaos_sender as f; f({s_ip!r}, "
                   f"{str(files['s'])!r}, {min_receivers}, 0.2, {pace_s})", lab.workdir / "s.log")  # fmt: skip
    for name in names:
        args = f"{s_ip!r}, {name!r}, {str(files[name])!r}, {slow_s}"
        code = f"from {ROLES} import chaos_receiver as f; f({args})"
        lab.spawn(name, code, lab.workdir / f"{name}.log")
    return files


def _all_logs(lab: Lab) -> list[Path]:
    return sorted(lab.workdir.glob("*.log")) + sorted(lab.workdir.glob("*.jsonl"))


def _assert_bitwise(files: dict[str, Path]) -> None:
    for name, path in files.items():
        for e in _events(path):
            if e["event"] == "ok":
                assert e["bitwise"], f"{name}: version {e['version']} arrived corrupted"


def test_partitioned_receiver_fails_bounded_others_go_on_and_it_rejoins(lab: Lab) -> None:
    files = _start(lab, ["r1", "r2"], slow_s=0.02)
    logs = _all_logs(lab)
    _wait("a version reaching both receivers", lambda: any(
        e["event"] == "sent" and e["receivers"] == 2 for e in _events(files["s"])), 120, logs)  # fmt: skip
    mark = time.time()
    start = _wait("r2 starting a version", lambda: next(
        (e for e in _events(files["r2"]) if e["event"] == "start" and e["t"] > mark), None), 60, logs)  # fmt: skip
    lab.cut("r2")
    cut_at = time.time()
    cut_version = start["version"]
    # bounded: the sender fails that version (or r2 is dropped from it) well within timeout_s + slack
    failed = _wait("the sender to fail the cut version", lambda: next(
        (e for e in _events(files["s"]) if e["version"] >= cut_version and e["event"] == "failed"), None),
        TIMEOUT_S * 3 + 20, _all_logs(lab))  # fmt: skip
    assert failed["t"] - cut_at < TIMEOUT_S * 3 + 20
    assert "r2" in failed["error"], failed  # the failure names the partitioned receiver
    # the others go on: r1 receives later versions whole while r2 is cut off
    _wait("r1 to receive a later version", lambda: any(
        e["event"] == "ok" and e["version"] > failed["version"] for e in _events(files["r1"])), 60, logs)  # fmt: skip
    # nothing half-applied: r2 either had every byte of the cut version before the link went (its
    # ack was lost: "ok", checked bitwise below) or failed it; it never reports a partial version
    lab.heal("r2")
    healed = time.time()
    _wait("r2 to rejoin and receive a version", lambda: any(
        e["event"] == "ok" and e["t"] > healed for e in _events(files["r2"])), 90, _all_logs(lab))  # fmt: skip
    _wait("a version reaching both again", lambda: any(
        e["event"] == "sent" and e["receivers"] == 2 and e["t"] > healed
        for e in _events(files["s"])), 60, logs)  # fmt: skip
    _assert_bitwise(files)


def test_delay_and_loss_versions_still_complete(tmp_path: Path) -> None:
    """50 ms each way and 1% loss in both directions. The kernel here has no sch_netem, so the link is
    `bench.netem.EmulatedLink`: a user-space wire between two namespaces (TUN devices), under the real
    kernel TCP stack, which retransmits what the wire drops."""
    from lightning_weightsync.bench.netem import EmulatedLink, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    files = {"s": tmp_path / "s.jsonl", "r1": tmp_path / "r1.jsonl"}
    with EmulatedLink(delay_us=50_000, loss_pct=1.0, seed=7) as link, contextlib.ExitStack() as procs:
        s_ip = link.ip[0]
        roles = [
            (0, "s", f"from {ROLES} import chaos_sender as f; f({s_ip!r}, "
                     f"{str(files['s'])!r}, 1, 0.2, 0.0)"),
            (1, "r1", f"from {ROLES} import chaos_receiver as f; f({s_ip!r}, 'r1', "
                      f"{str(files['r1'])!r}, 0.0)"),
        ]  # fmt: skip
        for side, name, code in roles:
            log = (tmp_path / f"{name}.log").open("w")
            procs.enter_context(log)
            cmd = [*link.exec_args(side), sys.executable, "-c", code]
            env = {"GLOO_SOCKET_IFNAME": link.dev[side], "PYTHONPATH": str(REPO)}
            procs.enter_context(process_group(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
        logs = sorted(tmp_path.glob("*.log")) + sorted(tmp_path.glob("*.jsonl"))
        _wait("three versions over the degraded link", lambda: sum(
            e["event"] == "ok" for e in _events(files["r1"])) >= 3, 240, logs)  # fmt: skip
    _assert_bitwise(files)


def test_sender_behind_a_cut_link_receivers_fail_in_time_and_serve_the_restarted_sender(lab: Lab) -> None:
    files = _start(lab, ["r1", "r2"], slow_s=0.02, pace_s=0.1)  # a version is ~4 s on the wire (each wait < timeout_s)
    logs = _all_logs(lab)
    for name in ("r1", "r2"):
        _wait(f"{name} to receive a version", lambda n=name: any(
            e["event"] == "ok" for e in _events(files[n])), 120, logs)  # fmt: skip
    mark = time.time()
    _wait("a version in flight", lambda: any(
        e["event"] == "start" and e["t"] > mark for e in _events(files["r1"])), 60, logs)  # fmt: skip
    lab.cut("s")
    cut_at = time.time()
    for name in ("r1", "r2"):
        fail = _wait(f"{name} to fail the version", lambda n=name: next(
            (e for e in _events(files[n]) if e["event"] == "fail" and e["t"] > cut_at), None),
            TIMEOUT_S * 2 + 15, _all_logs(lab))  # fmt: skip
        assert fail["t"] - cut_at < TIMEOUT_S * 2 + 15, fail
    for proc in list(lab._procs[:1]):  # the first spawned process is the sender
        lab.kill(proc)
    lab.heal("s")
    healed = time.time()
    restarted = lab.workdir / "s2.jsonl"
    s_ip = lab.nodes["s"].ip
    code = f"from {ROLES} import chaos_sender as f; f({s_ip!r}, {str(restarted)!r}, 2, 0.2)"
    lab.spawn("s", code, lab.workdir / "s2.log")
    files["s2"] = restarted
    for name in ("r1", "r2"):
        _wait(f"{name} to serve the restarted sender", lambda n=name: any(
            e["event"] == "ok" and e["t"] > healed for e in _events(files[n])), 120, _all_logs(lab))  # fmt: skip
    _assert_bitwise(files)
