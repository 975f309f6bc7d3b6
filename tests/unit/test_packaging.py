"""pyproject.toml declares exactly what the library imports (issue 12 point 8): no runtime
dependency that nothing imports (psutil was one until bench/ started measuring RSS with it), no
import of an undeclared package (PyYAML was one); and the wheel holds the library, the `bench` CLI's
benchmarks and the demo, not the checkout's tools/ and examples/ (issue 44)."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lightning_weightsync"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(req: str) -> str:
    return _norm(re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0])


def imported_distributions() -> dict[str, set[str]]:
    """{distribution: {files importing it}} for every third-party import anywhere in the package."""
    dists = packages_distributions()
    out: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                tops = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops = [node.module.split(".")[0]]
            else:
                continue
            for top in tops:
                if top in sys.stdlib_module_names or top in ("lightning_weightsync", "__future__"):
                    continue
                for dist in dists.get(top, [top]):  # not installed (an optional extra): its import name
                    out.setdefault(_norm(dist), set()).add(str(path.relative_to(ROOT)))
    return out


def test_runtime_dependencies_are_exactly_what_the_library_imports() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    required = {_requirement_name(r) for r in project["dependencies"]}
    extras = {_requirement_name(r) for reqs in project["optional-dependencies"].values() for r in reqs}
    imported = imported_distributions()
    unused = sorted(required - set(imported))
    assert unused == [], f"pyproject.toml dependencies nothing in lightning_weightsync imports: {unused}"
    # import names of extras that are not installed here, e.g. cupy for the nccl extra, vllm, torch_npu
    optional_import_names = {"cupy", "vllm", "torch-npu", "pytorch-lightning"}
    undeclared = {d: f for d, f in imported.items() if d not in required | extras | optional_import_names}
    assert undeclared == {}, f"imported but not declared in pyproject.toml: {undeclared}"
    assert "pyyaml" in required  # config.py imports yaml


# Issue 25 items 5-6: what a fresh `pip install lightning_weightsync` on CPU torch lacks. torch's CPU wheels
# do not depend on numpy, and lightning is an extra; this venv has both, so a child interpreter makes them
# unimportable (a meta-path finder that says "no such module", as a fresh venv would) and runs a real
# safetensors-sink version, the daemon's dump file and the top-level lazy import of the Lightning callback.
WITHOUT_EXTRAS = r"""
import sys


class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("numpy", "lightning", "pytorch_lightning"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


sys.meta_path.insert(0, NotInstalled())
import warnings

warnings.simplefilter("ignore")  # torch warns once that it runs without numpy
import torch
from safetensors.torch import load_file

from lightning_weightsync import BackendUnavailable, load_config
from lightning_weightsync.protocol.chunks import TensorMeta
from lightning_weightsync.rollout.sinks import build_sink
from lightning_weightsync.rollout.sinks.safetensors import write_safetensors

out = sys.argv[1]
sink = build_sink(load_config(overrides=["rollout.sink.type=safetensors", f"rollout.sink.dir={out}"]))
weights = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(3, dtype=torch.bfloat16)}
sink.begin(1)
for name, tensor in weights.items():
    sink.destination(TensorMeta(name, tuple(tensor.shape), tensor.dtype, 0, tensor.nbytes))
    sink.accept(name, tensor)
sink.commit(1)
got = load_file(str(sink.latest_path))
assert all(torch.equal(got[n], t) for n, t in weights.items()), got
write_safetensors(weights, f"{out}/dump.safetensors", {"version": "1"})  # the daemon's --dump
got = load_file(f"{out}/dump.safetensors")
assert all(torch.equal(got[n], t) for n, t in weights.items()), got
try:
    from lightning_weightsync import WeightSyncCallback  # noqa: F401
except BackendUnavailable as exc:
    print("ERROR:", exc)
assert "numpy" not in sys.modules
"""


def test_a_fresh_install_without_numpy_or_lightning(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_EXTRAS, str(tmp_path)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the safetensors sink wrote a version without numpy; the missing extra is named, not 'pytorch_lightning'
    assert "pip install 'lightning_weightsync[lightning]'" in proc.stdout, proc.stdout


# Issue 44: the wheel holds the library, what `lightning-weightsync bench` runs and the demo; the dev tools
# (tools/) and the examples (examples/) run from a checkout. Built for real (setuptools' build API, what
# `pip wheel` calls) from a copy of the source, so the build's own folders never land in this checkout.
BENCH_HELPERS = {"__init__", "layout", "netem", "inventory"}  # what the CLI's benchmarks import besides themselves
CHECKOUT_ONLY = ("tools", "examples")


def _built_wheel(tmp_path: Path) -> list[str]:
    import zipfile

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        (src / name).write_bytes((ROOT / name).read_bytes())
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for folder in ("lightning_weightsync", *CHECKOUT_ONLY):  # tools/ and examples/ are there to be left out
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    dist = tmp_path / "dist"
    build = "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))"
    proc = subprocess.run(
        [sys.executable, "-c", build, str(dist)], cwd=src, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


def test_the_wheel_holds_no_dev_tool(tmp_path: Path) -> None:
    from lightning_weightsync.bench import BENCHMARKS

    names = _built_wheel(tmp_path)
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"lightning_weightsync"}, sorted(tops)
    assert not [n for n in names if n.split("/")[0] in CHECKOUT_ONLY or "/examples/" in n]
    bench = {n.removeprefix("lightning_weightsync/bench/").removesuffix(".py") for n in names
             if n.startswith("lightning_weightsync/bench/") and n.endswith(".py")}  # fmt: skip
    assert bench == set(BENCHMARKS) | BENCH_HELPERS, f"bench/ in the wheel: only the CLI's benchmarks: {bench}"
    # the library whole: every module of the source package, its data, the demo
    source = {str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    assert source - set(names) == set(), "modules of the package missing from the wheel"
    for needed in ("lightning_weightsync/py.typed", "lightning_weightsync/bench/data/model_inventories.json",
                   "lightning_weightsync/bench/throughput.py", "lightning_weightsync/demo/demo.py",
                   "lightning_weightsync/demo/tiny_lm.py", "lightning_weightsync/cli.py"):  # fmt: skip
        assert needed in names, needed


@pytest.mark.parametrize(("module", "framework"), [("verl", "verl"), ("vllm_trainer", "vllm")])
def test_an_integration_without_its_framework_names_the_extra(monkeypatch, module: str, framework: str) -> None:
    """`import lightning_weightsync.integrations.<x>` without <x>'s framework says what to pip install."""
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, framework, None)  # as if not installed: `import verl` raises ImportError
    monkeypatch.delitem(sys.modules, f"lightning_weightsync.integrations.{module}", raising=False)
    with pytest.raises(ImportError, match=rf"pip install 'lightning_weightsync\[{framework}\]'"):
        importlib.import_module(f"lightning_weightsync.integrations.{module}")
