"""The package tree is the architecture: an import only ever points down the layers.

    errors <- protocol | rollout_engines <- transport <- config <- engine <- trainer | rollout <- examples <- bench
        <- cli, __init__

`rollout_engines` names the rollout engines by module path; the trainer loads an engine's
`rollout/<engine>/client.py` through it, and those client modules import nothing of the rollout layer
(tests/unit/test_rollout_engines.py).

`config` sits above `transport` because validation asks the backend registry which names exist.
Trainer and rollout never import each other; they meet only through the engine and the wire. Every
import counts, also the lazy ones inside functions and under `TYPE_CHECKING`: a lazy import that
points up is still a dependency that points up.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lightning_weightsync

PACKAGE_DIR = Path(lightning_weightsync.__file__).parent
PKG = "lightning_weightsync"

# layer of each top-level name under the package; equal numbers are siblings that must not import each other
LAYERS: dict[str, int] = {
    "errors": 0,
    "rollout_engines": 1,  # the engine registry: names and module paths, imported by config and trainer
    "protocol": 1,
    "transport": 2,
    "config": 3,
    "engine": 4,
    "trainer": 5,
    "rollout": 5,
    "examples": 6,
    "bench": 7,
    "cli": 8,
    "__init__": 8,
}
MAX_ROOT_MODULES = 7


def _modules() -> list[tuple[Path, str]]:
    out = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        rel = path.relative_to(PACKAGE_DIR).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append((path, ".".join([PKG, *parts])))
    return out


def _top(module: str) -> str:
    rest = module[len(PKG) + 1 :] if module != PKG else "__init__"
    return rest.split(".")[0]


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    """Every package-internal import of the file, resolved to an absolute module name."""
    is_pkg = path.name == "__init__.py"
    package = module if is_pkg else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target] if node.module or not node.level else [f"{target}.{a.name}" for a in node.names]
            found += [(node.lineno, t) for t in names if t.startswith(PKG)]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith(PKG)]
    return found


def test_every_top_level_name_has_a_layer() -> None:
    tops = {_top(m) for _, m in _modules()}
    assert tops <= set(LAYERS), f"give these a layer in tests/unit/test_layers.py: {sorted(tops - set(LAYERS))}"


def test_root_holds_few_modules() -> None:
    roots = [p.name for p in PACKAGE_DIR.glob("*.py")]
    assert len(roots) <= MAX_ROOT_MODULES, roots


def test_imports_point_down() -> None:
    bad = []
    for path, module in _modules():
        src_top = _top(module)
        for lineno, target in _imports(path, module):
            dst_top = _top(target)
            if dst_top == src_top or (target == PKG and src_top == "__init__"):
                continue
            if target == PKG:
                bad.append(f"{path.relative_to(PACKAGE_DIR)}:{lineno} imports the package root")
            elif LAYERS[dst_top] >= LAYERS[src_top]:
                kind = "sideways" if LAYERS[dst_top] == LAYERS[src_top] else "up"
                bad.append(f"{path.relative_to(PACKAGE_DIR)}:{lineno} imports {target} ({kind})")
    assert not bad, "imports that do not point down:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("source", "expect_bad"),
    [
        ("from ..engine.sender import WeightSender\n", True),  # transport -> engine: up
        ("from ..rollout.daemon import run_daemon\n", True),  # trainer -> rollout: sideways
        ("from ..protocol.chunks import TensorMeta\n", False),
    ],
)
def test_the_checker_catches_what_it_should(tmp_path: Path, source: str, expect_bad: bool) -> None:
    """The rule would be worthless if the resolver silently missed relative imports."""
    here = tmp_path / "mod.py"
    here.write_text(source)
    src_module = f"{PKG}.transport.mod" if "engine" in source else f"{PKG}.trainer.mod"
    ((_, target),) = _imports(here, src_module)
    is_bad = LAYERS[_top(target)] >= LAYERS[_top(src_module)]
    assert is_bad is expect_bad, target
