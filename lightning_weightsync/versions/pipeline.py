"""The receiver's bucket pipeline: bucket k + 1 is on the wire while the consumer merges bucket k.

    producer: for bucket k: read its metadata; unless it lands straight in the consumer's
              destination, wait for the next slot of the ring to be free; post its broadcast
              (executor thread) -> hand (metadata, slot) to the consumer
    consumer: the chunks of the bucket, read through `backend.view(slot, nbytes)` (or the
              destination itself); the slot is released as soon as its last chunk was copied out

Everything it works with is handed in (the session's steps, backend, executor, timeout), so it runs
the same for any receiver and its failure paths can be read here alone. Bucket metadata arrives
already validated by the control plane (`decode` with the plan's bucket_size, which the receiver
hands it): offsets and sizes are in range.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Protocol

import torch

from ..errors import PeerError, ProtocolError, WeightSyncError, WeightSyncTimeout
from ..protocol.boxes import box_of, is_dtensor, local_of
from ..protocol.chunks import TensorMeta, as_bytes
from ..protocol.layout import Layout, LayoutRecorder, no_layout
from ..protocol.messages import BucketMeta, LoraSpec, Plan
from ..transport.backends import NO_SLOT, NUM_SLOTS, Backend
from ..transport.executor import SerialExecutor, forget
from .stats import ReceiveStats
from .steps import ReceiverSteps

LISTEN_AFTER_S = 0.1  # a wait for a slot that lasts longer reads the control socket meanwhile (`_listening`)
LISTEN_POLL_S = 0.01  # ... in polls this long: the slot is noticed at most this late
RECEIVE_AHEAD = 8  # buckets whose broadcast may be posted before the consumer reached them (no memory: only
# direct buckets run ahead of the slots, into the consumer's own destinations)

Into = Callable[[TensorMeta], "torch.Tensor | None"]
HeldMetas = tuple[TensorMeta, ...] | None  # a bucket's entries as the held layout already converted them
BucketItem = tuple[BucketMeta, int, "torch.Tensor | None", HeldMetas]  # metadata, slot, in-place target, metas


class FingerprintNotes(Protocol):
    """What a pipeline tells of each bucket's fingerprints before its chunks are merged (`verify.Verifier`,
    or one sender's part of a `shard_verify.ShardVerifier`)."""

    def expect(self, meta: BucketMeta) -> None: ...


class Destinations:
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
        if meta.box is not None and dest is not None and is_dtensor(dest) and box_of(dest) == meta.box:
            if tuple(dest.shape) != meta.shape:  # the same box of another tensor: the merge refuses it by name
                return None
            dest = local_of(dest)  # a chunk of this rank's box: bytes of its local tensor, in order
            if dest.dtype != meta.dtype or dest.device != device or not dest.is_contiguous():
                return None
            return as_bytes(dest)[meta.chunk_offset : meta.chunk_offset + meta.chunk_size]
        if (
            not isinstance(dest, torch.Tensor)
            or meta.box is not None
            or is_dtensor(dest)  # it keeps only its box: the merge places the chunk (protocol/boxes.py)
            or dest.dtype != meta.dtype
            or tuple(dest.shape) != meta.shape
            or dest.device != device
            or not dest.is_contiguous()
        ):
            return None
        return as_bytes(dest)[meta.chunk_offset : meta.chunk_offset + meta.chunk_size]


