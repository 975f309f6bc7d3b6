"""verl's checkpoint engine `lightning_weightsync`: verl's actor -> rollout weight sync over our sender and receiver.

verl (0.9.1) imports a third-party engine on every worker that builds one when its config names a module, so
a verl user selects this one with two lines (docs/integrations.md, "verl"):

    actor_rollout_ref.rollout.checkpoint_engine.backend=lightning_weightsync
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=lightning_weightsync.integrations.verl

What verl calls, and where (verl 0.9.1; the signatures below mirror these lines):
- import: `import_external_libs(custom_backend_module)` on the actor (verl/workers/engine_workers.py:685), on each
  rollout-side `CheckpointEngineWorker` (verl/checkpoint_engine/base.py:336) and in the `CheckpointEngineManager`
  (base.py:417), then `CheckpointEngineRegistry.new(backend, ...)` / `.get(backend)` (base.py:84-113).
- build: actor ranks `new(backend, is_master=(rank == 0), bucket_size=..., **engine_kwargs)`
  (engine_workers.py:686-688), rollout ranks `new(backend, bucket_size=..., **engine_kwargs)` (base.py:337-339);
  `engine_kwargs` is `checkpoint_engine.engine_kwargs.lightning_weightsync` (engine_workers.py:682, base.py:333).
- every sync, `CheckpointEngineManager.update_weights` (base.py:509-562), in this order: `prepare()` on every
  actor and rollout rank (base.py:426-430), `build_topology(actor_world_size, rollout_world_size, metadata)`
  (base.py:432-439, each list as long as its side), `init_process_group(**kwargs)` (base.py:441-447), then in
  parallel `send_weights(per_tensor_param, global_steps)` on every actor rank (engine_workers.py:764-766, whose
  dict is merged into the step's metrics, base.py:543-548) and `receive_weights(global_steps)` on every rollout
  rank, drained by its server adapter (base.py:353-360), then `finalize()` everywhere (base.py:550-554).

What this engine does with that:
- One session a side, kept across syncs (verl's NCCL engine keeps its group too unless `rebuild_group`,
  nccl_checkpoint_engine.py:182-193, 297): actor rank 0 starts a `WeightSender` at its first `prepare()` and
  reports its control endpoint; each rollout rank starts a `WeightReceiver` connected to it at its first
  `init_process_group()`; later syncs reuse both (the data-plane group too, while the members are the same;
  `transport.rebuild_group=true` rebuilds it every version). `finalize()` keeps them.
- Every actor rank drains the weight generator: producing a tensor is collective over the actor group (FSDP
  all-gathers), as verl's NCCL engine's ranks outside the group do (nccl_checkpoint_engine.py:327-332); rank 0
  sends (gather mode). verl hands every rank full tensors (`get_per_tensor_param`, engine_workers.py:764), never
  its local shards (only its own `delta_sharded` backend gets those, engine_workers.py:759-763), so our sharded
  mode is not reachable through this interface.
- Our sender and receiver run on an event loop in a thread of their own (`LoopThread`): verl's sync methods
  (`prepare`, `init_process_group`, `finalize`, run through `execute_checkpoint_engine`, base.py:362-364) wait
  on it for a bounded time, its async ones await it, so verl's asyncio loop is never blocked by a wait of ours.
  The generator itself is still pulled on verl's thread, one tensor each time the sender asks for the next.
- Bounded: a rollout rank that dies mid-sync fails the version on the sender within `transport.liveness_s`
  (and the other rollout ranks with it); an actor that dies fails every rollout rank's receive within
  `transport.liveness_s` (its control link is watched while a version is awaited, and by the receiver while
  one streams). Both sides raise `WeightSyncError` subclasses; nothing is pickled on our wire (verl moves what
  `prepare`/`build_topology` return between its workers with Ray, as for every engine).

Configuration: `engine_kwargs.lightning_weightsync.overrides`, a list of our `key=value` overrides (e.g.
`transport.backend=nccl`, `transport.auth_token_file=/path`), applied after what verl decides: the bucket size
(`transport.bucket_size_mb` from `update_weights_bucket_megabytes`), the address the sender binds and reports
(`transport.host`: the node's address as Ray sees it, as verl's NCCL engine binds, nccl_checkpoint_engine.py:253),
the device received tensors land on (`rollout.device`: the rollout worker's current GPU, else cpu), and
`trainer.min_receivers` (every rollout rank of the topology).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ..config import ReceiverSettings, SenderSettings, WeightSyncConfig, load_config, settings
from ..errors import PeerError, WeightSyncError
from ..rollout_engines.worker import LoopThread
from ..transport.device import handoff
from ..versions.receiver import WeightReceiver
from ..versions.sender import WeightSender
from . import require

_base = require("verl.checkpoint_engine.base", "verl", "verl's lightning_weightsync checkpoint engine")
CheckpointEngineRegistry = _base.CheckpointEngineRegistry

logger = logging.getLogger(__name__)

BACKEND = "lightning_weightsync"
"""The name verl's `checkpoint_engine.backend` selects this engine by."""
LINK_POLL_S = 0.5
"""While a rollout rank waits for the next step of a version: how often it asks whether the actor is connected."""
METRICS_PREFIX = "lightning_weightsync/"

