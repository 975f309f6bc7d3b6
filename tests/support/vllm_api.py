"""The vLLM API surface we rely on, read from vLLM's source with `ast` (nothing of vLLM is imported).

One snapshot per supported vLLM release, `tests/data/vllm_api-<version>.json` (0.33.0 and 0.34.0 today;
the `vllm` extra in pyproject.toml is the range they span). The default test run checks the stand-ins
(tests/support/vllm_standin.py, tests/unit/test_vllm_fleet.py) against every snapshot; `./dev
vllm-contract` (VLLM_VERSION=...) re-derives the installed release's snapshot and compares, then runs our
engine on vLLM's real base class. A function a release lacks is recorded as `null`, so the diff of two
snapshots says what a release removed, renamed or added.

    python -m tests.support.vllm_api <path to the vllm package> <version>   # prints the JSON
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
    # what engine.py re-derives after a rollback (the hook's arguments changed in 0.34.0)
    ("model_executor/layers/attention/attention.py", "Attention", ["process_weights_after_loading"]),
    ("model_executor/layers/attention/mla_attention.py", "MLAAttention", ["process_weights_after_loading"]),
]
# (file under vllm/, functions): module-level functions our engine (rollout_engines/vllm/weight_transfer.py) or its
# contract test calls, where vLLM defines them; one a release lacks is recorded as null, which engine.py
# handles by feature (ReloadHooks), never by version
FUNCTIONS: list[tuple[str, list[str]]] = [
    (
        "model_executor/model_loader/reload/layerwise.py",
        ["record_metadata_for_reloading", "initialize_layerwise_reload", "finalize_layerwise_reload"],
    ),
    ("model_executor/model_loader/reload/lifecycle.py", ["start_reload", "finish_reload", "weight_update_active"]),
    ("model_executor/model_loader/mtp_validation.py", ["disable_mtp_completeness_check"]),
    ("model_executor/model_loader/weight_utils.py", ["finalize_model_weights"]),
    ("model_executor/utils.py", ["weights_already_processed"]),
    ("model_executor/layers/attention/__init__.py", ["is_deferred_attention_layer"]),
    ("distributed/parallel_state.py", ["get_world_group"]),
    ("plugins/__init__.py", ["load_general_plugins"]),
]
# (package __init__ under vllm/, names): what engine.py imports from the package, present in its __all__
EXPORTS: list[tuple[str, list[str]]] = [
    (
        "model_executor/model_loader/reload/__init__.py",
        [
            "record_metadata_for_reloading",
            "initialize_layerwise_reload",
            "finalize_layerwise_reload",
            "start_reload",
            "finish_reload",
            "weight_update_active",
        ],
    ),
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


def _module(rel: str) -> str:
    return "vllm." + rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _functions(vllm_root: Path) -> list[dict[str, Any]]:
    out = []
    for rel, names in FUNCTIONS:
        path = vllm_root / rel
        tree = ast.parse(path.read_text()) if path.is_file() else ast.Module(body=[], type_ignores=[])
        defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        for name in names:
            fn = defs.get(name)
            out.append({"module": _module(rel), "function": name, "params": _params(fn) if fn else None})
    return out


def _exports(vllm_root: Path) -> list[dict[str, Any]]:
    out = []
    for rel, names in EXPORTS:
        exported: set[str] = set()
        for node in ast.parse((vllm_root / rel).read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                assert isinstance(node, ast.Assign) and isinstance(node.value, ast.List | ast.Tuple)
                exported = {str(e.value) for e in node.value.elts if isinstance(e, ast.Constant)}
        out.append({"module": _module(rel), "names": [n for n in names if n in exported]})
    return out


def extract(vllm_root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"methods": [], "routes": []}
    out["functions"], out["exports"] = _functions(vllm_root), _exports(vllm_root)
    for rel, cls, methods in METHODS:
        tree = ast.parse((vllm_root / rel).read_text())
        node = _find_class(tree, cls)
        defs = {n.name: n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        for m in methods:
            fn = defs[m]
            out["methods"].append(
                {
                    "module": _module(rel),
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


DATA = Path(__file__).resolve().parents[1] / "data"


def snapshot_path(version: str) -> Path:
    return DATA / f"vllm_api-{version}.json"


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split("."))


def supported_versions() -> list[str]:
    """The vLLM releases a snapshot is pinned for, oldest first."""
    found = [p.name.removeprefix("vllm_api-").removesuffix(".json") for p in DATA.glob("vllm_api-*.json")]
    return sorted(found, key=_version_key)


def snapshot(version: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(snapshot_path(version).read_text())
    return data


def routes_on_every_version() -> dict[str, dict[str, Any]]:
    """path -> {"method", "query", "body"}: the parameters every supported release's route declares (what a
    client may send to any of them)."""
    out: dict[str, dict[str, Any]] = {}
    for version in supported_versions():
        for r in snapshot(version)["routes"]:
            seen = out.setdefault(r["path"], {"method": r["method"], "query": r["query"], "body": r["body"]})
            assert seen["method"] == r["method"], (r["path"], version)
            seen["query"] = [q for q in seen["query"] if q in r["query"]]
            seen["body"] = [b for b in seen["body"] if b in r["body"]]
    return out


if __name__ == "__main__":
    root = Path(sys.argv[1])
    version = sys.argv[2] if len(sys.argv) > 2 else "unknown"
    print(json.dumps({"vllm_version": version, **extract(root)}, indent=1))
