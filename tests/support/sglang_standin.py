"""STAND-IN for an `sglang serve` rollout (SGLang cannot run on this CPU machine). Clearly not SGLang.

It mirrors only what tests/data/sglang_api.json holds (read from SGLang 0.5.23's source; the CI test
checks this file's routes and bodies against it):

- the routes and their JSON bodies (unknown fields and pause modes outside the Literal are refused);
- `/update_weights_from_tensor` only inside a `/begin_weight_update` .. `/end_weight_update` session,
  only with dp_size 1; each TP rank takes `serialized_named_tensors[tp_rank]` (compared with the empty list
  our client sends, never unpickled here) and, when `load_format` is one of `--custom-weight-loader`,
  calls `loader(model, named_tensors)` by its import path; `weight_version` recorded on success;
- a loader exception ends the server (SGLang's scheduler quits on it);
- a "scheduler" thread that generates (a forward pass per step) unless paused; a control call runs
  between steps;
- `/load_lora_adapter` / `/unload_lora_adapter` (`lora=False`: a server without --enable-lora, which
  answers 400 naming the flag, as tokenizer_control_mixin.py does): a name is loaded once, under a fresh
  lora_id each load; unloading a name that is not loaded is a 400 ("does not exist"); the adapter
  directory is read whole (PEFT's two files) into the "served" adapter.
"""

from __future__ import annotations

import importlib
import json
import os
import threading
import time
import traceback
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from lightning_weightsync.demo.tiny_lm import build_model
from lightning_weightsync.rollout_engines.sglang import api
from lightning_weightsync.rollout_engines.worker import CONFIG_ENV
from tests.support.vllm_standin import StandInModel

SNAPSHOT = json.loads((Path(__file__).resolve().parents[1] / "data" / "sglang_api.json").read_text())