class BucketPipeline:
    """One version's buckets, received one ahead of the consumer. Created once the group is joined."""

    def __init__(
        self,
        plan: Plan,
        *,
        steps: ReceiverSteps,
        backend: Backend,
        executor: SerialExecutor,
        timeout_s: float,
        destinations: Destinations | None = None,
        on_bucket: Callable[[BucketMeta], None] | None = None,
        sender: int = 0,
        verifier: FingerprintNotes | None = None,
        layout: Layout | None = None,
        recorder: LayoutRecorder | None = None,
    ) -> None:
        self.plan, self.destinations, self.on_bucket = plan, destinations, on_bucket
        # layout once: a bucket that names the held layout takes its entries from it; the recorder keeps this
        # version's layout for the next one (protocol/layout.py)
        self.expand = layout.expand if layout is not None else no_layout
        self.layout, self.recorder = layout, recorder
        self.layout_buckets = 0  # buckets whose entries came from the held layout
        self.sender = sender  # which sender of a sharded version this stream comes from (its buckets say so)
        self.verifier = verifier  # notes each bucket's fingerprints before its chunks are merged
        # tensors arriving as a delta payload: name -> (the tensor's own meta, the version the delta is based on)
        self.delta_metas: dict[str, tuple[TensorMeta, int]] = {}
        self.delta_ranges: dict[str, tuple[int, int]] = {}  # sharded: (byte start, bytes) a shard's payload rebuilds
        self.steps, self.backend, self.executor, self.timeout_s = steps, backend, executor, timeout_s
        self.ready: asyncio.Queue[
            tuple[BucketMeta, int, torch.Tensor | None, asyncio.Future[None], HeldMetas] | BaseException
        ]
        self.ready = asyncio.Queue()
        self.free = [asyncio.Event() for _ in range(NUM_SLOTS)]
        for event in self.free:
            event.set()
        self.ahead = asyncio.Semaphore(RECEIVE_AHEAD)  # buckets posted that the consumer has not released
        self.task: asyncio.Task[None] = asyncio.ensure_future(self._produce())
        self.finished = False
        self.consumed = asyncio.Event()  # the last bucket released: the producer stops reading ahead
        self.current: BucketItem | None = None  # bucket being consumed, not yet released
        self.drain_task: asyncio.Future[None] | None = None
        # the producer's failure (the sender aborted the version, a bad bucket): it ends a wait for a broadcast
        # the sender will never finish, which would hold this rank until transport.timeout_s, past the next
        # version's Ready; a broadcast so left behind (`abandoned`) means the group cannot be kept
        self.producer_failed = asyncio.Event()
        self.producer_error: BaseException | None = None
        self.abandoned = False
        # {name sent: other names of that tensor}: the version's first bucket says (tied embeddings),
        # known before any destination is asked for
        self.tied: dict[str, list[str]] = {}
        self.lora: LoraSpec | None = None  # the version is of a PEFT LoRA model (bucket 0 says)

    async def _produce(self) -> None:
        """Post each bucket's broadcast as soon as its metadata is here and it has somewhere to land;
        the executor runs them back to back, with no event-loop round trip between two buckets.

        A bucket received straight into the consumer's destination needs no slot, so a run of large
        tensors is posted as fast as their metadata arrives (up to `RECEIVE_AHEAD` buckets the consumer
        has not reached); the others take turns in the slots, as on the sender."""
        try:
            index, ring = 0, 0
            while True:
                await (self._listening(self.ahead.acquire()) if self.ahead.locked() else self.ahead.acquire())
                meta = await self.steps.next_bucket(self.plan.version, index, self.timeout_s)  # 4
                named = bool(meta.layout)
                meta = self.expand(meta)  # a name this receiver does not hold has raised here
                metas = self.layout.buckets[index].metas if named and self.layout is not None else None
                self.layout_buckets += named
                if self.recorder is not None:
                    self.recorder.add(meta.nbytes, meta.is_last, meta.entries, self.layout)
                if meta.sender != self.sender:
                    raise ProtocolError(
                        f"version {meta.version}: bucket {index} says it is from sender {meta.sender}, but came from "
                        f"sender {self.sender} ({self.steps.control.address})"
                    )
                if index == 0:
                    self.tied = {name: list(aliases) for name, aliases in meta.tied.items()}
                    self.lora = meta.lora
                target = self._direct_target(meta)
                slot = NO_SLOT
                if target is None:
                    slot, ring = ring % NUM_SLOTS, ring + 1
                    if not self.free[slot].is_set():
                        await self._listening(self.free[slot].wait())
                    self.free[slot].clear()
                done = self._post(slot, meta.nbytes, index, target)
                self.ready.put_nowait((meta, slot, target, done, metas))
                if meta.is_last:
                    await self._listen_to_the_end()
                    return
                index += 1
        except BaseException as exc:
            self.ready.put_nowait(exc)
            self.producer_error = exc
            self.producer_failed.set()
            if isinstance(exc, asyncio.CancelledError):
                raise

    async def _listening(self, turn: Awaitable[object]) -> None:
        """Wait for `turn` (a slot the consumer frees); one that lasts (the consumer waits for a broadcast, maybe one
        the sender gave up) reads the control socket meanwhile, so the sender's abort ends the version now."""
        waiting = asyncio.ensure_future(turn)
        try:
            await asyncio.wait((waiting,), timeout=LISTEN_AFTER_S)
            while not waiting.done():
                await self.steps.look_ahead(self.plan.version, LISTEN_POLL_S)
        finally:
            if not waiting.done():
                waiting.cancel()

    async def _listen_to_the_end(self) -> None:
        """Every bucket is posted; while the consumer still waits for broadcasts, read on (an `Abort` of a chain
        cut ahead of this receiver comes now, and nothing else would read it). `chunks` waits for this to end."""
        consumed = asyncio.ensure_future(self.consumed.wait())
        try:
            await asyncio.wait((consumed,), timeout=LISTEN_AFTER_S)
        finally:
            consumed.cancel()
        while not self.finished:
            await self.steps.look_ahead(self.plan.version, LISTEN_POLL_S)

    def _post(self, slot: int, nbytes: int, index: int, target: torch.Tensor | None) -> asyncio.Future[None]:
        """A bucket's broadcast on this rank, posted to the data-plane thread in order; where the backend
        receives in place (the bytes are already in the mapped slot), complete at once on the loop."""
        if self.backend.receive_in_place:
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        return self.executor.submit_started(self.backend.start_broadcast, slot, nbytes, index, target)

    def _direct_target(self, meta: BucketMeta) -> torch.Tensor | None:
        """A bucket that is one chunk and nothing else (a chunk of a large tensor, or one filling the
        bucket) goes straight into its destination, if the consumer gave one: the bucket metadata says
        so, whatever the sender's `direct_min_mb`, so the wire stays self-describing."""
        if (
            self.destinations is None
            or (meta.deltas and meta.deltas[0] >= 0)  # a delta payload is not the destination's bytes
            or not self.backend.direct_ok
            or len(meta.entries) != 1
            or meta.nbytes == 0
            or meta.entries[0].offset != 0
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
        meta, slot, target, done, metas = item
        version, timeout_s = self.plan.version, self.timeout_s
        try:
            await self._complete(done)
        except asyncio.TimeoutError:
            self.finished = True
            raise WeightSyncTimeout(
                f"version {version}: broadcast of bucket {meta.bucket_index} from the sender not complete within "
                f"transport.timeout_s={timeout_s}s"
            ) from None
        except WeightSyncError:  # the backend already said what failed (a dead member, a timeout)
            self.finished = True
            raise
        except RuntimeError as exc:
            self.finished = True
            raise PeerError(f"version {version}: broadcast of bucket {meta.bucket_index} failed: {exc}") from exc
        return meta, slot, target, metas

    async def _complete(self, done: asyncio.Future[None]) -> None:
        """Wait for a bucket's broadcast on this rank, or for the version to end first (the producer failed:
        the sender aborted it, so this broadcast may never finish); `asyncio.TimeoutError` after `timeout_s`."""
        if done.done():  # complete already (received in place, or while the consumer merged the one before)
            # one turn of the loop all the same: the producer posts the next broadcast before this bucket is merged
            # (without it, a run of complete buckets kept gloo's next broadcast waiting: 1 MiB buckets ~1.5x slower)
            await asyncio.sleep(0)
            return done.result()
        failed = asyncio.ensure_future(self.producer_failed.wait())
        try:
            await asyncio.wait((done, failed), timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
        if done.done():
            return done.result()
        if self.producer_error is None:
            raise asyncio.TimeoutError
        self.abandoned = True
        forget(done)
        raise self.producer_error

    def _release(self, meta: BucketMeta, slot: int) -> None:
        if slot != NO_SLOT:
            self.backend.fence(slot)
        self.backend.release(slot, meta.bucket_index)  # shared-slot backends: the sender may reuse its slot
        if slot != NO_SLOT:
            self.free[slot].set()
        self.ahead.release()

    async def chunks(self, stats: ReceiveStats) -> AsyncGenerator[tuple[TensorMeta, torch.Tensor]]:
        while not self.finished:
            meta, slot, target, metas = self.current = await self._next()
            bucket = self.backend.view(slot, meta.nbytes) if target is None else target
            stats.num_buckets += bool(meta.entries)
            stats.direct_buckets += target is not None
            stats.nbytes += meta.nbytes
            stats.relayed_bytes += self.backend.relayed.take()  # forwarded along a chain (transport.fanout=chain)
            if self.on_bucket is not None:
                self.on_bucket(meta)
            if self.verifier is not None:
                self.verifier.expect(meta)
            for i, entry in enumerate(meta.entries):
                start = entry.offset if target is None else 0
                data = bucket[start : start + entry.chunk_size]
                if meta.deltas and meta.deltas[i] >= 0:  # a chunk of the payload that rebuilds this tensor
                    self.delta_metas[entry.name] = (entry.to_meta(), meta.delta_base)
                    if meta.delta_ranges:
                        self.delta_ranges[entry.name] = meta.delta_ranges[i]
                    payload = (meta.deltas[i],)
                    yield TensorMeta(entry.name, payload, torch.uint8, entry.chunk_offset, entry.chunk_size), data
                else:
                    yield (metas[i] if metas is not None else entry.to_meta()), data
            self._release_current()
        await asyncio.wait((self.task,))  # its last look ahead (at most LISTEN_POLL_S): one reader at a time

    def _release_current(self) -> None:
        if self.current is not None:
            (meta, slot, *_), self.current = self.current, None
            self._release(meta, slot)
            self.finished = meta.is_last
            if self.finished:
                self.consumed.set()

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
        while not self.ready.empty():  # broadcasts posted but never awaited
            item = self.ready.get_nowait()
            if not isinstance(item, BaseException):
                self.abandoned |= not item[3].done()
                forget(item[3])
