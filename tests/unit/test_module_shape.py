"""Shape rules the layer test does not cover: short functions in every module of the package, and no
import cycles between its modules (lazy imports included), so each can be read and tested alone."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.unit.test_layers import _imports, _modules

MAX_FUNCTION_LINES = 60


def _long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    return [
        f"{path.name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > limit
    ]


def test_no_function_in_the_package_is_longer_than_the_limit() -> None:
    long = [f for path, _ in _modules() for f in _long_functions(path)]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them by step): {long}"


def test_the_length_check_catches_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    path = tmp_path / "long.py"
    path.write_text(f"def f():\n{body}\n\ndef g():\n    return 1\n")
    assert [s.split()[1] for s in _long_functions(path)] == ["f"]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in list(graph):
        if node not in index:
            visit(node)
    return found


def _package_graph() -> dict[str, set[str]]:
    """Every module of the package and the package modules it imports (lazily or not), itself excluded."""
    modules = {module for _, module in _modules()}
    return {
        module: {target for _, target in _imports(path, module) if target in modules and target != module}
        for path, module in _modules()
    }


def test_the_package_modules_import_each_other_without_a_cycle() -> None:
    graph = _package_graph()
    assert len(graph) > 1 and any(graph.values()), "the import graph is empty: the cycle check would check nothing"
    assert not _cycles(graph), "modules that import each other (lazily or not)"


@pytest.mark.parametrize(
    ("graph", "expect"),
    [({"a": {"b"}, "b": {"c"}, "c": set()}, []), ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b"]])],
)
def test_the_cycle_check_catches_a_cycle(graph: dict[str, set[str]], expect: list[list[str]]) -> None:
    assert _cycles(graph) == expect
