"""The vLLM API surface we rely on, read from vLLM's source with `ast` (nothing of vLLM is imported).

`tests/data/vllm_api.json` is this, taken from vLLM 0.33.0. The default test run checks the
stand-in (tests/support/vllm_standin.py) against the JSON; `./dev vllm-contract` re-derives it from
the installed vLLM and compares, then runs our engine on vLLM's real base class.

    python -m tests.support.vllm_api <path to the vllm package>   # prints the JSON
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path
from typing import Any

# (file under vllm/, class, methods): what our engine subclasses or calls, and what the trainer calls
METHODS: list[tuple[str, str, list[str]]] = [
    (
        "distributed/weight_transfer/base.py",
        "WeightTransferEngine",
        [
            "__init__",
            "parse_init_info",
            "parse_update_info",
            "init_transfer_engine",
            "start_weight_update",
            "finish_weight_update",
            "update_weights",
            "receive_weights",
            "shutdown",
            "set_weight_update_target",
            "reset_weight_update_target",
        ],
    ),
    ("distributed/weight_transfer/factory.py", "WeightTransferEngineFactory", ["register_engine", "create_engine"]),
    (
        "v1/engine/async_llm.py",
        "AsyncLLM",
        [
            "pause_generation",
            "resume_generation",
            "init_weight_transfer_engine",
            "start_weight_update",
            "update_weights",
            "finish_weight_update",
            "update_weight_version",
            "reset_prefix_cache",
        ],
    ),
    (
        "entrypoints/rl/offline.py",
        "RLOfflineMixin",
        ["init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update"],
    ),
    ("entrypoints/llm.py", "LLM", ["reset_prefix_cache"]),
    (
        "v1/worker/gpu_worker.py",
        "Worker",
        ["init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update"],
    ),
    # --worker-extension-cls is mixed in here; /collective_rpc's method names resolve through __getattr__
    ("v1/worker/worker_base.py", "WorkerWrapperBase", ["init_worker", "__getattr__"]),
]
ROUTE_FILES = [
    "entrypoints/rl/online/api_router.py",
    "entrypoints/serve/dev/cache/api_router.py",
    "entrypoints/serve/dev/rpc/api_router.py",
    "entrypoints/serve/lora/api_router.py",  # routes defined inside attach_router(app)
]
# request bodies given as a pydantic model parameter: (file, class); its annotated fields are the body keys
BODY_MODELS = {"LoadLoRAAdapterRequest": "entrypoints/serve/lora/protocol.py"}
ROUTES = [
    "/collective_rpc",
    "/get_world_size",
    "/pause",
    "/resume",
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/reset_prefix_cache",
    "/v1/load_lora_adapter",  # trainer.lora=adapter (rollout_engines/vllm/client.py load_adapter)
]
CONSTANTS = [("distributed/weight_transfer/factory.py", "WeightTransferEngineFactory._registry")]


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = fn.args
    names = [p.arg for p in [*a.posonlyargs, *a.args]]
    names += [f"*{a.vararg.arg}"] if a.vararg else []
    names += [p.arg for p in a.kwonlyargs]
    names += [f"**{a.kwarg.arg}"] if a.kwarg else []
    return names


def _find_class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise KeyError(name)


def _route_param_kind(arg: ast.arg, default: ast.expr | None) -> str | None:
    """query | body | model (a pydantic body) | None (the raw request) for one route handler parameter, as
    FastAPI reads it."""
    text = ast.unparse(arg.annotation) if arg.annotation is not None else ""
    default_text = ast.unparse(default) if default is not None else ""
    if text == "Request":
        return None
    if text in BODY_MODELS:
        return "model"
    if "Body(" in text or "Body(" in default_text:
        return "body"
    return "query"  # Query(...) or a plain scalar: FastAPI reads both from the query string


def _raw_body_keys(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Keys a handler that parses the raw request itself reads from it: `body.get("k")` (/collective_rpc)."""
    keys: list[str] = []
    for node in ast.walk(fn):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "body"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            keys.append(str(node.args[0].value))
    return keys


def _model_fields(vllm_root: Path, name: str) -> list[str]:
    """The annotated fields of pydantic model `name` (`BODY_MODELS`), in order: FastAPI's body keys."""
    node = _find_class(ast.parse((vllm_root / BODY_MODELS[name]).read_text()), name)
    return [n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]


def extract(vllm_root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"methods": [], "routes": []}
    for rel, cls, methods in METHODS:
        tree = ast.parse((vllm_root / rel).read_text())
        node = _find_class(tree, cls)
        defs = {n.name: n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        for m in methods:
            fn = defs[m]
            out["methods"].append(
                {
                    "module": "vllm." + rel[:-3].replace("/", "."),
                    "class": cls,
                    "method": m,
                    "params": _params(fn),
                    "async": isinstance(fn, ast.AsyncFunctionDef),
                }
            )
    for rel in ROUTE_FILES:
        tree = ast.parse((vllm_root / rel).read_text())
        for node in ast.walk(tree):  # nested too: the LoRA routes are defined inside attach_router(app)
            if not isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
                continue
            for dec in node.decorator_list:
                if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)):
                    continue
                if not (dec.args and isinstance(dec.args[0], ast.Constant)) or dec.args[0].value not in ROUTES:
                    continue
                args = node.args.args
                defaults = [None] * (len(args) - len(node.args.defaults)) + list(node.args.defaults)
                query, body = [], []
                for arg, default in zip(args, defaults, strict=True):
                    kind = _route_param_kind(arg, default)
                    if kind == "query":
                        query.append(arg.arg)
                    elif kind == "body":
                        body.append(arg.arg)
                    elif kind == "model":
                        body += _model_fields(vllm_root, ast.unparse(arg.annotation))  # type: ignore[arg-type]
                body += _raw_body_keys(node)
                out["routes"].append(
                    {"path": dec.args[0].value, "method": dec.func.attr.upper(), "query": query, "body": body}
                )
    out["routes"].sort(key=lambda r: r["path"])
    return out


if __name__ == "__main__":
    root = Path(sys.argv[1])
    version = sys.argv[2] if len(sys.argv) > 2 else "unknown"
    print(json.dumps({"vllm_version": version, **extract(root)}, indent=1))
