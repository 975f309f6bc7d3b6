"""WeightReceiver: one version per `receive_weights()` call, bucket by bucket, merged into tensors.

    wait for Prepare (heartbeating) -> Ready -> Plan -> join the group
    `BucketPipeline` (pipeline.py): the version's buckets, one ahead of the consumer
    chunks of each bucket -> merge_weight_chunks(into=...) -> yield (name, tensor)

So bucket k + 1 is on the wire while bucket k is merged. If the consumer stops early or fails,
the receiver keeps taking part in the version's remaining broadcasts (discarding them) so the
sender and the other receivers are not stalled, then reports the failure in its ack.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import replace

import torch

from ..config import ReceiverSettings, UserConfig, VerifyMode, transport_token
from ..errors import (
    DeltaError,
    PeerError,
    ProtocolError,
    VersionAborted,
    WeightSyncError,
    WeightSyncTimeout,
    explain,
)
from ..protocol.boxes import Box, box_of, is_dtensor
from ..protocol.chunks import TensorMeta, merge_weight_chunks
from ..protocol.declare import PAGES_PER_VERSION, Declaration
from ..protocol.layout import Layout, LayoutRecorder
from ..protocol.messages import BucketMeta, LoraSpec, Plan, Prepare
from ..protocol.tiling import TilingMerger
from ..transport.backends import BACKENDS, Backend, backend_class
from ..transport.control import ReceiverControl, default_identity
from ..transport.device import resolve_device
from ..transport.executor import SerialExecutor
from .delta import apply_delta
from .endpoint import Endpoint
from .pipeline import BucketPipeline, Destinations, FingerprintNotes, Into
from .shard_verify import ShardVerifier
from .sharded import OtherSenders, tile
from .stats import ReceiveStats
from .steps import ReceiverSteps
from .verify import Verifier, VerifyReport

logger = logging.getLogger(__name__)


class WeightReceiver(Endpoint):
    """Receives versions from one `WeightSender`.

    Args:
        cfg: the weightsync config (None = the defaults), converted once here into its `ReceiverSettings`
            (`transport.*`, `rollout.identity`, and `rollout.device`: where merged tensors are allocated when no
            `into` destination is given), or those settings themselves.
    """

    _control: ReceiverControl

    def __init__(
        self,
        cfg: UserConfig | ReceiverSettings = None,
        *,
        identity: str | None = None,
        preallocate: bool = False,
    ) -> None:
        self.settings = ReceiverSettings.of(cfg)
        t = self.settings.transport
        self.identity = identity or self.settings.identity or default_identity()
        self.timeout_s = float(t.timeout_s)
        self.device = resolve_device(t.backend, t.device, backend_class(t.backend).natural_device)
        self.output_device = torch.device(self.settings.device)
        self._key = transport_token(t)
        self._control = ReceiverControl(
            t.host, int(t.port), self._key, self.identity, str(self.device), liveness_s=float(t.liveness_s)
        )
        self._steps = ReceiverSteps(self._control, self.identity)
        self._backend: Backend | None = None
        self._executor: SerialExecutor | None = None
        self.last_stats: ReceiveStats | None = None
        self.on_bucket: Callable[[BucketMeta], None] | None = None  # progress hook (daemon)
        self._pipeline: BucketPipeline | None = None
        self._layout: Layout | None = None  # the bucket layout of the last version received whole (layout once)
        self.preallocate = preallocate
        self.preallocated_bytes = 0
        # sharded versions: a receiver of each other sender
        self._others: OtherSenders[WeightReceiver] = OtherSenders(
            self.address, self._other_sender, float(t.ready_timeout_s)
        )
        self.verify = VerifyMode(t.verify)
        self.last_verify: VerifyReport | None = None  # what was checked of the last complete version
        # the boxes this receiver holds (protocol/declare.py): declared to the sender, which then sends those only
        self.declared: Declaration | None = None
        self._boxes_taken: tuple[str, str] | None = None  # (sender session, digest) its plan said it serves
        self._boxes_cursor = 0  # the next page to send (round robin until taken)
        self._boxes_refused: str | None = None  # a digest a sender refused: not declared again as it is

    # -- life cycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        self._executor = SerialExecutor(self._executor_name)
        if self.preallocate and self._backend is None:
            # the slots now, at transport.bucket_size_mb, where the backend owns them: memory a rollout
            # engine measures after start-up (vLLM's KV-cache profiling) already counts them
            t = self.settings.transport
            backend = self._new_backend(
                str(t.backend), bucket_size=self.settings.bucket_size, is_sender=False, session="",
                identity=self.identity,
            )  # fmt: skip
            self.preallocated_bytes = backend.preallocate()
            self._backend = backend
        await self._control.start()

    async def __aenter__(self) -> WeightReceiver:
        await self.start()
        return self

    @property
    def tied(self) -> dict[str, list[str]]:
        """The version in flight's tied names, {name sent: other names of that tensor} (tied
        embeddings are sent once); known once its first bucket's metadata arrived, before any
        destination is asked for."""
        return dict(self._pipeline.tied) if self._pipeline is not None else {}

    @property
    def lora(self) -> LoraSpec | None:
        """The version in flight's LoRA spec (`trainer.lora`: mode, base included, adapter config), known with
        its first bucket like `tied`; None for a version that is not of a PEFT LoRA model."""
        return self._pipeline.lora if self._pipeline is not None else None

    @property
    def dropped_messages(self) -> int:
        return self._control.dropped_messages

    @property
    def dropped_connections(self) -> int:
        """Links to the sender lost after their handshake (trainer gone, link silent, or a frame over the
        size limit: ZMQ_MAXMSGSIZE drops the connection); each logged, rate-limited, with the causes."""
        self._control.sender_link()
        return self._control.dropped_connections

    @property
    def in_flight(self) -> int | None:
        """The version this receiver took part in and has not acked yet (it owes the sender one ack)."""
        return self._steps.in_flight

    @property
    def version(self) -> int | None:
        """The version in flight, or the last one seen."""
        return self._steps.version

    @property
    def last_complete_version(self) -> int | None:
        return self._steps.last_complete

    @property
    def delta_base(self) -> int | None:
        """The version the consumer holds whole and can apply a delta to, said in every Ready; None: it cannot
        (no held version, or a sink that holds no tensors) and gets whole tensors. `receive_weights(base=...)`
        keeps it for the caller; a sink that tracks its own held version sets it."""
        return self._steps.held

    @delta_base.setter
    def delta_base(self, version: int | None) -> None:
        self._steps.held = version

    @property
    def address(self) -> str:
        """The sender's control address this receiver talks to."""
        return self._control.address

    async def register(self) -> None:
        """Announce this receiver to the sender now; `wait_version` does it every heartbeat while it
        waits, an engine worker between versions too (`rollout_engines/worker.py WorkerReceiver`)."""
        if self._executor is None:
            raise WeightSyncError("WeightReceiver.register() before start()")
        await self._steps.register()

    def sender_link(self) -> tuple[bool, float]:
        """(a trainer connected, seconds since that last changed): `ReceiverControl.sender_link`."""
        return self._control.sender_link()

    @property
    def handshake_refused(self) -> str | None:
        """Why the trainer refuses this receiver's handshake (the token), or None: `sender_link` reads it."""
        return self._control.handshake_refused

    def declare_boxes(self, boxes: dict[str, Box] | None) -> None:
        """Declare the box of each tensor this receiver holds ({name: Box}; a name not in it: whole); None or
        {}: whole tensors. Sent to the sender with the next version's Ready; from the version its plan says it
        took them (`Plan.boxes`), each tensor named arrives as that box alone. A receiver whose `into` returns
        DTensors declares their boxes itself after its first version (transport.slices)."""
        declared = Declaration.of(boxes) if boxes else None
        if (declared.digest if declared else None) != (self.declared.digest if self.declared else None):
            self.declared, self._boxes_cursor = declared, 0

    def _learn_boxes(self, destinations: Destinations | None) -> None:
        """After a version received whole: the boxes its DTensor destinations hold (transport.slices)."""
        if not self.settings.transport.slices or destinations is None:
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

    async def _send_boxes(self, prepare: Prepare) -> str:
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

    def _note_boxes(self, plan: Plan) -> None:
        """What the plan says of the declaration: taken (this session sends the boxes), or refused and why."""
        declared = self.declared
        if declared is None:
            return
        if plan.boxes == declared.digest:
            self._boxes_taken = (plan.session, declared.digest)
        elif plan.boxes_refused:
            logger.error(
                "version %d: the sender at %s refused the boxes this receiver declared (it gets whole tensors): %s",
                plan.version, self.address, plan.boxes_refused[:1000],
            )  # fmt: skip
            self._boxes_refused, self.declared, self._boxes_taken = declared.digest, None, None

    def _other_sender(self, host: str, port: int) -> WeightReceiver:
        """This receiver, for another sender of a sharded version (same identity, same token)."""
        own = self.settings
        at = replace(own, transport=replace(own.transport, host=host, port=port))
        return WeightReceiver(at, identity=self.identity)

    def give_up_group(self) -> None:
        """Another part of the version failed: leave the group now, so its sender's broadcast ends at once."""
        self._fail_group()

    def pipeline(
        self,
        plan: Plan,
        destinations: Destinations | None,
        *,
        on_bucket: Callable[[BucketMeta], None] | None = None,
        sender: int = 0,
        verifier: FingerprintNotes | None = None,
        recorder: LayoutRecorder | None = None,
    ) -> BucketPipeline:
        """The buckets of `plan` (joined by `wait_version`) over this receiver's group, steps and thread; with a
        `recorder`, buckets may name the layout this receiver holds (transport.layout_once)."""
        assert self._backend is not None and self._executor is not None  # wait_version joined the group
        return BucketPipeline(
            plan, steps=self._steps, backend=self._backend, executor=self._executor, timeout_s=self.timeout_s,
            destinations=destinations, on_bucket=on_bucket, sender=sender, verifier=verifier,
            layout=self._layout if recorder is not None else None, recorder=recorder,
        )  # fmt: skip

    # -- one version ------------------------------------------------------------------------------
    async def wait_version(self, wait_s: float | None = None) -> Plan:
        """Block until the sender starts a version, join its group, and return the plan."""
        if self._executor is None:
            raise WeightSyncError("WeightReceiver.receive_weights() / wait_version() before start()")
        await self._finish_abandoned()
        t = self.settings.transport
        while True:
            prepare = await self._steps.next_prepare(float(t.heartbeat_interval_s), wait_s)  # 1
            generation = self._backend.generation if self._backend is not None else -1
            boxes = await self._send_boxes(prepare)
            layout = self._layout.digest if self._layout is not None else ""
            await self._steps.ready(prepare, generation, layout, boxes)  # 2
            try:
                plan = await self._steps.wait_plan(prepare, self.timeout_s, float(t.heartbeat_interval_s))  # 3
            except VersionAborted as exc:
                logger.info("%s", exc)
                continue
            break
        self._note_boxes(plan)
        self._steps.begin(plan)  # this version gets exactly one ack from here on; the failures below send theirs
        try:
            backend = self._backend_for(plan)
        except WeightSyncError as exc:
            await self._send_ack(plan.version, False, str(exc))
            raise
        self._control.bucket_size = plan.group.bucket_size
        try:
            joined = self._executor.submit(backend.join, plan.group, plan.rank, plan.version)
            await asyncio.wait_for(asyncio.shield(joined), self.timeout_s)
        except BaseException as exc:
            self._fail_group()
            await self._send_ack(plan.version, False, f"could not join the group: {exc}")
            if isinstance(exc, asyncio.TimeoutError):
                raise WeightSyncTimeout(
                    f"version {plan.version}: joining the {plan.group.backend} group timed out "
                    f"(transport.timeout_s={self.timeout_s}s)"
                ) from None
            raise
        return plan

    def _backend_for(self, plan: Plan) -> Backend:
        """The backend the plan names, (re)built when the sender switched backends."""
        group = plan.group
        if plan.rank < 1 or group.members[plan.rank - 1].identity != self.identity:
            raise ProtocolError(f"version {plan.version}: the plan gives rank {plan.rank} to another receiver")
        if group.backend not in BACKENDS:
            raise ProtocolError(f"version {plan.version}: the plan names an unknown backend {group.backend[:64]!r}")
        if self._backend is None or self._backend.name != group.backend:
            if self._backend is not None:
                self._backend.close()
            self._backend = self._new_backend(
                group.backend,
                bucket_size=group.bucket_size,
                is_sender=False,
                session=group.session,
                identity=self.identity,
            )
        return self._backend

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

    async def _drain(self, pipeline: BucketPipeline) -> None:
        if not pipeline.finished:
            logger.warning("version %d was not consumed to the end; draining it", pipeline.plan.version)
            await pipeline.drain()
        await self._send_ack(pipeline.plan.version, False, "consumer stopped before the version was complete")

    async def receive_weights(
        self,
        *,
        into: Into | None = None,
        auto_ack: bool = True,
        wait_s: float | None = None,
        base: Into | None = None,
    ) -> AsyncGenerator[tuple[str, torch.Tensor]]:
        """Yield every `(name, tensor)` of the next version, then (by default) ack it.

        `base(meta)`: the tensor of version `self.delta_base` the consumer holds under that name, onto which
        a delta (`transport.delta`) is applied; the result lands in `into(meta)` (which may be that same
        tensor, updated in place) or a new tensor. Without it, or with `delta_base` None, a delta fails.
        Passing `base` declares that the consumer keeps what it receives (`base` answers with this version's
        tensors next time): once the version is acked ok, `delta_base` becomes its number, so the next one
        may be a delta with no bookkeeping by the caller; a version that fails or is nacked clears it (its
        tensors may be torn), and the next version comes whole.

        Raises `VersionAborted` when the sender drops the version mid-way, `WeightSyncTimeout`
        when a wait expires; in both cases nothing of the version may be applied.
        """
        plan = await self.wait_version(wait_s)
        self._steps.keeps = base is not None
        if plan.senders:
            parts = self._receive_sharded(plan, into, auto_ack, base)
        else:
            parts = self._receive_whole(plan, into, auto_ack, base)
        try:
            async for item in parts:
                yield item
        except BaseException:
            self._steps.torn()
            await parts.aclose()  # the part's own GeneratorExit handling (drain, ack) runs when the consumer stops
            raise

    async def _receive_whole(
        self, plan: Plan, into: Into | None, auto_ack: bool, base: Into | None
    ) -> AsyncGenerator[tuple[str, torch.Tensor]]:
        """A version from one sender (the usual case): its buckets merged into whole tensors."""
        stats = ReceiveStats(version=plan.version)
        start = time.perf_counter()
        destinations = Destinations(into) if into is not None else None
        verifier = Verifier(self.verify, plan.version)

        def merge_into(meta: TensorMeta) -> torch.Tensor | None:
            """A delta payload merges into a buffer of its own; a tensor goes where the consumer says."""
            if meta.name in pipeline.delta_metas:
                return None
            return destinations(meta) if destinations is not None else None

        recorder = LayoutRecorder() if self.settings.transport.layout_once else None
        pipeline = self._pipeline = self.pipeline(
            plan, destinations, on_bucket=self.on_bucket, verifier=verifier, recorder=recorder
        )
        try:  # failure paths below ack themselves; the final ok ack is ours or the caller's
            async for name, tensor in merge_weight_chunks(
                pipeline.chunks(stats), plan.group.bucket_size, into=merge_into, device=self.output_device
            ):
                if name in pipeline.delta_metas:
                    tensor = self._apply_delta(name, tensor, pipeline.delta_metas.pop(name), destinations, base)
                    stats.delta_tensors += 1
                stats.num_tensors += 1
                verifier.check(name, tensor)  # before the consumer sees it: a mismatch fails the version
                yield name, tensor
        except GeneratorExit:
            await self._finish_abandoned()
            raise
        except asyncio.CancelledError:
            pipeline.cancel()
            self._fail_group()
            raise
        except VersionAborted as exc:
            # the sender dropped the version; whether the group survived is its call (next Plan), unless a
            # broadcast was left posted here: it holds the executor and the group is out of step
            pipeline.cancel()
            if pipeline.abandoned:
                self._fail_group()
            await self._send_ack(plan.version, False, str(exc))
            raise
        except (WeightSyncTimeout, PeerError, ProtocolError) as exc:
            pipeline.cancel()
            self._fail_group()
            await self._send_ack(plan.version, False, str(exc))
            raise
        except Exception as exc:
            # local failure (merge found a corrupt stream, the consumer's sink raised): stay in step
            await self._send_ack(plan.version, False, explain(exc))
            await self._finish_abandoned()
            raise
        if recorder is not None:  # every bucket arrived: the layout the next version may name
            self._layout = recorder.finish() or self._layout
        stats.layout_buckets = pipeline.layout_buckets
        self._learn_boxes(destinations)
        await self._complete(plan.version, stats, verifier.report, start, auto_ack)

    async def _receive_sharded(
        self, plan: Plan, into: Into | None, auto_ack: bool, base: Into | None
    ) -> AsyncGenerator[tuple[str, torch.Tensor]]:
        """A version several senders send parts of (`versions/sharded.py`): their streams at once, tiled."""
        stats = ReceiveStats(version=plan.version)
        start = time.perf_counter()
        destinations = Destinations(into) if into is not None else None
        pipelines: list[BucketPipeline] = []
        try:
            parts = [(self, plan), *await self._others.join(plan, self.delta_base, self.declared)]
            addresses = [part.address for part, _ in parts]
            verifier = ShardVerifier(self.verify, plan.version, addresses)
            for index, (part, part_plan) in enumerate(parts):
                on_bucket = self.on_bucket if index == 0 else None
                pipelines.append(
                    part.pipeline(
                        part_plan, destinations, on_bucket=on_bucket, sender=index, verifier=verifier.part(index)
                    )
                )
            self._pipeline = pipelines[0]
            merger = TilingMerger(plan.group.bucket_size, destinations, self.output_device, addresses)
            held = functools.partial(self._held, base=base)
            async for name, tensor in tile(pipelines, merger, stats, held):
                stats.num_tensors += 1
                verifier.check(name, tensor)  # each sender's bytes, before the consumer sees them
                yield name, tensor
        except BaseException as exc:
            # any part failed (or the consumer stopped): the whole version fails here, on every sender alike
            for pipeline in pipelines:
                pipeline.cancel()
            self._pipeline = None
            self._fail_group()
            self._others.fail()
            reason = (
                "consumer stopped before the version was complete" if isinstance(exc, GeneratorExit) else explain(exc)
            )
            if not isinstance(exc, asyncio.CancelledError):
                await self._send_ack(plan.version, False, reason)
            raise
        self._learn_boxes(destinations)
        await self._complete(plan.version, stats, verifier.report, start, auto_ack)

    async def _complete(
        self, version: int, stats: ReceiveStats, report: VerifyReport, start: float, auto_ack: bool
    ) -> None:
        """Every tensor of `version` arrived and was checked: record it, and ack unless the caller will."""
        self._pipeline = None
        stats.seconds = time.perf_counter() - start
        stats.verified = report.verified
        self.last_stats, self.last_verify = stats, report
        self._steps.complete(version)
        logger.debug("version %d received: %d tensors, %.3fs", version, stats.num_tensors, stats.seconds)
        if auto_ack:
            await self._send_ack(version, True, None)

    def _apply_delta(
        self,
        name: str,
        payload: torch.Tensor,
        delta: tuple[TensorMeta, int],
        destinations: Destinations | None,
        base: Into | None,
    ) -> torch.Tensor:
        """The tensor a delta payload rebuilds, from the held version (`base`); the held version stays as it
        was unless the consumer's destination is that tensor itself (streaming in place)."""
        meta, based_on = delta
        held = self._held(meta, based_on, base)
        target = destinations(meta) if destinations is not None else None
        if is_dtensor(held) or is_dtensor(target):  # it holds a box: a delta rebuilds the whole tensor
            raise DeltaError(
                f"{name!r} arrived as a delta, which does not apply into a DTensor's box; transport.slices=true "
                "(boxes come whole) or transport.delta=off for a tensor-parallel rollout"
            )
        return apply_delta(payload, meta, held, target, self.output_device)

    def _held(self, meta: TensorMeta, based_on: int, base: Into | None) -> torch.Tensor:
        """The consumer's tensor of version `based_on`, which a delta of `meta`'s tensor applies to."""
        held = base(meta) if base is not None and self.delta_base == based_on else None
        if held is None:
            raise DeltaError(
                f"{meta.name!r} arrived as a delta of version {based_on}, but this receiver holds "
                f"{'no version it can apply one to' if self.delta_base is None else f'version {self.delta_base}'}"
            )
        return held

    async def ack(self, ok: bool = True, error: str | None = None) -> None:
        """Acknowledge the version just received (with `receive_weights(auto_ack=False)`)."""
        if self.version is None:
            raise WeightSyncError("ack() before any version was received")
        await self._send_ack(self.version, ok, error)

    async def _send_ack(self, version: int, ok: bool, error: str | None) -> None:
        if not self._steps.settle(version, ok):
            return
        await self._others.ack(version, ok, error)  # a sharded version: every sender hears the same
        await self._steps.ack(version, ok, error)  # 5

    async def close(self) -> None:
        await self._others.close()
        await super().close()


__all__ = ["ReceiveStats", "WeightReceiver"]
