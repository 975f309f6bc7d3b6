"""The receiving side of a lane: this receiver's place in one broadcast group, and what it holds.

The sender groups receivers by the boxes they declare (`versions/lanes.py`); a receiver is in exactly one lane
of each sender. Its lane owns what the mirror of the sender's lane needs: the backend (the group and the two
slots) and its executor thread, the layout of the last version received whole (`transport.layout_once`), and
the declaration of the boxes it holds (declared page by page until the sender's plan says it took them, or
refused and why), and it builds the bucket pipeline of a version over them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from ..config import TransportConfig
from ..errors import ProtocolError, WeightSyncError, WeightSyncTimeout
from ..protocol.boxes import Box, box_of
from ..protocol.declare import PAGES_PER_VERSION, Declaration
from ..protocol.layout import Layout, LayoutRecorder
from ..protocol.messages import BucketMeta, Plan, Prepare
from ..protocol.relay import check_relay
from ..transport.backends import BACKENDS, Backend
from ..transport.control import ReceiverControl
from ..transport.executor import SerialExecutor
from .pipeline import BucketPipeline, Destinations, FingerprintNotes
from .steps import ReceiverSteps

logger = logging.getLogger(__name__)
EXECUTOR_NAME = "weightsync"


class OtherAcks(Protocol):
    """The receivers of a sharded version's other senders (`versions/sharded.py OtherSenders`)."""

    async def ack(self, version: int, ok: bool, error: str | None) -> None: ...


class Acks:
    """Step 5, once per version: every sender of it hears the same (the other senders of a sharded version
    first, then this receiver's own)."""

    def __init__(self, steps: ReceiverSteps, others: OtherAcks) -> None:
        self.steps, self._others = steps, others

    async def send(self, version: int, ok: bool, error: str | None) -> None:
        if not self.steps.settle(version, ok):
            return
        await self._others.ack(version, ok, error)  # a sharded version: every sender hears the same
        await self.steps.ack(version, ok, error)  # 5


# builds this receiver's backend: new_backend(backend name, bucket_size=..., session=sender session)
NewBackend = Callable[..., Backend]


