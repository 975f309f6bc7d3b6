"""The GPU validation kit (`./dev device-check`, tools/device_check.py) kept from rotting on CPU:
its `--dry-run` runs every step with tiny sizes and CPU stand-ins (shm for cuda_ipc, gloo for nccl,
host memory for nixl, a 1-process FSDP2 Lightning run over gloo) and must write a complete report; a broken step is
recorded with its traceback while the others still run."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.support.mp import PYTHON, output_of, popen
from tests.support.transfer import NIXL_MISSING
from tools.device_check import INJECT_ENV, REPORT_JSON, REPORT_TXT, STEP_NAMES

REPO = Path(__file__).resolve().parents[2]
DRY_RUN_BUDGET_S = 200  # the driver's own budget: a hanging step still leaves a report (about 45 s normally)
DRY_RUN_TIMEOUT_S = 260


def _dry_run(out: Path, *extra: str, env: dict[str, str] | None = None) -> tuple[int, str, dict[str, Any]]:
    module = "tools.device_check"
    cmd = [PYTHON, "-m", module, "--dry-run", "--out", str(out), "--budget-s", str(DRY_RUN_BUDGET_S)]
    cmd += extra
    run_env = {k: v for k, v in os.environ.items() if k != "OUT"}  # --out wins anyway; keep $OUT out of it
    with popen(cmd, cwd=str(REPO), env={**run_env, **(env or {})}) as proc:
        output = output_of(proc, DRY_RUN_TIMEOUT_S, "dry run")
    assert (out / REPORT_JSON).exists(), output[-4000:]
    return proc.returncode, output, json.loads((out / REPORT_JSON).read_text())


@pytest.mark.slow
def test_dry_run_writes_a_complete_report(tmp_path: Path) -> None:
    rc, output, report = _dry_run(tmp_path)
    assert {"kit", "schema", "mode", "started", "budget_s", "seconds", "steps", "summary", "ok"} <= set(report)
    assert report["mode"] == "dry-run" and list(report["steps"]) == STEP_NAMES
    steps = report["steps"]
    for name, step in steps.items():
        assert {"status", "seconds", "timeout_s", "what", "log"} <= set(step), name
        assert (tmp_path / step["log"]).exists(), name
    # pytest_gpu runs the existing suite's files: their own failures are not the kit's, but the runs happen
    assert steps["pytest_gpu"]["status"] in ("ok", "fail"), steps["pytest_gpu"]
    assert steps["pytest_gpu"]["marked_gpu"]["exit_code"] in (0, 5)
    assert sum(steps["pytest_gpu"]["backends"]["counts"].values()) > 0
    for name in ("env", "cuda_ipc_stream", "pack_merge", "lightning_fsdp", "overlap_steps", "nccl"):
        assert steps[name]["status"] == "ok", (name, steps[name].get("error"), steps[name].get("log_tail"))
    # the stream steps: bitwise per version, ratios against the copy baseline of the same run
    for name, backend in (("cuda_ipc_stream", "shm"), ("nccl", "gloo")):
        s = steps[name]
        assert s["backend"] == backend and s["bitwise"] is True and s["ratio_vs_copy"] > 0
        assert s["baseline_copy_gbps"] > 0 and s["num_tensors"] == 399 + 4
        for rnd in s["rounds"]:
            assert rnd["bitwise"] is True and rnd["ratio_vs_copy"] > 0 and rnd["best_gbps"] > 0
            assert all(v["bitwise"] is True and v["receivers"] == 1 for v in rnd["versions"])
    assert len(steps["cuda_ipc_stream"]["rounds"]) == 2  # two bucket sizes
    for row in steps["pack_merge"]["results"]:
        assert row["split_pack_ratio"] > 0 and row["merge_into_ratio"] > 0
    # the nixl step: our backend between two processes (host memory here), raw NIXL of the same bytes beside it
    nixl = steps["nixl_stream"]
    if NIXL_MISSING is None:
        assert nixl["status"] == "ok", (nixl.get("error"), nixl.get("failed_checks"), nixl.get("log_tail"))
        assert nixl["backend"] == "nixl" and nixl["bitwise"] is True and nixl["num_tensors"] == 399 + 4
        raw = nixl["raw_nixl"]
        assert raw["mem_type"] == "DRAM" and raw["bitwise"] is True and raw["read_gbps"] > 0 and raw["pieces"] > 2
        assert nixl["ratio_vs_raw_nixl"] > 0 and nixl["failed_checks"] == []
        for rnd in nixl["rounds"]:
            assert rnd["bitwise"] is True and rnd["ratio_vs_raw_nixl"] > 0 and len(rnd["versions"]) == 2
    else:
        assert nixl["status"] == "skipped" and "NIXL" in nixl["reason"]
    fsdp = steps["lightning_fsdp"]
    assert fsdp["bitwise"] is True and fsdp["versions"] == [0, 1, 2] and fsdp["failed_checks"] == []
    # the overlap step: the three modes timed in one run, each with its stall and its N steps
    overlap = steps["overlap_steps"]
    assert sorted(overlap["modes"]) == ["blocking", "no sync", "overlap"] and overlap["failed_checks"] == []
    assert all(m["total_s"] > 0 for m in overlap["modes"].values())
    assert overlap["modes"]["no sync"]["median_stall_s"] < overlap["modes"]["blocking"]["median_stall_s"]
    # no GPU here: the CUDA-event check says why it did not run
    assert steps["event_fence"]["status"] == "skipped" and "CUDA" in steps["event_fence"]["reason"]
    assert rc == (0 if report["ok"] else 1)
    text = (tmp_path / REPORT_TXT).read_text()
    assert all(name in text for name in STEP_NAMES) and "bitwise true" in text and "ratio" in text
    assert "[cuda_ipc_stream] ok" in output  # timestamped progress lines


@pytest.mark.slow
def test_a_broken_step_is_recorded_and_the_others_still_run(tmp_path: Path) -> None:
    rc, _, report = _dry_run(tmp_path, "--only", "env,event_fence", env={INJECT_ENV: "env"})
    assert rc == 1 and report["ok"] is False and list(report["steps"]) == ["env", "event_fence"]
    broken = report["steps"]["env"]
    assert broken["status"] == "error" and "failure injected" in broken["error"]
    assert "RuntimeError" in broken["traceback"]
    assert report["steps"]["event_fence"]["status"] == "skipped"
    assert report["summary"] == {"ok": 0, "skipped": 1, "fail": 1}


def test_install_runs_where_the_package_s_dependencies_are_missing(tmp_path: Path) -> None:
    """`./dev device-check` on the GPU machine installs omegaconf, pyzmq and msgspec first: the installer
    must run by path without importing the package (which imports them). Here omegaconf is made
    unimportable; the installer still starts and says what it lacks (no prepared wheels)."""
    script = REPO / "tools" / "device_check.py"
    code = (
        "import runpy, sys; sys.modules['omegaconf'] = None; sys.modules['zmq'] = None; "
        f"sys.argv = [{str(script)!r}, '--install']; runpy.run_path({str(script)!r}, run_name='__main__')"
    )
    with popen([PYTHON, "-c", code], cwd=str(tmp_path)) as proc:
        output = output_of(proc, 60, "install")
    assert "ModuleNotFoundError" not in output and "ImportError" not in output, output
    assert proc.returncode in (0, 2) and ("present on this machine" in output or "--prepare" in output), output
