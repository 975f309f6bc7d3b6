"""`rollout.sink.type=vllm`: the daemon hosts a vLLM engine; each GPU worker receives the weights itself.

The pattern is the one TRL's `vllm-serve` and vLLM's RLHF examples use: vLLM mixes a
*worker extension* class (`worker_extension_cls`) into every GPU worker, and the host process calls
its methods on all workers at once with `LLM.collective_rpc(method, args=...)`. Here:

- `init_weight_receiver(cfg_yaml, identity)` creates a `WeightReceiver` *inside the worker*, with
  `transport.device` set to the worker's own device, so buckets land on that GPU with no extra hop
  through the host process. Each worker registers with the trainer as its own receiver
  (`<identity>-w<rank>`), so set `trainer.min_receivers` to the number of vLLM workers.
- `receive_and_load_version(apply)` receives one version and feeds each merged tensor to
  `self.model_runner.model.load_weights(...)`, which applies vLLM's own name mapping, fusing and
  tensor-parallel sharding. `streaming` loads tensor by tensor (one full tensor at a time on the
  GPU); `atomic` holds the whole version on the worker's device first (one extra model copy).
- `weight_policy_version()` reports the version the worker's model holds.

The host side (`VLLMSink`) builds `vllm.LLM(model=rollout.sink.target, worker_extension_cls=...,
**rollout.sink.options)`,
drives one version at a time, resets the prefix cache after every applied version (cached KV blocks
were computed with old weights) and exposes `llm` for generation.

vLLM is an optional extra: nothing here imports it until the sink is built, and a missing install is
a `BackendUnavailable` naming the `vllm` extra. vLLM cannot run on this project's CI machines; the
tests drive the extension through a clearly marked stand-in worker with the same attributes
(`device`, `rank`, `model_runner.model.load_weights`) and a stand-in `LLM` with `collective_rpc`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import torch
from omegaconf import DictConfig, OmegaConf

from ...errors import (
    BackendUnavailable,
    ConfigError,
    PeerError,
    ProtocolError,
    SinkError,
    VersionAborted,
    WeightSyncError,
    WeightSyncTimeout,
)
from ..sinks.base import RemoteSink, SinkState, VersionReport

logger = logging.getLogger(__name__)

T = TypeVar("T")
EXTENSION_CLS = "lightning_weightsync.rollout.vllm.sink.WeightSyncWorkerExtension"

# How an error crosses the collective_rpc boundary: by name, rebuilt on the host side as our own type.
_ERRORS: dict[str, type[WeightSyncError]] = {
    cls.__name__: cls
    for cls in (WeightSyncTimeout, VersionAborted, PeerError, ProtocolError, SinkError, ConfigError, WeightSyncError)
}


class _LoopThread:
    """An asyncio loop in a daemon thread, so the worker's receiver keeps heartbeating between RPCs.

    vLLM calls extension methods synchronously on the worker's main thread; the receiver is async.
    Running it on its own loop thread (instead of `asyncio.run` per call) keeps its sockets and
    heartbeats alive while the worker is busy generating.
    """

    def __init__(self, device: torch.device) -> None:
        self.loop = asyncio.new_event_loop()
        self._device = device
        self._thread = threading.Thread(target=self._run, name="weightsync-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)  # the loop thread's default device is the worker's
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def cancel_all(self, timeout_s: float = 10.0) -> None:
        """Cancel whatever runs on the loop (a receive blocked waiting for a version included)."""

        async def cancel() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.call(cancel(), timeout_s)
        except Exception as exc:  # best effort: we are tearing down
            logger.debug("cancelling the receiver's tasks: %s", exc)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


class WeightSyncWorkerExtension:
    """Mixed into each vLLM GPU worker by `worker_extension_cls`; methods run inside the worker.

    Relies on what vLLM's worker provides: `self.device`, `self.rank` and
    `self.model_runner.model.load_weights(weights)`.
    """

    # Attribute names are prefixed so they cannot collide with the worker's own.
    _weightsync_loop: _LoopThread | None = None
    _weightsync_receiver: Any = None
    _weightsync_version: int | None = None
    _weightsync_state: str = SinkState.EMPTY.value

    def init_weight_receiver(self, cfg_yaml: str, identity: str) -> str:
        """Create and start this worker's receiver; returns the identity it registered under."""
        from ...config import load_config
        from ...engine.receiver import WeightReceiver

        if self._weightsync_receiver is not None:
            raise SinkError("init_weight_receiver called twice on one worker; call close_weight_receiver first")
        device = torch.device(getattr(self, "device", "cpu"))
        rank = int(getattr(self, "rank", 0))
        worker_identity = f"{identity}-w{rank}"
        overrides = [f"transport.device={device}", f"rollout.device={device}", f"rollout.identity={worker_identity}"]
        cfg = load_config(base=OmegaConf.create(cfg_yaml), overrides=overrides)
        self._weightsync_loop = _LoopThread(device)
        receiver = WeightReceiver(cfg)
        self._weightsync_loop.call(receiver.start())
        self._weightsync_receiver = receiver
        logger.info("vLLM worker %d: weight receiver %s on %s", rank, worker_identity, device)
        return worker_identity

    def receive_and_load_version(self, apply: str = "streaming") -> dict[str, Any]:
        """Receive one version and load it with `model.load_weights`; errors come back as data.

        A `load_weights` failure does not stop the receive: the rest of the version is drained (the
        data-plane group must stay in step with the sender) and the version is acknowledged as failed.
        """
        loop, receiver = self._weightsync_loop, self._weightsync_receiver
        if loop is None or receiver is None:
            return {"ok": False, "error_type": "SinkError", "error": "call init_weight_receiver first"}
        model = self.model_runner.model  # type: ignore[attr-defined]
        started = time.perf_counter()
        stream = receiver.receive_weights(auto_ack=False)
        touched = False
        held: list[tuple[str, torch.Tensor]] = []
        load_error: str | None = None
        nbytes = num_tensors = 0
        try:
            while True:
                try:
                    name, tensor = loop.call(stream.__anext__())
                except StopAsyncIteration:
                    break
                nbytes += tensor.numel() * tensor.element_size()
                num_tensors += 1
                if load_error is not None:
                    continue  # drain
                if apply == "atomic":
                    held.append((name, tensor))
                    continue
                touched = True
                try:
                    model.load_weights(weights=[(name, tensor)])
                except Exception as exc:
                    load_error = f"model.load_weights failed on {name!r}: {type(exc).__name__}: {exc}"
            if held and load_error is None:
                touched = True
                try:
                    model.load_weights(weights=held)
                except Exception as exc:
                    load_error = f"model.load_weights failed: {type(exc).__name__}: {exc}"
        except WeightSyncError as exc:  # the receive itself failed: timeout, abort, dead or bad peer
            if touched:
                self._weightsync_state = SinkState.INCOMPLETE.value
            return {"ok": False, "error_type": type(exc).__name__, "error": str(exc), "touched": touched}
        finally:
            held.clear()
        version = int(receiver.version)
        if load_error is not None:
            loop.call(receiver.ack(ok=False, error=load_error))
            if touched:
                self._weightsync_state = SinkState.INCOMPLETE.value
            return {"ok": False, "version": version, "error_type": "SinkError", "error": load_error, "touched": touched}
        loop.call(receiver.ack(ok=True))
        self._weightsync_version = version
        self._weightsync_state = SinkState.COMPLETE.value
        stats = getattr(receiver, "last_stats", None)
        return {
            "ok": True,
            "version": version,
            "nbytes": nbytes,
            "num_tensors": num_tensors,
            "num_buckets": int(getattr(stats, "num_buckets", 0) or 0),
            "seconds": time.perf_counter() - started,
        }

    def weight_policy_version(self) -> dict[str, Any]:
        """The version this worker's model holds and whether it is whole."""
        return {"version": self._weightsync_version, "state": self._weightsync_state}

    def close_weight_receiver(self) -> None:
        """Close the receiver; safe to call from another thread while a receive is blocked.

        A blocked `receive_and_load_version` is cancelled first (it then raises in its own thread),
        so an engine shutting down never waits for a version that may never come.
        """
        loop, receiver = self._weightsync_loop, self._weightsync_receiver
        self._weightsync_receiver = None
        self._weightsync_loop = None
        if loop is not None:
            loop.cancel_all()
            if receiver is not None:
                try:
                    loop.call(receiver.close(), timeout_s=30)
                except Exception as exc:  # closing is best effort; the worker may be going away
                    logger.warning("closing the worker's weight receiver failed: %s", exc)
            loop.stop()