class ReceiverLane:
    """This receiver's lane of one sender: its backend and executor, held layout and declared boxes."""

    def __init__(self, control: ReceiverControl, identity: str, new_backend: NewBackend) -> None:
        self._control = control
        self.identity = identity
        self._new_backend = new_backend
        self.backend: Backend | None = None
        self.executor: SerialExecutor | None = None
        self.layout: Layout | None = None  # the bucket layout of the last version received whole (layout once)
        # the boxes this receiver holds (protocol/declare.py): declared to the sender, which then sends those only
        self.declared: Declaration | None = None
        self._boxes_taken: tuple[str, str] | None = None  # (sender session, digest) its plan said it serves
        self._boxes_cursor = 0  # the next page to send (round robin until taken)
        self._boxes_refused: str | None = None  # a digest a sender refused: not declared again as it is
        self.current: BucketPipeline | None = None  # the version in flight on this lane, until it is complete

    @property
    def generation(self) -> int:
        """The group generation this lane holds (-1: none), said in every Ready."""
        return self.backend.generation if self.backend is not None else -1

    def start(self, preallocate: tuple[str, int] | None) -> int:
        """The executor thread, and with `preallocate` (backend, bucket_size) the slots now, where the backend owns
        them: memory a rollout engine measures after start-up (vLLM's KV-cache profiling) already counts them.
        Returns the bytes preallocated."""
        self.executor = SerialExecutor(EXECUTOR_NAME)
        if preallocate is None or self.backend is not None:
            return 0
        backend = self._new_backend(preallocate[0], bucket_size=preallocate[1], session="")
        nbytes = backend.preallocate()
        self.backend = backend
        return nbytes

    # -- the boxes it holds -------------------------------------------------------------------------
    def declare_boxes(self, boxes: dict[str, Box] | None) -> None:
        """`WeightReceiver.declare_boxes`."""
        declared = Declaration.of(boxes) if boxes else None
        if (declared.digest if declared else None) != (self.declared.digest if self.declared else None):
            self.declared, self._boxes_cursor = declared, 0

    def learn_boxes(self, transport: TransportConfig, destinations: Destinations | None) -> None:
        """After a version received whole: the boxes its DTensor destinations hold (transport.slices)."""
        if not transport.slices or destinations is None:
            return
        boxes: dict[str, Box] = {}
        for name, dest in destinations.cache.items():
            box = box_of(dest) if dest is not None else None
            if box is not None and not box.is_whole(tuple(dest.shape)):  # type: ignore[union-attr]
                boxes[name] = box
        learnt = Declaration.of(boxes) if boxes else None
        if learnt is not None and learnt.digest == self._boxes_refused:
            return  # refused as it is: whole tensors (the sender said why, logged once)
        if learnt is not None and (self.declared is None or learnt.digest != self.declared.digest):
            logger.info(
                "declaring the boxes of %d tensors this rollout holds a slice of (transport.slices)", len(boxes)
            )
            self.declared, self._boxes_cursor = learnt, 0

    async def send_boxes(self, prepare: Prepare) -> str:
        """Before Ready: a few pages of the declaration, unless this sender session took it; its digest."""
        declared = self.declared
        if declared is None:
            return ""
        if self._boxes_taken != (prepare.session, declared.digest):
            pages = declared.pages(self.identity)
            for _ in range(min(PAGES_PER_VERSION, len(pages))):
                await self._control.send(pages[self._boxes_cursor % len(pages)])
                self._boxes_cursor = (self._boxes_cursor + 1) % len(pages)
        return declared.digest

    def note_boxes(self, plan: Plan) -> None:
        """What the plan says of the declaration: taken (this session sends the boxes), or refused and why."""
        declared = self.declared
        if declared is None:
            return
        if plan.boxes == declared.digest:
            self._boxes_taken = (plan.session, declared.digest)
        elif plan.boxes_refused:
            logger.error(
                "version %d: the sender at %s refused the boxes this receiver declared (it gets whole tensors): %s",
                plan.version, self._control.address, plan.boxes_refused[:1000],
            )  # fmt: skip
            self._boxes_refused, self.declared, self._boxes_taken = declared.digest, None, None

    # -- the group ----------------------------------------------------------------------------------
    def backend_for(self, plan: Plan) -> Backend:
        """The backend the plan names, (re)built when the sender switched backends."""
        group = plan.group
        if not 1 <= plan.rank <= len(group.members) or group.members[plan.rank - 1].identity != self.identity:
            raise ProtocolError(f"version {plan.version}: the plan gives rank {plan.rank} to another receiver")
        if group.backend not in BACKENDS:
            raise ProtocolError(f"version {plan.version}: the plan names an unknown backend {group.backend[:64]!r}")
        try:
            check_relay(group.relay, group.relay_piece, group.world_size, group.bucket_size)
        except ProtocolError as exc:
            raise ProtocolError(f"version {plan.version}: {exc}") from None
        if self.backend is None or self.backend.name != group.backend:
            if self.backend is not None:
                self.backend.close()
            self.backend = self._new_backend(group.backend, bucket_size=group.bucket_size, session=group.session)
        if group.relay and not self.backend.relays:
            raise ProtocolError(f"version {plan.version}: the plan chains backend {group.backend}, which cannot relay")
        return self.backend

    async def join(self, plan: Plan, timeout_s: float, acks: Acks) -> None:
        """Join the plan's group on the lane's thread, bounded by `timeout_s`; a failure nacks the version."""
        try:
            backend = self.backend_for(plan)
        except WeightSyncError as exc:
            await acks.send(plan.version, False, str(exc))
            raise
        self._control.bucket_size = plan.group.bucket_size
        assert self.executor is not None
        try:
            joined = self.executor.submit(backend.join, plan.group, plan.rank, plan.version)
            await asyncio.wait_for(asyncio.shield(joined), timeout_s)
        except BaseException as exc:
            self.fail()
            await acks.send(plan.version, False, f"could not join the group: {exc}")
            if isinstance(exc, asyncio.TimeoutError):
                raise WeightSyncTimeout(
                    f"version {plan.version}: joining the {plan.group.backend} group timed out "
                    f"(transport.timeout_s={timeout_s}s)"
                ) from None
            raise

    def pipeline(
        self,
        plan: Plan,
        steps: ReceiverSteps,
        timeout_s: float,
        destinations: Destinations | None,
        *,
        on_bucket: Callable[[BucketMeta], None] | None = None,
        sender: int = 0,
        verifier: FingerprintNotes | None = None,
        recorder: LayoutRecorder | None = None,
    ) -> BucketPipeline:
        """The buckets of `plan` (whose group this lane joined) over its group and thread; with a `recorder`,
        buckets may name the layout this lane holds (transport.layout_once)."""
        assert self.backend is not None and self.executor is not None
        return BucketPipeline(
            plan, steps=steps, backend=self.backend, executor=self.executor, timeout_s=timeout_s,
            destinations=destinations, on_bucket=on_bucket, sender=sender, verifier=verifier,
            layout=self.layout if recorder is not None else None, recorder=recorder,
        )  # fmt: skip

    async def finish_abandoned(self, acks: Acks) -> None:
        """A consumer that left `receive_weights` early (break, exception) leaves its version half-received;
        take part in the rest of it so the sender and the others are not stalled, then nack it.

        Both the generator's own finalizer and the next `wait_version` may get here; they share one drain, and
        nothing reads the control socket for a new version before it is done."""
        pipeline = self.current
        if pipeline is None:
            return
        if pipeline.drain_task is None:
            pipeline.drain_task = asyncio.ensure_future(self._drain(pipeline, acks))
        await asyncio.shield(pipeline.drain_task)
        if self.current is pipeline:
            self.current = None

    @staticmethod
    async def _drain(pipeline: BucketPipeline, acks: Acks) -> None:
        if not pipeline.finished:
            logger.warning("version %d was not consumed to the end; draining it", pipeline.plan.version)
            await pipeline.drain()
        await acks.send(pipeline.plan.version, False, "consumer stopped before the version was complete")

    def fail(self) -> None:
        """After a transport failure: forget the group (the next version rebuilds it). A collective may still be
        stuck on the executor thread until the backend's own timeout, so later versions get a new thread."""
        if self.backend is not None:
            self.backend.broken()
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = SerialExecutor(EXECUTOR_NAME)

    def close(self) -> None:
        """Free the buckets and the group first, then stop the executor."""
        if self.backend is not None:
            self.backend.close()
            self.backend = None
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None


__all__ = ["Acks", "ReceiverLane"]
