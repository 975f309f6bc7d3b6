"""What every rollout engine's receiving worker shares (vLLM's engine, SGLang's weight loader).

An engine's worker owns the model on its own thread and calls us there: vLLM's GPU worker in its
`collective_rpc`, SGLang's scheduler in `update_weights_from_tensor`. Our `WeightReceiver` lives on its
own asyncio loop in a daemon thread (`LoopThread`), so it keeps its ZeroMQ connection and heartbeats
alive while the worker generates, and re-registers every heartbeat between versions (`WorkerReceiver`):
a restarted trainer knows every worker before its first version starts. A version runs the shared
receive loop (`rollout/consume.py`) on that loop, and each merged tensor is handed back to the worker's
thread for `model.load_weights` (`ModelLoadSink`): the engine's own name mapping, fusing and
tensor-parallel sharding apply.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import socket
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from ..config import ReceiverSettings
from ..errors import SinkError, WeightSyncError
from ..protocol.boxes import Box, expand_box
from ..protocol.chunks import TensorMeta
from ..protocol.messages import LoraSpec
from ..rollout.consume import Call, VersionSink, consume_version
from ..rollout.observability import VersionRecord
from ..transport.device import handoff
from ..versions.receiver import WeightReceiver

logger = logging.getLogger(__name__)

T = TypeVar("T")
CONFIG_ENV = "LIGHTNING_WEIGHTSYNC_CONFIG"
"""Path of the weightsync YAML the receiver reads in every engine worker (the engine's launcher sets it)."""


class LoopThread:
    """An asyncio loop in a daemon thread, so the receiver heartbeats while the worker generates."""

    def __init__(self, device: torch.device) -> None:
        self.loop = asyncio.new_event_loop()
        self._device = device
        self._thread = threading.Thread(target=self._run, name="weightsync-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)  # buckets and broadcasts default to the worker's GPU
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def run_here(self, make: Callable[[Call], Coroutine[Any, Any, T]]) -> T:
        """Run `make(call)` on the loop; the sink methods it `await call(...)`s run on this thread.

        The receive loop needs the event loop (sockets, heartbeats, the pipeline), while the engine's model
        may only be touched from the worker thread that called us: this thread serves those calls
        until the coroutine is done."""
        Job = tuple[Callable[..., Any], tuple[Any, ...], Callable[[], None], Future[Any]]
        jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()

        async def call(fn: Callable[..., Any], *args: Any) -> Any:
            job: Future[Any] = Future()
            jobs.put((fn, args, handoff(args), job))  # the tensors are ready on the worker's stream before use
            return await asyncio.wrap_future(job)

        done = asyncio.run_coroutine_threadsafe(make(call), self.loop)
        done.add_done_callback(lambda _: jobs.put(None))
        while (item := jobs.get()) is not None:
            fn, args, adopt, job = item
            if not job.set_running_or_notify_cancel():
                continue
            try:
                adopt()
                job.set_result(fn(*args))
            except BaseException as exc:
                job.set_exception(exc)
        return done.result()

    def cancel_all(self, timeout_s: float = 10.0) -> None:
        async def cancel() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.call(cancel(), timeout_s)
        except Exception as exc:  # best effort: tearing down
            logger.debug("cancelling the receiver's tasks: %s", exc)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


class WorkerReceiver:
    """An engine worker's receiver: its loop thread, its `WeightReceiver` (buckets taken now, before the
    engine sizes its KV cache), and its registration kept between versions.

    A daemon waits for the next version all the time, and that wait re-registers every heartbeat. An
    engine worker waits only inside an update; between two it generates. Its connection keeps it known
    to the trainer that is running, but a restarted trainer would hear of it only once the next update
    began, racing its own version's start (a worker that registers late is left out of that version,
    and its server holds tensor-parallel shards of two versions). So between versions this worker
    re-registers every `transport.heartbeat_interval_s` on its own; while a version runs it does not
    (a `Register` mid-version would reset what the sender knows of it)."""

    def __init__(self, own: ReceiverSettings, device: torch.device) -> None:
        """`own`: the receiver's typed settings, made by the engine's loader from the YAML it read (the edge)."""
        self.loop = LoopThread(device)
        self.receiver = WeightReceiver(own, preallocate=True)
        self._receiving = False
        self.registrations = 0  # sent between versions (tests read it)
        try:
            self.loop.call(self.receiver.start(), timeout_s=own.transport.timeout_s)
        except BaseException:
            self.loop.stop()
            raise
        interval_s = own.transport.heartbeat_interval_s
        asyncio.run_coroutine_threadsafe(self._keep_registered(interval_s), self.loop.loop)

    async def _keep_registered(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            if self._receiving:
                continue
            try:
                await self.receiver.register()
                self.registrations += 1
            except WeightSyncError as exc:  # the next heartbeat tries again
                logger.debug("%s: re-registering failed: %s", self.receiver.identity, exc)

    def receive(self, sink: VersionSink, wait_s: float | None = None) -> VersionRecord:
        """One version into `sink`, its methods called on this (the worker's) thread."""

        async def one_version(call: Call) -> VersionRecord:
            self._receiving = True  # set on the loop: no re-registration interleaves with the version's start
            try:
                return await consume_version(self.receiver, sink, call=call, wait_s=wait_s)
            finally:
                self._receiving = False

        return self.loop.run_here(one_version)

    def close(self) -> None:
        """Cancel what runs (a version in flight, the registration), close the receiver, stop the loop."""
        self.loop.cancel_all()
        try:
            self.loop.call(self.receiver.close(), timeout_s=30)
        except Exception as exc:  # best effort: the worker may be going away
            logger.warning("closing the weight receiver failed: %s", exc)
        self.loop.stop()


class ModelLoadSink(VersionSink):
    """The shared receive loop's sink for an engine worker: each tensor goes to `model.load_weights`
    (the engine's own name mapping, fusing and tensor-parallel sharding apply); nothing is staged, so the
    version is whole only when the loop commits, and `touched` says whether a failed one reached
    the model. `expected`: the version the trainer announced; another one arriving is refused (a
    stale or foreign sender) and drained.

    A tensor that arrives as a box (a worker that declared the box its parameters read:
    `rollout_engines/slices.py`) is put back into a tensor of the whole shape, zeros outside the box, before
    `load_weights`, which reads only the box: the model is what it would be from the whole tensor, bitwise.
    Memory: one whole tensor at a time, as for a whole version, plus its box while it is copied in (the
    receiver's bucket-bounded buffers are unchanged).
    A tensor named as a parameter the model ties to another one (`aliases`, default `tied_aliases(model)`:
    a tied LM head) is not loaded: the engines skip it anyway (vLLM 0.34, SGLang), vLLM 0.33.0 raises when a
    `load_weights` call holds the alias without the tensor it is tied to (model_executor/models/utils.py
    `_check_skipped_aliases`), which a call per tensor always does, and inside vLLM's layerwise reload (the
    parameters on the meta device, the tie undone) it would be loaded into the tensor it is tied to: a sliced
    version's one-element box of it would overwrite the embedding. The engine passes the aliases it found
    before the reload began.
    `shapes`: every tensor's whole shape and dtype, as the last version sent them (what the boxes are
    derived from)."""

    def __init__(
        self,
        model: torch.nn.Module,
        expected: int | None,
        aliases: Mapping[str, str] | None = None,
        *,
        after_load: Callable[[], None] | None = None,
        check: Callable[[Mapping[str, tuple[tuple[int, ...], torch.dtype]]], None] | None = None,
    ) -> None:
        self.model = model
        self.expected = expected
        self.touched = False
        self.shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._boxes: dict[str, Box] = {}  # the box each boxed tensor of this version arrives as
        self._aliases = tied_aliases(model) if aliases is None else aliases
        self._after_load = after_load  # the engine watches what its engine buffers
        self._check = check  # the engine's last word before the ack: raises SinkError to refuse the version

    def begin(
        self, version: int, tied: Mapping[str, Sequence[str]] | None = None, lora: LoraSpec | None = None
    ) -> None:
        """`lora` is not taken (`takes_lora` False): `EngineVersionSink` routes adapter versions elsewhere."""
        if self.expected is not None and version != self.expected:
            raise SinkError(f"the trainer announced version {self.expected} but version {version} arrived")

    def destination(self, meta: TensorMeta) -> torch.Tensor | None:
        self.shapes[meta.name] = (tuple(meta.shape), meta.dtype)
        if meta.box is not None:
            self._boxes[meta.name] = meta.box
        return None  # load_weights copies (and shards) from a whole tensor; a box's own tensor is expanded

    def accept(self, name: str, tensor: torch.Tensor) -> None:
        self.touched = True
        box = self._boxes.pop(name, None)
        if name in self._aliases:
            return  # its values are the tensor it is tied to, which loads under its own name
        if box is not None:
            tensor = expand_box(tensor, self.shapes[name][0], box)
        try:
            # a vLLM / SGLang model's own method; torch types a Module's attributes as Tensor | Module
            self.model.load_weights([(name, tensor)])  # type: ignore[operator]
        except Exception as exc:
            raise SinkError(f"model.load_weights failed on {name!r}: {type(exc).__name__}: {exc}") from exc
        if self._after_load is not None:
            self._after_load()

    def commit(self, version: int) -> None:
        """Nothing staged: the tensors are in the model (the engine post-processes when its session ends). The
        engine's `check` (given the tensors that arrived) may still refuse the version: before the ack."""
        if self._check is not None:
            self._check(self.shapes)

    def abort(self, version: int, reason: str) -> None:
        """The engine repairs the model on its own thread (`_abandon_layerwise_reload`)."""


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{name: the name it is tied to}: every parameter of `model` that is another one under a second name (a
    tied LM head: vLLM's and SGLang's `lm_head.weight` is `model.embed_tokens.weight`)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def worker_rank() -> int:
    """This worker's rank in the engine's default process group (vLLM: its world; SGLang: the TP group of
    a dp_size 1 server); 0 when torch.distributed is not up."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return 0


def worker_identity(base: str | None, rank: int) -> str:
    """`<rollout.identity or hostname>-<pid>-w<rank>`: unique per worker process, also across servers
    on one host and across servers started from one YAML with one `rollout.identity` (the pid is the
    worker's own), so two workers never register under one name."""
    return f"{base or socket.gethostname()}-{os.getpid()}-w{rank}"


__all__ = [
    "CONFIG_ENV",
    "LoopThread",
    "ModelLoadSink",
    "WorkerReceiver",
    "tied_aliases",
    "worker_identity",
    "worker_rank",
]
