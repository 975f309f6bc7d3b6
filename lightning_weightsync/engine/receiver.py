"""WeightReceiver: one version per `receive_weights()` call, bucket by bucket, merged into tensors.

    wait for Prepare (heartbeating) -> Ready -> Plan -> join the group
    producer: for bucket k: wait until slot k % 2 is free, read its metadata, run its broadcast
              (executor thread) -> hand (metadata, slot) to the consumer
    consumer: chunks of the bucket -> merge_weight_chunks(into=...) -> yield (name, tensor);
              the slot is released as soon as its last chunk was copied out

So bucket k + 1 is on the wire while bucket k is merged. If the consumer stops early or fails,
the receiver keeps taking part in the version's remaining broadcasts (discarding them) so the
sender and the other receivers are not stalled, then reports the failure in its ack.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from ..config import auth_token, load_config
from ..errors import PeerError, ProtocolError, VersionAborted, WeightSyncError, WeightSyncTimeout
from ..protocol.chunks import TensorMeta, as_bytes, merge_weight_chunks
from ..protocol.messages import Ack, BucketMeta, Plan, Prepare, Ready
from ..transport.backends import Backend, backend_class, build_backend
from ..transport.control import ReceiverControl, default_identity
from ..transport.device import resolve_device
from ..transport.executor import SerialExecutor
from .endpoint import Endpoint

logger = logging.getLogger(__name__)

Into = Callable[[TensorMeta], "torch.Tensor | None"]


@dataclass
class ReceiveStats:
    version: int
    nbytes: int = 0
    num_tensors: int = 0
    num_buckets: int = 0
    direct_buckets: int = 0  # received straight into their destination (no merge copy)
    seconds: float = 0.0

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class WeightReceiver(Endpoint):
    """Receives versions from one `WeightSender`.

    Args:
        cfg: the weightsync config; uses `transport.*` and `rollout.identity` / `rollout.device`
            (where merged tensors are allocated when no `into` destination is given).
    """

    def __init__(self, cfg: DictConfig | None = None, *, identity: str | None = None) -> None:
        self.cfg = cfg if cfg is not None else load_config()
        t = self.cfg.transport
        self.identity = identity or self.cfg.rollout.identity or default_identity()
        self.timeout_s = float(t.timeout_s)
        self.device = resolve_device(t.backend, t.device, backend_class(t.backend).natural_device)
        self.output_device = torch.device(self.cfg.rollout.device)
        self._key = auth_token(self.cfg)
        self._control = ReceiverControl(t.host, int(t.port), self._key, self.identity, str(self.device))
        self._backend: Backend | None = None
        self._executor: SerialExecutor | None = None
        self._session: str | None = None
        self.version: int | None = None  # version of the stream received last (or in flight)
        self.last_complete_version: int | None = None
        self.last_stats: ReceiveStats | None = None
        self.on_bucket: Callable[[BucketMeta], None] | None = None  # progress hook (daemon)
        self._acked = True
        self._pipeline: _BucketPipeline | None = None

    # -- life cycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        self._executor = SerialExecutor(self._executor_name)
        await self._control.start()

    async def __aenter__(self) -> WeightReceiver:
        await self.start()
        return self

    @property
    def dropped_messages(self) -> int:
        return self._control.dropped_messages

    # -- one version ------------------------------------------------------------------------------
    async def wait_version(self, wait_s: float | None = None) -> Plan:
        """Block until the sender starts a version, join its group, and return the plan."""
        await self._finish_abandoned()
        t = self.cfg.transport
        while True:
            prepare = await self._control.wait_prepare(float(t.heartbeat_interval_s), wait_s)
            if not self._is_new(prepare):
                logger.warning("ignoring stale Prepare for version %d (have %s)", prepare.version, self.version)
                continue
            generation = self._backend.generation if self._backend is not None else -1
            await self._control.send(Ready(self.identity, prepare.version, generation))
            try:
                plan = await self._control.wait_plan(prepare, self.timeout_s)
            except VersionAborted as exc:
                logger.info("%s", exc)
                continue
            break
        if self._backend is None or self._backend.name != plan.backend:
            if self._backend is not None:
                self._backend.close()
            self._backend = build_backend(
                plan.backend,
                bucket_size=plan.bucket_size,
                device=self.device,
                timeout_s=self.timeout_s,
                is_sender=False,
                session=plan.session,
                auth_key=self._key,
                identity=self.identity,
            )
            self._backend.rendezvous = self._control
        self._control.bucket_size = plan.bucket_size
        self._session, self.version = plan.session, plan.version
        assert self._executor is not None
        try:
            await asyncio.wait_for(asyncio.shield(self._executor.submit(self._backend.join, plan)), self.timeout_s)
        except BaseException as exc:
            self._fail_group()
            await self._send_ack(plan.version, False, f"could not join the group: {exc}")
            if isinstance(exc, asyncio.TimeoutError):
                raise WeightSyncTimeout(f"version {plan.version}: joining the {plan.backend} group timed out") from None
            raise
        return plan

    async def _finish_abandoned(self) -> None:
        """A consumer that left `receive_weights` early (break, exception) leaves its version
        half-received; take part in the rest of it so the sender and the others are not stalled.

        Both the generator's own finalizer and the next `wait_version` may get here; they share
        one drain, and nothing reads the control socket for a new version before it is done.
        """
        pipeline = self._pipeline
        if pipeline is None:
            return
        if pipeline.drain_task is None:
            pipeline.drain_task = asyncio.ensure_future(self._drain(pipeline))
        await asyncio.shield(pipeline.drain_task)
        if self._pipeline is pipeline:
            self._pipeline = None

    async def _drain(self, pipeline: _BucketPipeline) -> None:
        if not pipeline.finished:
            logger.warning("version %d was not consumed to the end; draining it", pipeline.plan.version)
            await pipeline.drain()
        await self._send_ack(pipeline.plan.version, False, "consumer stopped before the version was complete")

    def _is_new(self, prepare: Prepare) -> bool:
        return prepare.session != self._session or self.version is None or prepare.version > self.version

    async def receive_weights(
        self, *, into: Into | None = None, auto_ack: bool = True, wait_s: float | None = None
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Yield every `(name, tensor)` of the next version, then (by default) ack it.

        Raises `VersionAborted` when the sender drops the version mid-way, `WeightSyncTimeout`
        when a wait expires; in both cases nothing of the version may be applied.
        """
        plan = await self.wait_version(wait_s)
        stats = ReceiveStats(version=plan.version)
        start = time.perf_counter()
        destinations = _Destinations(into) if into is not None else None
        pipeline = self._pipeline = _BucketPipeline(self, plan, destinations)
        self._acked = False  # failure paths below ack themselves; the final ok ack is ours or the caller's
        try:
            async for name, tensor in merge_weight_chunks(
                pipeline.chunks(stats), plan.bucket_size, into=destinations, device=self.output_device
            ):
                stats.num_tensors += 1
                yield name, tensor
        except GeneratorExit:
            await self._finish_abandoned()
            raise
        except asyncio.CancelledError:
            pipeline.cancel()
            self._fail_group()
            raise
        except VersionAborted as exc:
            # the sender dropped the version; whether the group survived is its call (next Plan)
            pipeline.cancel()
            await self._send_ack(plan.version, False, str(exc))
            raise
        except (WeightSyncTimeout, PeerError, ProtocolError) as exc:
            pipeline.cancel()
            self._fail_group()
            await self._send_ack(plan.version, False, str(exc))
            raise
        except Exception as exc:
            # local failure (merge found a corrupt stream, the consumer's sink raised): stay in step
            await self._send_ack(plan.version, False, f"{type(exc).__name__}: {exc}")
            await self._finish_abandoned()
            raise
        self._pipeline = None
        stats.seconds = time.perf_counter() - start
        self.last_stats = stats
        self.last_complete_version = plan.version
        self._control.last_version = plan.version
        logger.debug("version %d received: %d tensors, %.3fs", plan.version, stats.num_tensors, stats.seconds)
        if auto_ack:
            await self._send_ack(plan.version, True, None)

    async def ack(self, ok: bool = True, error: str | None = None) -> None:
        """Acknowledge the version just received (with `receive_weights(auto_ack=False)`)."""
        if self.version is None:
            raise WeightSyncError("ack() before any version was received")
        await self._send_ack(self.version, ok, error)

    async def _send_ack(self, version: int, ok: bool, error: str | None) -> None:
        if self._acked:
            return
        self._acked = True
        await self._control.send(Ack(self.identity, version, ok, None if error is None else error[:1000]))


