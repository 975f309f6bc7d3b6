"""A version this rollout failed, taken whole from a peer that installed it (`rollout.recover_from_peers`, with
`rollout.catch_up_from`), in the gap before the trainer's next version:

    the trainer's version v fails here for a cause outside this rollout: its sender aborted it (a chain cut at a
      dead member ahead of this one) or its transport failed (a dead or stalled feeder, a timeout)
    -> at once: version v from the first peer of catch_up_from that serves it (a peer's `rollout.serve_port`:
       the chain's head, which kept it), into the sink as the start-up catch-up takes one (begin, destinations,
       commit; every tensor checked against the peer's fingerprints); each peer gets catch_up_wait_s to start
    the trainer's next Prepare (this rollout's receiver, `on_version_start`) abandons it there and then: the
       answer to that Prepare is not held for it, what it staged is dropped, and its peer serve is left

Not recovered: a version this rollout refused (a sink failure, a verify or delta failure, a bad config: taking it
again from a peer would not be better, or would hide the fault) and a version not newer than the one the sink holds.
Only version v is installed: a peer serving another one is refused at `begin`, before any byte reaches the sink.

Whole or nothing: a recovery is a version of its own in the sink. With `rollout.apply=atomic` it is staged and
copied in at its commit, or dropped; with `streaming` it overwrites the live tensors the failed version tore (the
sink is incomplete until it commits: the peer serves every tensor of v, so none keeps the failed version's bytes).
The sink's one-version-in-flight rule keeps it apart from the trainer's next version: should a commit still run on a
worker thread (a blocking sink) when that version's first tensor lands, the sink refuses that version (nacked, named)
rather than mix the two. The trainer's version after a recovery comes whole (no delta base is claimed on a version
the trainer did not send to this rollout).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence

import torch

from ..config import ReceiverSettings
from ..errors import (
    DeltaError,
    PeerError,
    SinkError,
    VerifyError,
    WeightSyncError,
    WeightSyncTimeout,
    explain,
)
from ..protocol.chunks import TensorMeta
from ..protocol.messages import LoraSpec
from ..versions.peer_serve import CaughtUp, catch_up
from ..versions.receiver import WeightReceiver
from .consume import Call, begin_version, consume_version
from .sinks.base import Sink, VersionSink

logger = logging.getLogger(__name__)


def recoverable(exc: BaseException) -> bool:
    """A failure a peer's copy of the version mends: the sender aborted it, or its transport failed. Not this
    rollout's own refusals (sink, verify, delta, config), whose cause a second copy would not remove."""
    if isinstance(exc, (SinkError, VerifyError, DeltaError)):
        return False
    return isinstance(exc, (PeerError, WeightSyncTimeout))  # VersionAborted is a PeerError


class OnlyVersion(VersionSink):
    """The daemon's sink as a recovery drives it: only `version` is begun, only while it is newer than what the
    sink holds, and nothing once the recovery is abandoned (the trainer's next version owns the sink then)."""

    takes_lora = True  # passed on to `begin_version` of the sink itself, which decides

    def __init__(self, sink: Sink, version: int) -> None:
        self.sink, self.version = sink, version
        self.abandoned: str | None = None
        self.began = False

    def begin(
        self, version: int, tied: Mapping[str, Sequence[str]] | None = None, lora: LoraSpec | None = None
    ) -> None:
        self._live()
        held = self.sink.version
        if version != self.version or (held is not None and version <= held):
            raise SinkError(
                f"the peer serves version {version}; the recovery takes only version {self.version}, which failed "
                f"here, and never one not newer than the held version {held}"
            )
        begin_version(self.sink, version, tied or {}, lora)
        self.began = True

    def destination(self, meta: TensorMeta) -> torch.Tensor | None:
        self._live()
        return self.sink.destination(meta)

    def accept(self, name: str, tensor: torch.Tensor) -> None:
        self._live()
        self.sink.accept(name, tensor)

    def commit(self, version: int) -> None:
        self._live()
        self.sink.commit(version)

    def abort(self, version: int, reason: str) -> None:
        """Drop what the recovery staged, never the trainer's version that may be in flight by now."""
        if self.began and self.sink.in_flight == self.version:
            self.sink.abort(self.version, reason)
        self.began = False

    def abandon(self, reason: str) -> None:
        """The trainer's next version starts: nothing more reaches the sink from here; what was staged is dropped
        now where that is safe on this thread (a sink whose methods run on the event loop)."""
        self.abandoned = reason
        if not self.sink.blocking_io:
            self.abort(self.version, reason)

    def _live(self) -> None:
        if self.abandoned is not None:
            raise SinkError(f"the recovery of version {self.version} was abandoned: {self.abandoned}")


class Recovery:
    """One failed version's recovery from `peers`, run as a task beside the daemon's next receive."""

    def __init__(self, settings: ReceiverSettings, sink: Sink, version: int, peers: list[str], wait_s: float) -> None:
        self.settings, self.peers, self.wait_s = settings, peers, wait_s
        self.guard = OnlyVersion(sink, version)
        self.task: asyncio.Task[CaughtUp | None] | None = None
        self.seconds = 0.0

    @property
    def version(self) -> int:
        return self.guard.version

    @property
    def finished(self) -> bool:
        return self.task is not None and self.task.done()

    def start(self, identity: str, call: Call) -> asyncio.Task[CaughtUp | None]:
        self.task = asyncio.create_task(self._run(identity, call), name=f"recover-{self.version}")
        return self.task

    def abandon(self, reason: str) -> None:
        """Stop now, without waiting (called where the trainer's next Prepare is answered)."""
        if self.task is None or self.task.done():
            return
        self.guard.abandon(reason)
        self.task.cancel(reason)
        logger.warning("recovery of version %d abandoned: %s", self.version, reason)

    async def close(self) -> None:
        self.abandon("the rollout daemon is stopping")
        if self.task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task

    async def _run(self, identity: str, call: Call) -> CaughtUp | None:
        start = time.perf_counter()

        async def take(receiver: WeightReceiver, wait_s: float) -> object:
            return await consume_version(receiver, self.guard, call=call, wait_s=wait_s, claim_base=False)

        try:
            caught = await catch_up(self.settings, self.peers, None, identity=identity, wait_s=self.wait_s, take=take)
        except WeightSyncError as exc:  # catch_up logs each peer's failure; this is anything else it let through
            logger.warning("recovery of version %d failed: %s", self.version, explain(exc))
            caught = None
        self.seconds = time.perf_counter() - start
        if caught is None:
            logger.warning(
                "recovery of version %d: no peer of rollout.catch_up_from=%s served it within %gs each "
                "(rollout.catch_up_wait_s) in %.3f s; the trainer's next version comes whole",
                self.version, self.peers, self.wait_s, self.seconds,
            )  # fmt: skip
        return caught


__all__ = ["OnlyVersion", "Recovery", "recoverable"]