def _import_llm() -> Callable[..., Any]:
    try:
        from vllm import LLM
    except ImportError as exc:
        raise BackendUnavailable(
            f"rollout.sink.type=vllm needs vLLM ({exc}); install it with: pip install 'lightning_weightsync[vllm]'"
        ) from None
    return LLM


class VLLMSink(RemoteSink):
    """Hosts `vllm.LLM` with the weight-sync worker extension and drives one version at a time.

    `llm_factory` exists for tests (a stand-in `LLM`); by default it is `vllm.LLM`.
    """

    def __init__(self, cfg: DictConfig, llm_factory: Callable[..., Any] | None = None) -> None:
        self.cfg = cfg
        self.apply = str(cfg.rollout.apply)
        options = OmegaConf.to_container(cfg.rollout.sink.options, resolve=True) or {}
        assert isinstance(options, dict)
        if not options.get("model"):
            if not cfg.rollout.sink.target:
                raise ConfigError(
                    "rollout.sink.target is not set; the vllm sink needs the model to serve "
                    "(e.g. rollout.sink.target=Qwen/Qwen3-8B, or rollout.sink.options.model)"
                )
            options["model"] = str(cfg.rollout.sink.target)
        if "worker_extension_cls" in options:
            raise ConfigError("rollout.sink.options.worker_extension_cls is set by the vllm sink itself; remove it")
        factory = llm_factory if llm_factory is not None else _import_llm()
        self.llm = factory(worker_extension_cls=EXTENSION_CLS, **options)
        self.version = None
        self.state = SinkState.EMPTY
        self.workers: list[str] = []
        self.worker_versions: list[dict[str, Any]] = []  # per worker, from the last receive
        self._receiving = False
        self._lock = threading.Lock()

    def start(self) -> None:
        cfg_yaml = OmegaConf.to_yaml(self.cfg, resolve=True)
        identity = self.cfg.rollout.identity or "vllm"
        self.workers = list(self.llm.collective_rpc("init_weight_receiver", args=(cfg_yaml, identity)))
        logger.info("vLLM sink: %d worker receiver(s) registered: %s", len(self.workers), ", ".join(self.workers))
        if len(self.workers) > int(self.cfg.trainer.min_receivers):
            logger.warning(
                "trainer.min_receivers=%d but this vLLM engine has %d workers that must all receive every "
                "version; set trainer.min_receivers on the trainer accordingly",
                self.cfg.trainer.min_receivers,
                len(self.workers),
            )

    def receive_version(self) -> VersionReport:
        with self._lock:
            llm = self.llm
            if llm is None:
                raise SinkError("the vllm sink is closed")
            self._receiving = True
        try:
            results: list[dict[str, Any]] = list(llm.collective_rpc("receive_and_load_version", args=(self.apply,)))
        finally:
            with self._lock:
                self._receiving = False
        self.worker_versions = [
            {"version": r.get("version") if r.get("ok") else None, "ok": bool(r.get("ok"))} for r in results
        ]
        failed = [r for r in results if not r.get("ok")]
        if failed:
            if any(r.get("touched") for r in results):
                self.state = SinkState.INCOMPLETE
            first = failed[0]
            error_cls = _ERRORS.get(str(first.get("error_type")), WeightSyncError)
            raise error_cls(f"vLLM worker(s) failed version {first.get('version')}: {first.get('error')}")
        versions = {r["version"] for r in results}
        if len(versions) != 1:
            self.state = SinkState.INCOMPLETE
            raise PeerError(f"vLLM workers received different versions {sorted(versions)}; sink marked incomplete")
        self.llm.reset_prefix_cache()
        version = versions.pop()
        self.version = version
        self.state = SinkState.COMPLETE
        return VersionReport(
            version=version,
            ok=True,
            nbytes=int(results[0]["nbytes"]),
            num_tensors=int(results[0]["num_tensors"]),
            num_buckets=int(results[0]["num_buckets"]),
            seconds=max(float(r["seconds"]) for r in results),
        )

    def policy_versions(self) -> list[dict[str, Any]]:
        """What every worker's model holds, asked through `collective_rpc`.

        Only when no receive is in flight: a worker runs one RPC at a time, and while the daemon
        waits for the next version its workers are inside `receive_and_load_version`. The daemon
        itself reports `version` / `worker_versions` from the last receive instead.
        """
        with self._lock:
            if self._receiving or self.llm is None:
                raise SinkError("the vLLM workers are busy receiving (or the sink is closed); use worker_versions")
            llm = self.llm
        return list(llm.collective_rpc("weight_policy_version"))

    def close(self) -> None:
        """Close the workers' receivers, then shut the engine down.

        While a receive is in flight the workers are busy in that RPC (and may wait for a version
        indefinitely), so no further RPC can reach them: the engine is shut down directly, which
        ends the worker processes and their receivers with them.
        """
        with self._lock:
            llm, self.llm = self.llm, None
            receiving = self._receiving
        if llm is None:
            return
        if not receiving:
            try:
                llm.collective_rpc("close_weight_receiver")
            except Exception as exc:  # shutting down: vLLM may already be tearing its workers down
                logger.warning("closing the vLLM workers' receivers failed: %s", exc)
        shutdown = getattr(getattr(llm, "llm_engine", None), "shutdown", None)
        if callable(shutdown):
            shutdown()