T = TypeVar("T")


class Role(str, enum.Enum):
    """Which side of verl's sync a worker is on; `build_topology` tells each worker (verl's rollout ranks are
    built without `is_master`, so at construction an actor rank other than 0 and a rollout rank look alike)."""

    actor = "actor"
    rollout = "rollout"


@dataclass(frozen=True)
class SenderEndpoint:
    """Where actor rank 0's `WeightSender` listens: its control endpoint (the data plane is set up through it)."""

    host: str
    port: int


@dataclass(frozen=True)
class WorkerMetadata:
    """What `prepare()` reports for `build_topology`: actor rank 0 its endpoint, every other worker nothing."""

    sender: SenderEndpoint | None = None


def _sets(overrides: Sequence[str], key: str) -> bool:
    return any(o.split("=", 1)[0].lstrip("+~") == key for o in overrides)


def _node_address() -> str:
    """This node's address as Ray sees it, the one verl's NCCL engine binds its own socket to
    (nccl_checkpoint_engine.py:253); verl runs every worker under Ray."""
    import ray  # verl's own dependency (verl/checkpoint_engine/base.py:19)

    return str(ray.util.get_node_ip_address()).strip("[]")


def _worker_device() -> torch.device:
    """The device this worker computes on: its current GPU, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class _CallerWeights:
    """verl's weight iterable, pulled by our sender on its own loop one item at a time, each item produced on
    the loop of the caller (verl's actor worker): the generator runs the actor group's collectives (FSDP
    all-gathers) on that thread's device and stream, in the order every rank runs them. `drain()` pulls
    what is left, for a send that ended early (the generator must be exhausted on every rank)."""

    def __init__(self, weights: Iterable[Any] | AsyncIterable[Any], caller: asyncio.AbstractEventLoop) -> None:
        self._sync: Iterator[Any] | None = None
        self._async: AsyncIterator[Any] | None = None
        if isinstance(weights, AsyncIterable):
            self._async = weights.__aiter__()
        else:
            self._sync = iter(weights)
        self._caller = caller
        self._lock = asyncio.Lock()  # one pull at a time, on the caller's loop
        self.exhausted = False

    async def _pull(self) -> tuple[Any, Any] | None:
        """The next item and its stream hand-off, on the caller's loop; None at the end."""
        async with self._lock:
            if self.exhausted:
                return None
            try:
                if self._sync is not None:
                    item = next(self._sync)
                else:
                    assert self._async is not None
                    item = await self._async.__anext__()
            except (StopIteration, StopAsyncIteration):
                self.exhausted = True
                return None
            except BaseException:
                self.exhausted = True  # a generator that raised is finished
                raise
            return item, handoff(tuple(item) if isinstance(item, tuple) else ())

    def __aiter__(self) -> _CallerWeights:
        return self

    async def __anext__(self) -> Any:
        """On our loop: ask the caller's loop for the next item."""
        pulled = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._pull(), self._caller))
        if pulled is None:
            raise StopAsyncIteration
        item, adopt = pulled
        adopt()  # our thread's stream waits for the tensor the caller's stream produced
        return item

    async def drain(self) -> None:
        """On the caller's loop: pull the rest, sending none of it."""
        while await self._pull() is not None:
            pass