class StandInSGLang:
    """The routes of `sglang serve` that weight sync uses, over one TP rank (dp_size as given)."""

    ROUTES = {r["path"]: (r["method"], r["body"]) for r in SNAPSHOT["routes"]}
    BODIES = {name: set(fields) for name, fields in SNAPSHOT["bodies"].items()}

    def __init__(
        self, model: StandInModel, out_dir: Path, custom_weight_loader: list[str], dp_size: int = 1, lora: bool = True
    ) -> None:
        self.model, self.out_dir = model, out_dir
        self.lora_enabled = lora
        self.loras: dict[str, str] = {}  # lora_name -> lora_id (SGLang's LoRARegistry)
        self.lora_loads: list[dict[str, Any]] = []  # every successful load, in order (what the test checks)
        self.custom_weight_loader, self.dp_size, self.tp_size = custom_weight_loader, dp_size, 1
        self.lock = threading.Lock()  # one scheduler step or one control request at a time
        self.paused = False
        self.session: dict[str, Any] | None = None
        self.weight_version: str | None = None
        self.calls: list[str] = []
        self.steps = 0
        self.steps_by_version: dict[str, int] = {}
        self.stop = threading.Event()

    def generate_forever(self) -> None:
        tokens = torch.randint(0, self.model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
        while not self.stop.is_set():
            with self.lock:
                if not self.paused:
                    with torch.no_grad():
                        self.model(tokens)
                    self.steps += 1
                    key = str(self.weight_version)
                    self.steps_by_version[key] = self.steps_by_version.get(key, 0) + 1
            time.sleep(0.001)

    def handle(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        self.calls.append(path)
        if path == api.MODEL_INFO:
            return 200, {"weight_version": self.weight_version, "model_path": "stand-in"}
        if path == api.SERVER_INFO:
            return 200, {"tp_size": self.tp_size, "pp_size": 1, "dp_size": self.dp_size}
        if path == api.PAUSE:
            if body.get("mode", "abort") not in ("abort", "retract", "in_place"):
                return 422, {"detail": f"invalid mode {body.get('mode')!r}"}
            with self.lock:
                self.paused = True
            return 200, {"message": "Generation paused successfully.", "status": "ok"}
        if path == api.RESUME:
            with self.lock:
                self.paused = False
                self.dump()
            return 200, {"message": "Generation continued successfully.", "status": "ok"}
        with self.lock:  # the scheduler runs control requests between steps
            if path == api.BEGIN:
                if self.session is not None:
                    return 400, {"success": False, "message": "a weight-update session is already open"}
                self.session = {"loaded": False}
                return 200, {"success": True, "message": "Success"}
            if path == api.END:
                if self.session is None:
                    return 400, {"success": False, "message": "no weight-update session is open"}
                self.session = None
                self.dump()
                return 200, {"success": True, "message": "Success"}
            if path == api.SET_VERSION:
                self.weight_version = str(body["new_version"])
                return 200, {"success": True, "new_version": self.weight_version}
            if path == api.UPDATE:
                return self._update(body)
            if path in (api.LOAD_LORA, api.UNLOAD_LORA):
                return self._lora(path, body)
        raise KeyError(path)

    def _lora(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if not self.lora_enabled:
            message = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
            return 400, {"success": False, "error_message": message}
        name = body["lora_name"]
        if path == api.UNLOAD_LORA:
            if name not in self.loras:
                return 400, {"success": False, "error_message": f"LoRA with name {name} does not exist. Loaded LoRAs: "
                             f"{sorted(self.loras)}"}  # fmt: skip
            del self.loras[name]
            return 200, {"success": True, "error_message": "", "loaded_adapters": dict(self.loras)}
        if name in self.loras:
            return 400, {"success": False, "error_message": f"LoRA adapter {name} is already loaded"}
        lora_path = Path(body["lora_path"])
        weights, config = lora_path / "adapter_model.safetensors", lora_path / "adapter_config.json"
        if not (weights.is_file() and config.is_file()):
            return 400, {"success": False, "error_message": f"no adapter found at {lora_path}"}
        (self.out_dir / "served_adapter.safetensors").write_bytes(weights.read_bytes())
        (self.out_dir / "served_adapter_config.json").write_text(config.read_text())
        self.loras[name] = f"id{len(self.lora_loads)}"  # a fresh LoRARef every load
        self.lora_loads.append({"lora_name": name, "lora_path": str(lora_path), "weight_version": self.weight_version})
        self.dump()
        return 200, {"success": True, "error_message": "", "loaded_adapters": dict(self.loras)}

    def _update(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        assert self.dp_size == 1, "data-parallel replicas are not supported for update weights from tensor"
        if self.session is None:
            return 400, {"success": False, "message": "update_weights_from_tensor must run between "
                         "begin_weight_update() and end_weight_update()"}  # fmt: skip
        payload = body["serialized_named_tensors"][0]  # tp_rank 0
        if payload != api.EMPTY_NAMED_TENSORS:
            raise ValueError("the stand-in takes only the empty named-tensor list (it unpickles nothing)")
        load_format = body.get("load_format")
        if load_format not in self.custom_weight_loader:
            raise NotImplementedError(f"Unknown load_format={load_format}")
        module, _, name = load_format.rpartition(".")
        loader = getattr(importlib.import_module(module), name)
        try:
            loader(self.model, [])
        except BaseException:  # SGLang's scheduler has no handler here: the server goes down
            traceback.print_exc()
            os._exit(3)
        self.session["loaded"] = True
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return 200, {"success": True, "message": "Success"}

    def dump(self) -> None:
        state = {k: v.detach().clone().contiguous() for k, v in self.model.state_dict().items()}
        save_file(state, str(self.out_dir / "received.safetensors"))
        from lightning_weightsync.rollout_engines.sglang import loader

        rank = loader._rank
        (self.out_dir / "state.json").write_text(json.dumps({
            "weight_version": self.weight_version, "calls": self.calls, "steps": self.steps,
            "steps_by_version": self.steps_by_version,
            "loader_version": rank.version if rank else None, "identity": rank.identity if rank else None,
            "lora_loads": self.lora_loads,
        }))  # fmt: skip

    def http_handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self, method: str) -> None:
                path = urllib.parse.urlparse(self.path).path
                route = StandInSGLang.ROUTES.get(path)
                if route is None or route[0] not in (method, "API_ROUTE"):
                    self._answer(404 if route is None else 405, {"detail": "Not Found"})
                    return
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else {}
                fields = StandInSGLang.BODIES.get(route[1] or "", set())
                if set(body) - fields:
                    self._answer(422, {"detail": f"unknown fields {sorted(set(body) - fields)}"})
                    return
                try:
                    self._answer(*server.handle(path, body))
                except Exception:  # FastAPI: an unhandled exception is a 500
                    traceback.print_exc()
                    self._answer(500, {"detail": traceback.format_exc(limit=2)[-800:]})

            def do_GET(self) -> None:
                self._serve("GET")

            def do_POST(self) -> None:
                self._serve("POST")

            def _answer(self, code: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        return Handler


def standin_sglang_main(
    http_port: int, config_path: str, out_dir: str, run_s: float = 150.0, dp_size: int = 1, lora: bool = True
) -> None:
    """One stand-in `sglang serve --custom-weight-loader <ours>` process, until killed."""
    os.environ[CONFIG_ENV] = config_path  # what launch.py puts in the server's environment
    torch.manual_seed(4321)  # start from weights different from the trainer's
    model = StandInModel(build_model().config)
    server = StandInSGLang(model, Path(out_dir), [api.LOADER], dp_size=dp_size, lora=lora)
    httpd = ThreadingHTTPServer(("127.0.0.1", http_port), server.http_handler())
    threading.Thread(target=server.generate_forever, daemon=True).start()
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    Path(out_dir, "ready").write_text("1")
    deadline = time.monotonic() + run_s
    while time.monotonic() < deadline:
        time.sleep(0.2)
    server.stop.set()
    httpd.shutdown()
