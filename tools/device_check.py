"""One-command GPU validation kit: `./dev device-check` (see docs/backends.md, "Validating on a GPU").

The nccl, cuda_ipc and hccl paths are written but have not run on hardware, and a GPU machine is lent
rarely and briefly. This driver runs everything worth knowing in one go, in under 8 minutes, and
writes a JSON + text report to $OUT (else ./out/device_check/):

  env              torch / CUDA / GPU / dependency versions, and which dependencies came from .device/wheels
  pytest_gpu       `pytest -m gpu`, then tests/integration/test_backends.py (the hardware runs live there)
  cuda_ipc_stream  sender and receiver processes on one GPU, transport.backend=cuda_ipc: a full Qwen3-8B-shaped
                   bf16 stream (399 tensors, 15.3 GiB), bitwise per version, throughput as a ratio of a
                   device-to-device copy of the same bytes measured in the same sender process
  pack_merge       split_weight_chunks + pack and merge_weight_chunks(into=) on the GPU vs device memcpy
                   (the chunking benchmark's bench_one_size, on cuda)
  event_fence      CUDA-event buffer reuse: NcclBackend.broadcast waits for the packing event before its
                   stream reads the bucket, and returns only when that stream finished (so the double-buffered
                   bucket is never repacked while a broadcast still reads it); with a negative control
  nixl_stream      two processes on one GPU, transport.backend=nixl: VRAM to VRAM through UCX, a Qwen3-8B / 2
                   stream after raw NIXL READs of the same bytes between the same processes (the baseline):
                   bitwise, GB/s, ratio to raw NIXL (tools/device_nixl.py; NIXL travels as a cut-down
                   nixl-cu13, tools/nixl_wheel.py)
  lightning_fsdp   a 1-GPU Lightning FSDP2 (ModelParallelStrategy) run with WeightSyncCallback into a cuda_ipc
                   receiver in another process (the GPU gather path), final weights compared bitwise
  overlap_steps    1-GPU FSDP2 training of a 0.5 B-parameter LM, no sync vs blocking vs trainer.overlap into a
                   rollout daemon on the host, same run: the stall a sync and the time of N steps
  nccl             the same stream as cuda_ipc_stream over NCCL between cuda:0 and cuda:1; skipped with the
                   reason on a 1-GPU machine (one GPU cannot hold two NCCL ranks)

Every step runs in its own subprocess (own process group) with its own timeout, inside one overall
budget; a step that fails, hangs or crashes records its traceback / log tail and the others still run.
`--dry-run` runs the same steps on CPU with tiny sizes (shm stands in for cuda_ipc, gloo for nccl, nixl
moves host memory, the FSDP run uses gloo) so CI keeps the kit from rotting (tests/integration/test_device_check.py).

    python -m tools.device_check [--dry-run] [--out DIR] [--budget-s 450] [--only a,b]
    python -m tools.device_check --prepare   # here (PyPI access): wheels for the GPU machine
    python -m tools.device_check --install   # on the GPU machine: install them from there

Module level imports are stdlib only: `--install` runs before pyzmq / omegaconf / msgspec exist.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import queue as queue_mod
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # also when run by path (`--install`, before the package's dependencies exist)

from tools.device_common import (  # noqa: E402 - stdlib only, as this module's own imports
    PROGRESS,
    Skip,
    check_results,
    cuda_sync,
    make_tensor,
    now,
    progress,
    queue_get,
)

MODULE = "tools.device_check"  # each step runs as `python -m MODULE --step <name>`
DEVICE_DIR = REPO / ".device"
WHEEL_DIR = DEVICE_DIR / "wheels"
SITE_DIR = DEVICE_DIR / "site"
MANIFEST = "manifest.json"
REPORT_JSON = "device_check.json"
REPORT_TXT = "device_check.txt"
DEFAULT_BUDGET_S = 450.0  # the hard limit is 8 minutes; leave room for start-up and the report
INJECT_ENV = "LWS_DEVICE_CHECK_INJECT_FAILURE"  # a step name: that step raises (tests of failure isolation)
GiB = 1024**3
MiB = 1024**2

# What the GPU machine lacks (pyzmq, omegaconf, msgspec) and what the test run needs; each is installed
# there only when its import name is missing, so the machine's own packages are never shadowed.
# (distribution, import name); versions are the ones installed in this repo's .venv.
WHEELS: list[tuple[str, str]] = [
    ("pyzmq", "zmq"),
    ("omegaconf", "omegaconf"),
    ("msgspec", "msgspec"),
    ("PyYAML", "yaml"),
    ("antlr4-python3-runtime", "antlr4"),  # omegaconf < 2.4 needs it; skipped when .venv has none
    ("pytest", "pytest"),
    ("pluggy", "pluggy"),
    ("iniconfig", "iniconfig"),
    ("pytest-asyncio", "pytest_asyncio"),
    ("pytest-timeout", "pytest_timeout"),
    ("hypothesis", "hypothesis"),
    ("sortedcontainers", "sortedcontainers"),
    ("Pygments", "pygments"),
    ("packaging", "packaging"),
    ("typing_extensions", "typing_extensions"),
]
# NIXL for the nixl_stream step, which no GPU image has: the CUDA-13 build (the GPU machine's torch is CUDA 13) of
# the release this environment's nixl-cu12 is (what the CPU tests ran; NIXL_VERSION without one), cut down to what
# the nixl backend loads by tools/nixl_wheel.py: the full wheel (59 MiB) would not fit beside the rest of
# what the device tool carries (64 MiB in all).
NIXL_GPU_DIST, NIXL_GPU_MODULE, NIXL_VERSION = "nixl-cu13", "nixl_cu13", "1.5.1"
PLATFORM_ARGS = [
    "--only-binary=:all:",
    "--python-version",
    "3.12",
    "--implementation",
    "cp",
    "--platform",
    "manylinux_2_28_x86_64",
    "--platform",
    "manylinux_2_17_x86_64",
]


# ====================================================================================== wheels


def prepare(wheel_dir: Path = WHEEL_DIR) -> int:
    """Download the wheels the GPU machine lacks (versions as installed here) into `wheel_dir`."""
    from importlib import metadata

    wheel_dir.mkdir(parents=True, exist_ok=True)
    if SITE_DIR.exists():  # built for this machine's Python, not the GPU machine's: must not travel
        import shutil

        shutil.rmtree(SITE_DIR)
    for old in wheel_dir.glob("*.whl"):
        old.unlink()
    specs: list[str] = []
    entries: list[dict[str, str | None]] = []
    for dist, module in WHEELS:
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            print(f"  {dist}: not installed in {sys.prefix}; not needed by this environment, skipped")
            continue
        specs.append(f"{dist}=={version}")
        entries.append({"dist": dist, "version": version, "module": module})
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM_ARGS, "-d", str(wheel_dir), *specs]
    print("$ " + " ".join(cmd))
    subprocess.run(cmd, check=True, timeout=600)
    files = sorted(p.name for p in wheel_dir.glob("*.whl"))
    for entry in entries:
        stem = _normalize(str(entry["dist"]))
        entry["file"] = next((f for f in files if _normalize(f.split("-")[0]) == stem), None)
        if entry["file"] is None:
            raise SystemExit(f"no wheel downloaded for {entry['dist']}")
    entries.append(_prepare_nixl(wheel_dir))
    files = sorted(p.name for p in wheel_dir.glob("*.whl"))
    (wheel_dir / MANIFEST).write_text(json.dumps({"python": "3.12", "wheels": entries}, indent=2))
    total = sum(p.stat().st_size for p in wheel_dir.iterdir())
    print(
        f"{len(files)} wheels, {total / MiB:.1f} MiB in {wheel_dir} (carry it: it is git-ignored; the device tool "
        "carries 64 MiB of working tree in all)"
    )
    return 0


def _prepare_nixl(wheel_dir: Path) -> dict[str, Any]:
    """Download the GPU machine's NIXL wheel and write its cut-down copy into `wheel_dir`; its manifest entry."""
    from importlib import metadata

    from tools.nixl_wheel import strip_nixl_wheel

    try:
        version = metadata.version("nixl-cu12")
    except metadata.PackageNotFoundError:
        version = NIXL_VERSION
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM_ARGS, "-d", tmp]
        cmd.append(f"{NIXL_GPU_DIST}=={version}")
        print("$ " + " ".join(cmd))
        subprocess.run(cmd, check=True, timeout=600)
        (source,) = Path(tmp).glob("*.whl")
        report = strip_nixl_wheel(source, wheel_dir)
    print(
        f"  {report.source} ({report.source_bytes / MiB:.1f} MiB) -> {report.output} ({report.output_bytes / MiB:.1f}"
        f" MiB): the UCX plug-in, UCX and its {report.notes['ucx_modules']} modules kept, {len(report.dropped)} "
        "files dropped (tools/nixl_wheel.py says which and why)"
    )
    return {
        "dist": NIXL_GPU_DIST,
        "version": version,
        "module": NIXL_GPU_MODULE,
        "file": report.output,
        "cut_from": report.source,
        "cut_from_bytes": report.source_bytes,
    }


