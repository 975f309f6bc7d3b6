"""Step 4 on the receiving side: one version's buckets become tensors, as the sender's lanes sent them.

    one sender      its lane's `BucketPipeline` (the buckets, one ahead of the consumer) -> merge_weight_chunks
                    into the consumer's destinations -> a delta payload applied onto the held version -> the
                    tensor's fingerprint checked -> yielded
    several senders (a sharded version, `versions/sharded.py`): every sender's pipeline at once, tiled

A failure is answered here as the protocol wants it: a transport or peer failure leaves the group (the next
plan rebuilds it), a local one (a corrupt stream, the consumer's sink raised) stays in step by draining the
rest; either way the version is nacked once. The ok ack, and recording the version, are the receiver's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..config import TransportConfig, VerifyMode
from ..errors import PeerError, ProtocolError, VersionAborted, WeightSyncError, WeightSyncTimeout, explain
from ..protocol.chunks import TensorMeta, merge_weight_chunks
from ..protocol.declare import Declaration
from ..protocol.layout import LayoutRecorder
from ..protocol.messages import BucketMeta, Plan
from ..protocol.tiling import TilingMerger
from . import features
from .delta import HeldVersion
from .pipeline import BucketPipeline, Destinations, FingerprintNotes
from .receiver_lane import Acks, ReceiverLane
from .shard_verify import ShardVerifier
from .sharded import tile
from .stats import ReceiveStats
from .verify import Verifier, VerifyReport

logger = logging.getLogger(__name__)


class Part(Protocol):
    """One sender's part of a sharded version, as the receiver of that sender (`WeightReceiver`) serves it."""

    @property
    def address(self) -> str: ...

    def pipeline(
        self,
        plan: Plan,
        destinations: Destinations | None,
        *,
        on_bucket: Callable[[BucketMeta], None] | None = None,
        sender: int = 0,
        verifier: FingerprintNotes | None = None,
        recorder: LayoutRecorder | None = None,
    ) -> BucketPipeline: ...


class Others(Protocol):
    """The receivers of a sharded version's other senders (`versions/sharded.py OtherSenders`)."""

    async def join(
        self, plan: Plan, held: int | None, declared: Declaration | None = None
    ) -> Sequence[tuple[Part, Plan]]: ...

    def fail(self) -> None: ...


