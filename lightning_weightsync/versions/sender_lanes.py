"""The sender's lanes: which receivers share a broadcast this version, their groups, and one stream through all.

    at start      the whole lane (receivers that declared no boxes): its backend, slots and executor thread
    per version   the receivers grouped by the boxes each declared (a lane per declaration, `versions/lanes.py`),
                  each lane's group told and joined (Plan), the source pulled once and each lane's part of every
                  tensor planned, packed, described and broadcast on its own lane (`LaneStream`)
    on failure    every lane's broadcasts settled or given up (`abandon`); a transport failure forgets the groups

`WeightSender` keeps the order of the protocol's steps; everything about who shares which broadcast is here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ..config import FanOut, SenderSettings, mib_to_bytes
from ..errors import ConfigError, PeerError, ProtocolError, WeightSyncError, WeightSyncTimeout
from ..protocol.chunks import TensorShard
from ..protocol.declare import check_declared
from ..protocol.layout import Layout, LayoutRecorder
from ..protocol.messages import GroupSpec, Member, SenderAddress
from ..protocol.relay import chains, piece_size
from ..transport.backends import NUM_SLOTS, Backend
from ..transport.control import Peer, SenderControl
from ..transport.executor import SerialExecutor, forget
from . import features
from .delta import DeltaBase, DeltaPolicy, VersionDelta
from .lanes import WHOLE, Broadcasts, Lane, LaneStream, LaneVersion, LaneView, lane_bucket_size
from .options import ResolvedOptions
from .planner import BucketPlanner
from .source import Drainable
from .stats import SendStats
from .steps import SenderSteps
from .verify import SenderFingerprints
from .wire import Wire

logger = logging.getLogger(__name__)
EXECUTOR_NAME = "weightsync"


class SenderLanes:
    """Every lane of one sender, kept from version to version: the whole lane, and a lane per declaration of
    boxes (built when its receivers first take part, closed when none does any more).

    `new_backend(bucket_size)` builds a sender backend on the sender's device, timeout, key and control plane.
    `transport` and `timeout_s` are the sender's, given again each version (a caller may replace its settings
    between versions); the slot sizes are fixed at construction, as the whole lane's slots are."""

    def __init__(
        self,
        settings: SenderSettings,
        steps: SenderSteps,
        control: SenderControl,
        session: str,
        new_backend: Callable[[int], Backend],
    ) -> None:
        self.transport = settings.transport
        self.timeout_s = float(settings.transport.timeout_s)
        self.bucket_size = settings.bucket_size
        self.direct_min = settings.direct_min
        self.direct_in_flight = int(settings.transport.direct_in_flight)
        self._steps = steps
        self._control = control
        self.session = session
        self._new_backend = new_backend
        self.whole: Lane | None = None  # the lane of receivers that declared no boxes (built at start)
        self.boxes: dict[str, Lane] = {}  # the lanes of boxes, by declaration digest
        self.generation = 0  # the last group generation given out (unique over the lanes)
        self.shapes: dict[str, tuple[int, ...]] = {}  # the last version's tensors: declared boxes are checked on them
        self.refused: dict[str, str] = {}  # receiver -> why its declared boxes were refused (this version)

    @property
    def backend(self) -> Backend | None:
        """The whole lane's backend (None before start)."""
        return self.whole.backend if self.whole is not None else None

    @property
    def slot_bytes(self) -> int:
        """`WeightSender.slot_bytes`: every lane's slots."""
        return sum(NUM_SLOTS * lane.backend.bucket_size for lane in self._all())

    async def start(self) -> None:
        t = self.transport
        executor = SerialExecutor(EXECUTOR_NAME)
        backend = self._new_backend(self.bucket_size)
        if t.fanout == FanOut.chain and not backend.relays:
            executor.shutdown()
            raise ConfigError(
                f"transport.fanout=chain: backend {backend.name} cannot forward along chains (gloo can; nccl's own "
                "broadcast is a pipelined ring already); set transport.fanout=broadcast"
            )
        await executor.submit(backend.setup, t.host, int(t.store_port))
        self.whole = Lane(WHOLE, backend, executor)

    # -- who shares which broadcast ---------------------------------------------------------------
    async def of_version(self, version: int, peers: list[Peer]) -> list[LaneVersion]:
        """The version's receivers grouped by the boxes each declared: a declaration is taken once every page of it
        arrived and its boxes fit the tensors this sender sent last; one that does not is refused by name (its
        receiver gets whole tensors, and hears why in its plan)."""
        assert self.whole is not None
        by_key: dict[str, list[Peer]] = {}
        views: dict[str, LaneView] = {WHOLE: LaneView({})}
        self.refused = {}
        for peer in peers:
            key = self._declared(version, peer, views)
            by_key.setdefault(key, []).append(peer)
        box_keys = sorted(k for k in by_key if k != WHOLE)
        size = lane_bucket_size(self.bucket_size, len(box_keys))
        for key in [k for k in self.boxes if k not in by_key]:  # no receiver holds these boxes any more
            self.boxes.pop(key).close()
        lanes = [LaneVersion(self.whole, by_key[WHOLE], views[WHOLE])] if WHOLE in by_key else []
        for key in box_keys:
            lanes.append(LaneVersion(await self._box_lane(key, size), by_key[key], views[key]))
        return lanes

    def _declared(self, version: int, peer: Peer, views: dict[str, LaneView]) -> str:
        """The lane key of `peer` this version: its declaration's digest where taken, else WHOLE."""
        digest = self._steps.readies[peer.identity].boxes
        if not digest:
            return WHOLE
        if digest in views:  # another receiver of this version declared the same: the same lane
            return digest
        try:
            boxes = self._control.declarations.complete(peer.identity, digest)
            if boxes is None or not self.shapes:  # pages still coming, or no version sent yet to check it on
                return WHOLE
            parts = check_declared(boxes, self.shapes)
        except ProtocolError as exc:
            self._control.declarations.forget(peer.identity)
            self.refused[peer.identity] = str(exc)
            logger.warning("version %d: refused the boxes %s declared (it gets whole tensors): %s", version,
                           peer.identity, exc)  # fmt: skip
            return WHOLE
        if not parts:
            return WHOLE
        views[digest] = LaneView(parts)
        return digest

    async def _box_lane(self, key: str, bucket_size: int) -> Lane:
        """The lane of the receivers that declared boxes `key`, built (or rebuilt at another slot size) now: its
        own backend and executor thread; a process-group backend shares the whole lane's store."""
        lane = self.boxes.get(key)
        if lane is not None and lane.backend.bucket_size == bucket_size:
            return lane
        if lane is not None:
            self.boxes.pop(key).close()
        assert self.whole is not None
        backend = self._new_backend(bucket_size)
        executor = SerialExecutor(f"{EXECUTOR_NAME}-lane")
        try:
            await executor.submit(backend.setup_lane, self.whole.backend, self.transport.host)
        except BaseException:
            executor.shutdown()
            raise
        lane = self.boxes[key] = Lane(key, backend, executor)
        return lane

    # -- step 3: each lane's group ------------------------------------------------------------------
    async def join(self, version: int, lanes: list[LaneVersion], others: list[SenderAddress]) -> None:
        """Tell every receiver its rank in its lane's group, then build (or reuse) every lane's group at once."""
        joins: list[tuple[asyncio.Future[None], LaneVersion]] = []
        for run in lanes:
            lane, peers = run.lane, run.peers
            members = tuple(p.key for p in peers)
            lost = any(self._steps.readies[p.identity].generation != lane.generation for p in peers)
            rebuild = self.transport.rebuild_group or members != lane.members
            if rebuild or lane.backend.generation < 0 or lost:
                self.generation += 1
                lane.generation, lane.members = self.generation, members
            relay, piece = self._relay(len(peers), lane.backend.bucket_size)
            group = GroupSpec(
                session=self.session,
                generation=lane.generation,
                backend=lane.backend.name,
                bucket_size=lane.backend.bucket_size,
                members=[Member(p.identity, p.pid) for p in peers],
                join=lane.backend.join_spec(lane.generation),
                relay=relay,
                relay_piece=piece,
            )
            await self._steps.send_plans(version, peers, group, others, lane.key, self.refused)
            joins.append((lane.executor.submit(lane.backend.join, group, 0, version), run))
        for joined, _ in joins:
            await self._joined(version, joined, [f for f, _ in joins])

    def _relay(self, receivers: int, bucket_size: int) -> tuple[list[int], int]:
        """A lane's chains (transport.fanout=chain; `protocol/relay.py`), or none: the backend's broadcast."""
        t = self.transport
        if t.fanout != FanOut.chain:
            return [], 0
        upstream = chains(receivers, int(t.chain_length))
        return upstream, piece_size(upstream, bucket_size, mib_to_bytes(t.chain_piece_mb))

    async def _joined(self, version: int, joined: asyncio.Future[None], every: list[asyncio.Future[None]]) -> None:
        """One lane's join: bounded by timeout_s (the backend's own too); a member that is gone ends it sooner."""
        timeout_s = self.timeout_s
        try:
            await self._steps.while_connected(joined, timeout_s, f"version {version}: joining the group", joining=True)
        except asyncio.TimeoutError:
            for future in every:
                forget(future)
            who = await self._steps.laggards(version)
            raise WeightSyncTimeout(
                f"version {version}: the data-plane group not joined within transport.timeout_s={timeout_s}s; {who}"
            ) from None
        except WeightSyncError:
            for future in every:
                forget(future)
            raise
        except Exception as exc:  # the backend's own failure to form the group: a peer's, not a bug here
            for future in every:
                forget(future)
            who = await self._steps.laggards(version)
            raise PeerError(f"version {version}: joining the data-plane group failed ({exc}); {who}") from exc
        except BaseException:
            for future in every:
                forget(future)
            raise

    # -- step 4: the stream -------------------------------------------------------------------------
    async def stream(
        self,
        source: Drainable,
        lanes: list[LaneVersion],
        stats: SendStats,
        options: ResolvedOptions,
        whole: tuple[SenderFingerprints, VersionDelta],
    ) -> None:
        """Split, pack, publish, broadcast, swap: the source pulled once, each lane's part of every tensor on its
        own lane (`LaneStream`). The whole lane fingerprints and diffs with `whole`; a lane of boxes
        fingerprints its boxes and sends them whole.

        Packed buckets take turns in a lane's two slots (bucket metadata, then its broadcast, then on to the
        other slot once the broadcast that last read it is complete). A direct bucket (one chunk of a
        large tensor) needs no slot: its metadata leaves and its broadcast is queued at once, so the
        metadata runs ahead of the bytes and the data-plane thread issues broadcasts back to back."""
        streams = [self._stream_of(run, stats, options, whole) for run in lanes]
        shapes: dict[str, tuple[int, ...]] = {}  # this version's tensors: the next declarations are checked on them
        async for name, tensor in source:
            shapes[name] = tensor.shape if isinstance(tensor, TensorShard) else tuple(tensor.shape)
            for lane_stream in streams:
                await lane_stream.add(name, tensor, options.stable_tensors)
        for lane_stream in streams:
            await lane_stream.finish(stats)
        self.shapes = shapes

    def _stream_of(
        self,
        run: LaneVersion,
        stats: SendStats,
        options: ResolvedOptions,
        whole: tuple[SenderFingerprints, VersionDelta],
    ) -> LaneStream:
        """One lane's planner and wire for this version."""
        lane, backend = run.lane, run.lane.backend
        lane.reset()
        backend.relayed.take()  # what a version given up before this one left in the counter is not this one's
        if run.whole:
            fingerprints, delta = whole
        else:
            fingerprints = SenderFingerprints(options.verify, stats.version)
            delta = VersionDelta(DeltaBase(), DeltaPolicy(False, None, False))
        planner = BucketPlanner(
            backend.bucket_size,
            direct_min=self.direct_min,
            direct_device=backend.device if backend.direct_ok else None,
            # fingerprints are of the tensor itself; then the delta, then every registered feature (features.py)
            transforms=(fingerprints.stamp, delta.transform, *features.outgoing(stats.version)),
        )
        layouts = self._layouts(lane, run.peers, options)
        wire = Wire.of(stats.version, run.peers, options, delta, self.direct_in_flight, layouts)
        waits = Broadcasts(self._steps, self.timeout_s, stats.version)
        return LaneStream(lane, run.view, planner, wire, waits)

    def _layouts(
        self, lane: Lane, peers: list[Peer], options: ResolvedOptions
    ) -> tuple[Layout | None, LayoutRecorder | None]:
        """The layout this version may name on `lane` (the one every peer said it holds in Ready, if it is the one
        this lane streamed last), and the recorder of this version's (transport.layout_once; not sharded: each
        rank's buckets are its own)."""
        if not self.transport.layout_once or options.sharded:
            return None, None
        held = lane.layout
        if held is not None and any(self._steps.readies[p.identity].layout != held.digest for p in peers):
            held = None
        return held, LayoutRecorder()

    # -- failures and the end -----------------------------------------------------------------------
    def _all(self) -> list[Lane]:
        return [lane for lane in (self.whole, *self.boxes.values()) if lane is not None]

    async def abandon(self, version: int, transport_failed: bool) -> bool:
        """After a failure: if the caller's iterable failed, the groups are healthy: let the broadcasts in flight
        finish (receivers are inside them). Returns whether the transport failed (then the groups are forgotten
        by `fail`)."""
        if not transport_failed:
            waits = Broadcasts(self._steps, self.timeout_s, version)
            try:
                for lane in self._all():
                    await lane.settle(waits)
            except (WeightSyncError, asyncio.CancelledError):
                transport_failed = True
        for lane in self._all():
            lane.forget()
        return transport_failed

    def fail(self) -> None:
        """After a transport failure: every lane's group is forgotten (the next version rebuilds them). A
        collective may still be stuck on a lane's executor thread until the backend's own timeout, so later
        versions get a new thread instead of queueing behind it."""
        for lane in self._all():
            lane.backend.broken()
            lane.executor.shutdown()
            lane.executor = SerialExecutor(EXECUTOR_NAME if lane.key == WHOLE else f"{EXECUTOR_NAME}-lane")

    def close(self) -> None:
        """Free buckets and groups first, then stop the executors."""
        for lane in self._all():
            lane.close()
        self.boxes.clear()
        self.whole = None


__all__ = ["SenderLanes"]
