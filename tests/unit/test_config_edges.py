"""Config is converted once, at the edge: below it, every part reads only its own typed section.

A user hands a `load_config()` DictConfig (or None) to a public constructor: the Lightning callback, the
Accelerate hook, `SyncDriver`, `RolloutDaemon`, a sink, `WeightSender` / `WeightReceiver`. That constructor
converts it (`config.settings`, `SenderSettings.of`, `ReceiverSettings.of`, `SinkSettings.of`) and passes each
part its own dataclass section. Two rules keep it so, checked on every module of the layers below `config`
(docs/concepts.md, "Config"):

1. only `EDGES` take a DictConfig: a parameter annotated `DictConfig` or `UserConfig` (the edge's alias)
   appears in no other function;
2. no module there uses `OmegaConf` (merging, `to_container`, `create` are config's job: `dataclasses.replace`
   on a typed section instead), and only `OMEGACONF_IMPORTS` import omegaconf at all.

The CLI, `demo/`, `integrations/` and `bench/` (and the checkout's tools/ and examples/) load configs and are
edges themselves; `config/` is where the conversion lives. The engine processes of vLLM and SGLang read the YAML
their launcher wrote (`load_config`) and convert it right there (`ReceiverSettings.of`), so they name no DictConfig
in a signature.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lightning_weightsync

PACKAGE_DIR = Path(lightning_weightsync.__file__).parent
BELOW_THE_EDGE = ("protocol", "transport", "versions", "trainer", "rollout", "rollout_engines")
CONFIG_TYPES = {"DictConfig", "UserConfig"}

EDGES: dict[str, set[str]] = {
    # the trainer side: what a training script constructs
    "trainer/lightning.py": {"WeightSyncCallback.__init__"},
    "trainer/accelerate.py": {"AccelerateWeightSync.__init__"},
    "trainer/driver.py": {"SyncDriver.__init__"},
    # the engine's public constructors (`.of` converts at their top)
    "versions/sender.py": {"WeightSender.__init__", "BlockingWeightSender.__init__"},
    "versions/receiver.py": {"WeightReceiver.__init__"},
    # the rollout side: the daemon (the CLI's `run_daemon`) and the sinks a user may build (docs/operations.md)
    "rollout/daemon.py": {"RolloutDaemon.__init__", "run_daemon"},
    "rollout/sinks/base.py": {"Sink.__init__", "SinkSettings.of"},  # the sinks' own settings, made at their top
    "rollout/sinks/module.py": {"ModuleSink.__init__"},
    "rollout/sinks/safetensors.py": {"SafetensorsSink.__init__"},
    "rollout/sinks/callable.py": {"CallableSink.__init__"},
    # an engine's launcher: the CLI hands it the loaded config (`write_config` and `serve_command` take typed
    # config: the whole `WeightSyncConfig` written for the server's workers, the engine's own section)
    "rollout_engines/vllm/launch.py": {"launch"},
    "rollout_engines/sglang/launch.py": {"launch"},
}
"""Module (under the package) -> the functions in it that may take a user's DictConfig."""

OMEGACONF_IMPORTS: set[str] = set()
"""Edges that still name `DictConfig` in their signature (the rest name the `UserConfig` alias)."""


def _annotation_names(node: ast.expr | None) -> set[str]:
    if node is None:
        return set()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a string annotation
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return set()
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def _functions(tree: ast.Module) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name, def) of every function, methods as `Class.method`."""
    found: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                found.append((f"{prefix}{child.name}", child))
                visit(child, f"{prefix}{child.name}.")

    visit(tree, "")
    return found


def config_reads(source: str, rel: str) -> list[str]:
    """What in `source` (module `rel`, relative to the package) breaks the two rules."""
    tree = ast.parse(source)
    bad: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(m.split(".")[0] == "omegaconf" for m in mods) and rel not in OMEGACONF_IMPORTS:
                bad.append(f"{rel}:{node.lineno} imports omegaconf")
        elif isinstance(node, ast.Name) and node.id == "OmegaConf":
            bad.append(f"{rel}:{node.lineno} uses OmegaConf")
    allowed = EDGES.get(rel, set())
    for qualname, fn in _functions(tree):
        args = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs, fn.args.vararg, fn.args.kwarg]
        takes = [a.arg for a in args if a is not None and _annotation_names(a.annotation) & CONFIG_TYPES]
        if takes and qualname not in allowed:
            bad.append(f"{rel}:{fn.lineno} {qualname}({', '.join(takes)}) takes a DictConfig below the edge")
    return bad


def _modules(root: Path) -> list[tuple[str, Path]]:
    return [
        (path.relative_to(root).as_posix(), path)
        for layer in BELOW_THE_EDGE
        for path in sorted((root / layer).rglob("*.py"))
    ]


def test_only_the_edges_take_a_dictconfig() -> None:
    bad = [b for rel, path in _modules(PACKAGE_DIR) for b in config_reads(path.read_text(), rel)]
    assert not bad, "config below the edge (take the part's typed section instead):\n" + "\n".join(bad)


def test_every_edge_exists() -> None:
    """A renamed edge must leave this list, or the list would allow a name that no longer exists."""
    for rel, names in EDGES.items():
        defined = {q for q, _ in _functions(ast.parse((PACKAGE_DIR / rel).read_text()))}
        assert names <= defined, (rel, names - defined)


@pytest.mark.parametrize(
    ("rel", "source", "expect_bad"),
    [
        ("trainer/gather.py", "from omegaconf import DictConfig\ndef f(cfg: DictConfig) -> None: ...\n", True),
        ("trainer/gather.py", "def f(cfg: 'UserConfig') -> None: ...\n", True),
        ("trainer/gather.py", "def f(x):\n    return OmegaConf.merge(x, {})\n", True),
        ("rollout/sinks/module.py", "class ModuleSink:\n    def _build(self, cfg: UserConfig): ...\n", True),
        ("rollout/sinks/module.py", "class ModuleSink:\n    def __init__(self, cfg: UserConfig): ...\n", False),
        ("trainer/gather.py", "def f(names: NamesConfig) -> None: ...\n", False),
    ],
)
def test_the_edge_check_catches_what_it_should(rel: str, source: str, expect_bad: bool) -> None:
    assert bool(config_reads(source, rel)) is expect_bad