class _Destinations:
    """The consumer's `into`, called once per tensor and shared by merge (first chunk) and the
    producer (which receives a full-bucket chunk straight into its destination)."""

    def __init__(self, into: Into) -> None:
        self.into = into
        self.cache: dict[str, torch.Tensor | None] = {}

    def __call__(self, meta: TensorMeta) -> torch.Tensor | None:
        if meta.name not in self.cache:
            self.cache[meta.name] = self.into(meta)
        return self.cache[meta.name]

    def direct_target(self, meta: TensorMeta, device: torch.device) -> torch.Tensor | None:
        """The bytes of the destination where this chunk belongs, if it can be received in place."""
        try:
            dest = self(meta)
        except Exception:  # merge will call `into` again and report the error where it belongs
            self.cache.pop(meta.name, None)
            return None
        if (
            not isinstance(dest, torch.Tensor)
            or dest.dtype != meta.dtype
            or tuple(dest.shape) != meta.shape
            or dest.device != device
            or not dest.is_contiguous()
        ):
            return None
        return as_bytes(dest)[meta.chunk_offset : meta.chunk_offset + meta.chunk_size]


BucketItem = tuple[BucketMeta, int, "torch.Tensor | None"]  # metadata, slot, in-place target


class _BucketPipeline:
    """Receives bucket k + 1 while the consumer merges bucket k."""

    def __init__(self, receiver: WeightReceiver, plan: Plan, destinations: _Destinations | None) -> None:
        assert receiver._backend is not None and receiver._executor is not None
        self.receiver, self.plan, self.destinations = receiver, plan, destinations
        self.backend, self.executor = receiver._backend, receiver._executor
        self.ready: asyncio.Queue[tuple[BucketMeta, int, torch.Tensor | None, asyncio.Future[None]] | BaseException]
        self.ready = asyncio.Queue()
        self.free = [asyncio.Event(), asyncio.Event()]
        for event in self.free:
            event.set()
        self.task: asyncio.Task[None] = asyncio.ensure_future(self._produce())
        self.finished = False
        self.current: BucketItem | None = None  # bucket being consumed, not yet released
        self.drain_task: asyncio.Future[None] | None = None

    async def _produce(self) -> None:
        """Post each bucket's broadcast as soon as its metadata is here and its slot is free; the
        executor runs them back to back, with no event-loop round trip between two buckets."""
        control, plan, timeout_s = self.receiver._control, self.plan, self.receiver.timeout_s
        try:
            index = 0
            while True:
                slot = index % 2
                await self.free[slot].wait()
                self.free[slot].clear()
                meta = await control.next_bucket(plan.version, index, timeout_s)
                if meta.nbytes > plan.bucket_size:
                    raise ProtocolError(f"bucket {index} declares {meta.nbytes} bytes > bucket_size {plan.bucket_size}")
                target = self._direct_target(meta)
                done = self.executor.submit(self.backend.broadcast, slot, meta.nbytes, index, target)
                self.ready.put_nowait((meta, slot, target, done))
                if meta.is_last:
                    return
                index += 1
        except BaseException as exc:
            self.ready.put_nowait(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise

    def _direct_target(self, meta: BucketMeta) -> torch.Tensor | None:
        """A bucket that is one full-bucket chunk goes straight into its destination, if any."""
        if (
            self.destinations is None
            or not self.backend.direct_ok
            or len(meta.entries) != 1
            or meta.nbytes != self.plan.bucket_size
            or meta.entries[0].chunk_size != meta.nbytes
        ):
            return None
        return self.destinations.direct_target(meta.entries[0].to_meta(), self.backend.device)

    async def _next(self) -> BucketItem:
        """The next bucket, once its broadcast is complete on this rank."""
        item = await self.ready.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        meta, slot, target, done = item
        version, timeout_s = self.plan.version, self.receiver.timeout_s
        try:
            await asyncio.wait_for(asyncio.shield(done), timeout_s)
        except asyncio.TimeoutError:
            self.finished = True
            raise WeightSyncTimeout(
                f"version {version}: broadcast of bucket {meta.bucket_index} from the sender not complete within "
                f"transport.timeout_s={timeout_s}s"
            ) from None
        except RuntimeError as exc:
            self.finished = True
            raise PeerError(f"version {version}: broadcast of bucket {meta.bucket_index} failed: {exc}") from exc
        return meta, slot, target

    def _release(self, meta: BucketMeta, slot: int) -> None:
        self.backend.fence(slot)
        self.backend.release(slot, meta.bucket_index)
        self.free[slot].set()

    async def chunks(self, stats: ReceiveStats) -> AsyncIterator[tuple[TensorMeta, torch.Tensor]]:
        while not self.finished:
            meta, slot, target = self.current = await self._next()
            bucket = self.backend.buckets[slot] if target is None else target
            stats.num_buckets += bool(meta.entries)
            stats.direct_buckets += target is not None
            stats.nbytes += meta.nbytes
            if self.receiver.on_bucket is not None:
                self.receiver.on_bucket(meta)
            for entry in meta.entries:
                start = entry.offset if target is None else 0
                yield entry.to_meta(), bucket[start : start + entry.chunk_size]
            self._release_current()

    def _release_current(self) -> None:
        if self.current is not None:
            (meta, slot, _), self.current = self.current, None
            self._release(meta, slot)
            self.finished = meta.is_last

    async def drain(self) -> None:
        """Take part in the rest of the version without keeping anything."""
        self.destinations = None  # nothing more lands in the consumer's tensors
        self._release_current()  # the bucket the consumer was in the middle of
        with contextlib.suppress(WeightSyncError):
            while not self.finished:
                self.current = await self._next()
                self._release_current()

    def cancel(self) -> None:
        self.finished = True
        self.task.cancel()


__all__ = ["ReceiveStats", "WeightReceiver"]