def _normalize(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def install(wheel_dir: Path = WHEEL_DIR, target: Path = SITE_DIR) -> int:
    """Install into `target` the wheels whose module this Python lacks (no index, no deps)."""
    import importlib.util

    manifest_path = wheel_dir / MANIFEST
    if not manifest_path.exists():
        print(f"no {manifest_path}: run `./dev device-check --prepare` on a machine with PyPI access first")
        return 2
    manifest = json.loads(manifest_path.read_text())
    target.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(target))
    missing = [w for w in manifest["wheels"] if importlib.util.find_spec(w["module"]) is None]
    present = [w["dist"] for w in manifest["wheels"] if w not in missing]
    print(f"{now()} present on this machine: {', '.join(present) or '-'}")
    if not missing:
        print(f"{now()} nothing to install")
        return 0
    files = [str(wheel_dir / w["file"]) for w in missing]
    print(f"{now()} installing into {target}: {', '.join(w['dist'] + '==' + w['version'] for w in missing)}")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--upgrade",
        "--target",
        str(target),
        *files,
    ]
    try:
        rc: int | str = subprocess.run(cmd, timeout=300).returncode
    except (OSError, subprocess.TimeoutExpired) as exc:
        rc = f"{type(exc).__name__}: {exc}"
    if rc != 0:  # no pip here: a wheel is a zip laid out for site-packages
        print(f"{now()} pip install failed ({rc}); unpacking the wheels instead")
        for f in files:
            with zipfile.ZipFile(f) as zf:
                zf.extractall(target)
    return 0


# ====================================================================================== steps


@dataclass(frozen=True)
class Step:
    name: str
    timeout_s: float  # on the GPU machine
    dry_timeout_s: float  # --dry-run: a hang must still leave a report inside CI's timeout
    what: str


STEPS = [  # quick ones first: a step that hangs to its timeout costs the later ones their time
    Step("env", 60, 30, "versions, GPU, which dependencies came from .device/wheels"),
    Step("pytest_gpu", 110, 60, "pytest -m gpu, then tests/integration/test_backends.py"),
    Step("pack_merge", 60, 30, "split+pack and merge into= on the GPU vs device memcpy"),
    Step("event_fence", 45, 20, "CUDA-event buffer reuse in NcclBackend.broadcast, with a negative control"),
    Step("overlap_steps", 150, 90, "1-GPU FSDP2 training: no sync vs blocking vs trainer.overlap, stall and N steps"),
    Step("cuda_ipc_stream", 200, 60, "cuda_ipc, 2 processes on 1 GPU, Qwen3-8B-shaped bf16 stream, bitwise + ratio"),
    Step("nixl_stream", 120, 60, "nixl, VRAM to VRAM, 2 processes on 1 GPU, vs raw NIXL READ of the same bytes"),
    Step("lightning_fsdp", 150, 60, "1-GPU Lightning FSDP2 + WeightSyncCallback -> cuda_ipc receiver, bitwise"),
    Step("nccl", 120, 45, "NCCL between cuda:0 and cuda:1 (needs 2 GPUs)"),
]
STEP_NAMES = [s.name for s in STEPS]


def _params(name: str, dry: bool) -> dict[str, Any]:
    """Per-step sizes: the real ones on a GPU, tiny ones (and CPU stand-in backends) for --dry-run."""
    if name == "pytest_gpu":
        return {
            "marked": ["tests/integration/test_backends.py"] if dry else ["tests"],
            "files": ["tests/integration/test_backends.py"],
        }
    if name == "cuda_ipc_stream":
        if dry:
            return {
                "backend": "shm",
                "devices": ["cpu", "cpu"],
                "scale": 64,
                "rounds": [[0.5, 2], [0.125, 1]],
                "workers_timeout_s": 50,
            }
        return {
            "backend": "cuda_ipc",
            "devices": ["cuda:0", "cuda:0"],
            "scale": 1,
            "rounds": [[512.0, 3], [32.0, 2]],
            "workers_timeout_s": 190,
        }
    if name == "nixl_stream":
        if dry:
            return {
                "backend": "nixl",
                "devices": ["cpu", "cpu"],
                "scale": 64,
                "rounds": [[0.5, 2]],
                "workers_timeout_s": 50,
            }
        return {  # Qwen3-8B / 2 (3.8 GiB): room left in the kit's budget should UCX find only a slow path
            "backend": "nixl",
            "devices": ["cuda:0", "cuda:0"],
            "scale": 2,
            "rounds": [[256.0, 3]],
            "workers_timeout_s": 110,
        }
    if name == "nccl":
        if dry:
            return {
                "backend": "gloo",
                "devices": ["cpu", "cpu"],
                "scale": 64,
                "rounds": [[0.5, 1]],
                "workers_timeout_s": 35,
            }
        return {
            "backend": "nccl",
            "devices": ["cuda:0", "cuda:1"],
            "scale": 1,
            "rounds": [[512.0, 2]],
            "workers_timeout_s": 110,
        }
    if name == "pack_merge":
        if dry:
            return {
                "device": "cpu",
                "sizes": [256 * 1024, MiB],
                "bucket_size": 2 * MiB,
                "total_bytes": 4 * MiB,
                "repeats": 1,
            }
        return {
            "device": "cuda",
            "sizes": [MiB, 4 * MiB, 64 * MiB, 256 * MiB],
            "bucket_size": 512 * MiB,
            "total_bytes": 2 * GiB,
            "repeats": 3,
        }
    if name == "overlap_steps":
        if dry:
            return {"device": "cpu", "dim": 64, "layers": 2, "vocab_size": 512, "heads": 4, "batch": 2, "seq": 16,
                    "steps": 3, "bucket_mb": 1.0, "timeout_s": 80}  # fmt: skip
        # ~0.54 B parameters (2.1 GB fp32), 16 x 512 tokens a step: a step's compute and a version's send
        # over the host link are of the same order, which is where overlap matters
        return {"device": "cuda", "dim": 2048, "layers": 8, "vocab_size": 32768, "heads": 16, "batch": 16,
                "seq": 512, "steps": 6, "bucket_mb": 256.0, "timeout_s": 140}  # fmt: skip
    if name == "lightning_fsdp":
        if dry:
            return {"accelerator": "cpu", "backend": "shm", "device": "cpu", "steps": 2, "train_timeout_s": 40}
        return {"accelerator": "cuda", "backend": "cuda_ipc", "device": "cuda:0", "steps": 3, "train_timeout_s": 120}
    return {}


