"""The trainer drives each version through its vLLM rollouts: pause, receive, version, resume.

vLLM loads new weights through its weight-transfer API (vllm/entrypoints/rl/online/api_router.py for
`vllm serve`, `LLM` / `AsyncLLM` methods in process). Each rollout runs our engine
(`rollout/vllm/engine.py`), whose `receive_weights` takes one version from our sender. The sending
rank therefore wraps every send in the rollouts' update session:

    every rollout:  POST /pause?mode=<vllm.pause_mode>        (generation stops stepping)
                    POST /start_weight_update
                    POST /update_weights {"update_info": {"version": v}}   <- in a thread each, since
                         it returns only when the workers' receive_weights did, i.e. after...
    this process:   sender.send_weights(...)                 <- ...our broadcast, run meanwhile
    every rollout:  POST /finish_weight_update {"weight_version": "v"}   (vLLM records the version)
                    POST /reset_prefix_cache                 (blocks computed with old weights)
                    POST /resume                             (always, also after any failure)

So generation runs between versions and is paused only for the transfer. A failing call is named
with its rollout's URL and fails the version (`PeerError`, i.e. `trainer.on_failure` applies); a
rollout whose update failed is not finished (vLLM already closed its session), the others are, and
every paused rollout is resumed. This layer talks HTTP with the standard library and never imports
the rollout layer or vLLM (in-process engines are duck-typed, see `EngineRolloutClient`).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from omegaconf import DictConfig

from ..config import PauseMode
from ..errors import ConfigError, PeerError, WeightSyncTimeout

logger = logging.getLogger(__name__)

T = TypeVar("T")


class RolloutClient(Protocol):
    """One rollout engine's weight-update surface (vLLM's RL routes, or its engine methods)."""

    name: str

    def pause(self, mode: PauseMode) -> None: ...
    def start_weight_update(self) -> None: ...
    def update_weights(self, update_info: dict[str, Any]) -> None: ...
    def finish_weight_update(self, weight_version: str | None) -> None: ...
    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool: ...
    def resume(self) -> None: ...
    def workers(self) -> int | None: ...


class HTTPRolloutClient:
    """`vllm serve` (started with VLLM_SERVER_DEV_MODE=1, which registers the RL and cache routes).

    Routes and bodies as vLLM 0.33.0 defines them: `/pause` takes `mode` as a query parameter;
    `/update_weights` a JSON body `{"update_info": {...}}`; `/finish_weight_update` an optional
    `{"weight_version": "<str>"}`; `/reset_prefix_cache` answers `{"success": bool}`.
    """

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.name = self.url
        self.timeout_s = timeout_s

    def _post(
        self,
        path: str,
        body: dict[str, Any] | None = None,
        query: dict[str, str] | None = None,
        method: str = "POST",
        uncapped: bool = False,
    ) -> Any:
        """One request, bounded by `vllm.request_timeout_s` unless `uncapped` (see `update_weights`)."""
        timeout = None if uncapped else self.timeout_s
        target = f"{self.url}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(target, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:500].decode(errors="replace")
            raise PeerError(f"vLLM rollout {self.url}: POST {path} failed: HTTP {exc.code}: {detail}") from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                raise WeightSyncTimeout(
                    f"vLLM rollout {self.url}: POST {path} got no answer within vllm.request_timeout_s="
                    f"{self.timeout_s}s"
                ) from None
            raise PeerError(
                f"vLLM rollout {self.url}: POST {path}: cannot reach the server ({exc.reason}); check vllm.urls"
            ) from None
        except TimeoutError:
            raise WeightSyncTimeout(
                f"vLLM rollout {self.url}: POST {path} got no answer within vllm.request_timeout_s={self.timeout_s}s"
            ) from None
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return None

    def pause(self, mode: PauseMode) -> None:
        self._post("/pause", query={"mode": str(mode)})

    def start_weight_update(self) -> None:
        self._post("/start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM answers when every worker received the whole version: the request lasts the transfer, which
        # vllm.request_timeout_s must not cap. Bounded elsewhere: each worker's receive by transport.timeout_s
        # (update_info.timeout_s), the trainer's wait by RolloutControl (request_timeout_s after the send).
        self._post("/update_weights", {"update_info": update_info}, uncapped=True)

    def finish_weight_update(self, weight_version: str | None) -> None:
        self._post("/finish_weight_update", {"weight_version": weight_version} if weight_version is not None else None)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        query = {"reset_running_requests": "true"} if reset_running_requests else None
        answer = self._post("/reset_prefix_cache", query=query)
        return bool(answer.get("success")) if isinstance(answer, dict) else False

    def resume(self) -> None:
        self._post("/resume")

    def workers(self) -> int | None:
        """How many workers (each one receiver) the server runs: vLLM's `GET /get_world_size`
        (TP x PP x PCP x DP with `include_dp`, an RL route like the weight-update ones); None when it
        does not say."""
        answer = self._post("/get_world_size", query={"include_dp": "true"}, method="GET")
        size = answer.get("world_size") if isinstance(answer, dict) else None
        return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


@dataclass
class _UpdateRequest:
    """The shape of vLLM's `WeightTransferUpdateRequest` (its one field), used when vLLM's own class
    cannot be imported; `LLM.update_weights` and `AsyncLLM.update_weights` both read `.update_info`."""

    update_info: dict[str, Any] = field(default_factory=dict)


class EngineRolloutClient:
    """An in-process `vllm.LLM` or `vllm.v1.engine.async_llm.AsyncLLM`.

    `AsyncLLM` methods are coroutines bound to the loop the engine runs on: pass that `loop` (this
    client is called from the trainer's thread). `LLM` has no pause: it only generates inside your
    own `generate()` calls, so do not call those while a version is sent.
    """

    def __init__(
        self,
        engine: Any,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        name: str | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        self.engine, self.loop, self.timeout_s = engine, loop, timeout_s
        self.name = name or type(engine).__name__

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        result = getattr(self.engine, method)(*args, **kwargs)
        if inspect.isawaitable(result):
            if self.loop is not None:
                return asyncio.run_coroutine_threadsafe(result, self.loop).result(self.timeout_s)  # type: ignore[arg-type]
            return asyncio.run(result)  # type: ignore[arg-type]
        return result

    def pause(self, mode: PauseMode) -> None:
        if hasattr(self.engine, "pause_generation"):
            self._call("pause_generation", mode=str(mode))

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        try:
            from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest as request_cls
        except ImportError:
            request_cls = _UpdateRequest  # type: ignore[misc,assignment]
        self._call("update_weights", request_cls(update_info=update_info))

    def finish_weight_update(self, weight_version: str | None) -> None:
        self._call("finish_weight_update", weight_version=weight_version)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return bool(self._call("reset_prefix_cache", reset_running_requests=reset_running_requests))

    def resume(self) -> None:
        if hasattr(self.engine, "resume_generation"):
            self._call("resume_generation")

    def workers(self) -> int | None:
        # what vLLM's /get_world_size answers: ParallelConfig.world_size_across_dp
        parallel = getattr(getattr(self.engine, "vllm_config", None), "parallel_config", None)
        size = getattr(parallel, "world_size_across_dp", None)
        return int(size) if isinstance(size, int) else None


@dataclass
class RolloutTimings:
    """Seconds each phase of the last version took (the paused window is `paused_s`)."""

    version: int
    paused_s: float = 0.0
    update_s: float = 0.0
    finish_s: float = 0.0


class RolloutControl:
    """Runs one version's update session on every rollout around the trainer's send.

    Args:
        clients: the rollouts (`HTTPRolloutClient` per `vllm.urls`, or `EngineRolloutClient`s).
        pause_mode: `vllm.pause_mode`.
        reset_prefix_cache: `vllm.reset_prefix_cache`.
        timeout_s: `vllm.request_timeout_s`, also the bound on waiting for `update_weights`
            after the send returned.
        receive_timeout_s: how long a worker waits for the version to start (`update_info.timeout_s`;
            `transport.timeout_s` from config), so a send that never starts cannot hold a worker.
        min_receivers: `trainer.min_receivers`; checked before the first version against the workers the
            servers report, so that a version is never applied by some workers of a server and not others.
    """

    def __init__(
        self,
        clients: Sequence[RolloutClient],
        *,
        pause_mode: PauseMode = PauseMode.keep,
        reset_prefix_cache: bool = True,
        timeout_s: float = 600.0,
        receive_timeout_s: float | None = None,
        min_receivers: int | None = None,
    ) -> None:
        self.clients = list(clients)
        self.min_receivers = min_receivers
        self.workers: dict[str, int] | None = None  # per server, once asked
        self.receive_timeout_s = receive_timeout_s
        self.pause_mode = PauseMode(pause_mode)
        self.reset_prefix_cache = reset_prefix_cache
        self.timeout_s = timeout_s
        self.last_timings: RolloutTimings | None = None
        self._pool = ThreadPoolExecutor(max_workers=max(1, 2 * len(self.clients)), thread_name_prefix="rollout-ctl")

    @classmethod
    def from_config(cls, cfg: DictConfig) -> RolloutControl | None:
        """One HTTP client per `vllm.urls`; None when there are none."""
        v = cfg.vllm
        if not v.urls:
            return None
        timeout_s = float(v.request_timeout_s)
        return cls(
            [HTTPRolloutClient(str(u), timeout_s) for u in v.urls],
            pause_mode=PauseMode(v.pause_mode),
            reset_prefix_cache=bool(v.reset_prefix_cache),
            timeout_s=timeout_s,
            receive_timeout_s=float(cfg.transport.timeout_s),
            min_receivers=int(cfg.trainer.min_receivers),
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _on_all(
        self, clients: Sequence[RolloutClient], what: str, call: Callable[[RolloutClient], Any]
    ) -> tuple[list[RolloutClient], list[str]]:
        """`call` on every client at once; (the clients it succeeded on, one error line per failure)."""
        futures = [(c, self._pool.submit(call, c)) for c in clients]
        ok: list[RolloutClient] = []
        errors: list[str] = []
        deadline = time.monotonic() + self.timeout_s  # one bound for all: they run at once
        for client, future in futures:
            error = _outcome(future, deadline, self.timeout_s, client, what)
            if error is None:
                ok.append(client)
            else:
                errors.append(error)
        return ok, errors

    def run_version(self, version: int, send: Callable[[], T]) -> T:
        """Pause and open an update on every rollout, run `send()` while they receive, finish with
        `weight_version=str(version)`, resume. Raises `PeerError` naming each failed rollout; `send`
        is not called when a rollout could not be paused or started (the caller drains its stream)."""
        self._check_receivers()
        timings = RolloutTimings(version)
        self.last_timings = timings
        start = time.perf_counter()
        paused: list[RolloutClient] = []
        errors: list[str] = []
        try:
            paused, errors = self._on_all(self.clients, "pause", lambda c: c.pause(self.pause_mode))
            started: list[RolloutClient] = []
            if not errors:
                started, errors = self._on_all(paused, "start_weight_update", lambda c: c.start_weight_update())
            if errors:
                self._finish(started, None)  # close the sessions that did open
                raise PeerError(f"version {version} not sent: " + "; ".join(errors))
            update_info: dict[str, Any] = {"version": version}
            if self.receive_timeout_s is not None:
                update_info["timeout_s"] = self.receive_timeout_s
            updates = [(c, self._pool.submit(c.update_weights, update_info)) for c in started]
            t0 = time.perf_counter()
            try:
                result = send()
            except BaseException:
                # the workers fail their receive too; collect, then raise: one bound for all servers, not
                # vllm.request_timeout_s for each in turn
                deadline = time.monotonic() + self.timeout_s
                for client, future in updates:
                    _outcome(future, deadline, self.timeout_s, client, "update_weights")
                raise
            updated = []
            deadline = time.monotonic() + self.timeout_s
            for client, future in updates:
                error = _outcome(future, deadline, self.timeout_s, client, "update_weights")
                if error is None:
                    updated.append(client)
                else:
                    errors.append(error)
            timings.update_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            errors += self._finish(updated, str(version))  # those that loaded it whole hold `version`
            if errors:
                raise PeerError(f"version {version}: " + "; ".join(errors))
            if self.reset_prefix_cache:
                self._reset_prefix_cache(version)
            timings.finish_s = time.perf_counter() - t1
            return result
        finally:
            _, resume_errors = self._on_all(paused, "resume", lambda c: c.resume())
            timings.paused_s = time.perf_counter() - start
            for error in resume_errors:  # never masks the version's own error; loud, generation is stuck
                logger.error("%s (generation stays paused there until /resume succeeds)", error)

    def _check_receivers(self) -> None:
        """Every worker of every server must be in every version: with fewer than all of them required
        (`trainer.min_receivers`), a late worker is left out and its server serves tensor-parallel shards
        of two versions at once. The servers say how many workers they run; asked once."""
        if self.workers is not None or self.min_receivers is None:
            return
        workers: dict[str, int] = {}
        for client in self.clients:
            try:
                n = client.workers()
            except Exception as exc:  # an older server, or dev routes off: say so, do not guess
                logger.warning("vLLM rollout %s: cannot tell how many workers it runs (%s)", client.name, exc)
                n = None
            if n is not None:
                workers[client.name] = n
        self.workers = workers
        total = sum(workers.values())
        if total > self.min_receivers:
            each = ", ".join(f"{name}: {n}" for name, n in workers.items())
            raise ConfigError(
                f"trainer.min_receivers={self.min_receivers}, but the vLLM servers run {total} workers ({each}), "
                f"and every worker receives: a version sent to fewer would leave a server with shards of two "
                f"versions; set trainer.min_receivers={total} (tensor x pipeline x data parallel size, summed "
                f"over the servers, plus any other rollouts)"
            )

    def _finish(self, clients: list[RolloutClient], weight_version: str | None) -> list[str]:
        if not clients:
            return []
        return self._on_all(clients, "finish_weight_update", lambda c: c.finish_weight_update(weight_version))[1]

    def _reset_prefix_cache(self, version: int) -> None:
        """Drop KV computed with the previous weights. Under `keep` the paused requests still hold
        their blocks, and vLLM resets only when no running request holds any (scheduler.py
        `reset_prefix_cache`): they are preempted (`reset_running_requests`) and re-prefilled with the
        new weights, which costs their prefill again but is the only way their next tokens are on-policy.
        Under `abort` and `wait` nothing runs at this point and a plain reset suffices."""
        running = self.pause_mode is PauseMode.keep
        futures = [(c, self._pool.submit(c.reset_prefix_cache, running)) for c in self.clients]
        for client, future in futures:
            try:
                if not future.result(self.timeout_s):
                    logger.warning(
                        "vLLM rollout %s: the prefix cache was not reset after version %d (blocks still held, "
                        "pause_mode=%s); cached prefixes may reuse KV computed with the previous weights",
                        client.name,
                        version,
                        self.pause_mode,
                    )
            except Exception as exc:  # cache hygiene is not worth failing a delivered version
                logger.warning("vLLM rollout %s: resetting the prefix cache failed: %s", client.name, exc)


def _outcome(future: Future[Any], deadline: float, limit_s: float, client: RolloutClient, what: str) -> str | None:
    """None when `future` succeeded by `deadline` (monotonic), else one line naming the rollout and the call."""
    try:
        future.result(max(deadline - time.monotonic(), 0.0))
        return None
    except FutureTimeout:
        return f"vLLM rollout {client.name}: {what} not done within vllm.request_timeout_s={limit_s}s"
    except Exception as exc:
        text = str(exc)
        if client.name in text:  # the HTTP client names its URL already
            return text
        return f"vLLM rollout {client.name}: {what} failed: {type(exc).__name__}: {text}"


__all__ = ["EngineRolloutClient", "HTTPRolloutClient", "RolloutClient", "RolloutControl", "RolloutTimings"]
