"""STAND-IN for a `vllm serve` rollout (vLLM cannot run on this CPU machine). Clearly not vLLM.

It mirrors only API that vLLM 0.33.0 and 0.34.0 both really have (each method cites the vLLM file:line it
mirrors, as "0.33.0 / 0.34.0" where they differ), and tests/unit/test_vllm_contract.py checks its signatures
and routes against every tests/data/vllm_api-<version>.json (taken from vLLM's source):

- `StandInWeightTransferEngine`: vLLM's `WeightTransferEngine` base (distributed/weight_transfer/
  base.py): `__init__(config, vllm_config, device, model)` sets the same attributes, `update_weights`
  parses the dict and calls `receive_weights` (the accelerator sync is a no-op on CPU).
- `StandInWorker`: the weight-update methods of vLLM's GPU `Worker` (v1/worker/gpu_worker.py): the
  one-session-at-a-time flag, a failed update ending the session (0.34.0 also lends the KV cache to the
  update and, with VLLM_RELOAD_MODE=direct, ends the session on a failed finish: neither is mirrored).
- `StandInServer`: the RL routes (entrypoints/rl/online/api_router.py) and `/reset_prefix_cache`
  (entrypoints/serve/dev/cache/api_router.py) with their query and body parameters. An exception in
  a handler is an HTTP 500, as FastAPI makes it.
- `/v1/load_lora_adapter` (entrypoints/serve/lora/api_router.py, served only with --enable-lora and
  VLLM_ALLOW_RUNTIME_LORA_UPDATING=True: `lora=False` answers 404 as FastAPI does for a route never
  registered), checked as `OpenAIServingModels.load_lora_adapter` checks it (entrypoints/openai/models/
  serving.py): both names non-empty, a loaded name refused unless `load_inplace`, which keeps its
  lora_int_id; the adapter directory is read whole (PEFT's two files) into the "served" adapter.
- An "engine core" thread that generates (a forward pass of the model per step) unless paused; RPCs
  hold the same lock as a step, as vLLM's engine core runs utility calls between steps.

The model is the tiny LM of the examples with vLLM's `load_weights(weights)` shape (copy by name).
"""

from __future__ import annotations

import json
import threading
import time
import traceback
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from lightning_weightsync.demo.tiny_lm import TinyLM, build_model
from lightning_weightsync.rollout_engines.vllm.extension import WeightSyncWorkerExtension
from lightning_weightsync.rollout_engines.vllm.worker import WeightSyncEngineBody


class StandInModel(TinyLM):
    """The tiny LM with vLLM's model interface for weight loading: `load_weights(weights)` (every vLLM model
    has one, e.g. model_executor/models/qwen3.py:346 / 352; a parameter without a loader is copied as
    model_loader/weight_utils.py:1529 / 1588 default_weight_loader does)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        targets = dict(self.named_parameters()) | dict(self.named_buffers())
        loaded = set()
        for name, tensor in weights:
            if name not in targets:
                raise KeyError(f"no parameter named {name!r}")
            param = targets[name]
            loader = getattr(param, "weight_loader", None)  # as vLLM's models: the layerwise reload wraps it
            if loader is not None:
                loader(param, tensor)
            else:
                with torch.no_grad():
                    param.copy_(tensor)  # vLLM's default_weight_loader: param.data.copy_(loaded_weight)
            loaded.add(name)
        return loaded


@dataclass
class StandInWeightTransferConfig:
    """vllm.config.weight_transfer.WeightTransferConfig (config/weight_transfer.py:9 in both): one field."""

    backend: str = "nccl"


class StandInWeightTransferEngine:
    """vLLM's `WeightTransferEngine` base, the parts our engine uses (distributed/weight_transfer/base.py:428;
    the file is the same in 0.33.0 and 0.34.0, so each line cited is both)."""

    init_info_cls: type[Any]
    update_info_cls: type[Any]
    supports_draft_weight_update: bool = True
    defers_processing: bool = False

    # base.py:478
    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        self.config = config
        self.vllm_config = vllm_config
        self.parallel_config = getattr(vllm_config, "parallel_config", None)
        self.model_config = getattr(vllm_config, "model_config", None)
        self.device = device
        self.model = model
        self._default_model_config = self.model_config
        self._default_model = model

    # base.py:503
    def set_weight_update_target(self, model: torch.nn.Module, model_config: Any) -> None:
        self.model, self.model_config = model, model_config

    # base.py:512
    def reset_weight_update_target(self) -> None:
        self.model, self.model_config = self._default_model, self._default_model_config

    # base.py:517
    def parse_init_info(self, init_dict: dict[str, Any]) -> Any:
        try:
            return self.init_info_cls(**init_dict)
        except TypeError as e:
            raise ValueError(f"Invalid init_info for {self.__class__.__name__}: {e}") from e

    # base.py:537
    def parse_update_info(self, update_dict: dict[str, Any]) -> Any:
        try:
            return self.update_info_cls(**update_dict)
        except TypeError as e:
            raise ValueError(f"Invalid update_info for {self.__class__.__name__}: {e}") from e

    # base.py:558
    def init_transfer_engine(self, init_info: Any) -> None:
        raise NotImplementedError

    # base.py:569
    def start_weight_update(self) -> None:
        raise NotImplementedError

    # base.py:579
    def finish_weight_update(self) -> None:
        raise NotImplementedError

    # base.py:587
    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        # vLLM: torch.accelerator.synchronize() here; nothing to wait for on CPU

    # base.py:601
    def receive_weights(self, update_info: Any) -> None:
        raise NotImplementedError

    # base.py:612
    def shutdown(self) -> None:
        raise NotImplementedError


class StandInEngine(WeightSyncEngineBody, StandInWeightTransferEngine):
    """Our engine body on the stand-in base, as engine.py binds it to vLLM's real base."""

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module,
                 config_path: str) -> None:  # fmt: skip
        super().__init__(config, vllm_config, device, model)
        self._weightsync_setup(rank=0, config_path=config_path)