_CHILD_GROUPS: set[int] = set()  # process groups of this step's subprocesses (pytest, the trainer)


def _on_sigterm(signum: int, frame: Any) -> None:
    """The driver timed this step out: take the subprocesses in their own groups down with it."""
    for pgid in list(_CHILD_GROUPS):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    os._exit(128 + signum)


def run_step(name: str, dry: bool, result_path: Path) -> int:
    """Entry of a step subprocess: run it, write {status, ...} to `result_path`."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    started = time.perf_counter()
    try:
        if os.environ.get(INJECT_ENV) == name:  # tests: one broken step must not stop the others
            raise RuntimeError(f"failure injected into step {name} by {INJECT_ENV}")
        if os.environ.get(INJECT_ENV) == f"{name}:hang":  # a stuck subprocess in its own group
            run_cmd(["sleep", "1000"], cwd=REPO, timeout_s=1000)
        data = _STEP_FUNCS[name](_params(name, dry), dry)
        result: dict[str, Any] = {"status": "fail" if data.get("failed_checks") else "ok", **data}
    except Skip as exc:
        result = {"status": "skipped", "reason": str(exc)}
    except BaseException as exc:
        traceback.print_exc()
        result = {
            "status": "error",
            "error": f"{type(exc).__name__}: {exc}"[:2000],
            "traceback": traceback.format_exc(),
        }
    result["seconds_in_step"] = round(time.perf_counter() - started, 3)
    result_path.write_text(json.dumps(result, indent=2, default=str))
    return 0


# -------------------------------------------------------------------------------------- env


def step_env(params: dict[str, Any], dry: bool) -> dict[str, Any]:
    import importlib.metadata as md

    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "cpus": os.cpu_count(),
        "hostname": socket.gethostname(),
    }
    if torch.cuda.is_available():
        info["gpus"] = []
        for i in range(torch.cuda.device_count()):
            prop = torch.cuda.get_device_properties(i)
            info["gpus"].append(
                {
                    "name": prop.name,
                    "memory_gib": round(prop.total_memory / GiB, 1),
                    "capability": f"{prop.major}.{prop.minor}",
                }
            )
        with contextlib.suppress(Exception):
            v = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    versions = {}
    for dist in (
        "lightning",
        "accelerate",
        "cupy-cuda13x",
        "cupy-cuda12x",
        "nixl-cu13",
        "nixl-cu12",
        "safetensors",
        "pyzmq",
        "omegaconf",
        "msgspec",
        "PyYAML",
        "pytest",
        "pytest-asyncio",
        "hypothesis",
    ):
        with contextlib.suppress(md.PackageNotFoundError):
            versions[dist] = md.version(dist)
    info["versions"] = versions
    site = str(SITE_DIR)
    info["from_device_wheels"] = sorted(
        d.metadata["Name"] for d in md.distributions() if str(getattr(d, "_path", "")).startswith(site)
    )
    if not dry and not torch.cuda.is_available():
        info["failed_checks"] = ["cuda_available"]
    return info


# -------------------------------------------------------------------------------------- pytest


def step_pytest(params: dict[str, Any], dry: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    failed = []
    runs = {"marked_gpu": ["-m", "gpu", *params["marked"]], "backends": list(params["files"])}
    timeouts = {"marked_gpu": 40.0, "backends": 60.0}
    with tempfile.TemporaryDirectory() as tmp:
        for key, args in runs.items():
            xml = Path(tmp, f"{key}.xml")
            cmd = [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-rA",
                "-p",
                "no:cacheprovider",
                f"--junitxml={xml}",
                "--timeout=90",
                *args,
            ]
            progress(f"$ {' '.join(cmd[1:])}")
            returncode, output = run_cmd(cmd, cwd=REPO, timeout_s=timeouts[key])
            tail = output[-3000:]
            print(tail, flush=True)
            cases = _junit_cases(xml)
            counts: dict[str, int] = {}
            for c in cases:
                counts[c["outcome"]] = counts.get(c["outcome"], 0) + 1
            # exit code 5 = nothing selected (no test carries the marker): recorded, not a failure
            ok = returncode in (0, 5) and not counts.get("failed") and not counts.get("error")
            out[key] = {
                "cmd": " ".join(cmd[3:]),
                "exit_code": returncode,
                "counts": counts,
                "tests": cases,
                "ok": ok,
                **({} if ok else {"output_tail": tail}),
            }
            if returncode is None:
                out[key]["note"] = f"killed after {timeouts[key]:.0f}s"
            if returncode == 5:
                out[key]["note"] = "no test carries the gpu marker (exit code 5: nothing selected)"
            if not ok:
                failed.append(key)
    out["failed_checks"] = failed
    return out


def run_cmd(cmd: list[str], *, cwd: Path, timeout_s: float) -> tuple[int | None, str]:
    """Run `cmd` in its own process group; (exit code or None on timeout, output). On timeout the
    whole group is killed (pytest's spawned workers, the trainer's children)."""
    with tempfile.TemporaryFile("w+") as buf:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=buf, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        _CHILD_GROUPS.add(proc.pid)  # its own group: killed by _on_sigterm if the driver times this step out
        try:
            returncode: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            _CHILD_GROUPS.discard(proc.pid)
        buf.seek(0)
        return returncode, buf.read()


def _junit_cases(xml: Path) -> list[dict[str, str]]:
    if not xml.exists():
        return []
    cases = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (el.get("message") or "")[:300]
                break
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome, "message": message})
    return cases


# -------------------------------------------------------------------------------------- streams


def stream_specs(scale: int) -> list[tuple[str, tuple[int, ...], Any]]:
    """Qwen3-8B's tensors (real names, shapes / `scale`, bf16), plus the awkward cases a real stream
    has: an empty tensor, a 0-dim scalar, an fp32 tensor and a non-contiguous (transposed) one."""
    import torch

    from lightning_weightsync.bench.inventory import scaled_shapes

    specs: list[tuple[str, tuple[int, ...], Any]] = list(scaled_shapes("qwen3-8b", scale))
    specs += [
        ("extras.empty", (0, 5), torch.bfloat16),
        ("extras.scalar_step", (), torch.int64),
        ("extras.fp32_router", (33, 17), torch.float32),
        ("extras.transposed", (19, 23), torch.float32),  # generated as (23, 19), sent transposed
    ]
    return specs


def _seed(version: int, index: int) -> int:
    return 1_000_003 * version + index


def stream_for(specs: list[tuple[str, tuple[int, ...], Any]], version: int, device: Any) -> list[tuple[str, Any]]:
    return [(n, make_tensor(n, s, d, _seed(version, i), device)) for i, (n, s, d) in enumerate(specs)]


def _cfg(port: int, backend: str, bucket_mb: float, device: str, identity: str = "device-check-rollout") -> Any:
    from lightning_weightsync.config import load_config

    return load_config(
        overrides=[
            f"transport.port={port}",
            f"transport.backend={backend}",
            f"transport.bucket_size_mb={bucket_mb}",
            f"transport.device={device}",
            "transport.timeout_s=120",
            "transport.ready_timeout_s=60",
            "transport.heartbeat_interval_s=0.5",
            "trainer.min_receivers=1",
            f"rollout.identity={identity}",
            f"rollout.device={device}",
        ]
    )


def stream_sender(params: dict[str, Any], to_recv: Any, to_send: Any) -> dict[str, Any]:
    """Sender process: a d2d (or CPU memcpy) baseline of the stream's bytes, then per round a
    WeightSender (port chosen by the OS, passed to the receiver) sending `versions` versions."""
    import torch

    from lightning_weightsync.protocol.chunks import as_bytes
    from lightning_weightsync.versions.sender import WeightSender

    device = torch.device(params["devices"][0])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    specs = stream_specs(params["scale"])
    weights = stream_for(specs, 0, device)
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    progress(f"sender: {len(weights)} tensors, {_size(nbytes)} on {device}")
    # baseline: one copy_ per tensor into a flat destination of the same bytes, best of 3 after a warm-up
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for rnd in range(4):
        cuda_sync(device)
        start = time.perf_counter()
        offset = 0
        for _, t in weights:
            n = t.numel() * t.element_size()
            if n:
                flat[offset : offset + n].copy_(as_bytes(t), non_blocking=True)
            offset += n
        cuda_sync(device)
        if rnd:
            times.append(time.perf_counter() - start)
    del flat
    if device.type == "cuda":
        torch.cuda.empty_cache()
    baseline_s = min(times)
    progress(f"sender: baseline copy {nbytes / baseline_s / 1e9:.1f} GB/s")
    if params.get("raw_nixl"):  # the nixl step: raw NIXL between these same two processes first
        from tools.device_nixl import raw_nixl_sender

        raw_nixl_sender(params, to_recv, to_send, device)
    rounds = []
    for bucket_mb, versions in params["rounds"]:
        cfg = _cfg(0, params["backend"], bucket_mb, str(device), identity="device-check-trainer")
        per_version: list[Any] = []

        async def send_round(
            cfg: Any = cfg, versions: int = versions, per_version: list[Any] = per_version, bucket_mb: float = bucket_mb
        ) -> None:
            nonlocal weights
            async with WeightSender(cfg) as sender:
                to_recv.put(("port", sender.port))
                for v in range(1, versions + 1):
                    queue_get(to_send, 150, f"receiver ready for version {v}")
                    weights = None  # type: ignore[assignment]
                    weights = stream_for(specs, v, device)
                    cuda_sync(device)
                    stats = await sender.send_weights(weights, version=v)
                    per_version.append(
                        {
                            "version": v,
                            "seconds": stats.seconds,
                            "gbps": stats.gbps,
                            "buckets": stats.num_buckets,
                            "chunked_tensors": stats.num_chunked_tensors,
                            "direct_buckets": stats.direct_buckets,
                            "receivers": stats.receivers,
                        }
                    )
                    progress(
                        f"sender: {bucket_mb} MiB buckets, version {v}: {stats.seconds:.3f}s, {stats.gbps:.3g} GB/s"
                    )
                # the receiver maps our slots (cuda_ipc): it must let go before we free them
                queue_get(to_send, 150, "receiver done with the round")

        asyncio.run(send_round())
        timed = per_version[1:] or per_version  # version 1 includes group formation (IPC mapping, communicator)
        best = min(timed, key=lambda r: r["seconds"])
        rounds.append(
            {
                "bucket_mb": bucket_mb,
                "versions": per_version,
                "best_seconds": best["seconds"],
                "best_gbps": nbytes / best["seconds"] / 1e9,
                "ratio_vs_copy": baseline_s / best["seconds"],
            }
        )
    return {
        "nbytes": nbytes,
        "num_tensors": len(specs),
        "device": str(device),
        "baseline_copy_seconds": baseline_s,
        "baseline_copy_gbps": nbytes / baseline_s / 1e9,
        "rounds": rounds,
    }


def stream_receiver(params: dict[str, Any], to_recv: Any, to_send: Any) -> dict[str, Any]:
    """Receiver process: per round, receive into preallocated destinations (`into=`, as the module
    sink does), then regenerate each tensor and compare bytes."""
    import torch

    from lightning_weightsync.protocol.chunks import as_bytes
    from lightning_weightsync.versions.receiver import WeightReceiver

    device = torch.device(params["devices"][1])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    specs = stream_specs(params["scale"])
    dests = {n: torch.empty(s, dtype=d, device=device) for n, s, d in specs}
    raw = None
    if params.get("raw_nixl"):  # the nixl step: raw NIXL of the stream's byte count first
        from tools.device_nixl import raw_nixl_receiver

        raw = raw_nixl_receiver(params, to_recv, to_send, device, sum(t.nbytes for t in dests.values()))
    rounds = []
    for bucket_mb, versions in params["rounds"]:
        _, port = queue_get(to_recv, 150, "sender port")
        cfg = _cfg(port, params["backend"], bucket_mb, str(device))
        per_version: list[Any] = []

        async def receive_round(
            cfg: Any = cfg, versions: int = versions, per_version: list[Any] = per_version, bucket_mb: float = bucket_mb
        ) -> None:
            async with WeightReceiver(cfg) as receiver:
                for v in range(1, versions + 1):
                    for t in dests.values():  # stale bytes must not pass for received ones
                        as_bytes(t).fill_(0xA5)
                    to_send.put(("ready", v))
                    names = [n async for n, _ in receiver.receive_weights(into=lambda m: dests.get(m.name))]
                    stats = receiver.last_stats
                    cuda_sync(device)
                    wrong = []
                    for i, (n, s, d) in enumerate(specs):
                        expected = make_tensor(n, s, d, _seed(v, i), device)
                        if not torch.equal(as_bytes(dests[n]), as_bytes(expected)):
                            wrong.append(n)
                    per_version.append(
                        {
                            "version": receiver.version,
                            "tensors": len(names),
                            "names_in_order": names == [n for n, _, _ in specs],
                            "bitwise": not wrong and names == [n for n, _, _ in specs],
                            "mismatched": wrong[:10],
                            "receive_seconds": stats.seconds if stats else None,
                            "buckets": stats.num_buckets if stats else None,
                        }
                    )
                    progress(f"receiver: version {v}: {len(names)} tensors, bitwise {not wrong}")
            to_send.put(("done", bucket_mb))

        asyncio.run(receive_round())
        rounds.append({"bucket_mb": bucket_mb, "versions": per_version})
    return {"device": str(device), "rounds": rounds, **({"raw_nixl": raw} if raw is not None else {})}


def run_processes(targets: list[tuple[Callable[..., Any], tuple[Any, ...]]], timeout_s: float) -> list[Any]:
    """Run each `fn(*args)` in a spawned process; their results in order. A failure or timeout in
    any raises with the worker's traceback; every worker is killed before this returns."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results_q = ctx.Queue()
    procs = [
        ctx.Process(target=_trampoline, args=(fn, args, results_q, i), daemon=True)
        for i, (fn, args) in enumerate(targets)
    ]
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    dead_since: float | None = None
    try:
        for p in procs:
            p.start()
        while len(results) < len(procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers timed out after {timeout_s}s; finished: {sorted(results)}")
            if dead_since is not None and time.monotonic() > dead_since + 5:
                codes = {i: p.exitcode for i, p in enumerate(procs) if i not in results}
                raise RuntimeError(f"worker(s) died without a report; exit codes {codes}")
            try:
                index, ok, value = results_q.get(timeout=0.5)
            except queue_mod.Empty:
                if dead_since is None and any(p.exitcode not in (None, 0) for p in procs):
                    dead_since = time.monotonic()
                continue
            if not ok:
                raise RuntimeError(f"worker {index} ({targets[index][0].__name__}) failed:\n{value}")
            results[index] = value
        return [results[i] for i in range(len(procs))]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results_q.close()


def _trampoline(fn: Callable[..., Any], args: tuple[Any, ...], results_q: Any, index: int) -> None:
    try:
        results_q.put((index, True, fn(*args)))
    except BaseException:
        results_q.put((index, False, traceback.format_exc()))
        raise SystemExit(1) from None


def stream_pair(params: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    to_recv, to_send = ctx.Queue(), ctx.Queue()
    sent, got = run_processes(
        [(stream_sender, (params, to_recv, to_send)), (stream_receiver, (params, to_recv, to_send))], timeout_s
    )
    rounds = []
    for s, r in zip(sent["rounds"], got["rounds"], strict=True):
        bitwise = all(v["bitwise"] for v in r["versions"]) and len(r["versions"]) == len(s["versions"])
        for sv, rv in zip(s["versions"], r["versions"], strict=False):
            sv.update({k: rv[k] for k in ("bitwise", "mismatched", "receive_seconds")})
        rounds.append({**s, "bitwise": bitwise})
    out = {k: v for k, v in sent.items() if k != "rounds"}
    out.update(
        {
            "backend": params["backend"],
            "receiver_device": got["device"],
            "rounds": rounds,
            "bitwise": all(r["bitwise"] for r in rounds),
            "ratio_vs_copy": rounds[0]["ratio_vs_copy"] if rounds else None,
        }
    )
    if "raw_nixl" in got:
        out["raw_nixl"] = got["raw_nixl"]
    out.update(check_results({"bitwise": out["bitwise"]}))
    return out


def step_cuda_ipc(params: dict[str, Any], dry: bool) -> dict[str, Any]:
    import torch

    if not dry and not torch.cuda.is_available():
        raise Skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    out = stream_pair(params, timeout_s=params["workers_timeout_s"])
    out["note"] = (
        "ratio_vs_copy = one copy_ per tensor of the same bytes / one end-to-end version (Prepare .. acks); "
        "the engine copies every byte twice (pack, merge), so 0.5 is its ceiling"
    )
    return out


def step_nixl(params: dict[str, Any], dry: bool) -> dict[str, Any]:
    import torch

    from lightning_weightsync.errors import BackendUnavailable
    from lightning_weightsync.transport.backends import backend_class

    if not dry and not torch.cuda.is_available():
        raise Skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    try:
        backend_class("nixl").agent_classes()  # type: ignore[attr-defined]  # the nixl backend's own import check
    except BackendUnavailable as exc:
        if dry:
            raise Skip(f"NIXL is not installed here: {exc}") from None
        raise BackendUnavailable(
            f"{exc}; the kit brings a cut-down nixl-cu13 in .device/wheels: run `./dev device-check --prepare` "
            "where PyPI is reachable and carry .device/wheels"
        ) from None
    started = time.perf_counter()
    out = stream_pair({**params, "raw_nixl": True}, timeout_s=params["workers_timeout_s"])
    raw = out["raw_nixl"]
    for rnd in out["rounds"]:
        rnd["ratio_vs_raw_nixl"] = raw["read_s"] / rnd["best_seconds"]
    out["ratio_vs_raw_nixl"] = out["rounds"][0]["ratio_vs_raw_nixl"]
    out["pair_seconds"] = round(time.perf_counter() - started, 2)
    out["note"] = (
        "ratio_vs_raw_nixl = raw NIXL READ of the same bytes in bucket-sized pieces (best of 3) / one end-to-end "
        "engine version (Prepare .. acks); ratio_vs_copy as in cuda_ipc_stream"
    )
    out.update(check_results({"bitwise": out["bitwise"], "raw_nixl_bitwise": raw["bitwise"]}))
    return out


def step_nccl(params: dict[str, Any], dry: bool) -> dict[str, Any]:
    import importlib.util

    import torch

    if not dry:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count < 2:
            raise Skip(
                f"torch.cuda.device_count()={count}: one GPU cannot hold two NCCL ranks (NCCL needs a distinct "
                "device per rank), so the NCCL backend needs 2 GPUs"
            )
        if importlib.util.find_spec("cupy") is None:
            raise Skip("cupy is not installed (extra [nccl]: cupy-cuda12x / cupy-cuda13x)")
    return stream_pair(params, timeout_s=params["workers_timeout_s"])


# -------------------------------------------------------------------------------------- pack / merge


def step_pack_merge(params: dict[str, Any], dry: bool) -> dict[str, Any]:
    import torch

    from lightning_weightsync.bench.chunking import GOAL_MIN_TENSOR_SIZE, GOAL_RATIO, bench_one_size

    device = torch.device(params["device"])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise Skip("needs a CUDA GPU")
    loop = asyncio.new_event_loop()
    rows = []
    try:
        for size in params["sizes"]:
            row = bench_one_size(
                size,
                bucket_size=params["bucket_size"],
                total_bytes=params["total_bytes"],
                repeats=params["repeats"],
                device=device,
                loop=loop,
            )
            progress(
                f"pack_merge {size // 1024} KiB: split+pack {row['split_pack_ratio']:.2f}, "
                f"merge into= {row['merge_into_ratio']:.2f} of memcpy"
            )
            rows.append({k: v for k, v in row.items() if k != "seconds"})
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        loop.close()
    judged = [r for r in rows if r["tensor_size"] >= GOAL_MIN_TENSOR_SIZE]
    return {
        "device": str(device),
        "bucket_size": params["bucket_size"],
        "total_bytes": params["total_bytes"],
        "results": rows,
        "goal": {"ratio": GOAL_RATIO, "min_tensor_size": GOAL_MIN_TENSOR_SIZE},
        "meets_goal": all(min(r["split_pack_ratio"], r["merge_into_ratio"]) >= GOAL_RATIO for r in judged),
    }


# -------------------------------------------------------------------------------------- CUDA events


def step_event_fence(params: dict[str, Any], dry: bool) -> dict[str, Any]:
    """NcclBackend.broadcast's stream discipline, on one GPU.

    The NCCL communicator is replaced by a stand-in whose `bcast` copies the bucket into a "wire"
    buffer on the stream NCCL would be given; everything else is the real backend (`fence` records
    a CUDA event after the pack, `broadcast` makes its stream wait for it, runs, synchronizes).
    Checks: (a) a pack delayed on the compute stream (torch.cuda._sleep) is complete before the
    broadcast reads the bucket; (b) with a broadcast that is slow on its own stream, repacking the
    bucket right after `broadcast` returns does not change what was sent. Negative control: without
    the fence the same delayed pack is *not* seen, which shows the check can fail.
    """
    import importlib.util

    if dry:  # not even a stand-in: on CPU, copies are synchronous and record_event returns None
        raise Skip("needs CUDA: on CPU, copies are synchronous and there are no events to wait for")
    import torch

    if not torch.cuda.is_available():
        raise Skip("needs CUDA (torch.cuda.is_available() is False)")
    if importlib.util.find_spec("cupy") is None:
        raise Skip("cupy is not installed: NcclBackend cannot be built")
    from lightning_weightsync.transport.backends import backend_class

    NcclBackend: Any = backend_class("nccl")  # through the table; its buckets and communicator are driven below

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    nbytes = 64 * MiB
    backend = NcclBackend(bucket_size=nbytes, device=device, timeout_s=30.0, is_sender=True)
    backend.setup("127.0.0.1", 0)
    wire = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    sleep_cycles = int(params.get("sleep_cycles", 200_000_000))  # ~0.1 s at ~2 GHz

    class StandInComm:
        slow = False

        def bcast(self, ptr: int, count: int, dtype: Any, root: int, stream_ptr: int) -> None:
            src = next(b for b in backend.buckets if b.data_ptr() == ptr)
            stream = torch.cuda.ExternalStream(stream_ptr, device=device)
            with torch.cuda.stream(stream):
                if self.slow:
                    torch.cuda._sleep(sleep_cycles)
                wire[:count].copy_(src[:count], non_blocking=True)

    comm = StandInComm()
    backend._comm = comm  # the stand-in for cupy's NcclCommunicator (one GPU cannot hold two ranks)

    def trial(value: int, *, fence: bool, slow: bool, repack: int | None) -> int:
        slot = value % 2
        comm.slow = slow
        wire.zero_()
        torch.cuda.synchronize(device)
        torch.cuda._sleep(sleep_cycles)  # the pack below is queued behind ~0.1 s of work
        backend.buckets[slot].fill_(value)
        if fence:
            backend.fence(slot)
        backend.broadcast(slot, nbytes, value)
        if repack is not None:
            backend.buckets[slot].fill_(repack)  # the sender's next pack into this slot
        torch.cuda.synchronize(device)
        return int(wire[0].item()) if bool((wire == wire[0]).all()) else -1

    packed_seen = [trial(v, fence=True, slow=False, repack=None) == v for v in (11, 12, 13)]
    not_overwritten = [trial(v, fence=True, slow=True, repack=200 + v) == v for v in (21, 22, 23)]
    control = [trial(v, fence=False, slow=False, repack=None) == v for v in (31, 32, 33)]
    backend.close()
    control_hazard = not all(control)
    out = {
        "bucket_bytes": nbytes,
        "packed_before_broadcast_reads": packed_seen,
        "not_repacked_while_broadcast_reads": not_overwritten,
        "control_without_fence_saw_pack": control,
        "control_detected_hazard": control_hazard,
        "note": "control_detected_hazard false means the delay was too short to expose a missing fence "
        "(the checks then prove less, but are not wrong)",
    }
    out.update(
        check_results(
            {
                "packed_before_broadcast_reads": all(packed_seen),
                "not_repacked_while_broadcast_reads": all(not_overwritten),
            }
        )
    )
    return out


# -------------------------------------------------------------------------------------- Lightning


def fsdp_receiver(port: int, backend: str, device: str, expect: int, out_dir: str) -> dict[str, Any]:
    """The rollout side of the Lightning step: receive `expect` versions, save the last one."""
    import torch
    from safetensors.torch import save_file

    from lightning_weightsync.config import load_config
    from lightning_weightsync.versions.receiver import WeightReceiver

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device).index or 0)  # set_device refuses a bare "cuda"
    cfg = load_config(
        overrides=[
            f"transport.port={port}",
            f"transport.backend={backend}",
            "transport.timeout_s=90",
            "transport.heartbeat_interval_s=0.2",
            "rollout.identity=device-check-rollout",
            f"rollout.device={device}",
        ]
    )
    versions: list[int] = []
    devices: set[str] = set()

    async def main() -> dict[str, Any]:
        last: dict[str, torch.Tensor] = {}
        async with WeightReceiver(cfg) as receiver:
            while len(versions) < expect:
                got = {}
                async for n, t in receiver.receive_weights(wait_s=120):
                    devices.add(str(t.device))
                    got[n] = t.detach().to("cpu", copy=True)
                last = got
                versions.append(int(receiver.version))  # type: ignore[arg-type]
                progress(f"rollout: version {versions[-1]}: {len(got)} tensors")
        save_file(last, str(Path(out_dir, "received.safetensors")))
        return {"versions": versions, "tensors": len(last), "received_on": sorted(devices)}

    return asyncio.run(main())


