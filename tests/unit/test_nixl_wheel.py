"""The cut-down NIXL wheel the GPU kit carries (tools/nixl_wheel.py), made here from this environment's
nixl-cu12 (the same NIXL release and wheel layout as the nixl-cu13 that `--prepare` cuts, built for this
Python): the cut keeps the UCX plug-in and everything it links, installs with pip, imports from where it
was installed and moves bytes between two agents over UCX; a wheel missing the UCX plug-in is refused."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import zipfile
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import NamedTuple

import pytest

from tests.support.mp import PYTHON, output_of, popen
from tests.support.transfer import NIXL_MISSING
from tools import nixl_wheel
from tools.nixl_wheel import BUILD_TAG, WheelStripError, elf_needed, strip_nixl_wheel

DIST = "nixl-cu12"
PKG = "nixl_cu12"
pytestmark = pytest.mark.skipif(NIXL_MISSING is not None, reason=str(NIXL_MISSING))

# Run in a fresh interpreter with only the cut's install folder in front of site-packages: two agents
# (UCX only, no progress thread, as the backend makes them), one MiB READ from one to the other.
PROBE = """
import json, sys
import numpy as np
api = __import__(sys.argv[1] + "._api", fromlist=["nixl_agent"])
cfg = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
a, b = api.nixl_agent("probe-a", cfg), api.nixl_agent("probe-b", cfg)
n = 1 << 20
src = np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8)
dst = np.zeros(n, np.uint8)
a.register_memory([(src.ctypes.data, n, 0, "")], "DRAM")
b.register_memory([(dst.ctypes.data, n, 0, "")], "DRAM")
peer = b.add_remote_agent(a.get_agent_metadata())
peer = peer.decode() if isinstance(peer, bytes) else peer
here = b.get_xfer_descs([(dst.ctypes.data, n, 0)], "DRAM")
there = b.get_xfer_descs([(src.ctypes.data, n, 0)], "DRAM")
handle = b.initialize_xfer("READ", here, there, peer)
state = b.transfer(handle)
while state == "PROC":
    a.get_new_notifs()
    state = b.check_xfer_state(handle)
print("PROBE " + json.dumps({"file": api.__file__, "plugins": a.plugin_list, "backends": sorted(a.backends),
                             "state": state, "bitwise": bool((src == dst).all())}))
