"""pyproject.toml declares exactly what the library imports (issue 12 point 8): no runtime
dependency that nothing imports (psutil was one until bench/ started measuring RSS with it), no
import of an undeclared package (PyYAML was one)."""

from __future__ import annotations

import ast
import re
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