class StandInWorker:
    """vLLM's GPU `Worker` (v1/worker/gpu_worker.py), its weight-update methods (one session at a time, a failed
    update ends it)."""

    def __init__(self, engine: StandInEngine) -> None:
        self.weight_transfer_engine = engine
        self._weight_update_active = False

    # gpu_worker.py:1519 / 1629
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        engine = self.weight_transfer_engine
        engine.init_transfer_engine(engine.parse_init_info(init_info))

    # gpu_worker.py:1542 / 1655
    def start_weight_update(self) -> None:
        if self._weight_update_active:
            raise RuntimeError(
                "start_weight_update called while a weight update is already active. Call finish_weight_update first."
            )
        self.weight_transfer_engine.start_weight_update()
        self._weight_update_active = True

    # gpu_worker.py:1592 / 1718 (a failure: 1624-1631 / 1750-1752, _end_weight_update 1754)
    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        if not self._weight_update_active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        try:
            self.weight_transfer_engine.update_weights(update_info[0] if isinstance(update_info, list) else update_info)
        except BaseException:
            self._weight_update_active = False
            self.weight_transfer_engine.reset_weight_update_target()
            raise

    # gpu_worker.py:1633 / 1764
    def finish_weight_update(self) -> None:
        if not self._weight_update_active:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
        self.weight_transfer_engine.finish_weight_update()
        self.weight_transfer_engine.reset_weight_update_target()
        self._weight_update_active = False