def step_lightning(params: dict[str, Any], dry: bool) -> dict[str, Any]:
    import importlib.util

    import torch

    if not dry and not torch.cuda.is_available():
        raise Skip("needs a CUDA GPU")
    if importlib.util.find_spec("lightning") is None:
        raise Skip("lightning is not installed")
    import multiprocessing as mp

    from safetensors.torch import load_file

    steps = int(params["steps"])
    port = _free_port()
    tmp = Path(tempfile.mkdtemp(prefix="device_check_fsdp_"))
    ctx = mp.get_context("spawn")
    results_q = ctx.Queue()
    receiver = ctx.Process(
        target=_trampoline,
        args=(fsdp_receiver, (port, params["backend"], params["device"], steps + 1, str(tmp)), results_q, 0),
        daemon=True,
    )
    cmd = [
        sys.executable,
        "-m",
        "lightning_weightsync.demo.tiny_lm",
        "--config",
        str(REPO / "recipes" / "tiny_lm_cpu.yaml"),
        f"transport.port={port}",
        f"transport.backend={params['backend']}",
        "transport.timeout_s=90",
        f"recipe.steps={steps}",
        "recipe.devices=1",
        f"recipe.accelerator={params['accelerator']}",
        "recipe.strategy=model_parallel",
        f"recipe.output_dir={tmp / 'runs'}",
        f"recipe.save_final={tmp / 'final.st'}",
    ]
    receiver.start()
    started = time.perf_counter()
    try:
        progress(f"lightning: training {steps} steps on {params['accelerator']}, backend {params['backend']}")
        train_timeout_s = float(params["train_timeout_s"])
        returncode, log = run_cmd(cmd, cwd=tmp, timeout_s=train_timeout_s)
        train_s = time.perf_counter() - started
        if returncode != 0:
            raise RuntimeError(
                f"training exited with {returncode} (None: killed after {train_timeout_s:.0f}s):\n{log[-4000:]}"
            )
        _, ok, got = queue_get(results_q, 15, "the receiver's report")
        if not ok:
            raise RuntimeError(f"receiver failed:\n{got}")
        final, received = load_file(str(tmp / "final.st")), load_file(str(tmp / "received.safetensors"))
        same_names = sorted(final) == sorted(received)
        wrong = [
            n
            for n, t in final.items()
            if n not in received
            or not (received[n].dtype == t.dtype and received[n].shape == t.shape and torch.equal(received[n], t))
        ]
        out = {
            "steps": steps,
            "accelerator": params["accelerator"],
            "backend": params["backend"],
            "train_seconds": round(train_s, 2),
            "versions": got["versions"],
            "tensors": got["tensors"],
            "received_on": got["received_on"],
            "bitwise": same_names and not wrong,
            "mismatched": wrong[:10],
            "trainer_summary": [ln for ln in log.splitlines() if ln.startswith("tiny_lm:")][-1:],
        }
        every_version = got["versions"] == list(range(steps + 1))
        out.update(check_results({"bitwise": out["bitwise"], "every_version": every_version}))
        return out
    finally:
        receiver.join(timeout=10)
        if receiver.is_alive():
            receiver.kill()
            receiver.join(timeout=5)
        results_q.close()
        with contextlib.suppress(OSError):
            import shutil

            shutil.rmtree(tmp)


