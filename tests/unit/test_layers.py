"""The package tree is the architecture: an import only ever points down the layers.

    errors, choice <- registry | quantize <- plugins <- protocol <- transport | config <- versions <- trainer | rollout
        <- rollout_engines <- demo | integrations <- bench <- cli, __init__

`registry` is the one plug-in seam (name -> module path, imported when used); `plugins` holds every table built
with it (backends, join kinds, sinks, rollout engines) and the `RolloutClient` base the trainer drives, so every
layer may read a table without importing a plug-in. `choice` is the base of every config choice, below `config`
so that a config section living with its plug-in can define choices.

A plug-in declares its config section next to its code (`rollout/sinks/config.py`, `rollout_engines/<engine>/
config.py`) and its table entry names it (`section=`); config collects the sections from the tables while it is
itself being imported, so a section module imports only `errors` and `choice`, and importing config loads
nothing of a layer above it but those modules and their (empty) packages. Config and transport are siblings:
the choices config lists come from the tables, not from the transport layer, and neither imports the other.

`rollout_engines/` (vLLM, SGLang: one folder each, both halves of an engine) is one layer, above `trainer` and
`rollout`: the trainer reaches an engine's client only through `ROLLOUT_ENGINES` (by path), and the CLI its
launcher the same way. Trainer and rollout never import each other; they meet only through the versions layer
and the wire. Every import counts, also the lazy ones inside functions and under `TYPE_CHECKING`: a lazy
import that points up is still a dependency that points up.

Plug-ins stay behind their tables: no module outside `transport/backends/` imports a backend's module (the
versions layer and the CLI ask `transport.backends`), no module outside a backend or `protocol/joins/` imports
a join kind's module, an engine's modules are named only inside its folder, and every table entry imports and
is what its table says.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_weightsync
from lightning_weightsync.plugins import BACKENDS, JOIN_KINDS, ROLLOUT_ENGINES, SINKS
from lightning_weightsync.protocol.joins import JoinSpec
from lightning_weightsync.rollout.sinks.base import Sink
from lightning_weightsync.transport.backends import Backend

PACKAGE_DIR = Path(lightning_weightsync.__file__).parent
PKG = "lightning_weightsync"
ENGINES = "rollout_engines"

# layer of each top-level name under the package; equal numbers are siblings that must not import each other
LAYERS: dict[str, int] = {
    "errors": 0,
    "choice": 0,  # the base of every config choice
    "registry": 1,  # the plug-in seam every table is built with
    "quantize": 1,  # trainer-side quantizers and the rollout's quantization contract: torch and errors only
    "plugins": 2,  # every plug-in table, and the RolloutClient base
    "protocol": 3,
    "transport": 4,
    "config": 4,  # beside transport: both read the tables, neither imports the other
    "versions": 5,
    "trainer": 6,
    "rollout": 6,
    ENGINES: 7,  # both halves of every engine: above the trainer (which drives it by path) and the rollout
    "demo": 8,  # `lightning-weightsync demo`: the tiny LM and the recipes' one main()
    "integrations": 8,  # other frameworks' plug points (TRL, verl, vLLM's trainer API): thin adapters
    "bench": 9,
    "cli": 10,
    "__init__": 10,
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
    ("src_module", "source", "expect_bad"),
    [
        ("transport.mod", "from ..versions.sender import WeightSender\n", True),  # transport -> engine: up
        ("trainer.mod", "from ..rollout.daemon import run_daemon\n", True),  # trainer -> rollout: sideways
        ("trainer.mod", "from ..protocol.chunks import TensorMeta\n", False),
        # the rollout-engine seam: one layer above trainer and rollout
        ("integrations.mod", "from ..trainer.fleet import RolloutFleet\n", False),  # the trainer drives the fleet
        ("trainer.mod", "from ..rollout_engines.vllm.client import clients\n", True),  # only by path, the table
        ("trainer.mod", "from ..plugins import ROLLOUT_ENGINES, RolloutClient\n", False),
        ("rollout_engines.vllm.client", "from ...trainer.fleet import RolloutFleet\n", False),
        ("rollout_engines.vllm.worker", "from ...rollout.consume import Call\n", False),
        ("rollout.daemon", "from ..rollout_engines.worker import WorkerReceiver\n", True),  # rollout -> engines
        ("config.schema", "from ..rollout_engines.vllm.config import VLLMConfig\n", True),  # collected by path
        ("config.schema", "from ..plugins import ROLLOUT_ENGINES\n", False),
        ("plugins", "from .transport.backends import Backend\n", True),
        ("config.validate", "from ..transport.backends import BACKENDS\n", True),  # sideways: use plugins
    ],
)
def test_the_checker_catches_what_it_should(tmp_path: Path, src_module: str, source: str, expect_bad: bool) -> None:
    """The rule would be worthless if the resolver silently missed relative imports, or if a module landed in
    the wrong layer."""
    here = tmp_path / "mod.py"
    here.write_text(source)
    src_module = f"{PKG}.{src_module}"
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


CHECKOUT_ONLY = ("tools", "examples", "tests", "recipes")  # top-level folders of a checkout, not in the wheel


def _checkout_imports(path: Path) -> list[str]:
    """Imports of a checkout-only folder (`tools`, `examples`, ...) in the file, lazy ones included."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
        bad += [f"{path.name}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in CHECKOUT_ONLY]
    return bad


def test_the_package_never_imports_the_checkout() -> None:
    """tools/ and examples/ (and tests/, recipes/) are not in the wheel: they may import the library, the
    library never imports them, or an installed package would fail where a checkout works."""
    bad = [line for path, _ in _modules() for line in _checkout_imports(path)]
    assert not bad, "package modules that import a folder the wheel does not hold:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("source", "expect_bad"),
    [
        ("from tools.device_check import STEP_NAMES\n", True),
        ("def f():\n    import examples.grpo\n", True),
        ("from lightning_weightsync.bench.inventory import model_stream\n", False),
        ("from .tools import x\n", False),  # relative: a module of the package
    ],
)
def test_the_checkout_import_check_catches_what_it_should(tmp_path: Path, source: str, expect_bad: bool) -> None:
    here = tmp_path / "mod.py"
    here.write_text(source)
    assert bool(_checkout_imports(here)) is expect_bad