class StandInServer:
    """The routes of `vllm serve` with VLLM_SERVER_DEV_MODE=1 that weight sync uses, over one worker. Where each
    is declared (the same line in 0.33.0 and 0.34.0): entrypoints/rl/online/api_router.py /pause :31, /resume :78,
    /init_weight_transfer_engine :162, /start_weight_update :181, /update_weights :195, /finish_weight_update
    :207, /get_world_size :269; entrypoints/serve/dev/cache/api_router.py /reset_prefix_cache :20;
    entrypoints/serve/dev/rpc/api_router.py /collective_rpc :23; entrypoints/serve/lora/api_router.py
    /v1/load_lora_adapter :63 (checked as entrypoints/openai/models/serving.py:167 load_lora_adapter)."""

    ROUTES = {
        "/pause": (["mode", "clear_cache"], []),
        "/resume": ([], []),
        "/init_weight_transfer_engine": ([], ["init_info"]),
        "/start_weight_update": ([], []),
        "/update_weights": ([], ["update_info"]),
        "/finish_weight_update": ([], ["weight_version"]),
        "/reset_prefix_cache": (["reset_running_requests", "reset_external"], []),
        "/get_world_size": (["include_dp"], []),  # GET
        "/collective_rpc": ([], ["method", "args", "kwargs", "timeout"]),
        "/v1/load_lora_adapter": ([], ["lora_name", "lora_path", "load_inplace", "is_3d_lora_weight"]),
    }

    def __init__(self, worker: StandInWorker, model: StandInModel, out_dir: Path, lora: bool = True) -> None:
        self.worker, self.model, self.out_dir = worker, model, out_dir
        self.lora_enabled = lora
        self.lora_requests: dict[str, dict[str, Any]] = {}  # OpenAIServingModels.lora_requests, by name
        self.lora_loads: list[dict[str, Any]] = []  # every successful load, in order (what the test checks)
        self.core_lock = threading.Lock()  # one step or one utility call at a time, as in the engine core
        self.paused = False
        self.weight_version: str | None = None
        self.calls: list[str] = []
        self.steps = 0
        self.steps_by_version: dict[str, int] = {}
        self.paused_s = 0.0
        self._paused_at: float | None = None
        self.first_pause: float | None = None  # the window the trainer drove: first /pause .. last /resume
        self.last_resume: float | None = None
        self.started = time.perf_counter()
        self.stop = threading.Event()

    # -- the engine core: generate unless paused ---------------------------------------------------
    def generate_forever(self) -> None:
        tokens = torch.randint(0, self.model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
        while not self.stop.is_set():
            with self.core_lock:
                if not self.paused:
                    with torch.no_grad():
                        self.model(tokens)
                    self.steps += 1
                    key = str(self.weight_version)
                    self.steps_by_version[key] = self.steps_by_version.get(key, 0) + 1
            time.sleep(0.001)

    # -- the routes ------------------------------------------------------------------------------------
    def handle(self, path: str, query: dict[str, str], body: dict[str, Any]) -> dict[str, Any] | str:
        self.calls.append(path)
        if path == "/v1/load_lora_adapter":
            return self.load_lora_adapter(body)
        if path == "/pause":
            mode = query.get("mode", "abort")
            if mode not in ("abort", "wait", "keep"):
                raise ValueError(f"Invalid pause mode: {mode}")
            with self.core_lock:
                self.paused = True
                self.pause_mode = mode
                self._paused_at = time.perf_counter()
                if self.first_pause is None:
                    self.first_pause = self._paused_at
            return {"status": "paused"}
        if path == "/resume":
            with self.core_lock:
                if self._paused_at is not None:
                    self.last_resume = time.perf_counter()
                    self.paused_s += self.last_resume - self._paused_at
                    self._paused_at = None
                self.paused = False
                self.dump()
            return {"status": "resumed"}
        with self.core_lock:  # a collective_rpc runs between engine steps
            if path == "/init_weight_transfer_engine":
                self.worker.init_weight_transfer_engine(body["init_info"])
                return {"message": "Weight transfer initialized"}
            if path == "/start_weight_update":
                self.worker.start_weight_update()
                return {"message": "Weight update started"}
            if path == "/update_weights":
                self.worker.update_weights(body["update_info"])
                return {"message": "Weights updated"}
            if path == "/finish_weight_update":
                self.worker.finish_weight_update()
                if body.get("weight_version") is not None:
                    self.weight_version = str(body["weight_version"])
                self.dump()
                return {"message": "Weight update finished"}
            if path == "/collective_rpc":  # vLLM: run_method(worker, method) on every worker (here one)
                method = body.get("method")
                fn = getattr(self.worker, method, None) if isinstance(method, str) else None
                if fn is None:
                    raise NotImplementedError(f"Method {method!r} is not implemented.")
                result = fn(*body.get("args", []), **body.get("kwargs", {}))
                return {"results": [result if result is None or isinstance(result, dict | list) else str(result)]}
            if path == "/reset_prefix_cache":
                # as vLLM's scheduler: requests kept by pause(mode=keep) hold KV blocks, so the reset
                # fails unless they are preempted (reset_running_requests=true)
                held = self.paused and getattr(self, "pause_mode", "abort") == "keep"
                return {"success": not held or query.get("reset_running_requests") == "true"}
        raise KeyError(path)

    def load_lora_adapter(self, body: dict[str, Any]) -> str:
        """vLLM's checks and effect; the "engine" loads the directory whole (engine_client.add_lora)."""
        name, path, inplace = body.get("lora_name"), body.get("lora_path"), bool(body.get("load_inplace", False))
        if not name or not path:
            raise ValueError("Both 'lora_name' and 'lora_path' must be provided.")
        if not inplace and name in self.lora_requests:
            raise ValueError(
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, set "
                "'load_inplace' to True."
            )
        known = self.lora_requests.get(name)
        lora_int_id = known["lora_int_id"] if known else len(self.lora_requests) + 1  # in place: the same id
        with self.core_lock:  # add_lora runs in the engine core, between steps
            weights = Path(path) / "adapter_model.safetensors"
            config = Path(path) / "adapter_config.json"
            if not (weights.is_file() and config.is_file()):
                raise FileNotFoundError(f"Loading lora {name} failed: No adapter found for {path}")
            (self.out_dir / "served_adapter.safetensors").write_bytes(weights.read_bytes())
            (self.out_dir / "served_adapter_config.json").write_text(config.read_text())
            self.lora_requests[name] = {"lora_int_id": lora_int_id, "lora_path": path}
            self.lora_loads.append({"lora_name": name, "lora_path": path, "load_inplace": inplace,
                                    "lora_int_id": lora_int_id, "weight_version": self.weight_version})  # fmt: skip
            self.dump()
        return f"Success: LoRA adapter '{name}' added successfully."

    def dump(self) -> None:
        """What the test checks: the model's tensors and the versions vLLM would report."""
        state = {k: v.detach().clone().contiguous() for k, v in self.model.state_dict().items()}
        save_file(state, str(self.out_dir / "received.safetensors"))
        engine = self.worker.weight_transfer_engine
        (self.out_dir / "state.json").write_text(
            json.dumps(
                {
                    "weight_version": self.weight_version,
                    "engine_version": engine.version,
                    "identity": engine.identity,
                    "calls": self.calls,
                    "steps": self.steps,
                    "steps_by_version": self.steps_by_version,
                    "paused_s": self.paused_s,
                    "elapsed_s": time.perf_counter() - self.started,
                    "window_s": (self.last_resume or 0.0) - (self.first_pause or 0.0),
                    "lora_loads": self.lora_loads,
                }
            )
        )

    def http_handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urllib.parse.urlparse(self.path)
                if url.path != "/get_world_size":
                    self._answer(404 if url.path not in StandInServer.ROUTES else 405, {"detail": "Not Found"})
                    return
                self._answer(200, {"world_size": 1})  # one worker: TP x PP x DP = 1

            def do_POST(self) -> None:
                url = urllib.parse.urlparse(self.path)
                lora_off = url.path == "/v1/load_lora_adapter" and not server.lora_enabled  # attach_router skipped it
                if url.path not in StandInServer.ROUTES or lora_off:
                    self._answer(404, {"detail": "Not Found"})
                    return
                query = dict(urllib.parse.parse_qsl(url.query))
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else {}
                try:
                    self._answer(200, server.handle(url.path, query, body))
                except ValueError as exc:
                    self._answer(400, {"error": str(exc)})
                except FileNotFoundError as exc:  # vLLM's LoRAAdapterNotFoundError answer
                    self._answer(404, {"error": {"message": str(exc), "type": "NotFoundError", "code": 404}})
                except Exception:  # FastAPI: an unhandled exception is a 500
                    traceback.print_exc()
                    self._answer(500, {"detail": traceback.format_exc(limit=2)[-800:]})

            def _answer(self, code: int, payload: dict[str, Any] | str) -> None:
                text = isinstance(payload, str)  # the LoRA route answers Response(content=<str>), not JSON
                data = payload.encode() if text else json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain" if text else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        return Handler


def standin_server_main(
    http_port: int, config_path: str, out_dir: str, run_s: float = 150.0, extension: bool = True, lora: bool = True
) -> None:
    """One stand-in `vllm serve` process: engine + worker + routes + generation, until killed."""
    torch.manual_seed(1234)  # start from weights different from the trainer's
    model = StandInModel(build_model().config)
    engine = StandInEngine(StandInWeightTransferConfig("lightning_weightsync"), None, torch.device("cpu"), model,
                           config_path)  # fmt: skip
    # as `vllm serve --worker-extension-cls <ours>` (the launcher passes it): vLLM mixes it into its worker class
    worker_cls = type("Worker", (StandInWorker, WeightSyncWorkerExtension), {}) if extension else StandInWorker
    server = StandInServer(worker_cls(engine), model, Path(out_dir), lora=lora)
    httpd = ThreadingHTTPServer(("127.0.0.1", http_port), server.http_handler())
    threading.Thread(target=server.generate_forever, daemon=True).start()
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    Path(out_dir, "ready").write_text("1")
    deadline = time.monotonic() + run_s
    while time.monotonic() < deadline:
        time.sleep(0.2)
    server.stop.set()
    httpd.shutdown()
    engine.shutdown()
