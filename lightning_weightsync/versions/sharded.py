"""A receiver's side of a sharded version (`trainer.send_mode: sharded`): several senders, one version.

    sender 0's Plan lists the other senders (`Plan.senders`)
    -> a sub-receiver per other sender (same identity, same token; kept from version to version):
       each takes part in its sender's own Prepare / Ready / Plan / group for the same version
    -> one `BucketPipeline` per sender, all running at once (each its own executor thread and group)
    -> their chunks, in whatever order they complete, into one `TilingMerger` (each tensor tiled
       exactly once by the union of the senders' byte ranges; the consumer's `into` is shared)
    -> every sender acked alike: ok once every tensor is whole, or the same failure

Why one group per sender rather than one group with per-sender broadcasts: the senders are independent
trainer ranks that produce at their own pace (no order to agree on, no sender waiting for another's
turn), and each link carries only its own sender's bytes, so N senders get N links' bandwidth. The price
is memory on the receiver: two bucket slots per sender (`docs/backends.md`).

A failure of any part fails the whole version on this receiver: every stream is cancelled, every group
given up (so each sender's broadcast ends at once instead of waiting for us) and every sender nacked
with the same reason; the consumer applies nothing (`rollout/consume.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Generic, Protocol, TypeVar

import torch

from ..errors import DeltaError, ProtocolError, WeightSyncError, WeightSyncTimeout, explain
from ..protocol.chunks import TensorMeta
from ..protocol.declare import Declaration
from ..protocol.messages import Plan
from ..protocol.tiling import TilingMerger
from .delta import apply_range_delta
from .pipeline import BucketPipeline
from .stats import ReceiveStats

logger = logging.getLogger(__name__)


class SenderPart(Protocol):
    """What a sharded version needs of the receiver of one other sender (a `WeightReceiver`: its public face)."""

    delta_base: int | None  # the version it says (in its Ready) it can apply a delta to
    declared: Declaration | None  # the boxes it declares to its sender (protocol/declare.py)

    @property
    def address(self) -> str: ...

    async def start(self) -> None: ...

    async def wait_version(self, wait_s: float | None = None) -> Plan: ...

    def sender_link(self) -> tuple[bool, float]: ...

    def give_up_group(self) -> None: ...

    async def ack(self, ok: bool = True, error: str | None = None) -> None: ...

    async def close(self) -> None: ...


P = TypeVar("P", bound=SenderPart)


class OtherSenders(Generic[P]):
    """The receivers of one receiver's other senders of a sharded version, one per sender address, kept from
    version to version. `new(host, port)` builds one (same identity, same token, that sender's address)."""

    def __init__(self, coordinator: str, new: Callable[[str, int], P], ready_timeout_s: float) -> None:
        self.coordinator, self.new, self.ready_timeout_s = coordinator, new, ready_timeout_s
        self.subs: dict[tuple[str, int], P] = {}
        self.joined: list[tuple[P, Plan]] = []  # the version in flight: each sub and its plan

    async def join(self, plan: Plan, held: int | None, declared: Declaration | None = None) -> list[tuple[P, Plan]]:
        """Join every other sender's part of `plan.version` (their Prepare / Ready / Plan / group, at once);
        `held`: the version this receiver holds whole, which each sender hears (deltas are of it); `declared`:
        the boxes it holds, which each sender hears too (each serves them once it took them)."""
        wanted = [(a.host, a.port) for a in plan.senders]
        for key in [k for k in self.subs if k not in wanted]:  # a sender no longer in the version
            await self.subs.pop(key).close()
        for host, port in wanted:
            if (host, port) not in self.subs:
                sub = self.new(host, port)
                await sub.start()
                self.subs[(host, port)] = sub
        subs = [self.subs[key] for key in wanted]
        for sub in subs:
            sub.delta_base = held
            sub.declared = declared
        results = await asyncio.gather(*(self._version(sub, plan.version) for sub in subs), return_exceptions=True)
        self.joined = [(sub, got) for sub, got in zip(subs, results, strict=True) if isinstance(got, Plan)]
        failed = [(sub, got) for sub, got in zip(subs, results, strict=True) if isinstance(got, BaseException)]
        if failed:
            sub, exc = failed[0]
            raise WeightSyncError(f"version {plan.version}: joining sender {sub.address} failed: {explain(exc)}")
        return self.joined

    async def _version(self, sub: P, version: int) -> Plan:
        """`sub`'s sender's plan for exactly `version` (it is told which receivers to wait for)."""
        wait_s = self.ready_timeout_s
        try:  # the coordinator already started the version: this sender is there now, or unreachable
            got = await sub.wait_version(wait_s=wait_s)
        except WeightSyncTimeout as exc:
            linked, _ = sub.sender_link()
            why = "its version did not start" if linked else "no connection to it"
            raise WeightSyncTimeout(
                f"version {version}: the sender at {sub.address} that the coordinator ({self.coordinator}) listed: "
                f"{why} within transport.ready_timeout_s={wait_s}s (is transport.sender_host that rank's address as "
                f"this rollout sees it?): {exc}"
            ) from None
        if got.version != version or got.senders:
            sub.give_up_group()  # it joined that sender's group: leave it, so its broadcast ends now, not at timeout_s
            await sub.ack(False, f"expected version {version} of a sharded version")
            raise ProtocolError(
                f"sender {sub.address} started version {got.version}"
                f"{' listing other senders' if got.senders else ''} while version {version} was expected"
            )
        return got

    async def ack(self, version: int, ok: bool, error: str | None) -> None:
        for sub, plan in self.joined:
            if plan.version == version:
                await sub.ack(ok, error)

    def fail(self) -> None:
        for sub, _ in self.joined:
            sub.give_up_group()

    async def close(self) -> None:
        for sub in self.subs.values():
            with contextlib.suppress(Exception):
                await sub.close()
        self.subs.clear()


Held = Callable[[TensorMeta, int], torch.Tensor]
"""(the tensor's meta, the version a delta is based on) -> the consumer's tensor of that version; raises
`DeltaError` where the receiver holds no such version (`WeightReceiver._held`)."""


class ShardDeltas:
    """The delta payloads of a sharded version (`transport.delta`): each sender's payload for a tensor is
    assembled from its chunks (one sender's chunks of one tensor come in order), then applied onto the held
    version in the byte range it rebuilds (`BucketMeta.delta_ranges`; a whole tensor where none is given),
    which the merger checks and counts like any chunk's range."""

    def __init__(self, pipelines: list[BucketPipeline], held: Held | None) -> None:
        self.pipelines, self.held = pipelines, held
        self.buffers: dict[tuple[int, str], tuple[torch.Tensor, int]] = {}  # -> (payload, bytes received)
        self.applied = 0  # shards rebuilt from a delta (`ReceiveStats.delta_tensors` in sharded mode)

    def takes(self, index: int, meta: TensorMeta) -> bool:
        return meta.name in self.pipelines[index].delta_metas

    def push(
        self, index: int, meta: TensorMeta, data: torch.Tensor, merger: TilingMerger
    ) -> tuple[str, torch.Tensor] | None:
        key = (index, meta.name)
        payload, got = self.buffers.pop(key, (None, 0))
        if payload is None:
            payload = torch.empty(meta.nbytes, dtype=torch.uint8, device=data.device)
        if meta.chunk_offset != got or data.numel() != meta.chunk_size:
            raise ProtocolError(
                f"delta of {meta.name!r} from sender {index}: chunk at byte {meta.chunk_offset} of its payload, "
                f"{got} expected"
            )
        payload[got : got + meta.chunk_size].copy_(data)
        got += meta.chunk_size
        if got < meta.nbytes:
            self.buffers[key] = (payload, got)
            return None
        pipeline = self.pipelines[index]
        whole, based_on = pipeline.delta_metas.pop(meta.name)
        start, size = pipeline.delta_ranges.pop(meta.name, (0, whole.nbytes))
        if self.held is None:
            raise DeltaError(f"{meta.name!r} arrived as a delta of version {based_on}, but this receiver holds none")
        held = self.held(whole, based_on)
        shard = TensorMeta(whole.name, whole.shape, whole.dtype, start, size)
        self.applied += 1
        return merger.write(index, shard, lambda dest: apply_range_delta(payload, whole, start, size, held, dest))


async def tile(
    pipelines: list[BucketPipeline], merger: TilingMerger, stats: ReceiveStats, held: Held | None = None
) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """Every pipeline's chunks, as they complete, into `merger`; yields each tensor once it is whole.
    A delta payload's chunks go to `ShardDeltas`, which applies it onto `held`'s tensor once complete.

    A chunk is a view of its pipeline's slot, valid until that pipeline is asked for its next chunk: it is
    copied into its tensor before its own stream moves on, while the other streams keep receiving."""
    streams = [pipeline.chunks(stats) for pipeline in pipelines]
    deltas = ShardDeltas(pipelines, held)

    def advance(index: int) -> asyncio.Future[tuple[TensorMeta, torch.Tensor]]:
        return asyncio.ensure_future(streams[index].__anext__())

    pending = {advance(i): i for i in range(len(streams))}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                index = pending.pop(future)
                try:
                    meta, data = future.result()
                except StopAsyncIteration:
                    continue
                if deltas.takes(index, meta):
                    whole = deltas.push(index, meta, data, merger)
                else:
                    whole = merger.push(index, meta, data)
                if whole is not None:
                    yield whole
                pending[advance(index)] = index
        merger.finish()
        stats.delta_tensors = deltas.applied
    finally:
        for future in pending:
            future.cancel()
        for future in pending:
            with contextlib.suppress(BaseException):
                await future
        for stream in streams:
            with contextlib.suppress(BaseException):
                await stream.aclose()


__all__ = ["Held", "OtherSenders", "SenderPart", "ShardDeltas", "tile"]