def test_no_module_imports_another_modules_private_name() -> None:
    bad = [line for path, module in _modules() for line in _private_imports(path, module)]
    assert not bad, "private names imported across modules (make them public):\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("source", "expect_bad"),
    [
        ("from .chunks import TensorMeta, _place\n", True),  # relative
        ("from lightning_weightsync.bench.throughput import _raw_group\n", True),  # absolute
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
    """An engine is its folder and one line of `ROLLOUT_ENGINES`: the trainer (`trainer/fleet.py`) and the
    CLI reach its client and launcher through the table, config its section (`<engine>/config.py`) too."""
    bad = []
    for name in ROLLOUT_ENGINES:
        folder = f"{ENGINES_PKG}.{name}"
        for path, module in _modules():
            if module == folder or module.startswith(f"{folder}."):
                continue
            for lineno, target in _imports(path, module):
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
    assert SINKS.module(name) == f"{PKG}.rollout.sinks.{name}" and cls.kind == name
    section = SINKS.section(name)
    assert dataclasses.is_dataclass(section) and section.__module__ == SINKS_SECTIONS, section


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
    section = ROLLOUT_ENGINES.section(name)
    assert dataclasses.is_dataclass(section) and section.__module__ == f"{package}.config", section
    assert {"urls", "request_timeout_s"} <= {f.name for f in dataclasses.fields(section)}


SINKS_SECTIONS = f"{PKG}.rollout.sinks.config"
SECTION_MAY_IMPORT = ("errors", "choice")


def _section_modules() -> list[str]:
    return sorted({t.section(n).__module__ for t in (SINKS, ROLLOUT_ENGINES) for n in t})


@pytest.mark.parametrize("module", _section_modules())
def test_a_plug_ins_config_section_imports_only_errors_and_choice(module: str) -> None:
    """Config collects each section through its table while config itself is being imported: a section
    module that imported config (or anything that does) would be a cycle, whatever its layer."""
    path = PACKAGE_DIR.joinpath(*module.split(".")[1:]).with_suffix(".py")
    bad = [t for _, t in _imports(path, module) if _top(t) not in SECTION_MAY_IMPORT]
    assert not bad, f"{module} imports {bad}"


def test_importing_config_loads_no_plug_in_above_it_but_its_sections() -> None:
    """`config` imports nothing above it: of the layers above, only the section modules the tables name
    and the packages that hold them (whose `__init__` imports nothing) are loaded with it."""
    code = "import sys, lightning_weightsync.config; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    allowed = set(_section_modules())
    allowed |= {m.rsplit(".", k)[0] for m in allowed for k in range(1, m.count("."))}
    above = [m for m in loaded if m.startswith(f"{PKG}.") and LAYERS[_top(m)] > LAYERS["config"]]
    assert sorted(set(above) - allowed) == [], "config loads more than the plug-ins' sections"


PLUG_IN_DRIVERS = ("rollout/consume.py", "rollout/daemon.py", "rollout/sinks/build.py", "trainer/fleet.py", "cli.py")
"""The modules that drive plug-ins (sinks, rollout engines' clients): what a plug-in may do is a member of its
base (`VersionSink`, `RolloutClient`) with a default, so these never ask a plug-in whether it has one."""


def _capability_probes(path: Path) -> list[str]:
    """`getattr(x, "name", ...)` / `hasattr(x, "name")` calls whose object is a name of ours (not `logging`)."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            obj = node.args[0] if node.args else None
            if isinstance(obj, ast.Name) and obj.id in ("sink", "client", "c", "self"):
                bad.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return bad


def test_no_driver_probes_a_plug_in_for_a_capability() -> None:
    bad = [b for rel in PLUG_IN_DRIVERS for b in _capability_probes(PACKAGE_DIR / rel)]
    assert not bad, "declare the capability on the plug-in's base class with a default:\n" + "\n".join(bad)


def test_the_probe_check_catches_a_probe(tmp_path: Path) -> None:
    here = tmp_path / "mod.py"
    here.write_text('held = getattr(sink, "held", None)\nlevel = getattr(logging, "INFO")\n')
    assert _capability_probes(here) == ["mod.py:1 getattr(sink, 'held', None)"]
