"""`SyncDriver`, the one sync both integrations run: every rank gathers, global rank 0 sends, all agree.

Its failure paths, each with a test that fails when the guard is removed (tools/plant_check.py
plants each one): a send that never started still joins the other ranks' all-gathers, and a bug is not
a rollout failure (`on_failure: warn` skips a version a rollout lost, never a TypeError).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_weightsync import load_config
from lightning_weightsync.trainer.driver import SyncDriver
from tests.integration.test_gather import make_net
from tests.support.collectives import Lockstep
from tests.support.mp import free_port, run_workers

WORLD = 2
WORKER_TIMEOUT_S = 90


def _cfg(*overrides: str) -> Any:
    return load_config(overrides=["transport.port=0", "transport.timeout_s=20", *overrides])


def _fsdp2_net() -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    net = make_net()
    for block in net.blocks:
        fully_shard(block)
    return fully_shard(net)


def _init(rank: int, port: int) -> dist.Store:
    import faulthandler

    faulthandler.dump_traceback_later(WORKER_TIMEOUT_S - 10, exit=True)  # a hung worker shows where
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    return store


def _unpausable_rollout_worker(rank: int, port: int, dead_url: str) -> dict[str, Any]:
    """Rank 0's rollout cannot be paused, so its send never starts; rank 1 is inside FSDP2's all-gathers."""
    store = _init(rank, port)
    try:
        model = _fsdp2_net()
        cfg = _cfg("trainer.min_receivers=0", "trainer.on_failure=warn", f"vllm.urls=[{dead_url}]")
        driver = SyncDriver(cfg, rank=rank, device=torch.device("cpu"), prefix=None)
        driver.start()
        try:
            # every collective checked against the other rank's before it runs: a rank that skips the
            # gather shows up as a mismatch (or as the other rank not arriving), not as a hang
            with Lockstep(store, rank, WORLD, "unpausable") as lockstep:
                delivered = driver.sync(model, 1)
        finally:
            driver.close()
        return {"delivered": delivered, "failures": driver.record.failures, "collectives": len(lockstep.issued)}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_send_that_never_started_still_joins_the_gather() -> None:
    """Issue 25 item 8: with the drain removed, the sending rank skipped its share of FSDP's all-gathers
    when its rollout could not be paused, and the other ranks waited in them."""
    dead = f"http://127.0.0.1:{free_port()}"
    port = free_port()
    results = run_workers(_unpausable_rollout_worker, [(r, port, dead) for r in range(WORLD)], timeout_s=120)
    assert [r["delivered"] for r in results] == [False, False]  # skipped on every rank (on_failure=warn)
    assert [r["failures"] for r in results] == [1, 1]
    assert results[0]["collectives"] == results[1]["collectives"] > len(list(make_net().parameters()))


def test_a_bug_is_not_a_rollout_failure_under_warn() -> None:
    """Issue 25 item 8: `on_failure: warn` skips a version a rollout lost; a bug in the caller (here a
    version that is not an int, which the sender refuses with a TypeError) must still raise."""
    driver = SyncDriver(_cfg("trainer.min_receivers=0", "trainer.on_failure=warn"), rank=0, device=None, prefix=None)
    driver.start()
    try:
        assert driver.sync(torch.nn.Linear(2, 2), 1) is True  # the policy is warn, and a good sync goes through
        with pytest.raises(TypeError, match="version must be an int"):
            driver.sync(torch.nn.Linear(2, 2), 2.5)  # type: ignore[arg-type]
    finally:
        driver.close()
    assert driver.record.failures == 1 and driver.record.last_synced_version == 1


def test_warn_with_no_rollout_logs_once_and_later_syncs_fail_at_once(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 25 item 1: under `on_failure: warn` each failed sync was logged twice (the sender's "abandoned"
    and the driver's "skipped") and every step waited transport.timeout_s again for a rollout that was
    not there. Now: the first sync waits timeout_s (the rollout may still be starting), later ones fail at
    once (within transport.liveness_s), and one WARNING says so for the whole outage."""
    cfg = _cfg("trainer.min_receivers=1", "trainer.on_failure=warn", "transport.timeout_s=1", "transport.liveness_s=30")
    driver = SyncDriver(cfg, rank=0, device=None, prefix=None)
    driver.start()
    module = torch.nn.Linear(2, 2)
    try:
        with caplog.at_level("DEBUG", logger="lightning_weightsync"):
            outcomes = [driver.sync(module, version) for version in range(4)]
            started = time.monotonic()
            driver.sync(module, 4)
            later = time.monotonic() - started
    finally:
        driver.close()
    assert outcomes == [False] * 4 and driver.record.failures == 5
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "waiting" not in r.getMessage()]
    assert len(warnings) == 1 and "version 0 failed, skipped (trainer.on_failure=warn)" in warnings[0], warnings
    skipped = [r.getMessage() for r in caplog.records if "failed, skipped" in r.getMessage()]
    assert len(skipped) == 5, skipped  # the others at DEBUG
    quick = later < 30  # not liveness_s=30 (nor timeout_s): the rollout is known to be missing
    assert quick, f"{later:.1f}s"


SHOW_LOGS = """
import torch
from lightning_weightsync import load_config
from lightning_weightsync.trainer.driver import SyncDriver

cfg = load_config(overrides=["transport.port=0", "trainer.min_receivers=0"])
driver = SyncDriver(cfg, rank=0, device=None, prefix=None)
driver.start()
driver.sync(torch.nn.Linear(2, 2), 0)
driver.close()
"""


def test_one_line_per_version_sent_is_shown_without_any_logging_setup() -> None:
    """Issue 25 item 1: the trainer printed no line per version: the sender's INFO line went to Python's
    last-resort handler, which shows WARNING and up only. A script that configures no logging now sees it."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", SHOW_LOGS], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "versions.sender: version 0" in line]
    assert len(lines) == 1 and "INFO" in lines[0], proc.stderr[-3000:]  # no rollout: "no receivers; nothing sent"
