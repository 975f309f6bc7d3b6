"""The package tree is the architecture: an import only ever points down the layers.

    errors <- registry <- protocol | rollout_engines <- transport <- config <- engine <- trainer | rollout
        <- examples <- bench <- cli, __init__

`registry` is the one plug-in seam (name -> module path, imported when used) that the backend, join-kind,
sink and rollout-engine tables are built with; every layer may use it.

`rollout_engines` names the rollout engines by module path; the trainer loads an engine's
`rollout/<engine>/client.py` through it, and those client modules import nothing of the rollout layer
(tests/unit/test_rollout_engines.py).

`config` sits above `transport` because validation asks the backend registry which names exist.
Trainer and rollout never import each other; they meet only through the engine and the wire. Every
import counts, also the lazy ones inside functions and under `TYPE_CHECKING`: a lazy import that
points up is still a dependency that points up.

Plug-ins stay behind their tables: no module outside `transport/backends/` imports a backend's module (the
engine and the CLI ask `transport.backends`), no module outside a backend or `protocol/joins/` imports a
join kind's module, and every table entry imports and is what its table says.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import lightning_weightsync
from lightning_weightsync.config import SINKS
from lightning_weightsync.protocol.joins import JOIN_KINDS, JoinSpec
from lightning_weightsync.rollout.sinks import Sink
from lightning_weightsync.rollout_engines import ROLLOUT_ENGINES
from lightning_weightsync.transport.backends import BACKENDS, Backend

PACKAGE_DIR = Path(lightning_weightsync.__file__).parent
PKG = "lightning_weightsync"

# layer of each top-level name under the package; equal numbers are siblings that must not import each other
LAYERS: dict[str, int] = {
    "errors": 0,
    "registry": 1,  # the plug-in seam every table is built with
    "rollout_engines": 2,  # the engine registry: names and module paths, imported by config and trainer
    "protocol": 2,
    "transport": 3,
    "config": 4,
    "engine": 5,
    "trainer": 6,
    "rollout": 6,
    "examples": 7,
    "bench": 8,
    "cli": 9,
    "__init__": 9,
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


def _private_imports(path: Path, module: str) -> list[str]:
    """`from <a package module> import _name` in the file: a name with one leading underscore is its module's
    own, and a second module that needs it should get it public (third-party privates are not ours to judge)."""
    is_pkg = path.name == "__init__.py"
    package = module if is_pkg else module.rsplit(".", 1)[0]
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        if target != PKG and not target.startswith(PKG + "."):
            continue
        for alias in node.names:
            if alias.name.startswith("_") and not alias.name.startswith("__"):
                bad.append(f"{path.name}:{node.lineno} imports {alias.name} from {target}")
    return bad


def test_no_module_imports_another_modules_private_name() -> None:
    bad = [line for path, module in _modules() for line in _private_imports(path, module)]
    assert not bad, "private names imported across modules (make them public):\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("source", "expect_bad"),
    [
        ("from .chunks import TensorMeta, _place\n", True),  # relative
        ("from lightning_weightsync.bench.engine import _raw_group\n", True),  # absolute
        ("from torch.distributed.tensor.placement_types import _StridedShard\n", False),  # third-party
        ("from .chunks import __all__\n", False),  # a dunder is no private name
    ],
)
def test_the_private_import_check_catches_what_it_should(tmp_path: Path, source: str, expect_bad: bool) -> None:
    here = tmp_path / "mod.py"
    here.write_text(source)
    assert bool(_private_imports(here, f"{PKG}.protocol.mod")) is expect_bad


BACKENDS_PKG = f"{PKG}.transport.backends"
JOINS_PKG = f"{PKG}.protocol.joins"
SHARED_BY_BACKENDS = {f"{BACKENDS_PKG}.base"}  # the interface every part may name


def _plug_in_imports(package: str, owners: tuple[str, ...]) -> list[str]:
    """Imports of a module inside `package` (not the package itself, not SHARED_BY_BACKENDS) by a module
    outside every one of `owners`."""
    bad = []
    for path, module in _modules():
        if any(module == o or module.startswith(f"{o}.") for o in owners):
            continue
        for lineno, target in _imports(path, module):
            if target.startswith(f"{package}.") and target not in SHARED_BY_BACKENDS:
                bad.append(f"{path.relative_to(PACKAGE_DIR)}:{lineno} imports {target}")
    return bad


def test_no_module_outside_the_backends_imports_a_backend() -> None:
    """A backend is its file and one line of `BACKENDS`: the engine, the CLI, config and bench reach a
    backend through `transport.backends` (`build_backend`, `groups_draining`), never by its module."""
    bad = _plug_in_imports(BACKENDS_PKG, (BACKENDS_PKG,))
    assert not bad, "modules that name a concrete backend:\n" + "\n".join(bad)


def test_join_kinds_are_imported_only_by_their_backends() -> None:
    """A join kind (protocol/joins/<kind>.py) belongs to the backends that use it; the message schema
    reads the table (`JOIN_KINDS`), not the kinds."""
    bad = _plug_in_imports(JOINS_PKG, (JOINS_PKG, BACKENDS_PKG))
    assert not bad, "modules that name a join kind:\n" + "\n".join(bad)


def test_the_plug_in_check_catches_a_backend_import(tmp_path: Path) -> None:
    here = tmp_path / "mod.py"
    here.write_text(
        "from ..transport.backends.torch_pg import groups_draining\nfrom ..transport.backends import Backend\n"
    )
    targets = [t for _, t in _imports(here, f"{PKG}.engine.mod")]
    assert targets == [f"{BACKENDS_PKG}.torch_pg", BACKENDS_PKG]
    assert targets[0].startswith(f"{BACKENDS_PKG}.") and not targets[1].startswith(f"{BACKENDS_PKG}.")


@pytest.mark.parametrize("name", list(BACKENDS))
def test_every_backend_entry_imports_and_is_that_backend(name: str) -> None:
    cls = BACKENDS[name]
    assert isinstance(cls, type) and issubclass(cls, Backend), cls
    assert cls.name == name, f"{BACKENDS.path(name)} says it is {cls.name!r}"
    assert cls.natural_device in ("cpu", "cuda", "npu")
    assert cls.join_type in {JOIN_KINDS[k] for k in JOIN_KINDS}, cls.join_type


@pytest.mark.parametrize("name", list(SINKS))
def test_every_sink_entry_imports_and_is_a_sink(name: str) -> None:
    cls = SINKS[name]
    assert isinstance(cls, type) and issubclass(cls, Sink), cls
    assert SINKS.module(name) == f"{PKG}.rollout.sinks.{name}"


@pytest.mark.parametrize("name", list(JOIN_KINDS))
def test_every_join_entry_imports_and_is_that_kind(name: str) -> None:
    kind = JOIN_KINDS[name]
    assert issubclass(kind, JoinSpec) and kind.__struct_config__.tag == name and kind.MAX_BYTES > 0
    assert kind.validate is not JoinSpec.validate, f"{kind.__name__} validates nothing of its own"


@pytest.mark.parametrize("name", list(ROLLOUT_ENGINES))
def test_every_engine_entry_imports_and_has_a_client_and_a_launcher(name: str) -> None:
    package = ROLLOUT_ENGINES[name].package
    assert package == ROLLOUT_ENGINES.path(name)
    assert callable(importlib.import_module(f"{package}.client").clients)
    assert callable(importlib.import_module(f"{package}.launch").launch)