@dataclass
class Arrivals:
    """One version on this receiver's lane, from its plan to its last tensor: `whole()` or `sharded()`."""

    plan: Plan
    lane: ReceiverLane
    acks: Acks
    transport: TransportConfig
    device: torch.device  # where merged tensors are allocated when no destination is given
    verify: VerifyMode
    held: HeldVersion
    on_bucket: Callable[[BucketMeta], None] | None
    destinations: Destinations | None
    stats: ReceiveStats = field(init=False)
    report: VerifyReport | None = field(default=None, init=False)  # what was checked, once every tensor arrived
    start: float = field(init=False)

    def __post_init__(self) -> None:
        self.stats = ReceiveStats(version=self.plan.version)
        self.start = time.perf_counter()

    async def whole(self, own: Part) -> AsyncGenerator[tuple[str, torch.Tensor]]:
        """A version from one sender (the usual case): its buckets merged into whole tensors."""
        plan, stats, destinations = self.plan, self.stats, self.destinations
        verifier = Verifier(self.verify, plan.version)

        def merge_into(meta: TensorMeta) -> torch.Tensor | None:
            """A delta payload merges into a buffer of its own; a tensor goes where the consumer says."""
            if meta.name in pipeline.delta_metas:
                return None
            return destinations(meta) if destinations is not None else None

        arriving = features.arriving(plan.version)  # every registered feature's receiving side (features.py)
        recorder = LayoutRecorder() if self.transport.layout_once else None
        pipeline = own.pipeline(plan, destinations, on_bucket=self.on_bucket, verifier=verifier, recorder=recorder)
        self.lane.current = pipeline
        try:  # failure paths below ack themselves; the final ok ack is the receiver's or the caller's
            async for name, tensor in merge_weight_chunks(
                pipeline.chunks(stats), plan.group.bucket_size, into=merge_into, device=self.device
            ):
                for undo in arriving:  # as it arrived: what the sending side's features put out, undone in place
                    undo(name, tensor)
                if name in pipeline.delta_metas:
                    tensor = self.held.apply(tensor, pipeline.delta_metas.pop(name), destinations, self.device)
                    stats.delta_tensors += 1
                stats.num_tensors += 1
                verifier.check(name, tensor)  # before the consumer sees it: a mismatch fails the version
                yield name, tensor
        except GeneratorExit:
            await self.lane.finish_abandoned(self.acks)
            raise
        except asyncio.CancelledError:
            pipeline.cancel()
            self.lane.fail()
            raise
        except VersionAborted as exc:
            # the sender dropped the version; whether the group survived is its call (next Plan), unless a
            # broadcast was left posted here: it holds the executor and the group is out of step
            pipeline.cancel()
            if pipeline.abandoned:
                self.lane.fail()
            await self.acks.send(plan.version, False, str(exc))
            raise
        except (WeightSyncTimeout, PeerError, ProtocolError) as exc:
            pipeline.cancel()
            self.lane.fail()
            await self.acks.send(plan.version, False, str(exc))
            raise
        except Exception as exc:
            # local failure (merge found a corrupt stream, the consumer's sink raised): stay in step
            await self.acks.send(plan.version, False, explain(exc))
            await self.lane.finish_abandoned(self.acks)
            raise
        if recorder is not None:  # every bucket arrived: the layout the next version may name
            self.lane.layout = recorder.finish() or self.lane.layout
        stats.layout_buckets = pipeline.layout_buckets
        self.lane.learn_boxes(self.transport, destinations)
        self.report = verifier.report

    async def sharded(
        self, own: Part, others: Others, declared: Declaration | None
    ) -> AsyncGenerator[tuple[str, torch.Tensor]]:
        """A version several senders send parts of (`versions/sharded.py`): this receiver's own and the other
        senders' (joined now, told the version held and the boxes `declared`), their streams at once, tiled."""
        plan, destinations = self.plan, self.destinations
        pipelines: list[BucketPipeline] = []
        try:
            if features.arriving(plan.version):
                names = ", ".join(features.FEATURES)
                raise WeightSyncError(
                    f"version {plan.version}: the registered features ({names}) do not reach a sharded version's "
                    "tensors yet; unregister them, or trainer.send_mode=gather"
                )
            parts = [(own, plan), *await others.join(plan, self.held.version(), declared)]
            addresses = [part.address for part, _ in parts]
            verifier = ShardVerifier(self.verify, plan.version, addresses)
            for index, (part, part_plan) in enumerate(parts):
                on_bucket = self.on_bucket if index == 0 else None
                pipelines.append(
                    part.pipeline(
                        part_plan, destinations, on_bucket=on_bucket, sender=index, verifier=verifier.part(index)
                    )
                )
            self.lane.current = pipelines[0]
            merger = TilingMerger(plan.group.bucket_size, destinations, self.device, addresses)
            async for name, tensor in tile(pipelines, merger, self.stats, self.held.held):
                self.stats.num_tensors += 1
                verifier.check(name, tensor)  # each sender's bytes, before the consumer sees them
                yield name, tensor
        except BaseException as exc:
            # any part failed (or the consumer stopped): the whole version fails here, on every sender alike
            for pipeline in pipelines:
                pipeline.cancel()
            self.lane.current = None
            self.lane.fail()
            others.fail()
            reason = (
                "consumer stopped before the version was complete" if isinstance(exc, GeneratorExit) else explain(exc)
            )
            if not isinstance(exc, asyncio.CancelledError):
                await self.acks.send(plan.version, False, reason)
            raise
        self.lane.learn_boxes(self.transport, destinations)
        self.report = verifier.report

    def complete(self) -> tuple[ReceiveStats, VerifyReport]:
        """Every tensor of the version arrived and was checked: record it (the receiver acks it, or its caller)."""
        version, stats, report = self.plan.version, self.stats, self.report
        assert report is not None
        self.lane.current = None
        stats.seconds = time.perf_counter() - self.start
        stats.verified = report.verified
        self.acks.steps.complete(version)
        logger.debug("version %d received: %d tensors, %.3fs", version, stats.num_tensors, stats.seconds)
        return stats, report


__all__ = ["Arrivals"]