# -------------------------------------------------------------------------------------- overlap


def step_overlap(params: dict[str, Any], dry: bool) -> dict[str, Any]:
    """What CPU cannot show (issue 33's last measurement): N training steps with `trainer.overlap` closer to
    no sync at all than to a blocking sync, when training runs on the GPU and the send on the host link
    (gloo to a rollout daemon on the host: the bytes leave the GPU as they would for a NIC). One trainer
    rank, FSDP2 over NCCL, the three modes in one process on the same model (bench/stall.py run_overlap)."""
    import torch

    if not dry and not torch.cuda.is_available():
        raise Skip("needs a CUDA GPU")
    from lightning_weightsync.bench.stall import run_overlap

    keys = ("dim", "layers", "vocab_size", "heads", "batch", "seq", "steps", "bucket_mb")
    progress(f"overlap: {params['steps']} steps per mode on {params['device']}, dim {params['dim']}")
    out = run_overlap(world=1, device=params["device"], modes=("no sync", "blocking", "overlap"),
                      timeout_s=float(params["timeout_s"]), **{k: params[k] for k in keys})  # fmt: skip
    modes = out["modes"]
    none, blocking, overlap = (modes[m]["total_s"] for m in ("no sync", "blocking", "overlap"))
    out["overlap_share_of_sync_cost"] = (overlap - none) / (blocking - none) if blocking > none else None
    out["overlap_closer_to_no_sync"] = (overlap - none) < (blocking - overlap)
    for mode, m in modes.items():
        stall_ms = m["median_stall_s"] * 1e3
        progress(f"overlap: {mode}: {params['steps']} steps {m['total_s']:.2f}s, stall {stall_ms:.0f}ms")
    # measured, not asserted: the step passes when every mode ran to its last delivered version
    out.update(check_results({"ran_every_mode": sorted(modes) == sorted(("no sync", "blocking", "overlap"))}))
    return out


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_STEP_FUNCS: dict[str, Callable[[dict[str, Any], bool], dict[str, Any]]] = {
    "env": step_env,
    "pytest_gpu": step_pytest,
    "cuda_ipc_stream": step_cuda_ipc,
    "nixl_stream": step_nixl,
    "pack_merge": step_pack_merge,
    "event_fence": step_event_fence,
    "lightning_fsdp": step_lightning,
    "overlap_steps": step_overlap,
    "nccl": step_nccl,
}


