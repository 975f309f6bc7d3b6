"""`trainer.overlap`: a version's send runs in the background while the next training step computes.

A blocking sync holds training until the last rollout acked. With overlap, the sync after optimizer
step N only takes a snapshot of exactly what version N sends and returns; a background thread sends
that snapshot while step N+1 computes. On every rank, in the training thread, at the sync point:

    1. the previous version: `wait` blocks until this rank's background send of it is done; `latest`
       only looks whether it still sends
    2. agree (one tiny all-reduce on the training group): does any rank still send it, what was its
       outcome, did a SIGTERM / SIGINT come (`interrupt.py`)? A finished version's outcome goes through
       `trainer.on_failure` here, exactly as a blocking sync's (`SyncDriver.settle`). `latest` and a
       version still sending somewhere: this sync's version is skipped (counted; never snapshotted,
       never half-sent), training goes on
    3. snapshot version N into staging buffers allocated at the first sync and reused by every later
       one (`Staging`): sharded mode, and gather mode with `trainer.overlap_gather=background`, every
       rank copies its FSDP2 local shards (and the whole tensors it sends), no all-gather at all; gather
       mode with `sync` (and LoRA models), the FSDP all-gathers run here on the training group and
       global rank 0 copies each full tensor
    4. agree again (a rank whose snapshot failed, a signal meanwhile), hand version N to this rank's
       background thread and return to training

    background thread (one per rank that sends or gathers; the `BlockingWeightSender`'s own event loop
    runs there):
       rollouts: pause, start -> send_weights(snapshot) -> finish(weight_version=N), resume
       sharded mode: rank 0 tells the other ranks its receivers (`MembersRelay`) on a gloo group made
       for this at start, never on the training group, whose collectives training runs meanwhile
       gather mode, background gather: every rank all-gathers the staged shards, tensor by tensor, on
       mirror groups made for this (`side_gather.py`); rank 0 sends each full tensor as it comes

At most one version is in flight: the staging buffers are written only when no rank still sends from
them. Every rollout still gets whole versions, in increasing order, numbered by their optimizer step.

Why the gather moved to the background (gather mode): FSDP2's `full_tensor()` all-gathers on the
mesh's own process group, the training group, so at the sync point it stalls training for every
all-gather (bench.stall: most of a gather-mode sync). The background gather copies the local shards
instead (what sharded mode's snapshot does) and rebuilds each full tensor on mirror groups
(`side_gather.py`); `trainer.overlap_gather=sync` keeps the old way (bench.stall --overlap measures both).
LoRA models gather at the sync point either way (the merge of `trainer.lora=merged` needs whole tensors).

Faults: a background failure is seen at the next sync (or at `finish()`, the end of fit) and handled
there as a blocking one; `close()` (training ended or failed, a SIGTERM turned into Lightning's
exception) interrupts a send still in flight: the sender aborts the version to its receivers, which
never apply half a version (atomic apply, or streaming rolled back), then drains.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from ..config import FailurePolicy, OverlapGather, OverlapPolicy, OverlapStaging
from ..errors import ConfigError, WeightSyncError
from ..protocol.chunks import TensorShard
from ..versions.options import VersionOptions
from .agree import OK, RECOVERABLE, SyncFailed, all_ranks_max_each, outcome_code
from .gather import PendingGather
from .interrupt import SyncStopWatch, raise_signal
from .send import Outbound, SendRoute, send_version
from .sharded import MembersRelay
from .side_gather import MirrorMeshes, StagedShard

if TYPE_CHECKING:
    from ..config import TrainerConfig, WeightSyncConfig
    from ..versions.sender import BlockingWeightSender
    from ..versions.stats import SendStats
    from .facts import ModelFacts
    from .record import SyncRecord

logger = logging.getLogger(__name__)

CLOSE_JOIN_S = 30.0
"""How long `close()` waits for an interrupted background send to end (it aborts and drains in well
under a second; the bound is for a rollout engine call that hangs)."""

Item = tuple[str, "torch.Tensor | TensorShard | StagedShard"]


class Staging:
    """One buffer per sent item, allocated at the first snapshot and reused by every later one (a
    tensor whose shape, dtype or device changed gets a new buffer). Where: `trainer.overlap_staging`
    (`auto`: the device's own memory on an accelerator, fastest to copy into; host memory on CPU)."""

    def __init__(self, kind: OverlapStaging) -> None:
        self.kind = kind
        self._buffers: dict[str, torch.Tensor] = {}
        self.uses_cuda = False  # a copy was enqueued on a CUDA stream: the sender waits for it (`Snapshot.ready`)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def where(self) -> str:
        kinds = sorted({"pinned host" if b.is_pinned() else b.device.type for b in self._buffers.values()})
        return " + ".join(kinds) or "no"

    def _allocate(self, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        kind = self.kind
        if kind is OverlapStaging.auto:
            kind = OverlapStaging.host if src.device.type == "cpu" else OverlapStaging.device
        if kind is OverlapStaging.device:
            return torch.empty(src.shape, dtype=dtype, device=src.device)
        pinned = kind is OverlapStaging.pinned and src.device.type == "cuda"
        return torch.empty(src.shape, dtype=dtype, device="cpu", pin_memory=pinned)

    def copy(self, name: str, src: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """`src` into its buffer, cast to `dtype` on the way (element-wise, as `Tensor.to` casts)."""
        dtype = dtype or src.dtype
        buf = self._buffers.get(name)
        if buf is None or buf.shape != src.shape or buf.dtype != dtype:
            if buf is not None:
                logger.info("overlap staging: %r changed to %s %s; new buffer", name, tuple(src.shape), dtype)
            buf = self._buffers[name] = self._allocate(src, dtype)
        if src.device.type == "cuda":
            self.uses_cuda = True
        # pinned device -> host copies are asynchronous (the sender waits for the event); others are ordered
        buf.copy_(src.detach(), non_blocking=buf.is_pinned())
        return buf


@dataclass
class Snapshot:
    """One version, copied: what the background thread sends (this rank's part of it)."""

    version: int
    items: list[Item] = field(default_factory=list)
    options: VersionOptions = field(default_factory=VersionOptions)  # tied names, LoRA spec (gather mode)
    sharded: bool = False
    gathers: bool = False  # gather mode, background gather: items hold `StagedShard`s every rank gathers
    ready: Any = None  # a CUDA event the background waits for before the first byte (device / pinned staging)
    ready_device: int | None = None  # the CUDA device `ready` was recorded on
    replica_drift: int = 0  # sharded mode: tensors whose whole copies differed between ranks (rank 0's staged)

    def sendable(self) -> Iterator[tuple[str, torch.Tensor | TensorShard]]:
        """`iter(items)` as the sender takes it: only background gather stages `StagedShard`s, and it sends
        `_gathered` instead. A list's own iterator, so the sender knows the list holds its tensors."""
        assert not self.gathers
        return cast("Iterator[tuple[str, torch.Tensor | TensorShard]]", iter(self.items))

    def outbound(self, weights: Iterator[tuple[str, Any]]) -> Outbound:
        """The version as the one send takes it; a snapshot's tensors are its own copies: stable."""
        options = dataclasses.replace(self.options, stable_tensors=True)
        return Outbound(self.version, weights, options, self.sharded, self.replica_drift)


class SyncHost(Protocol):
    """What the overlap runner uses of the driver that owns it (`driver.SyncDriver`), named here so that
    this module does not import the driver: the training-thread side settles through it; the background
    thread gets none of it (`OverlapSync._send`)."""

    config: WeightSyncConfig
    trainer: TrainerConfig
    device: torch.device | None
    sender: BlockingWeightSender | None
    is_sender: bool
    rank: int
    sharded: bool
    on_failure: FailurePolicy
    record: SyncRecord
    syncs: int
    last_stats: SendStats | None

    def deliver_signal(self, signum: int) -> None: ...
    def facts(self, module: nn.Module) -> ModelFacts: ...
    def sends_sharded(self, module: nn.Module) -> bool: ...
    def route(self, sharded: bool) -> SendRoute: ...
    def outbound(self, module: nn.Module, version: int, *, sharded: bool, defer_gather: bool = False) -> Outbound: ...
    def settle(self, version: int, error: Exception | None, agreed: int) -> bool: ...
    def signal_stopped(
        self, version: int, what: str, agreed: int, signum: int, signalled: int, stats: SendStats | None
    ) -> bool: ...


class OverlapSync:
    """The driver's sync when `trainer.overlap` is on (see the module docstring); one per `SyncDriver`.

    `sync()` and `finish()` run on every rank at the same points (they hold collectives on the training
    group, in the training thread); the background thread touches only the sender, the rollouts and,
    in sharded mode, its own gloo group.
    """

    def __init__(self, driver: SyncHost) -> None:
        tr = driver.trainer
        self.driver = driver
        self.policy = tr.overlap_policy
        kind = tr.overlap_staging
        if kind is OverlapStaging.pinned and not torch.cuda.is_available():
            raise ConfigError(
                "trainer.overlap_staging=pinned needs a CUDA device (page-locked memory speeds up device -> host "
                "copies only); use trainer.overlap_staging=host or auto"
            )
        self.staging = Staging(kind)
        self.gather_where = tr.overlap_gather
        self._mirrors = MirrorMeshes(driver.config.transport.timeout_s, driver.device)
        self.skipped = 0  # versions `latest` skipped because the previous one still sent
        self.snapshot_seconds = 0.0  # the last snapshot's copy (and, gather mode, all-gather) time
        self._pool: ThreadPoolExecutor | None = None
        self._version: int | None = None  # handed off, not settled yet (every rank knows it)
        self._future: Future[SendStats | None] | None = None  # this rank's background send of it
        self._skipped_last: int | None = None  # the newest skipped version, when nothing was handed off since
        self._group: Any = None  # sharded mode: the background's own gloo group
        self._stream: Any = None  # a CUDA snapshot is read on this stream of the background thread's own
        self._flight: SyncStopWatch | None = None  # SIGTERM / SIGINT held while a version is in flight
        self._flight_stops = False  # this rank's flight watch interrupts its own background send
        self._reported = False
        driver.record.overlap_skipped = 0

    # -- life cycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Every rank (collective in sharded mode: the side group is made here, where every rank is)."""
        d = self.driver
        if d.sharded:
            self._group = dist.new_group(backend="gloo")
        logger.info(
            "trainer.overlap on (policy %s, staging %s): each sending rank keeps one copy of what it sends in a "
            "snapshot (sized at the first sync and logged then); a version is sent while the next step computes",
            self.policy.value, self.staging.kind.value,
        )  # fmt: skip

    def close(self) -> None:
        """End a background send still in flight (interrupted: the receivers abort it), within CLOSE_JOIN_S."""
        self._end_flight()
        future = self._future
        if future is not None and not future.done():
            logger.warning("version %s still sending while the trainer closes: interrupting it", self._version)
            self._interrupt("the trainer closed (training ended or failed) while the version was in flight")
            if not wait([future], timeout=CLOSE_JOIN_S).done:
                logger.error("the background send of version %s did not end within %.0f s", self._version, CLOSE_JOIN_S)
        if future is not None and future.done() and self._version is not None:
            error = future.exception()
            logger.warning(
                "version %s was not settled before close: %s", self._version, "sent" if error is None else error
            )
        self._future = self._version = None
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    # -- one sync -----------------------------------------------------------------------------------
    def sync(self, module: nn.Module, version: int, *, policy: OverlapPolicy | None = None) -> bool:
        """Steps 1-4 of the module docstring, on every rank. True when the previous version was
        delivered (settled here); this sync's version is only handed off."""
        carried = self._end_flight()
        try:
            return self._sync(module, version, policy, carried)
        finally:
            self._arm_flight()

    def _route(self, module: nn.Module) -> tuple[bool, SendRoute]:
        """This sync's mode and what this rank sends through; counts the sync (every rank alike)."""
        d = self.driver
        if d.facts(module).fsdp1:
            raise ConfigError(
                "trainer.overlap does not support FSDP1: its summoned full parameters are views of storage it "
                "reuses unit by unit, so a snapshot would cost a full gather into a second copy anyway; use "
                "FSDP2 (fully_shard) or trainer.overlap=false"
            )
        d.syncs += 1
        sharded = d.sends_sharded(module)
        route = d.route(sharded)
        if d.is_sender and route.sender is None:
            raise WeightSyncError("SyncDriver.sync() before start()")
        return sharded, route

    def _previous(self, policy: OverlapPolicy) -> tuple[int, BaseException | None]:
        """Step 1: (still sending, this rank's failure of it) for the version in flight; `wait` waits for it."""
        if policy is OverlapPolicy.wait and self._future is not None:
            wait([self._future])  # bounded by the sender's own timeouts; a signal interrupts it (watch)
        busy = int(self._future is not None and not self._future.done())
        return busy, (self._future.exception() if not busy and self._future is not None else None)

    def _sync(self, module: nn.Module, version: int, policy: OverlapPolicy | None, carried: list[int]) -> bool:
        d = self.driver
        sharded, route = self._route(module)
        snapshot: Snapshot | None = None
        snap_error: BaseException | None = None
        snap_code = OK
        on_stop = self._interrupt if route.sender is not None else None
        watch = SyncStopWatch(rank=d.rank, sync_id=d.syncs, on_stop=on_stop)
        with watch:
            for signum in carried:  # came while the previous version was in flight (`_arm_flight`)
                watch.note(signum)
            busy, error = self._previous(policy or self.policy)  # 1. the previous version
            # 2. agree: still sending anywhere, its outcome, a signal
            busy_any, agreed, signum, signalled = all_ranks_max_each(
                [busy, outcome_code(error), *watch.seen()], d.device
            )
            fatal = agreed != OK and not (agreed == RECOVERABLE and d.on_failure is FailurePolicy.warn)
            if not busy_any and agreed == OK and self._version is not None:
                # delivered on every rank: recorded before this version's snapshot, whose content may depend
                # on it (LoRA sends the base until a version with it was delivered); settled again below
                d.record.delivered(self._version, self._stats())
            if not signum and not busy_any and not fatal:
                # 3. snapshot: every rank, the gather's all-gathers included
                started = time.perf_counter()
                snapshot, snap_error = self._snapshot(module, version, sharded)
                self.snapshot_seconds = time.perf_counter() - started
                # 4. agree again: every snapshot whole, no signal meanwhile
                snap_code, signum, signalled = all_ranks_max_each([outcome_code(snap_error), *watch.seen()], d.device)
        for late in watch.late(signum):
            raise_signal(late)  # came after this rank had agreed: handled here alone, as without a sync
        if busy_any:
            if signum:  # the version in flight was interrupted by it; close() joins it
                d.deliver_signal(signum)
            else:
                self._skip(version)
            return False
        # the previous version is done on every rank: settled below, whatever happens to this one
        previous, future = self._version, self._future
        self._version = self._future = None
        if snapshot is not None and snap_code == OK and not signum:
            self._hand_off(snapshot, route)
        delivered = self._conclude(previous, future, agreed, error, signum, signalled)
        if snap_code != OK:
            if snap_error is not None:
                raise snap_error
            raise SyncFailed(f"global rank {d.rank}: the overlap snapshot of version {version} failed on another rank")
        return delivered

    def finish(self, module: nn.Module, version: int | None) -> bool:
        """End of training, every rank: the last version is sent (a final `version` that `latest` skipped
        is handed off now) and its outcome applied (`trainer.on_failure`) before this returns."""
        d = self.driver
        if version is not None and self._skipped_last == version:
            self.skipped -= 1  # sent after all: not a skipped version
            d.record.overlap_skipped = self.skipped
            self.sync(module, version, policy=OverlapPolicy.wait)
        carried = self._end_flight()
        d.syncs += 1
        error: BaseException | None = None
        watch = SyncStopWatch(rank=d.rank, sync_id=d.syncs, on_stop=self._interrupt if d.sender is not None else None)
        with watch:
            for signum in carried:
                watch.note(signum)
            if self._future is not None:
                wait([self._future])
                error = self._future.exception()
            agreed, signum, signalled = all_ranks_max_each([outcome_code(error), *watch.seen()], d.device)
        for late in watch.late(signum):
            raise_signal(late)
        previous, future = self._version, self._future
        self._version = self._future = None
        return self._conclude(previous, future, agreed, error, signum, signalled)

    # -- the pieces ---------------------------------------------------------------------------------
    def _conclude(
        self,
        previous: int | None,
        future: Future[SendStats | None] | None,
        agreed: int,
        error: BaseException | None,
        signum: int,
        signalled: int,
    ) -> bool:
        """Settle `previous` (the version that was in flight, done on every rank; None: nothing was) as a
        blocking sync would, and hand on a signal that stopped this sync."""
        d = self.driver
        if previous is None:
            if signum:
                d.deliver_signal(signum)
            return False
        stats = future.result() if future is not None and error is None else None
        d.last_stats = stats
        if signum:
            return d.signal_stopped(previous, "background weight sync", agreed, signum, signalled, stats)
        if error is not None and not isinstance(error, Exception):
            raise error  # a BaseException from the background thread (not a send failure)
        return d.settle(previous, error if isinstance(error, Exception) else None, agreed)

    def _skip(self, version: int) -> None:
        self.skipped += 1
        self._skipped_last = version
        self.driver.record.overlap_skipped = self.skipped
        logger.info(
            "version %d skipped (trainer.overlap_policy=latest): version %s is still sending; %d skipped so far",
            version, self._version, self.skipped,
        )  # fmt: skip

    def _snapshot(self, module: nn.Module, version: int, sharded: bool) -> tuple[Snapshot, BaseException | None]:
        """Copy what this rank sends of `version` into staging (nothing on ranks that do not send).
        The stream is exhausted on every rank whatever fails (the other ranks' all-gathers need this
        one); a ConfigError (raised by the gather on every rank at the same point) propagates."""
        d = self.driver
        gathers = not sharded and self.gathers_in_background(module)
        # sync gather: every rank runs the all-gathers here; global rank 0 alone gets tensors
        live = d.outbound(module, version, sharded=sharded, defer_gather=gathers)
        snap = Snapshot(version, options=live.options, sharded=sharded, gathers=gathers)
        snap.replica_drift = live.replica_drift
        error: BaseException | None = None
        keeps = d.is_sender or sharded or gathers
        pending: list[tuple[int, PendingGather]] = []  # background gather: items to give their mirror mesh
        for name, item in live.weights:
            if error is not None:
                continue  # still join the other ranks' all-gathers
            try:
                if isinstance(item, TensorShard):
                    staged = self.staging.copy(name, item.data)
                    snap.items.append((name, TensorShard(item.shape, item.dtype, item.byte_offset, staged)))
                elif isinstance(item, PendingGather):  # given its mirror mesh once staged (`_stage_shards`)
                    local = self.staging.copy(name, item.tensor.to_local(), item.dtype)
                    pending.append((len(snap.items), item))
                    snap.items.append((name, local))
                else:
                    snap.items.append((name, self.staging.copy(name, item)))
            except Exception as exc:  # e.g. out of memory for the staging buffers
                error = exc
                logger.error("global rank %d: the overlap snapshot of version %d failed: %s", d.rank, version, exc)
        if gathers:
            self._stage_shards(snap, pending)  # collective on the first snapshot: every rank, failed or not
        if self.staging.uses_cuda:
            snap.ready = torch.cuda.Event()
            snap.ready.record()
            snap.ready_device = torch.cuda.current_device()
        if not self._reported and keeps and error is None:
            self._reported = True
            logger.info(
                "trainer.overlap: the snapshot holds %.1f MiB of %s memory on global rank %d (one copy of what this "
                "rank sends, reused every version)",
                self.staging.nbytes / (1 << 20), self.staging.where(), d.rank,
            )  # fmt: skip
        return snap, error

    def gathers_in_background(self, module: nn.Module) -> bool:
        """Gather mode: whether this sync's all-gathers run in the background thread (module docstring)."""
        facts = self.driver.facts(module)
        return (
            self.gather_where is OverlapGather.background
            and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            and facts.sharded and not facts.lora
        )  # fmt: skip

    def _stage_shards(self, snap: Snapshot, pending: list[tuple[int, PendingGather]]) -> None:
        """Give each staged local shard the mirror of its mesh (made here the first time: collective)."""
        staged: dict[int, torch.Tensor] = {}
        for i, _ in pending:
            local = snap.items[i][1]
            assert isinstance(local, torch.Tensor)  # the local shard `_snapshot` copied, not staged yet
            staged[i] = local
        device_type = next((t.device.type for t in staged.values()), "cpu")
        meshes = {id(p.tensor.device_mesh): p.tensor.device_mesh for _, p in pending}
        self._mirrors.ensure(meshes.values(), device_type)
        for i, p in pending:
            dt, local = p.tensor, staged[i]
            mesh = self._mirrors.mirror(dt.device_mesh, device_type)
            snap.items[i] = (snap.items[i][0], StagedShard(local, mesh, tuple(dt.placements), dt.shape, dt.stride()))

    def _hand_off(self, snapshot: Snapshot, route: SendRoute) -> None:
        """Every rank records the version in flight; a rank that sends (or, background gather, gathers)
        starts its background work, given what it sends through (never the driver)."""
        self._version, self._future, self._skipped_last = snapshot.version, None, None
        self._flight_stops = route.sender is not None
        if route.sender is None and not snapshot.gathers:
            return
        if route.sender is not None:
            route.sender.clear_interrupt()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="weightsync-overlap")
        relay = MembersRelay(torch.device("cpu"), self._group) if snapshot.sharded else None
        self._future = self._pool.submit(self._send, snapshot, route, relay)

    def _stats(self) -> SendStats | None:
        """The finished background send's stats (None: this rank sent nothing, or it failed)."""
        future = self._future
        if future is None or not future.done() or future.exception() is not None:
            return None
        return future.result()

    # -- a signal while a version is in flight --------------------------------------------------------
    def _arm_flight(self) -> None:
        """From a hand-off to the next sync, training runs while the version sends; a SIGTERM / SIGINT then
        would meet Lightning's handler (a collective, mid-step) or end the process with the send still out,
        and the next step boundary would wait for a send that nobody ends. Instead it is recorded, ends the
        background send on every rank at once (the store relays it, as within a sync), and is carried into
        the next sync (`sync`/`finish`), whose agreement stops every rank alike. A second one of the same
        kind is handled at once (a step that never ends must not hold it back)."""
        if self._flight is not None or self._version is None:
            return
        d = self.driver
        watch = SyncStopWatch(
            rank=d.rank, sync_id=f"flight-{d.syncs}", on_stop=self._interrupt if self._flight_stops else None,
            escalate=True,
        )  # fmt: skip
        self._flight = watch.__enter__()

    def _end_flight(self) -> list[int]:
        """Stop holding signals back; the ones this rank received meanwhile, to carry into the sync."""
        watch, self._flight = self._flight, None
        if watch is None:
            return []
        try:
            watch.__exit__(None, None, None)
        except ValueError:  # not the main thread: signal handlers cannot be restored from here
            logger.debug("the in-flight signal watch ended off the main thread")
        return list(watch.signals)

    def _interrupt(self, reason: str) -> None:
        sender = self.driver.sender
        if sender is not None:
            sender.interrupt(reason)

    # -- the background thread ------------------------------------------------------------------------
    def _side_stream(self, snap: Snapshot) -> contextlib.AbstractContextManager[Any]:
        """A CUDA snapshot is read on a stream of the background thread's own. On the thread's default
        (legacy) stream its copies out of staging would queue behind the next step's kernels: the send
        would wait for the step it should overlap (seen on an H200: the overlap stall was 0.84x blocking's,
        with steps longer than the send). Waits for the snapshot's copies first (`Snapshot.ready`)."""
        if snap.ready is None:
            return contextlib.nullcontext()
        snap.ready.synchronize()  # the device's copies into staging are done
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=snap.ready_device)
        return torch.cuda.stream(self._stream)

    def _send(self, snap: Snapshot, route: SendRoute, relay: MembersRelay | None) -> SendStats | None:
        """The background runner: one version from the snapshot, through the one send (`send.send_version`,
        rollouts included); a rank without a sender runs its part of the background gather."""
        with self._side_stream(snap):
            weights = self._gathered(snap, keep=route.sender is not None) if snap.gathers else snap.sendable()
            return send_version(snap.outbound(weights), route, relay)

    @staticmethod
    def _gathered(snap: Snapshot, *, keep: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """The version's full tensors, all-gathered one at a time on the mirror groups (every rank runs
        this, in the same order); the sending rank alone keeps them (the other ranks hold only shards)."""
        for name, item in snap.items:
            if isinstance(item, StagedShard):
                full = item.full()
                if keep:
                    yield name, full
                del full
            elif keep:
                yield name, item  # type: ignore[misc]  # rank 0's whole tensors


__all__ = ["OverlapSync", "Snapshot", "Staging"]