"""


def _installed_as_wheel(out_dir: Path) -> Path:
    """This environment's nixl-cu12 zipped back into the wheel it was installed from (stored, not compressed:
    the test cuts it, it does not ship it). Files installed outside site-packages (headers, scripts) are
    left out: the cut drops them anyway."""
    dist = metadata.distribution(DIST)
    root = Path(str(dist.locate_file("")))
    wheel_file = (dist.read_text("WHEEL") or "").splitlines()
    tag = next(ln.split(":", 1)[1].strip() for ln in wheel_file if ln.startswith("Tag:"))
    wheel = out_dir / f"{PKG}-{dist.version}-{tag}.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as zf:
        for f in dist.files or []:
            if not str(f).startswith("..") and "__pycache__" not in str(f):
                zf.write(root / str(f), str(f))
    return wheel


class Cut(NamedTuple):
    source: Path
    wheel: Path
    report: nixl_wheel.StripReport


@pytest.fixture(scope="module")
def cut(tmp_path_factory: pytest.TempPathFactory) -> Cut:
    tmp = tmp_path_factory.mktemp("nixl_wheel")
    (tmp / "source").mkdir()
    source = _installed_as_wheel(tmp / "source")
    report = strip_nixl_wheel(source, tmp / "cut")
    return Cut(source, tmp / "cut" / report.output, report)


def test_elf_needed_reads_what_the_loader_must_find() -> None:
    import importlib.util

    spec = importlib.util.find_spec(f"{PKG}._bindings")
    assert spec is not None and spec.origin is not None
    needed = elf_needed(Path(spec.origin).read_bytes())
    assert "libnixl.so" in needed and "libc.so.6" in needed
    if shutil.which("readelf"):  # the binutils reading, where it is installed, as the oracle
        out = subprocess.run(["readelf", "-d", spec.origin], capture_output=True, text=True, timeout=60).stdout
        assert needed == re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out)
    with pytest.raises(WheelStripError, match="ELF"):
        elf_needed(b"#!/bin/sh\n")


@pytest.mark.slow
def test_the_cut_keeps_the_ucx_plugin_and_what_it_links_and_drops_the_rest(cut: Cut) -> None:
    source, wheel, report = cut
    kept = set(report.kept)
    assert f"-{BUILD_TAG}-" in report.output and report.output_bytes * 3 < report.source_bytes
    plugins = {PurePosixPath(k).name for k in kept if "/plugins/" in k}
    assert plugins == {"libplugin_UCX.so"}, plugins
    ucx_modules = {PurePosixPath(k).name.split(".so")[0] for k in kept if k.startswith(f"{PKG}.libs/ucx/")}
    assert ucx_modules == {"libuct_cuda", "libucm_cuda", "libuct_cma"}, ucx_modules
    dropped_dirs = ("nixl_ep_", f"{PKG}.libs/nixl/", f"{PKG}-", f"{PKG}.scripts/")
    assert not [k for k in kept if k.startswith(dropped_dirs) and ".dist-info/" not in k]
    assert any(d.startswith("nixl_ep_") for d in report.dropped)  # it was in the source, and is gone
    # every library a kept one links is kept, or the source wheel does not have it either (the system's)
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(wheel) as out:
        in_source = {PurePosixPath(n).name for n in src.namelist()}
        kept_names = {PurePosixPath(n).name for n in out.namelist()}
        assert set(out.namelist()) - {n for n in out.namelist() if n.endswith(("/RECORD", "/WHEEL"))} <= kept
        unresolved = sorted(
            (k, lib)
            for k in out.namelist()
            if re.search(r"\.so(\.\d+)*$", k)
            for lib in elf_needed(out.read(k))
            if lib not in kept_names and lib in in_source
        )
    assert not unresolved, unresolved
    assert not set(report.external) & in_source


@pytest.mark.slow
def test_the_cut_installs_imports_and_moves_bytes_over_ucx(cut: Cut, tmp_path: Path) -> None:
    site = tmp_path / "site"
    pip = [PYTHON, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", str(site)]
    with popen([*pip, str(cut.wheel)]) as proc:
        out = output_of(proc, 180, "pip install of the cut wheel")
    assert proc.returncode == 0, out[-3000:]
    env = {**os.environ, "PYTHONPATH": str(site), "NIXL_LOG_LEVEL": "WARN"}
    with popen([PYTHON, "-c", PROBE, PKG], env=env, cwd=str(tmp_path)) as proc:
        out = output_of(proc, 120, "the NIXL probe")
    assert proc.returncode == 0, out[-3000:]
    probe = json.loads(next(ln[len("PROBE ") :] for ln in out.splitlines() if ln.startswith("PROBE ")))
    assert probe["file"].startswith(str(site)), probe  # the cut, not this environment's full install
    assert probe["plugins"] == ["UCX"] and probe["backends"] == ["UCX"], probe
    assert probe["state"] == "DONE" and probe["bitwise"] is True, probe


@pytest.mark.slow
def test_a_cut_that_would_lack_the_ucx_plugin_is_refused(
    cut: Cut, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nixl_wheel, "KEPT_PLUGINS", ())  # the plug-in is no longer a root of the cut
    with pytest.raises(WheelStripError, match="would lack the UCX plug-in"):
        strip_nixl_wheel(cut.source, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written


def test_a_wheel_of_another_layout_is_refused(tmp_path: Path) -> None:
    wheel = tmp_path / f"{PKG}-1.5.1-cp311-cp311-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(f"{PKG}/_api.py", "")
        zf.writestr(f"{PKG}-1.5.1.dist-info/WHEEL", "Wheel-Version: 1.0\n")
    with pytest.raises(WheelStripError, match=r"libplugin_UCX\.so"):
        strip_nixl_wheel(wheel, tmp_path / "out")
    assert not (tmp_path / "out").exists()