# ====================================================================================== driver


def _env() -> dict[str, str]:
    paths = [str(SITE_DIR), str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), "PYTHONUNBUFFERED": "1"}


def _run_one(step: Step, dry: bool, out_dir: Path, timeout_s: float) -> dict[str, Any]:
    """One step in its own subprocess and process group; killed (with its children) at the timeout."""
    log_path = out_dir / "logs" / f"{step.name}.log"
    result_path = out_dir / "logs" / f"{step.name}.result.json"
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", MODULE, "--step", step.name, "--result", str(result_path)]
    cmd += ["--dry-run"] if dry else []
    started = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if line.startswith(PROGRESS):
                    print(f"  {step.name}: {line[len(PROGRESS) + 1 :].rstrip()}", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)  # the step kills its own subprocess groups, then exits
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # the step's children (spawned workers, trainer) too
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        reader.join(timeout=5)
    seconds = round(time.perf_counter() - started, 2)
    tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-40:])
    if timed_out:
        result: dict[str, Any] = {"status": "timeout", "log_tail": tail}
        result["error"] = f"no result within {timeout_s:.0f}s; killed"
    elif result_path.exists():
        result = json.loads(result_path.read_text())
        if result["status"] in ("error", "fail"):
            result["log_tail"] = tail
    else:
        result = {
            "status": "error",
            "error": f"step process exited with {proc.returncode} and no result",
            "log_tail": tail,
        }
    result.update(
        {
            "seconds": seconds,
            "timeout_s": round(timeout_s),
            "what": step.what,
            "log": str(log_path.relative_to(out_dir)),
        }
    )
    return result


