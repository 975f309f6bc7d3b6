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
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ..errors import ProtocolError, WeightSyncError, WeightSyncTimeout, explain
from ..protocol.chunks import TensorMeta
from ..protocol.messages import Plan
from ..protocol.tiling import TilingMerger
from .pipeline import BucketPipeline
from .stats import ReceiveStats

if TYPE_CHECKING:
    from .receiver import WeightReceiver

logger = logging.getLogger(__name__)


class OtherSenders:
    """The sub-receivers of one receiver, one per other sender of a sharded version, by address."""

    def __init__(self, owner: WeightReceiver) -> None:
        self.owner = owner
        self.subs: dict[tuple[str, int], WeightReceiver] = {}
        self.joined: list[tuple[WeightReceiver, Plan]] = []  # the version in flight: each sub and its plan

    async def join(self, plan: Plan) -> list[tuple[WeightReceiver, Plan]]:
        """Join every other sender's part of `plan.version` (their Prepare / Ready / Plan / group, at once)."""
        from .receiver import WeightReceiver

        wanted = [(a.host, a.port) for a in plan.senders]
        for key in [k for k in self.subs if k not in wanted]:  # a sender no longer in the version
            await self.subs.pop(key).close()
        for host, port in wanted:
            if (host, port) not in self.subs:
                own = self.owner.settings
                at = replace(own, transport=replace(own.transport, host=host, port=port))
                sub = WeightReceiver(at, identity=self.owner.identity)
                await sub.start()
                self.subs[(host, port)] = sub
        subs = [self.subs[key] for key in wanted]
        results = await asyncio.gather(*(self._version(sub, plan.version) for sub in subs), return_exceptions=True)
        self.joined = [(sub, got) for sub, got in zip(subs, results, strict=True) if isinstance(got, Plan)]
        failed = [(sub, got) for sub, got in zip(subs, results, strict=True) if isinstance(got, BaseException)]
        if failed:
            sub, exc = failed[0]
            raise WeightSyncError(
                f"version {plan.version}: joining sender {sub._control.address} failed: {explain(exc)}"
            )
        return self.joined

    async def _version(self, sub: WeightReceiver, version: int) -> Plan:
        """`sub`'s sender's plan for exactly `version` (it is told which receivers to wait for)."""
        wait_s = float(self.owner.settings.transport.ready_timeout_s)
        try:  # the coordinator already started the version: this sender is there now, or unreachable
            got = await sub.wait_version(wait_s=wait_s)
        except WeightSyncTimeout as exc:
            linked, _ = sub.sender_link()
            why = "its version did not start" if linked else "no connection to it"
            raise WeightSyncTimeout(
                f"version {version}: the sender at {sub._control.address} that the coordinator listed: {why} within "
                f"transport.ready_timeout_s={wait_s}s (is transport.sender_host that rank's address as this rollout "
                f"sees it?): {exc}"
            ) from None
        if got.version != version or got.senders:
            sub._fail_group()  # it joined that sender's group: give it up, so its broadcast ends now, not at timeout_s
            await sub._send_ack(got.version, False, f"expected version {version} of a sharded version")
            raise ProtocolError(
                f"sender {sub._control.address} started version {got.version}"
                f"{' listing other senders' if got.senders else ''} while version {version} was expected"
            )
        return got

    async def ack(self, version: int, ok: bool, error: str | None) -> None:
        for sub, plan in self.joined:
            if plan.version == version:
                await sub._send_ack(version, ok, error)

    def fail(self) -> None:
        for sub, _ in self.joined:
            sub._fail_group()

    async def close(self) -> None:
        for sub in self.subs.values():
            with contextlib.suppress(Exception):
                await sub.close()
        self.subs.clear()


async def tile(
    pipelines: list[BucketPipeline], merger: TilingMerger, stats: ReceiveStats
) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """Every pipeline's chunks, as they complete, into `merger`; yields each tensor once it is whole.

    A chunk is a view of its pipeline's slot, valid until that pipeline is asked for its next chunk: it is
    copied into its tensor before its own stream moves on, while the other streams keep receiving."""
    streams = [pipeline.chunks(stats) for pipeline in pipelines]

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
                whole = merger.push(index, meta, data)
                if whole is not None:
                    yield whole
                pending[advance(index)] = index
        merger.finish()
    finally:
        for future in pending:
            future.cancel()
        for future in pending:
            with contextlib.suppress(BaseException):
                await future
        for stream in streams:
            with contextlib.suppress(BaseException):
                await stream.aclose()


__all__ = ["OtherSenders", "tile"]
