"""The package tree is the architecture: an import only ever points down the layers.

    errors, choice <- registry <- protocol | rollout_engines (table, config sections) <- transport <- config
        <- engine <- rollout_engines (trainer half) <- trainer | rollout <- rollout_engines (receiving half)
        <- examples | integrations <- bench <- cli, __init__

`registry` is the one plug-in seam (name -> module path, imported when used) that the backend, join-kind,
sink and rollout-engine tables are built with; every layer may use it. `choice` is the base of every config
choice, below `config` so that a config section living with its code can define choices.

`rollout_engines/` holds every rollout engine (one folder each) and what they share; its files belong to
three layers, one rule per group (`_group`):
- the table and the config sections: `rollout_engines/__init__.py` (names -> module paths, the
  `RolloutClient` protocol) and `rollout_engines/<engine>/config.py` (+ the engine's empty `__init__.py`),
  which `config` imports, so they import only `errors`, `choice`, `registry`;
- the trainer half: `control.py` (drives the servers around a version) and each engine's `client.py` (+
  `api.py`, its constants): below `trainer`, which imports `control`; they import `config`, `engine` and what
  is below, never `rollout` nor the receiving half (so the trainer, which loads a client by path, never
  crosses into the rollout side), and never each other (`control` reaches a client only through the table);
- the receiving half: everything else (`worker.py`, `launch.py`, `host_copy.py`, `adapter.py`, and each
  engine's server-side modules): above `rollout`, whose receive loop and sinks they run inside the engine's
  server; nothing in the package but the table (by path) and the CLI (through the table) reaches them.
An engine's modules are imported by name only from its own folder (and its `config.py` by `config`): the
rest of the package goes through the table.

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
ENGINES = "rollout_engines"
ENGINES_TABLE = "rollout_engines (table, config sections)"
ENGINES_TRAINER = "rollout_engines (trainer half)"
ENGINES_RECEIVING = "rollout_engines (receiving half)"

# layer of each top-level name under the package; equal numbers are siblings that must not import each other
LAYERS: dict[str, int] = {
    "errors": 0,
    "choice": 0,  # the base of every config choice
    "registry": 1,  # the plug-in seam every table is built with
    ENGINES_TABLE: 2,  # rollout_engines/__init__.py + <engine>/config.py: imported by config
    "protocol": 2,
    "transport": 3,
    "config": 4,
    "engine": 5,
    ENGINES_TRAINER: 6,  # control.py, <engine>/client.py + api.py: imported by trainer
    "trainer": 7,
    "rollout": 7,
    ENGINES_RECEIVING: 8,  # the rest of rollout_engines/: runs rollout's receive loop in a server
    "examples": 9,
    "integrations": 9,  # other frameworks' plug points (TRL, verl, vLLM's trainer API): thin adapters
    "bench": 10,
    "cli": 11,
    "__init__": 11,
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


def _group(module: str) -> str:
    """The layer group of a module: its top-level name, except in `rollout_engines/`, whose files split into
    the table + config sections, the trainer half and the receiving half (module docstring)."""
    top = _top(module)
    if top != ENGINES:
        return top
    inner = module[len(f"{PKG}.{ENGINES}") :].lstrip(".").split(".") if module != f"{PKG}.{ENGINES}" else []
    if not inner or (len(inner) == 1 and inner[0] in ROLLOUT_ENGINES) or inner[1:] == ["config"]:
        return ENGINES_TABLE
    if inner == ["control"] or (len(inner) == 2 and inner[1] in ("client", "api")):
        return ENGINES_TRAINER
    return ENGINES_RECEIVING


def _submodule(package: str, name: str) -> str:
    """`from <package> import <name>`: the submodule when there is one, else a name of the package itself."""
    rel = Path(*package.split(".")[1:], name)
    is_module = (PACKAGE_DIR / rel).with_suffix(".py").is_file() or (PACKAGE_DIR / rel / "__init__.py").is_file()
    return f"{package}.{name}" if is_module else package


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
            names = [target] if node.module or not node.level else [_submodule(target, a.name) for a in node.names]
            found += [(node.lineno, t) for t in names if t.startswith(PKG)]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith(PKG)]
    return found


def test_every_top_level_name_has_a_layer() -> None:
    tops = {_group(m) for _, m in _modules()}
    assert tops <= set(LAYERS), f"give these a layer in tests/unit/test_layers.py: {sorted(tops - set(LAYERS))}"


def test_root_holds_few_modules() -> None:
    roots = [p.name for p in PACKAGE_DIR.glob("*.py")]
    assert len(roots) <= MAX_ROOT_MODULES, roots


def test_imports_point_down() -> None:
    bad = []
    for path, module in _modules():
        src_top = _group(module)
        for lineno, target in _imports(path, module):
            dst_top = _group(target)
            if dst_top == src_top or (target == PKG and src_top == "__init__"):
                continue
            if target == PKG:
                bad.append(f"{path.relative_to(PACKAGE_DIR)}:{lineno} imports the package root")
            elif LAYERS[dst_top] >= LAYERS[src_top]:
                kind = "sideways" if LAYERS[dst_top] == LAYERS[src_top] else "up"
                bad.append(f"{path.relative_to(PACKAGE_DIR)}:{lineno} imports {target} ({kind})")
    assert not bad, "imports that do not point down:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("src_module", "source", "expect_bad"),
    [
        ("transport.mod", "from ..engine.sender import WeightSender\n", True),  # transport -> engine: up
        ("trainer.mod", "from ..rollout.daemon import run_daemon\n", True),  # trainer -> rollout: sideways
        ("trainer.mod", "from ..protocol.chunks import TensorMeta\n", False),
        # the rollout-engine seam, group by group
        ("trainer.mod", "from ..rollout_engines.control import RolloutControl\n", False),
        ("trainer.mod", "from ..rollout_engines.vllm.worker import BACKEND_NAME\n", True),  # receiving half
        ("trainer.mod", "from ..rollout_engines.host_copy import HostCopy\n", True),
        ("rollout_engines.vllm.client", "from ..worker import CONFIG_ENV\n", True),  # client -> receiving half
        ("rollout_engines.vllm.client", "from ...rollout.consume import Call\n", True),  # client -> rollout
        ("rollout_engines.vllm.client", "from .config import PauseMode\n", False),
        ("rollout_engines.vllm.client", "from ...trainer.driver import SyncDriver\n", True),
        ("rollout_engines.control", "from ..trainer.names import NameMap\n", True),
        ("rollout_engines.vllm.config", "from ...config import load_config\n", True),  # config imports it: a cycle
        ("rollout_engines.vllm.config", "from ...choice import Choice\n", False),
        ("rollout_engines.vllm.worker", "from ...rollout.consume import Call\n", False),
        ("rollout.daemon", "from ..rollout_engines.worker import WorkerReceiver\n", True),  # rollout -> receiving
    ],
)
def test_the_checker_catches_what_it_should(tmp_path: Path, src_module: str, source: str, expect_bad: bool) -> None:
    """The rule would be worthless if the resolver silently missed relative imports, or if a file of
    `rollout_engines/` landed in the wrong group."""
    here = tmp_path / "mod.py"
    here.write_text(source)
    src_module = f"{PKG}.{src_module}"
    ((_, target),) = _imports(here, src_module)
    is_bad = LAYERS[_group(target)] >= LAYERS[_group(src_module)]
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


ENGINES_PKG = f"{PKG}.{ENGINES}"


def test_an_engines_modules_are_imported_only_from_its_folder() -> None:
    """An engine is its folder and one line of `ROLLOUT_ENGINES`: the trainer (through `control.py`) and the
    CLI reach its client and launcher through the table; only `config` names a module of it, its config
    section (`<engine>/config.py`)."""
    bad = []
    for name in ROLLOUT_ENGINES:
        folder = f"{ENGINES_PKG}.{name}"
        for path, module in _modules():
            if module == folder or module.startswith(f"{folder}."):
                continue
            for lineno, target in _imports(path, module):
                if target == f"{folder}.config" and module.split(".")[:2] == [PKG, "config"]:
                    continue
                if target == folder or target.startswith(f"{folder}."):
                    bad.append(f"{path.relative_to(PACKAGE_DIR)}:{lineno} imports {target}")
    assert not bad, "modules that name a rollout engine's module (go through ROLLOUT_ENGINES):\n" + "\n".join(bad)


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
    assert package == ROLLOUT_ENGINES.path(name) == f"{ENGINES_PKG}.{name}"
    assert callable(importlib.import_module(f"{package}.client").clients)
    assert callable(importlib.import_module(f"{package}.launch").launch)