def _summary_line(name: str, r: dict[str, Any]) -> str:
    """One line per step for the text report."""
    st = r["status"]
    if st == "skipped":
        return r.get("reason", "")
    if st in ("error", "timeout"):
        return r.get("error", "").splitlines()[0][:200] if r.get("error") else ""
    try:
        if name == "env":
            gpus = r.get("gpus") or []
            gpu = f"{gpus[0]['name']} x{len(gpus)}" if gpus else "no GPU"
            return f"{gpu}; python {r['python']}, torch {r['torch']} (CUDA {r['torch_cuda']}); from wheels: " + (
                ", ".join(r["from_device_wheels"]) or "-"
            )
        if name == "pytest_gpu":
            parts = []
            for key in ("marked_gpu", "backends"):
                c = r[key]["counts"]
                parts.append(f"{key}: " + (", ".join(f"{n} {k}" for k, n in sorted(c.items())) or "none selected"))
            return "; ".join(parts)
        if name in ("cuda_ipc_stream", "nccl"):
            rounds = ", ".join(
                f"{x['bucket_mb']:g} MiB buckets {x['best_gbps']:.3g} GB/s (ratio {x['ratio_vs_copy']:.3f})"
                for x in r["rounds"]
            )
            return (
                f"bitwise {str(r['bitwise']).lower()}; {r['num_tensors']} tensors, {_size(r['nbytes'])}, "
                f"{r['backend']}; copy baseline {r['baseline_copy_gbps']:.3g} GB/s; {rounds}"
            )
        if name == "nixl_stream":
            raw = r["raw_nixl"]
            rounds = ", ".join(
                f"{x['bucket_mb']:g} MiB buckets {x['best_gbps']:.3g} GB/s (ratio {x['ratio_vs_raw_nixl']:.3f} of raw "
                f"NIXL, {x['ratio_vs_copy']:.3f} of copy)"
                for x in r["rounds"]
            )
            return (
                f"bitwise {str(r['bitwise']).lower()}; {r['num_tensors']} tensors, {_size(r['nbytes'])}, "
                f"{raw['mem_type']}; raw NIXL READ {raw['read_gbps']:.3g} GB/s "
                f"(bitwise {str(raw['bitwise']).lower()}); {rounds}"
            )
        if name == "overlap_steps":
            m = r["modes"]
            share = r["overlap_share_of_sync_cost"]
            return (
                f"{r['model_mb']:.0f} MiB, {r['steps']} steps: "
                + ", ".join(f"{k} {v['total_s']:.2f}s (stall {v['median_stall_s'] * 1e3:.0f} ms)" for k, v in m.items())
                + f"; overlap pays {'-' if share is None else f'{share:.2f}'} of blocking's sync cost"
            )
        if name == "pack_merge":
            return (
                "; ".join(
                    f"{x['tensor_size'] // 1024} KiB: pack {x['split_pack_ratio']:.2f}, "
                    f"merge {x['merge_into_ratio']:.2f}"
                    for x in r["results"]
                )
                + f" (of memcpy; goal met: {str(r['meets_goal']).lower()})"
            )
        if name == "event_fence":
            return (
                f"packed before read {all(r['packed_before_broadcast_reads'])}, not repacked while read "
                f"{all(r['not_repacked_while_broadcast_reads'])}, control saw hazard {r['control_detected_hazard']}"
            )
        if name == "lightning_fsdp":
            return (
                f"bitwise {str(r['bitwise']).lower()}; versions {r['versions']}, {r['tensors']} tensors, "
                f"{r['accelerator']} + {r['backend']}, received on {r['received_on']}, {r['train_seconds']}s"
            )
    except (KeyError, IndexError, TypeError) as exc:
        return f"(summary unavailable: {exc!r})"
    return ""


