"""The trainer side of vLLM rollouts: each version's update window over vLLM's own API.

vLLM loads new weights through its weight-transfer API (vllm/entrypoints/rl/online/api_router.py for
`vllm serve`, `LLM` / `AsyncLLM` methods in process). Each server's workers run our engine
(`engine.py`), whose `receive_weights` takes one version from our sender. Per version
(`trainer/fleet.py` runs the steps on every rollout at once):

    POST /pause?mode=<vllm.pause_mode>                         (generation stops stepping)
    POST /start_weight_update
    POST /update_weights {"update_info": {"version": v}}       <- in a thread: it returns when the
                                                                  workers received our broadcast
    POST /finish_weight_update {"weight_version": "v"}         (vLLM records the version)
    POST /v1/load_lora_adapter {"lora_name": vllm.lora_name,   (adapter versions only, trainer.lora=adapter:
          "lora_path": "<vllm.lora_dir>/step_v",               worker 0 wrote that PEFT adapter directory while
          "load_inplace": true}                                receiving; the served name keeps its id, new content)
    POST /reset_prefix_cache                                   (blocks computed with old weights)
    POST /collective_rpc {"method": REPORT_METHOD}             (verify: what every worker holds)
    POST /resume                                               (always, also after any failure)

The engine's trainer half: it imports nothing of the rollout side (the trainer loads it by path through
`ROLLOUT_ENGINES` in `plugins.py`), talks HTTP with the standard library and never imports vLLM (in-process
engines are duck-typed, see `EngineRolloutClient`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...errors import CannotAsk, ConfigError, PeerError
from ...plugins import RolloutClient
from ...protocol.lora import adapter_path
from ...transport.http import JSONEndpoint
from ...versions.verify import weight_problems
from .config import PauseMode, VLLMConfig

logger = logging.getLogger(__name__)

ENGINE = "vLLM"  # how errors name it
REPORT_METHOD = "lightning_weightsync_weight_report"
"""The worker method verify names over /collective_rpc (`extension.py` defines it on vLLM's worker)."""
EXTENSION_CLASS = "lightning_weightsync.rollout_engines.vllm.extension.WeightSyncWorkerExtension"
"""What `vllm serve --worker-extension-cls` must name for it (the launcher passes it). Strings here: this
module is the trainer's and imports nothing of the rollout side."""
TIMEOUT_KNOB = "vllm.request_timeout_s"
LOAD_LORA = "/v1/load_lora_adapter"
"""vLLM's runtime LoRA route (entrypoints/serve/lora/api_router.py: registered only with
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; `load_inplace` keeps the name's lora_int_id and reloads its content,
entrypoints/openai/models/serving.py `load_lora_adapter`)."""


def clients(v: VLLMConfig) -> list[HTTPRolloutClient]:
    """One client per `vllm.urls` (the registry's entry point for the trainer side); `v` is the typed `vllm`
    section, all of the config this module reads."""
    return [
        HTTPRolloutClient(
            u,
            v.request_timeout_s,
            pause_mode=v.pause_mode,
            reset_prefix_cache=v.reset_prefix_cache,
            lora_name=v.lora_name,
            lora_dir=v.lora_dir,
        )
        for u in v.urls
    ]


class _PrefixCacheReset:
    """After a version: drop KV computed with the previous weights. Under `keep` the paused requests still
    hold their blocks, and vLLM resets only when no running request holds any (scheduler.py
    `reset_prefix_cache`): they are preempted (`reset_running_requests`) and re-prefilled with the new
    weights, which costs their prefill again but is the only way their next tokens are on-policy. Under
    `abort` and `wait` nothing runs at this point and a plain reset suffices."""

    name: str
    pause_mode: PauseMode
    reset_prefix_cache: bool

    def _reset(self, reset_running_requests: bool) -> bool:
        raise NotImplementedError

    def after_update(self, version: int) -> None:
        if not self.reset_prefix_cache:
            return
        running = self.pause_mode is PauseMode.keep
        try:
            if not self._reset(running):
                logger.warning(
                    "vLLM rollout %s: the prefix cache was not reset after version %d (blocks still held, "
                    "pause_mode=%s); cached prefixes may reuse KV computed with the previous weights",
                    self.name,
                    version,
                    self.pause_mode,
                )
        except Exception as exc:  # cache hygiene is not worth failing a delivered version
            logger.warning("vLLM rollout %s: resetting the prefix cache failed: %s", self.name, exc)


class _WorkersHoldIt:
    """`verify`, the same over HTTP and in process: the finish call recorded `version`, and every worker says it
    holds that version, whole (`weight_reports`: which version its model holds and how many of its tensors
    matched the trainer's fingerprints on arrival; a mismatch would have failed the version). A rollout that
    cannot be asked (`CannotAsk`) is judged by the finish call alone, and says so once."""

    name: str
    _weight_version: str | None
    _said_cannot_ask = False

    def weight_reports(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    def verify(self, version: int) -> None:
        if self._weight_version != str(version):
            raise PeerError(f"vLLM rollout {self.name}: holds weight_version {self._weight_version}, not {version}")
        try:
            reports = self.weight_reports()
        except CannotAsk as exc:
            if not self._said_cannot_ask:
                self._said_cannot_ask = True
                logger.warning("%s", exc)
            return
        problems = [p for report in reports for p in weight_problems(self.name, version, report, None)]
        if problems:
            raise PeerError("; ".join(problems))


class HTTPRolloutClient(_WorkersHoldIt, _PrefixCacheReset, RolloutClient):
    """`vllm serve` (started with VLLM_SERVER_DEV_MODE=1, which registers the RL and cache routes).

    Routes and bodies as vLLM 0.33.0 defines them: `/pause` takes `mode` as a query parameter;
    `/update_weights` a JSON body `{"update_info": {...}}`; `/finish_weight_update` an optional
    `{"weight_version": "<str>"}`; `/reset_prefix_cache` answers `{"success": bool}`.
    """

    engine = ENGINE
    timeout_knob = TIMEOUT_KNOB

    def __init__(
        self,
        url: str,
        timeout_s: float,
        *,
        pause_mode: PauseMode = PauseMode.keep,
        reset_prefix_cache: bool = True,
        lora_name: str = "policy",
        lora_dir: str | None = None,
    ) -> None:
        self.http = JSONEndpoint(url, timeout_s, label="vLLM rollout", timeout_knob=TIMEOUT_KNOB, urls_knob="vllm.urls")
        self.url = self.name = self.http.url
        self.timeout_s = timeout_s
        self.pause_mode = PauseMode(pause_mode)
        self.reset_prefix_cache = reset_prefix_cache
        self.lora_name, self.lora_dir = lora_name, lora_dir
        self._weight_version: str | None = None

    def pause(self) -> None:
        self.http.request("/pause", query={"mode": str(self.pause_mode)})

    def start_update(self) -> None:
        self.http.request("/start_weight_update")

    def update(self, version: int, receive_timeout_s: float | None) -> None:
        # vLLM answers when every worker received the whole version: the request lasts the transfer, which
        # vllm.request_timeout_s must not cap. Bounded elsewhere: each worker's receive by transport.timeout_s
        # (update_info.timeout_s), the trainer's wait by RolloutFleet (request_timeout_s after the send).
        info: dict[str, Any] = {"version": version}
        if receive_timeout_s is not None:
            info["timeout_s"] = receive_timeout_s
        self.http.request("/update_weights", {"update_info": info}, uncapped=True)

    def finish_update(self, weight_version: str | None) -> None:
        self.http.request(
            "/finish_weight_update", {"weight_version": weight_version} if weight_version is not None else None
        )
        if weight_version is not None:
            self._weight_version = weight_version

    def check_adapter(self) -> None:
        """Before an adapter version is paused for: the client knows where the server's workers write it."""
        if not self.lora_dir:
            raise ConfigError(
                f"vLLM rollout {self.name}: an adapter version (trainer.lora=adapter) needs vllm.lora_dir, the "
                "directory (as the server sees it) where its worker 0 writes each version for /v1/load_lora_adapter; "
                "set it on both sides, or set trainer.lora=merged"
            )

    def load_adapter(self, version: int) -> None:
        """Serve adapter `version` under `lora_name`: the directory worker 0 wrote while receiving it, loaded in
        place (`load_inplace`: the name keeps its lora_int_id, so requests naming it get the new content; the
        first load registers the name). A 404 "Not Found" is the route missing: the server runs without
        runtime LoRA updating."""
        assert self.lora_dir, "check_adapter() first"
        body = {"lora_name": self.lora_name, "lora_path": adapter_path(self.lora_dir, version), "load_inplace": True}
        try:
            self.http.request(LOAD_LORA, body)
        except PeerError as exc:
            if "HTTP 404" in str(exc) and "Not Found" in str(exc):
                raise PeerError(
                    f"vLLM rollout {self.name}: POST {LOAD_LORA} is not served (HTTP 404), so adapter version "
                    f"{version} cannot be loaded: start `vllm serve` with --enable-lora (and --max-lora-rank at least "
                    "the adapter's r) and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment, or set "
                    "trainer.lora=merged"
                ) from None
            raise

    def _reset(self, reset_running_requests: bool) -> bool:
        query = {"reset_running_requests": "true"} if reset_running_requests else None
        answer = self.http.request("/reset_prefix_cache", query=query)
        return bool(answer.get("success")) if isinstance(answer, dict) else False

    def weight_reports(self) -> list[dict[str, Any]]:
        """Every worker's `weight_report`, through POST /collective_rpc {"method": REPORT_METHOD}: vLLM calls
        worker methods by name only (entrypoints/serve/dev/rpc/api_router.py:23-59), so the server must run with
        `--worker-extension-cls` naming ours (`extension.py`; the launcher passes it). `CannotAsk` when it does not."""
        try:
            answer = self.http.request("/collective_rpc", {"method": REPORT_METHOD})
        except PeerError as exc:
            text = str(exc)
            # 404: dev mode off. 500: vLLM's answer to a method the workers lack (run_method raises
            # NotImplementedError; the route has no handler for it, so no detail says which)
            if "HTTP 404" in text or "HTTP 500" in text:
                raise CannotAsk(
                    f"vLLM rollout {self.name}: cannot ask its workers which weights they hold ({text[:200]}); start "
                    f"`vllm serve` with VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls {EXTENSION_CLASS} "
                    "(`lightning-weightsync rollout rollout.engine=vllm` does both)"
                ) from None
            raise
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list):
            raise PeerError(f"vLLM rollout {self.name}: /collective_rpc answered {str(answer)[:200]!r}, not results")
        return [dict(r) if isinstance(r, dict) else {"error": str(r)[:200]} for r in results]

    def resume(self) -> None:
        self.http.request("/resume")

    def weight_version(self) -> str | None:
        """The version this client last finished (`verify` asks the workers)."""
        return self._weight_version

    def workers(self) -> int | None:
        """How many workers (each one receiver) the server runs: vLLM's `GET /get_world_size`
        (TP x PP x PCP x DP with `include_dp`, an RL route like the weight-update ones); None when it
        does not say."""
        answer = self.http.request("/get_world_size", query={"include_dp": "true"}, method="GET")
        size = answer.get("world_size") if isinstance(answer, dict) else None
        return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def worker_kernel_digest(worker: Any) -> dict[str, Any]:
    """A vLLM worker's digest of every tensor its model serves now (`kernel_digest` of its weight-transfer engine,
    when that engine is ours): for an online-quantized model the FP8 bytes and scales the reload produced. Compare it
    with the digest a server cold-started from the same bf16 checkpoint answers, worker by worker (same vLLM, same
    TP rank). Pass this function to `collective_rpc`, as `worker_weight_report`."""
    engine = getattr(worker, "weight_transfer_engine", None)
    digest = getattr(engine, "kernel_digest", None)
    if not callable(digest):
        return {"error": f"the worker's weight transfer engine ({type(engine).__name__}) is not lightning_weightsync"}
    answer = digest()
    return dict(answer) if isinstance(answer, Mapping) else {"error": f"kernel_digest returned {answer!r:.80}"}


def worker_weight_report(worker: Any) -> dict[str, Any]:
    """A vLLM worker's answer to "which version do you hold, and was it verified" (its weight-transfer
    engine's `weight_report`, when that engine is ours). Pass this function to `LLM.collective_rpc` /
    `AsyncLLM.collective_rpc`: one answer per worker. Duck-typed, so the trainer side imports no vLLM."""
    engine = getattr(worker, "weight_transfer_engine", None)
    report = getattr(engine, "weight_report", None)
    if not callable(report):
        return {"error": f"the worker's weight transfer engine ({type(engine).__name__}) is not lightning_weightsync"}
    answer = report()
    return dict(answer) if isinstance(answer, Mapping) else {"error": f"weight_report returned {answer!r:.80}"}


@dataclass
class _UpdateRequest:
    """The shape of vLLM's `WeightTransferUpdateRequest` (its one field), used when vLLM's own class
    cannot be imported; `LLM.update_weights` and `AsyncLLM.update_weights` both read `.update_info`."""

    update_info: dict[str, Any] = field(default_factory=dict)


class EngineRolloutClient(_WorkersHoldIt, _PrefixCacheReset, RolloutClient):
    """An in-process `vllm.LLM` or `vllm.v1.engine.async_llm.AsyncLLM`.

    `AsyncLLM` methods are coroutines bound to the loop the engine runs on: pass that `loop` (this
    client is called from the trainer's thread). `LLM` has no pause: it only generates inside your
    own `generate()` calls, so do not call those while a version is sent.
    """

    engine = ENGINE
    timeout_knob = TIMEOUT_KNOB

    def __init__(
        self,
        engine: Any,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        name: str | None = None,
        timeout_s: float = 600.0,
        pause_mode: PauseMode = PauseMode.keep,
        reset_prefix_cache: bool = True,
    ) -> None:
        self.llm, self.loop, self.timeout_s = engine, loop, timeout_s
        self.name = name or type(engine).__name__
        self.pause_mode = PauseMode(pause_mode)
        self.reset_prefix_cache = reset_prefix_cache
        self._weight_version: str | None = None

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        result = getattr(self.llm, method)(*args, **kwargs)
        if inspect.isawaitable(result):
            if self.loop is not None:
                return asyncio.run_coroutine_threadsafe(result, self.loop).result(self.timeout_s)  # type: ignore[arg-type]
            return asyncio.run(result)  # type: ignore[arg-type]
        return result

    def pause(self) -> None:
        if hasattr(self.llm, "pause_generation"):
            self._call("pause_generation", mode=str(self.pause_mode))

    def start_update(self) -> None:
        self._call("start_weight_update")

    def update(self, version: int, receive_timeout_s: float | None) -> None:
        try:
            from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest as request_cls
        except ImportError:
            request_cls = _UpdateRequest
        info: dict[str, Any] = {"version": version}
        if receive_timeout_s is not None:
            info["timeout_s"] = receive_timeout_s
        self._call("update_weights", request_cls(update_info=info))

    def finish_update(self, weight_version: str | None) -> None:
        self._call("finish_weight_update", weight_version=weight_version)
        if weight_version is not None:
            self._weight_version = weight_version

    def _reset(self, reset_running_requests: bool) -> bool:
        return bool(self._call("reset_prefix_cache", reset_running_requests=reset_running_requests))

    def weight_reports(self) -> list[dict[str, Any]]:
        """Every worker's `weight_report` (`worker_weight_report` through `collective_rpc`);
        `CannotAsk` for an engine without `collective_rpc` (a stand-in)."""
        if not hasattr(self.llm, "collective_rpc"):
            raise CannotAsk(f"vLLM rollout {self.name}: the engine has no collective_rpc to ask its workers")
        answer = self._call("collective_rpc", worker_weight_report)
        return [dict(r) if isinstance(r, dict) else {"error": repr(r)[:200]} for r in (answer or [])]

    def resume(self) -> None:
        if hasattr(self.llm, "resume_generation"):
            self._call("resume_generation")

    def weight_version(self) -> str | None:
        return self._weight_version

    def workers(self) -> int | None:
        # what vLLM's /get_world_size answers: ParallelConfig.world_size_across_dp
        parallel = getattr(getattr(self.llm, "vllm_config", None), "parallel_config", None)
        size = getattr(parallel, "world_size_across_dp", None)
        return int(size) if isinstance(size, int) else None


__all__ = ["EngineRolloutClient", "HTTPRolloutClient", "clients", "worker_kernel_digest", "worker_weight_report"]