async def _next_received(stream: AsyncGenerator[tuple[str, torch.Tensor]]) -> tuple[str, torch.Tensor, Any] | None:
    """On our loop: the next tensor of a version and its stream hand-off; None once the version is complete."""
    try:
        name, tensor = await stream.__anext__()
    except StopAsyncIteration:
        return None
    return name, tensor, handoff((tensor,))


async def _while_sender_linked(receiver: WeightReceiver, step: Coroutine[Any, Any, T], liveness_s: float) -> T:
    """On our loop: `step`, failed with `PeerError` once the actor's control link has been down `liveness_s`.
    The receiver watches the link itself while buckets stream; before the first (the Prepare, the plan) its
    wait has no bound but `transport.timeout_s`, and verl's rollout rank must not wait minutes for a dead actor."""
    task = asyncio.ensure_future(step)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=LINK_POLL_S)
            if done:
                return task.result()
            linked, since = receiver.sender_link()
            if not linked and since >= liveness_s:
                raise PeerError(
                    f"the actor's weight sender at {receiver.address} is gone (no connection for {since:.1f}s, "
                    f"transport.liveness_s={liveness_s}s)"
                )
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


@CheckpointEngineRegistry.register(BACKEND)
class LightningWeightSyncCheckpointEngine(_base.CheckpointEngine):  # type: ignore[name-defined]
    """verl `CheckpointEngine` (verl/checkpoint_engine/base.py:116-226) over our `WeightSender` / `WeightReceiver`.

    Args:
        bucket_size: bytes, verl's `update_weights_bucket_megabytes << 20` (engine_workers.py:681, base.py:332):
            our `transport.bucket_size_mb`, two buckets a side.
        is_master: verl passes `torch.distributed.get_rank() == 0` on actor ranks (engine_workers.py:687) and
            nothing on rollout ranks: the master starts the sender.
        overrides: our `key=value` config overrides (`engine_kwargs.lightning_weightsync.overrides`), applied
            after what verl decides (module docstring); e.g. `["transport.backend=nccl"]`.
    """

    def __init__(self, bucket_size: int, is_master: bool = False, overrides: Sequence[str] = ()) -> None:
        if isinstance(overrides, str):
            overrides = [overrides]
        user = [str(o) for o in overrides]
        from_verl = [f"transport.bucket_size_mb={int(bucket_size) / (1 << 20)!r}"]
        if not _sets(user, "rollout.device"):
            from_verl.append(f"rollout.device={_worker_device()}")
        self.bucket_size = int(bucket_size)
        self.is_master = bool(is_master)
        self.config: WeightSyncConfig = settings(load_config(None, [*from_verl, *user]))
        self._host_set = _sets(user, "transport.host")
        self.role: Role | None = Role.actor if self.is_master else None  # the others learn it from the topology
        self._loop: LoopThread | None = None
        self._sender: WeightSender | None = None
        self._receiver: WeightReceiver | None = None
        self._endpoint: SenderEndpoint | None = None  # the master's own, or the one a rollout rank is connected to
        self._last_version: int | None = None
        self._open: AsyncGenerator[tuple[str, torch.Tensor]] | None = None  # the version a rollout rank receives

    # -- verl's per-sync steps (base.py:426-447), sync methods run by execute_checkpoint_engine -------------
    def prepare(self) -> WorkerMetadata:
        """Actor rank 0: start the sender once (it stays up across syncs) and report its endpoint."""
        self._close_abandoned()
        if not self.is_master:
            return WorkerMetadata()
        if self._sender is None:
            t = self.config.transport
            host = t.host if self._host_set else _node_address()
            own = SenderSettings(dataclasses.replace(t, host=host), int(self.config.trainer.min_receivers))
            loop = self._loop_thread()
            sender = WeightSender(own)
            loop.call(sender.start(), timeout_s=t.timeout_s)
            self._sender, self._endpoint = sender, SenderEndpoint(host, sender.port)
            logger.info("lightning_weightsync: actor rank 0 sends from %s:%d", host, sender.port)
        return WorkerMetadata(sender=self._endpoint)

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[WorkerMetadata]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Every worker learns its side, actor rank 0's endpoint and how many rollout ranks a version waits for.
        `metadata`: the actor ranks' `prepare()` in rank order, then the rollout ranks' (base.py:427-430)."""
        if len(metadata) != actor_wg_world_size + rollout_world_size:
            raise WeightSyncError(
                f"build_topology: {len(metadata)} workers' metadata for {actor_wg_world_size} actor + "
                f"{rollout_world_size} rollout ranks"
            )
        senders = [m.sender for m in metadata[:actor_wg_world_size] if m.sender is not None]
        if len(senders) != 1 or any(m.sender is not None for m in metadata[actor_wg_world_size:]):
            raise WeightSyncError(
                f"build_topology: expected exactly one actor rank with is_master=True (verl passes rank 0), "
                f"found {len(senders)} endpoints among the actor ranks"
            )

        def side(role: Role, size: int) -> dict[str, list[Any]]:
            return {"role": [role] * size, "sender": senders * size, "receivers": [rollout_world_size] * size}

        return side(Role.actor, actor_wg_world_size), side(Role.rollout, rollout_world_size)

    def init_process_group(self, role: Role, sender: SenderEndpoint, receivers: int) -> None:
        """The actor master waits for `receivers` rollout ranks per version; a rollout rank connects its receiver
        to `sender` (once: a later sync to the same endpoint keeps it; a new endpoint, a restarted actor, replaces
        it). The data-plane group itself is formed by the first version and kept while its members stay."""
        self._close_abandoned()
        self.role = Role(role)
        if self.role is Role.actor:
            if self._sender is not None:
                if sender != self._endpoint:
                    raise WeightSyncError(
                        f"init_process_group: the topology names {sender}, this sender is {self._endpoint}"
                    )
                self._sender.settings = dataclasses.replace(self._sender.settings, min_receivers=int(receivers))
            return
        if self._receiver is not None and sender == self._endpoint:
            return
        self._close_receiver()
        t = self.config.transport
        own = ReceiverSettings.of(self.config)
        own = dataclasses.replace(own, transport=dataclasses.replace(t, host=sender.host, port=int(sender.port)))
        loop = self._loop_thread()
        receiver = WeightReceiver(own)
        loop.call(receiver.start(), timeout_s=t.timeout_s)
        self._receiver, self._endpoint = receiver, sender
        logger.info(
            "lightning_weightsync: rollout rank %s receives from %s:%d", receiver.identity, sender.host, sender.port
        )

    def finalize(self) -> None:
        """The session, the buckets and the group are kept for the next sync (module docstring)."""
        self._close_abandoned()

    # -- the transfer (base.py:538-542) --------------------------------------------------------------------
    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        """Every actor rank: drain `weights`; rank 0 sends them as one version. Returns our metrics for verl's step
        metrics (engine_workers.py:765-766, base.py:543-548): rank 0's `SendStats`, {} on the others."""
        if self.role is Role.rollout:
            raise WeightSyncError("send_weights on a rollout rank: build_topology made this worker a receiver")
        caller = _CallerWeights(weights, asyncio.get_running_loop())
        if self._sender is None:  # not the master: the generator is collective (nccl_checkpoint_engine.py:327-332)
            await caller.drain()
            return {}
        version = self._next_version(global_steps)
        try:
            stats = await self._on_our_loop(self._sender.send_weights(caller, version=version))
        finally:
            await caller.drain()  # the sender drains after a failure itself; this covers a send cut short otherwise
        return {f"{METRICS_PREFIX}{k}": float(v) for k, v in stats.as_metrics().items()}

    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor]]:
        """Every rollout rank: the next version's tensors, whole, on `rollout.device` (the worker's GPU by
        default). The version is acked once the consumer asked past its last tensor; a consumer that stops
        early leaves it drained and nacked (nothing of it counts as delivered)."""
        receiver, liveness_s = self._receiver, float(self.config.transport.liveness_s)
        if receiver is None or self.role is not Role.rollout:
            raise WeightSyncError("receive_weights before init_process_group made this worker a rollout receiver")
        self._close_abandoned()
        stream = self._open = receiver.receive_weights()
        done = False
        try:
            while True:
                got = await self._on_our_loop(_while_sender_linked(receiver, _next_received(stream), liveness_s))
                if got is None:
                    done = True
                    break
                name, tensor, adopt = got
                adopt()  # verl's stream waits for the merge our thread's stream made
                yield name, tensor
        finally:
            if self._open is stream:
                self._open = None
            if not done and self._loop is not None:
                await self._on_our_loop(stream.aclose())  # drains what is left of the version and nacks it

    # -- ours ----------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the sender or receiver and the loop thread (verl has no such call: a process's session ends
        with it; tests and a caller that replaces the engine use this)."""
        self._close_abandoned()
        self._close_receiver()
        if self._sender is not None and self._loop is not None:
            try:
                self._loop.call(self._sender.close(), timeout_s=30)
            except Exception as exc:  # best effort: tearing down
                logger.warning("closing the weight sender failed: %s", exc)
            self._sender = None
        if self._loop is not None:
            self._loop.cancel_all()
            self._loop.stop()
            self._loop = None

    def _close_abandoned(self) -> None:
        """A version whose consumer stopped without closing our generator. An adapter that raises inside its
        `async for` leaves the generator suspended until it is garbage: CPython closes it (drain, nack) as soon
        as nothing holds the error's traceback. Where something keeps it alive, the actor's send waits for this
        rank's ack up to `transport.timeout_s`, and the next call into this engine drains and nacks the version."""
        stream, self._open = self._open, None
        if stream is not None and self._loop is not None:
            self._loop.call(stream.aclose(), timeout_s=float(self.config.transport.timeout_s))

    def _close_receiver(self) -> None:
        if self._receiver is not None and self._loop is not None:
            try:
                self._loop.call(self._receiver.close(), timeout_s=30)
            except Exception as exc:  # best effort: the old actor may be gone
                logger.warning("closing the weight receiver failed: %s", exc)
        self._receiver = None

    def _loop_thread(self) -> LoopThread:
        if self._loop is None:
            self._loop = LoopThread(_worker_device())
        return self._loop

    async def _on_our_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro` run on our loop thread; verl's loop stays free meanwhile (a cancel reaches `coro`)."""
        assert self._loop is not None
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop.loop))

    def _next_version(self, global_steps: int | None) -> int:
        """verl's `global_steps`, while it grows; our versions must increase within a sender's session, so a
        repeated or missing step is sent as the next number."""
        last = self._last_version
        wanted = global_steps if isinstance(global_steps, int) and global_steps >= 0 else None
        version = (
            wanted if wanted is not None and (last is None or wanted > last) else (0 if last is None else last + 1)
        )
        if wanted is not None and version != wanted:
            logger.warning(
                "global_steps=%d is not above the last version sent (%s): sent as version %d", wanted, last, version
            )
        self._last_version = version
        return version


__all__ = [
    "BACKEND",
    "LightningWeightSyncCheckpointEngine",
    "Role",
    "SenderEndpoint",
    "WorkerMetadata",
]