def _size(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / MiB:.1f} MiB"


def write_report(report: dict[str, Any], out_dir: Path) -> str:
    (out_dir / REPORT_JSON).write_text(json.dumps(report, indent=2, default=str))
    s = report["summary"]
    env = report["steps"].get("env", {})
    lines = [
        f"lightning_weightsync device check ({report['mode']}), {report['started']}, "
        f"torch {env.get('torch', '?')}: {s['ok']} ok, {s['fail']} failed, {s['skipped']} skipped, "
        f"{report['seconds']:.1f}s of a {report['budget_s']:.0f}s budget",
        f"{'step':<16} {'status':<8} {'seconds':>8}  summary",
    ]
    for name, r in report["steps"].items():
        lines.append(f"{name:<16} {r['status']:<8} {r['seconds']:>8.1f}  {_summary_line(name, r)}")
    for name, r in report["steps"].items():
        if r["status"] in ("error", "timeout", "fail"):
            lines += ["", f"--- {name}: {r['status']} ({', '.join(r.get('failed_checks', [])) or r.get('error', '')})"]
            lines += [r.get("traceback") or r.get("log_tail") or ""]
    lines.append(f"\nfull report: {out_dir / REPORT_JSON}; step logs: {out_dir / 'logs'}")
    text = "\n".join(lines) + "\n"
    (out_dir / REPORT_TXT).write_text(text)
    return text


def drive(dry: bool, out_dir: Path, budget_s: float, only: list[str] | None) -> int:
    wall0 = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "logs").mkdir(exist_ok=True)
    mode = "dry-run (CPU stand-ins, tiny sizes)" if dry else "gpu"
    print(f"{now()} device check, {mode}: budget {budget_s:.0f}s, report -> {out_dir}", flush=True)
    report: dict[str, Any] = {
        "kit": "device_check",
        "schema": 1,
        "mode": "dry-run" if dry else "gpu",
        "started": dt.datetime.now().isoformat(timespec="seconds"),
        "budget_s": budget_s,
        "steps": {},
    }
    for step in STEPS:
        if only and step.name not in only:
            continue
        left = budget_s - (time.perf_counter() - wall0)
        if left < 15:
            r = {
                "status": "timeout",
                "error": f"overall budget of {budget_s:.0f}s spent before this step",
                "seconds": 0.0,
            }
        else:
            timeout_s = min(step.dry_timeout_s if dry else step.timeout_s, left - 5)
            print(f"{now()} [{step.name}] start (timeout {timeout_s:.0f}s): {step.what}", flush=True)
            r = _run_one(step, dry, out_dir, timeout_s)
        report["steps"][step.name] = r
        print(f"{now()} [{step.name}] {r['status']} in {r['seconds']:.1f}s: {_summary_line(step.name, r)}", flush=True)
        write_report(_finish(report, wall0), out_dir)  # a partial report survives a killed driver
    text = write_report(_finish(report, wall0), out_dir)
    print("\n" + text, flush=True)
    return 0 if report["ok"] else 1


def _finish(report: dict[str, Any], wall0: float) -> dict[str, Any]:
    statuses = [r["status"] for r in report["steps"].values()]
    report["summary"] = {
        "ok": statuses.count("ok"),
        "skipped": statuses.count("skipped"),
        "fail": len(statuses) - statuses.count("ok") - statuses.count("skipped"),
    }
    report["ok"] = report["summary"]["fail"] == 0
    report["seconds"] = round(time.perf_counter() - wall0, 2)
    return report


def main(argv: list[str] | None = None) -> int:
    prog = f"python -m {MODULE}"
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, shm/gloo standing in for cuda_ipc/nccl")
    p.add_argument("--prepare", action="store_true", help="download the GPU machine's missing wheels to .device/wheels")
    p.add_argument("--install", action="store_true", help="install the missing ones from .device/wheels")
    p.add_argument("--out", help="report folder (default: $OUT, else ./out/device_check)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="overall time budget in seconds")
    p.add_argument("--only", help=f"comma-separated steps out of: {','.join(STEP_NAMES)}")
    p.add_argument("--step", choices=STEP_NAMES, help=argparse.SUPPRESS)  # internal: run one step
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.prepare:
        return prepare()
    if args.install:
        return install()
    if args.step:
        return run_step(args.step, args.dry_run, Path(args.result))
    out_dir = Path(args.out or os.environ.get("OUT") or REPO / "out" / "device_check").resolve()
    only = [s.strip() for s in args.only.split(",")] if args.only else None
    if only and (bad := [s for s in only if s not in STEP_NAMES]):
        p.error(f"unknown step(s) {bad}; choose from {STEP_NAMES}")
    return drive(args.dry_run, out_dir, args.budget_s, only)


if __name__ == "__main__":
    # run as the importable module, so spawned workers find their functions by name (it imports no package:
    # `--install` runs before omegaconf, pyzmq and msgspec exist on the GPU machine)
    import tools.device_check as _module

    sys.exit(_module.main())
