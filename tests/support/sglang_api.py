"""What we use of SGLang, read from its source with `ast` (no import: SGLang's heavy dependencies are not
needed to read it). `extract(root)` gives tests/data/sglang_api.json; the CI test checks our client and the
stand-in server against that file, `./dev sglang-contract` re-derives it from the installed package."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

HTTP = "srt/entrypoints/http_server.py"
IO = "srt/managers/io_struct.py"
ROUTES = ("/pause_generation", "/continue_generation", "/begin_weight_update", "/end_weight_update",
          "/update_weights_from_tensor", "/update_weight_version", "/model_info", "/server_info",
          "/load_lora_adapter", "/unload_lora_adapter")  # fmt: skip
SERVER_ARGS = {"srt/arg_groups/fields/model.py": ["model_path", "custom_weight_loader"],
               "srt/arg_groups/fields/parallel.py": ["tp_size", "pp_size", "dp_size"]}  # fmt: skip
# (file, class or None, function, what to record): the lines our loader path rests on
SOURCE = [
    ("srt/model_executor/model_runner_components/weight_updater.py", "WeightUpdater", "update_weights_from_tensor",
     "custom_loader"),
    ("srt/managers/tp_worker.py", None, "deserialize_own_rank", "return"),
    ("srt/managers/tokenizer_control_mixin.py", None, "update_weights_from_tensor", "assert"),
    ("srt/managers/scheduler_components/weight_updater.py", None, "update_weights_from_tensor", "session"),
    # why adapter versions need sglang.pause_mode=abort: the unload waits for the requests using the adapter
    ("srt/managers/tokenizer_control_mixin.py", None, "_unload_lora_adapter_locked", "registry"),
]  # fmt: skip


def _functions(tree: ast.AST, name: str) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name]


def _routes(root: Path) -> list[dict[str, Any]]:
    out = []
    for node in ast.parse((root / HTTP).read_text()).body:
        if not isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        for dec in node.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.args):
                continue
            path = dec.args[0].value if isinstance(dec.args[0], ast.Constant) else None
            if path not in ROUTES:
                continue
            body = None
            for arg in node.args.args:
                ann = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                if ann.startswith("Annotated[") and "Body()" in ann:
                    body = ann.removeprefix("Annotated[").split(",")[0]
            out.append({"path": path, "method": dec.func.attr.upper(), "body": body})
    return sorted(out, key=lambda r: r["path"])


def _bodies(root: Path, names: set[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for node in ast.parse((root / IO).read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name in names:
            fields = {}
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    fields[item.target.id] = {
                        "type": ast.unparse(item.annotation),
                        "default": ast.unparse(item.value) if item.value is not None else None,
                    }
            out[node.name] = fields
    return out


def _source(root: Path) -> list[dict[str, Any]]:
    out = []
    for rel, cls, fn, what in SOURCE:
        tree: ast.AST = ast.parse((root / rel).read_text())
        if cls is not None:
            tree = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
        node = _functions(tree, fn)[0]
        found: list[str] = []
        for sub in ast.walk(node):
            if what == "custom_loader" and isinstance(sub, ast.Call) and ast.unparse(sub.func) == "custom_loader":
                found.append(ast.unparse(sub))
            if what == "custom_loader" and isinstance(sub, ast.Compare) and "custom_weight_loaders" in ast.unparse(sub):
                found.append(ast.unparse(sub))
            if what == "return" and isinstance(sub, ast.Return) and sub.value is not None:
                found.append(ast.unparse(sub.value))
            if what == "assert" and isinstance(sub, ast.Assert):
                found.append(ast.unparse(sub.test))
            if what == "session" and isinstance(sub, ast.Compare) and "_session" in ast.unparse(sub):
                found.append(ast.unparse(sub))
            if what == "registry" and isinstance(sub, ast.Await) and "lora_registry" in ast.unparse(sub.value):
                found.append(ast.unparse(sub.value))
        out.append({"file": rel, "function": f"{cls + '.' if cls else ''}{fn}", "found": sorted(set(found))})
    return out


def _server_args(root: Path) -> dict[str, dict[str, list[str]]]:
    """{file: {field: its command-line flags}}: `--field-name` plus the `aliases` of its `Arg(...)`."""
    out = {}
    for rel, names in SERVER_ARGS.items():
        fields = {}
        for node in ast.walk(ast.parse((root / rel).read_text())):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in names:
                flags = ["--" + node.target.id.replace("_", "-")]
                for kw in (k for c in ast.walk(node.annotation) if isinstance(c, ast.Call) for k in c.keywords):
                    if kw.arg == "aliases" and isinstance(kw.value, ast.List):
                        flags += [e.value for e in kw.value.elts if isinstance(e, ast.Constant)]
                fields[node.target.id] = flags
        out[rel] = fields
    return out


def _model_info_keys(root: Path) -> list[str]:
    fn = _functions(ast.parse((root / HTTP).read_text()), "model_info")[0]
    dicts = [d for d in ast.walk(fn) if isinstance(d, ast.Dict)]
    return sorted(k.value for d in dicts for k in d.keys if isinstance(k, ast.Constant))


def extract(root: Path) -> dict[str, Any]:
    routes = _routes(root)
    return {
        "routes": routes,
        "bodies": _bodies(root, {r["body"] for r in routes if r["body"]}),
        "server_args": _server_args(root),
        "model_info_keys": _model_info_keys(root),
        "source": _source(root),
    }


if __name__ == "__main__":  # python -m tests.support.sglang_api <sglang package dir> > tests/data/sglang_api.json
    import json
    import sys

    print(json.dumps({"sglang_version": sys.argv[2] if len(sys.argv) > 2 else "?", **extract(Path(sys.argv[1]))},
                     indent=1))  # fmt: skip
