"""WeightSender: split, pack, publish, broadcast, swap.

    for each step the bucket planner (versions/planner.py) makes of the stream (fingerprints, deltas: its
    transforms; the layout: protocol.chunks.BucketLayout):
        Pack: bucket[offset : offset + size] = chunk, in the slot being filled
        Flush of a packed bucket: publish its metadata (ZeroMQ), start its broadcast on the executor
            thread, and wait until the other slot's previous broadcast is complete (not merely
            enqueued) before packing into it
        Flush of a direct bucket (a chunk of a large tensor, >= transport.direct_min_mb, where the
            backend can): its metadata, then its broadcast straight from the caller's tensor, no slot
    publish + broadcast the last bucket (is_last); wait for both slots; collect acks

Buckets are allocated once (by the backend, at `start()`) and reused for every version. Memory:
two buckets plus whatever the caller's iterable holds (one full tensor when it streams a gather).
A direct broadcast reads the caller's tensor: by default it completes before the next tensor is
pulled (the caller may reuse that memory, as FSDP1's unsharded views do); a producer that yields
fresh tensors (`stable_tensors=True`: FSDP2 `full_tensor()`, a dtype cast) lets the next gather
overlap the broadcast, and the sender holds each tensor until its broadcast completed: at most
`NUM_SLOTS` tensors in flight on top of the two buckets.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from ..config import DeltaMode, SenderSettings, TransportConfig, UserConfig, VerifyMode, transport_token
from ..errors import Interrupted, PeerError, ProtocolError, WeightSyncError, WeightSyncTimeout, explain
from ..protocol.chunks import NamedTensors, TensorShard, aiter_any
from ..protocol.declare import check_declared
from ..protocol.dtypes import dtype_name
from ..protocol.layout import Layout, LayoutRecorder
from ..protocol.messages import (
    Ack,
    BucketMeta,
    GroupSpec,
    LoraSpec,
    Member,
    SenderAddress,
    check_tensor,
    validate_lora,
    validate_tied,
)
from ..transport.backends import NUM_SLOTS, Backend, backend_class, next_slot
from ..transport.control import Peer, SenderControl
from ..transport.device import resolve_device
from ..transport.executor import SerialExecutor, forget
from .delta import DeltaBase, DeltaPolicy, VersionDelta
from .endpoint import Endpoint
from .lanes import WHOLE, Lane, LaneVersion, LaneView, lane_bucket_size
from .options import Sharding, VersionOptions
from .planner import BucketPlanner, Flush, Pack
from .stats import SendStats, human_bytes
from .steps import SenderSteps
from .verify import SenderFingerprints

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


_HOLDING_TYPES: tuple[type, ...] = (list, tuple, type({}.items()), type({}.values()))
_HELD: tuple[Iterable[object], ...] = ([], (), {}.items(), {}.values())
_HOLDING_TYPES += tuple({type(iter(c)) for c in _HELD})
_MODULE_WALKS = torch.nn.Module.named_parameters.__code__.co_filename  # named_parameters(), state_dict walks, ...


def holds_its_tensors(weights: object) -> bool:
    """Whether `weights` cannot hand out memory it reuses for a later tensor, so the sender may still read a
    tensor after pulling the next (`stable_tensors` decided for the caller): a list, a tuple, a dict's items or
    values (a state_dict's), an iterator over one of those, or a module's own walk (`named_parameters()`,
    `named_buffers()`: the module's tensors themselves). Anything else, a user's generator above all, may
    yield views of one buffer it overwrites (FSDP1's unsharded walk does), and keeps the safe path."""
    if isinstance(weights, _HOLDING_TYPES):
        return True
    code = getattr(weights, "gi_code", None)
    return code is not None and code.co_filename == _MODULE_WALKS


class _Drainable:
    """Wraps the caller's iterable so that, after a failure, the rest can still be consumed.

    On FSDP every rank must run the same all-gathers; if rank 0 stopped pulling from its gather
    generator mid-way, the other ranks would hang. So the sender always exhausts the iterable.
    """

    def __init__(self, weights: NamedTensors) -> None:
        self.weights = weights  # the caller's own object (`holds_its_tensors` reads what it is)
        self._it: AsyncIterator[tuple[str, torch.Tensor | TensorShard]] = aiter_any(weights)
        self.exhausted = False
        self.failed = False  # the caller's iterable raised (a local failure: the group is fine)
        self.check = True  # validate each tensor with the receivers' rules (off while draining)
        self.names: set[str] = set()  # sent in this version: a second one would fail every receiver's merge

    def __aiter__(self) -> _Drainable:
        return self

    async def __anext__(self) -> tuple[str, torch.Tensor | TensorShard]:
        try:
            item = await self._it.__anext__()
        except StopAsyncIteration:
            self.exhausted = True
            raise
        except BaseException:
            self.exhausted = self.failed = True
            raise
        if self.check:
            try:
                _check_outgoing(item, self.names)
            except WeightSyncError:
                self.failed = True  # a local failure: the group is fine, the rest is drained
                raise
        return item

    async def drain(self) -> None:
        self.check = False
        if not self.exhausted:
            async for _ in self:
                pass


@functools.lru_cache(maxsize=1 << 16)
def _checked(name: str, shape: tuple[int, ...], dtype: str) -> int:
    """`check_tensor`, remembered for what passed (a pure rule): a model sends the same tensors every version."""
    return check_tensor(name, shape, dtype)


def _check_outgoing(item: object, names: set[str]) -> None:
    """What every receiver would refuse, refused here first (the same `check_tensor`, a name sent twice),
    and what cannot be sent at all (no dense bytes), so the version fails at once naming the tensor
    instead of every receiver dropping the metadata or a raw torch error from deep in the split."""
    if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], (torch.Tensor, TensorShard))):
        raise TypeError(f"weights must yield (name, tensor) pairs, got {type(item).__name__}")
    name, tensor = item
    shape, dtype = (
        (tensor.shape, tensor.dtype) if isinstance(tensor, TensorShard) else (tuple(tensor.shape), tensor.dtype)
    )
    if isinstance(tensor, TensorShard):
        tensor = tensor.data
    if not isinstance(name, str):
        raise TypeError(f"tensor names must be str, got {type(name).__name__} ({name!r:.80})")
    fix = "rename or exclude it (trainer.names.rename / trainer.names.exclude)"
    try:
        _checked(name, shape, dtype_name(dtype))
    except ProtocolError as exc:
        raise ProtocolError(f"cannot send {name[:120]!r}: {exc}; {fix}") from None
    if tensor.layout != torch.strided:
        raise ProtocolError(f"cannot send {name[:120]!r}: a {tensor.layout} tensor has no dense bytes; send "
                            f"tensor.to_dense(), or {fix}")  # fmt: skip
    if tensor.device.type == "meta":
        raise ProtocolError(f"cannot send {name[:120]!r}: it is on the meta device (no data: never materialized, "
                            f"or offloaded); materialize it, or {fix}")  # fmt: skip
    if name in names:
        raise ProtocolError(f"cannot send {name[:120]!r} twice in one version (every receiver would refuse the "
                            f"second); {fix}")  # fmt: skip
    names.add(name)


def _one_options(
    options: VersionOptions | None,
    *,
    stable_tensors: bool | None,
    tied: Mapping[str, Iterable[str]] | None,
    sharding: Sharding | None,
    lora: LoraSpec | None,
) -> VersionOptions:
    """`send_weights`' options from either its `options` or its keywords (the same fields), never both."""
    keywords = stable_tensors is not None or tied is not None or sharding is not None or lora is not None
    if options is None:
        return VersionOptions(tied or {}, lora, sharding, stable_tensors)
    if keywords:
        raise TypeError("send_weights takes options= or the keywords stable_tensors/tied/sharding/lora, not both")
    return options


class _TellOnce:
    """`Sharding.on_members`, called exactly once per version (with [] when the version failed before it
    gathered anyone), so no other rank waits for it."""

    def __init__(self, sharding: Sharding | None) -> None:
        self._on_members = sharding.on_members if sharding is not None else None

    def __call__(self, members: list[str]) -> None:
        on_members, self._on_members = self._on_members, None
        if on_members is not None:
            on_members(members)


@dataclass(frozen=True)
class _VersionOptions:
    """One version's options, resolved once from `send_weights`' arguments and the config."""

    stable_tensors: bool
    tied: dict[str, list[str]]
    lora: LoraSpec | None
    verify: VerifyMode
    sharded: bool = False
    index: int = 0  # this sender's index in a sharded version (0: the coordinator, or the only sender)
    only: frozenset[str] | None = None  # a sharded part: exactly the coordinator's receivers
    others: list[SenderAddress] = field(default_factory=list)  # the coordinator's plan lists the other senders

    @classmethod
    def resolve(cls, transport: TransportConfig, weights: object, options: VersionOptions) -> _VersionOptions:
        # sharded: each shard's bytes are fingerprinted, and each receiver checks them where they land
        verify = VerifyMode(transport.verify)
        # a shard's chunks end before its tensor's last byte, so "the caller may reuse this tensor now" cannot be
        # read from the metadata: shards are the module's own local storage, untouched during a sync (stable)
        given = options.stable_tensors
        stable = holds_its_tensors(weights) if given is None else bool(given)
        tied_names = {str(k): [str(a) for a in v] for k, v in options.tied.items()}
        sharding, lora = options.sharding, options.lora
        if sharding is None:
            return cls(stable, tied_names, lora, verify)
        only = frozenset(sharding.members) if sharding.index > 0 else None
        others = list(sharding.others) if sharding.index == 0 else []
        return cls(True, tied_names, lora, verify, True, sharding.index, only, others)


@dataclass
class _Sent:
    """What a version's stream leaves for its accounting (`WeightSender._account`)."""

    delta: VersionDelta
    fingerprints: SenderFingerprints
    formed: bool  # the version formed the group: its time is not a measure of the link
    sharded: bool = False  # this rank sent a part of the version: its fingerprints are of shards
    acks: dict[str, Ack | None] = field(default_factory=dict)


@dataclass(frozen=True)
class _Wire:
    """One version's stream as `_stream` sends it: to whom, what every bucket's metadata says besides its own
    layout, and how many direct broadcasts may still run while the next tensor is produced."""

    version: int
    peers: list[Peer]
    tied: dict[str, list[str]]
    sender: int
    lora: LoraSpec | None
    delta_base: int  # the version the deltas are against; -1: none
    direct_in_flight: int
    held: Layout | None = None  # the layout every peer holds: a bucket cut as in it goes as a reference
    recorder: LayoutRecorder | None = None  # this version's layout, for the next one (transport.layout_once)

    @classmethod
    def of(
        cls,
        version: int,
        peers: list[Peer],
        options: _VersionOptions,
        delta: VersionDelta,
        direct_in_flight: int,
        layouts: tuple[Layout | None, LayoutRecorder | None] = (None, None),
    ) -> _Wire:
        base = delta.policy.base_version
        # Unless the producer's tensors are stable, the caller may reuse a tensor's memory once it yields the next
        # one, so its broadcasts must be complete by then; with stable tensors, up to `direct_in_flight` of them
        # may still be moving.
        in_flight = max(1, direct_in_flight) if options.stable_tensors else 0
        delta_base = -1 if base is None else base
        return cls(version, peers, options.tied, options.index, options.lora, delta_base, in_flight, *layouts)

    def meta(self, step: Flush) -> BucketMeta:
        """The metadata of a planned bucket: the tie and the LoRA spec travel with the first one; its entries
        unless every peer holds them (layout once: the digest of the layout they hold stands for them)."""
        first = step.index == 0
        entries, layout = step.entries, ""
        if self.recorder is not None and self.recorder.add(step.nbytes, step.is_last, step.entries, self.held):
            assert self.held is not None
            entries, layout = [], self.held.digest
        return BucketMeta(
            self.version, step.index, step.is_last, step.nbytes, entries, self.tied if first else {},
            self.sender, fingerprints=step.fingerprints, deltas=step.deltas,
            delta_base=self.delta_base if step.deltas else -1, lora=self.lora if first else None,
            delta_ranges=step.delta_ranges, layout=layout,
        )  # fmt: skip


@dataclass
class _LaneRun:
    """One lane in one version's stream: its state, what it takes of each tensor, its planner and its wire."""

    lane: Lane
    view: LaneView
    planner: BucketPlanner
    wire: _Wire


class WeightSender(Endpoint):
    """Sends versions of a stream of `(name, tensor)` to every registered receiver.

    Args:
        cfg: the weightsync config (`load_config()`; None = the defaults), converted once here into its
            `SenderSettings` (`transport.*` and `trainer.min_receivers`), or those settings themselves.
    """

    _control: SenderControl

    def __init__(self, cfg: UserConfig | SenderSettings = None) -> None:
        # read per version: a caller may replace it between versions (e.g. lower min_receivers)
        self.settings = SenderSettings.of(cfg)
        t = self.settings.transport
        self.bucket_size = self.settings.bucket_size
        self.direct_min = self.settings.direct_min
        self.direct_in_flight = int(t.direct_in_flight)
        self.timeout_s = float(t.timeout_s)
        self.session = secrets.token_hex(8)
        self.device = resolve_device(t.backend, t.device, backend_class(t.backend).natural_device)
        self._key = transport_token(t)
        self.liveness_s = float(t.liveness_s)
        self._control = SenderControl(
            t.host, int(t.port), self._key, self.bucket_size, session=self.session, liveness_s=self.liveness_s
        )
        self._steps = SenderSteps(
            self._control,
            session=self.session,
            min_receivers=self.settings.min_receivers,
            timeout_s=self.timeout_s,
            ready_timeout_s=float(t.ready_timeout_s),
            liveness_s=self.liveness_s,
        )
        self._backend: Backend | None = None  # the whole lane's (versions/lanes.py)
        self._executor: SerialExecutor | None = None
        self._whole: Lane | None = None  # the lane of receivers that declared no boxes (built at start)
        self._box_lanes: dict[str, Lane] = {}  # the lanes of boxes, by declaration digest
        self._generation = 0
        self._last_version: int | None = None
        self._delta_base = DeltaBase()  # the host copy deltas are taken against (transport.delta)
        self._shapes: dict[str, tuple[int, ...]] = {}  # the last version's tensors: declared boxes are checked on them
        self._refused: dict[str, str] = {}  # receiver -> why its declared boxes were refused (this version)

    # -- life cycle -----------------------------------------------------------------------------
    @property
    def port(self) -> int:
        """The bound control port (useful with `transport.port=0`)."""
        return self._control.port

    @property
    def address(self) -> str:
        return self._control.address

    @property
    def generation(self) -> int:
        """The data-plane group generation: it grows each time the group is (re)built, so a caller can
        tell that receivers joined, left or were replaced."""
        return self._generation

    @property
    def slot_bytes(self) -> int:
        """Bucket memory the sender holds now, over all its lanes: the whole lane's slots, and the lanes of boxes'
        slots sharing one more bucket budget (lanes.py), so at most 2 x NUM_SLOTS x bucket_size."""
        lanes = [lane for lane in (self._whole, *self._box_lanes.values()) if lane is not None]
        return sum(NUM_SLOTS * lane.backend.bucket_size for lane in lanes)

    @property
    def registered(self) -> list[str]:
        """Identities of the receivers registered now (authenticated ones only, when a token is set)."""
        return sorted(self._control.peers)

    @property
    def dropped_messages(self) -> int:
        """Control messages rejected (malformed, unsigned, badly signed, replayed) since start."""
        return self._control.dropped_messages

    @property
    def overflowed_messages(self) -> int:
        """Control messages read while the trainer was busy and dropped, unread, past the queue budget."""
        return self._control.overflowed_messages

    @property
    def dropped_connections(self) -> int:
        """Receiver connections that went down without a Bye: a receiver killed or cut off, or a frame over
        the size limit (ZMQ_MAXMSGSIZE drops the connection); each logged, rate-limited, with the causes."""
        return self._control.poll_connections()

    @property
    def lost_messages(self) -> int:
        """Every control message this sender did not act on, for whatever reason: `dropped_messages` (it was
        bad) + `overflowed_messages` (too many, too fast). The one number to alert on: an honest fleet keeps
        it at 0, so any rise is a broken or hostile peer (the WARNING lines name which)."""
        return self.dropped_messages + self.overflowed_messages

    def request_full_sync(self) -> None:
        """The next version goes whole to every receiver, whatever `transport.delta` says."""
        self._delta_base.full_requested = True

    @property
    def delta_copy_bytes(self) -> int:
        """Host memory held for deltas (`transport.delta`): a copy of the last version sent."""
        return self._delta_base.nbytes

    def _delta_policy(self, peers: list[Peer]) -> DeltaPolicy:
        """Deltas only against the version every receiver says it holds, while the copy of it is whole."""
        mode = DeltaMode(self.settings.transport.delta)
        base = self._delta_base
        usable = base.version is not None and not base.full_requested and bool(peers)
        usable = usable and all(self._steps.readies[p.identity].delta_base == base.version for p in peers)
        base.full_requested = False
        if usable and mode is DeltaMode.auto and base.prefer_whole():  # measured: deltas lose on this link
            usable = False
        return DeltaPolicy(mode is not DeltaMode.off, base.version if usable else None, mode is DeltaMode.always)

    async def start(self) -> None:
        t = self.settings.transport
        await self._control.start()
        self._executor = SerialExecutor(self._executor_name)
        self._backend = self._new_backend(t.backend, bucket_size=self.bucket_size, is_sender=True, session=self.session)
        await self._executor.submit(self._backend.setup, t.host, int(t.store_port))
        self._whole = Lane(WHOLE, self._backend, self._executor)

    async def _box_lane(self, key: str, bucket_size: int) -> Lane:
        """The lane of the receivers that declared boxes `key`, built (or rebuilt at another slot size) now: its
        own backend and executor thread; a process-group backend shares the whole lane's store."""
        lane = self._box_lanes.get(key)
        if lane is not None and lane.backend.bucket_size == bucket_size:
            return lane
        if lane is not None:
            self._close_lane(self._box_lanes.pop(key))
        assert self._backend is not None
        t = self.settings.transport
        backend = self._new_backend(t.backend, bucket_size=bucket_size, is_sender=True, session=self.session)
        executor = SerialExecutor(f"{self._executor_name}-lane")
        try:
            await executor.submit(backend.setup_lane, self._backend, t.host)
        except BaseException:
            executor.shutdown()
            raise
        lane = self._box_lanes[key] = Lane(key, backend, executor)
        return lane

    @staticmethod
    def _close_lane(lane: Lane) -> None:
        lane.backend.close()
        lane.executor.shutdown()

    def _fail_group(self) -> None:
        """After a transport failure: every lane's group is forgotten (the next version rebuilds them)."""
        super()._fail_group()
        if self._whole is not None and self._backend is not None and self._executor is not None:
            self._whole.backend, self._whole.executor = self._backend, self._executor
        for key, lane in self._box_lanes.items():
            lane.backend.broken()
            lane.executor.shutdown()
            lane.executor = SerialExecutor(f"{self._executor_name}-lane")
            self._box_lanes[key] = lane

    async def close(self) -> None:
        for lane in self._box_lanes.values():
            self._close_lane(lane)
        self._box_lanes.clear()
        await super().close()

    async def __aenter__(self) -> WeightSender:
        await self.start()
        return self

    # -- one version ------------------------------------------------------------------------------
    async def send_weights(
        self,
        weights: NamedTensors,
        *,
        version: int,
        options: VersionOptions | None = None,
        stable_tensors: bool | None = None,
        tied: Mapping[str, Iterable[str]] | None = None,
        sharding: Sharding | None = None,
        lora: LoraSpec | None = None,
    ) -> SendStats:
        """Send one version; raises `WeightSyncError` (after draining `weights`) on failure.

        A receiver that nacks or does not ack in time makes this raise `PeerError` with the
        stats attached (`exc.stats`): the bytes went out, but not every rollout holds them.

        `options`: what the version carries besides its tensors (`VersionOptions`: tied names, LoRA spec,
        sharding, stable tensors). The keywords `stable_tensors`, `tied`, `sharding`, `lora` are the same
        fields, for a caller that sets one or two; not together with `options`.
        """
        options = _one_options(options, stable_tensors=stable_tensors, tied=tied, sharding=sharding, lora=lora)
        self._check_call(weights, version)
        self._last_version = version
        stats = SendStats(version=version)
        start = time.perf_counter()
        try:
            sent = await self._send_version(_Drainable(weights), version, stats, options)
        finally:
            stats.seconds = time.perf_counter() - start
        if sent is not None:
            self._account(sent, stats)
        return stats

    def _check_call(self, weights: object, version: object) -> None:
        """What makes `send_weights` fail before anything is sent or pulled."""
        iterable = hasattr(weights, "__iter__") or hasattr(weights, "__aiter__")
        if isinstance(weights, (Mapping, str, bytes)) or not iterable:
            hint = "; pass weights.items() for a dict" if isinstance(weights, Mapping) else ""
            raise TypeError(f"weights must be an iterable of (name, tensor) pairs, got {type(weights).__name__}{hint}")
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"version must be an int, got {type(version).__name__}")
        if version < 0:
            raise ValueError(f"version={version} is negative; versions are >= 0 and increase")
        if self._backend is None or self._executor is None:
            raise WeightSyncError("WeightSender.send_weights() before start() (or after close())")
        if self._last_version is not None and version <= self._last_version:
            raise WeightSyncError(
                f"version {version} <= last sent version {self._last_version}; versions must increase"
            )

    async def _send_version(
        self,
        source: _Drainable,
        version: int,
        stats: SendStats,
        given: VersionOptions,
    ) -> _Sent | None:
        """Steps 1-5 of one version (None: nothing to send). On any failure the version is abandoned: the
        group is told, and `source` drained (every FSDP rank must run the same gathers)."""
        tell = _TellOnce(given.sharding)
        peers: list[Peer] = []
        try:
            options = self._options(source, version, given)
            if options.only is not None and not options.only:
                logger.info("version %d: the coordinating sender gathered no receivers; nothing sent", version)
                await source.drain()
                return None
            peers = await self._steps.gather_ready(version, options.only)  # 1-2: Prepare -> Ready
            tell([p.identity for p in peers])
            stats.receivers = len(peers)
            if not peers:
                logger.info("version %d: no receivers registered; nothing sent", version)
                await source.drain()
                return None
            generation = self._generation
            lanes = await self._lanes(version, peers)  # who holds what: a lane per declaration (lanes.py)
            await self._join(version, lanes, options.others)  # 3: Plan, and each lane's data-plane group
            formed = self._generation != generation  # this version's time includes forming the group
            # sharded: each rank diffs its own shards against its own copy of them (`VersionDelta._shard`)
            whole = [p for lane in lanes if lane.whole for p in lane.peers]
            policy = self._delta_policy(whole)
            fingerprints = SenderFingerprints(options.verify, version)
            sent = _Sent(VersionDelta(self._delta_base, policy), fingerprints, formed, options.sharded)
            await self._stream(source, lanes, stats, options, sent)  # 4: bucket metadata, each ahead of its bytes
            sent.acks = await self._steps.collect_acks(version, peers)  # 5: Ack
        except BaseException as exc:
            tell([])
            if peers:
                self._delta_base.invalidate()  # the copy may be part-updated, or some receivers lack the version
            await self._abandon(version, peers, exc, transport_failed=not source.failed)
            self._refused = {}
            await source.drain()
            raise
        return sent

    def _options(self, source: _Drainable, version: int, given: VersionOptions) -> _VersionOptions:
        """`send_weights`' arguments and the config, resolved once for the version; what every receiver would
        refuse is refused here (a local failure: the group is fine, `source` is marked so)."""
        # the policy is read per version (a caller may lower min_receivers after losing a rollout)
        self._steps.min_receivers = self.settings.min_receivers
        self._steps.ready_timeout_s = float(self.settings.transport.ready_timeout_s)
        try:
            transport = self.settings.transport
            options = _VersionOptions.resolve(transport, source.weights, given)
            validate_tied(BucketMeta(version, 0, False, 0, [], options.tied))  # what every receiver checks
            if options.lora is not None:
                validate_lora(options.lora)
        except ProtocolError:
            source.failed = True
            raise
        return options

    def _account(self, sent: _Sent, stats: SendStats) -> None:
        """After the acks: what the version leaves (checksums, the delta copy and its measure); raises
        `PeerError` (stats attached) when a receiver did not take it."""
        stats.checksums = sent.fingerprints.checksums if not sent.sharded else {}  # a shard's is no tensor's
        stats.failed = {
            ident: ("no ack within transport.timeout_s" if ack is None else ack.error or "failed")
            for ident, ack in sent.acks.items()
            if ack is None or not ack.ok
        }
        sent.delta.finish(stats.version, ok=not stats.failed)
        stats.delta_tensors = sent.delta.payloads
        if not stats.failed and not sent.formed:
            self._delta_base.measured(sent.delta.payloads > 0, stats.seconds, sent.delta.model_bytes)
        if stats.failed:
            err = PeerError(f"version {stats.version}: receivers failed: {stats.failed}")
            err.stats = stats
            raise err
        delta = sent.delta
        form = (
            f"delta of version {delta.policy.base_version}: {delta.payloads} tensors as deltas, "
            f"{human_bytes(delta.model_bytes)} of tensors in {human_bytes(stats.nbytes)}"
            if delta.payloads
            else "whole"
        )
        logger.info(
            "version %d sent: %s in %.3f s (%s/s) to %d receivers, %d tensors, %d buckets; %s",
            stats.version, human_bytes(stats.nbytes), stats.seconds,
            human_bytes(stats.nbytes / stats.seconds if stats.seconds > 0 else 0.0), stats.receivers,
            stats.num_tensors, stats.num_buckets, form,
        )  # fmt: skip

    async def _lanes(self, version: int, peers: list[Peer]) -> list[LaneVersion]:
        """The version's receivers grouped by the boxes each declared (lanes.py): a declaration is taken once
        every page of it arrived and its boxes fit the tensors this sender sent last; one that does not is
        refused by name (its receiver gets whole tensors, and hears why in its plan)."""
        assert self._whole is not None
        by_key: dict[str, list[Peer]] = {}
        views: dict[str, LaneView] = {WHOLE: LaneView({})}
        self._refused = {}
        for peer in peers:
            key = self._declared(version, peer, views)
            by_key.setdefault(key, []).append(peer)
        box_keys = sorted(k for k in by_key if k != WHOLE)
        size = lane_bucket_size(self.bucket_size, len(box_keys))
        for key in [k for k in self._box_lanes if k not in by_key]:  # no receiver holds these boxes any more
            self._close_lane(self._box_lanes.pop(key))
        lanes = [LaneVersion(self._whole, by_key[WHOLE], views[WHOLE])] if WHOLE in by_key else []
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
            if boxes is None or not self._shapes:  # pages still coming, or no version sent yet to check it on
                return WHOLE
            parts = check_declared(boxes, self._shapes)
        except ProtocolError as exc:
            self._control.declarations.forget(peer.identity)
            self._refused[peer.identity] = str(exc)
            logger.warning("version %d: refused the boxes %s declared (it gets whole tensors): %s", version,
                           peer.identity, exc)  # fmt: skip
            return WHOLE
        if not parts:
            return WHOLE
        views[digest] = LaneView(parts)
        return digest

    async def _join(self, version: int, lanes: list[LaneVersion], others: list[SenderAddress] | None = None) -> None:
        """Tell every receiver its rank in its lane's group, then build (or reuse) every lane's group at once."""
        joins: list[tuple[asyncio.Future[None], LaneVersion]] = []
        for run in lanes:
            lane, peers = run.lane, run.peers
            members = tuple(p.key for p in peers)
            lost = any(self._steps.readies[p.identity].generation != lane.generation for p in peers)
            rebuild = self.settings.transport.rebuild_group or members != lane.members
            if rebuild or lane.backend.generation < 0 or lost:
                self._generation += 1
                lane.generation, lane.members = self._generation, members
            group = GroupSpec(
                session=self.session,
                generation=lane.generation,
                backend=lane.backend.name,
                bucket_size=lane.backend.bucket_size,
                members=[Member(p.identity, p.pid) for p in peers],
                join=lane.backend.join_spec(lane.generation),
            )
            await self._steps.send_plans(version, peers, group, others or [], lane.key, self._refused)
            joins.append((lane.executor.submit(lane.backend.join, group, 0, version), run))
        for joined, _ in joins:
            await self._joined(version, joined, [f for f, _ in joins])

    async def _joined(self, version: int, joined: asyncio.Future[None], every: list[asyncio.Future[None]]) -> None:
        """One lane's join: bounded by timeout_s (the backend's own too); a member that is gone ends it sooner."""
        try:
            await self._steps.while_connected(joined, self.timeout_s, f"version {version}: joining the group")
        except asyncio.TimeoutError:
            for future in every:
                forget(future)
            who = await self._steps.laggards(version)
            raise WeightSyncTimeout(
                f"version {version}: the data-plane group not joined within transport.timeout_s={self.timeout_s}s; "
                f"{who}"
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

    async def _stream(
        self, source: _Drainable, lanes: list[LaneVersion], stats: SendStats, options: _VersionOptions, sent: _Sent
    ) -> None:
        """Split, pack, publish, broadcast, swap: the planner's steps for one version, executed on every lane.

        Packed buckets take turns in a lane's two slots (bucket metadata, then its broadcast, then on to the
        other slot once the broadcast that last read it is complete). A direct bucket (one chunk of a
        large tensor) needs no slot: its metadata leaves and its broadcast is queued at once, so the
        metadata runs ahead of the bytes and the data-plane thread issues broadcasts back to back.
        The source is pulled once; each lane gets its part of every tensor (lanes.py).
        """
        runs = [self._lane_run(run, stats, options, sent) for run in lanes]
        shapes: dict[str, tuple[int, ...]] = {}  # this version's tensors: the next declarations are checked on them
        async for name, tensor in source:
            shapes[name] = tensor.shape if isinstance(tensor, TensorShard) else tuple(tensor.shape)
            for run in runs:
                part = run.view.part(name, tensor)
                if part is None:
                    continue
                for step in run.planner.add(name, part):
                    if isinstance(step, Pack):
                        run.lane.backend.pack(step.slot, step.offset, step.data)
                    else:
                        await self._flush(run, step)
                if not options.stable_tensors:  # the caller may reuse this tensor's memory next
                    await self._settle_direct(run.lane, 0, run.wire.version)
        for run in runs:
            last = run.planner.finish()
            await self._flush(run, last)  # after a direct bucket: an empty terminator (no broadcast)
            await self._settle_direct(run.lane, 0, run.wire.version)
            for slot in (next_slot(last.slot), last.slot):  # oldest broadcast first
                await self._complete(run.lane, slot, run.wire.version)
            if run.wire.recorder is not None:  # streamed whole: what every peer that takes it will hold
                run.lane.layout = run.wire.recorder.finish()
                stats.layout_buckets += run.wire.recorder.same  # 0 without a held layout
            counts = run.planner.counts
            stats.nbytes += counts.nbytes
            stats.num_tensors = max(stats.num_tensors, counts.tensors)
            stats.num_chunked_tensors += counts.chunked_tensors
            stats.num_buckets += counts.buckets
            stats.direct_buckets += counts.direct_buckets
        self._shapes = shapes

    def _lane_run(self, run: LaneVersion, stats: SendStats, options: _VersionOptions, sent: _Sent) -> _LaneRun:
        """One lane's planner and wire for this version: the whole lane fingerprints and diffs as configured;
        a lane of boxes fingerprints its boxes and sends them whole."""
        lane, backend = run.lane, run.lane.backend
        lane.reset()
        if run.whole:
            fingerprints, delta = sent.fingerprints, sent.delta
        else:
            fingerprints = SenderFingerprints(options.verify, stats.version)
            delta = VersionDelta(DeltaBase(), DeltaPolicy(False, None, False))
        planner = BucketPlanner(
            backend.bucket_size,
            direct_min=self.direct_min,
            direct_device=self.device if backend.direct_ok else None,
            transforms=(fingerprints.stamp, delta.transform),  # fingerprints are of the tensor itself
        )
        layouts = self._layouts(lane, run.peers, options)
        wire = _Wire.of(stats.version, run.peers, options, delta, self.direct_in_flight, layouts)
        return _LaneRun(lane, run.view, planner, wire)

    def _layouts(
        self, lane: Lane, peers: list[Peer], options: _VersionOptions
    ) -> tuple[Layout | None, LayoutRecorder | None]:
        """The layout this version may name on `lane` (the one every peer said it holds in Ready, if it is the one
        this lane streamed last), and the recorder of this version's (transport.layout_once; not sharded: each
        rank's buckets are its own)."""
        if not self.settings.transport.layout_once or options.sharded:
            return None, None
        held = lane.layout
        if held is not None and any(self._steps.readies[p.identity].layout != held.digest for p in peers):
            held = None
        return held, LayoutRecorder()

    async def _flush(self, run: _LaneRun, step: Flush) -> None:
        """A planned bucket out: its metadata to the lane's receivers, then its broadcast onto the lane's
        data-plane thread (from its slot, or from the caller's tensor for a direct bucket). A packed bucket's
        slot is the next but one to pack: the sender waits until the other slot's last broadcast is complete."""
        lane, wire = run.lane, run.wire
        backend = lane.backend
        backend.fence(step.slot)
        await self._steps.publish(wire.peers, wire.meta(step))
        future = lane.executor.submit_started(backend.start_broadcast, step.slot, step.nbytes, step.index, step.data)
        if step.direct:
            lane.direct.append((future, step.index))
            await self._settle_direct(lane, wire.direct_in_flight, wire.version)
            return
        lane.pending[step.slot] = (future, step.index)
        if not step.is_last:
            await self._complete(lane, next_slot(step.slot), wire.version)

    async def _settle_direct(self, lane: Lane, keep: int, version: int) -> None:
        """Wait for the lane's oldest direct broadcasts until at most `keep` are queued or running."""
        while len(lane.direct) > keep:
            future, index = lane.direct.popleft()
            await self._broadcast_done(future, version, index)

    async def _complete(self, lane: Lane, slot: int, version: int) -> None:
        """Wait until the broadcast that last used the lane's `slot` is complete on this rank."""
        pending, lane.pending[slot] = lane.pending[slot], None
        if pending is not None:
            await self._broadcast_done(pending[0], version, pending[1])

    async def _broadcast_done(self, future: asyncio.Future[None] | None, version: int, index: int) -> None:
        if future is None:
            return
        try:
            await self._wait_broadcast(future, version, index)
        except BaseException:
            # given up while still running (a member gone, the timeout): its own failure, when the transfer's
            # timeout ends it, is nobody's news; left unconsumed it would be logged from some later garbage
            # collection ("Future exception was never retrieved")
            forget(future)
            raise

    async def _wait_broadcast(self, future: asyncio.Future[None], version: int, index: int) -> None:
        try:  # answering late rendezvous requests meanwhile; a member that is gone ends it at once
            await self._steps.while_connected(future, self.timeout_s, f"version {version}: broadcast of bucket {index}")
        except asyncio.TimeoutError:
            who = await self._steps.laggards(version)
            raise WeightSyncTimeout(
                f"version {version}: broadcast of bucket {index} not complete within transport.timeout_s="
                f"{self.timeout_s}s; {who}"
            ) from None
        except WeightSyncError:
            raise
        except Exception as exc:
            who = await self._steps.laggards(version)
            raise PeerError(f"version {version}: broadcast of bucket {index} failed ({exc}); {who}") from exc

    async def _abandon(self, version: int, peers: list[Peer], exc: BaseException, *, transport_failed: bool) -> None:
        """After a failure: tell the group to drop the version.

        If the caller's iterable failed, the groups are healthy: let the broadcasts in flight finish
        (receivers are inside them) and keep the groups. If the transport failed, forget them.
        """
        reason = explain(exc)[:1000]
        # the caller gets `exc` (the trainer's driver logs it once, or raises it): not a second WARNING here
        logger.debug("version %d abandoned: %s", version, reason)
        lanes = [lane for lane in (self._whole, *self._box_lanes.values()) if lane is not None]
        if not transport_failed:
            try:
                for lane in lanes:
                    await self._settle_direct(lane, 0, version)
                    for slot in range(NUM_SLOTS):
                        await self._complete(lane, slot, version)
            except (WeightSyncError, asyncio.CancelledError):
                transport_failed = True
        for lane in lanes:
            for future in lane.futures():
                forget(future)
            lane.reset()
        await self._steps.abort(version, peers, reason)
        if transport_failed:
            self._fail_group()


class BlockingWeightSender:
    """`WeightSender` for synchronous training loops: owns a private event loop.

    The loop runs only inside these calls, in the caller's thread, so a weights generator that
    runs FSDP collectives executes in the training thread as usual.
    """

    def __init__(self, cfg: UserConfig | SenderSettings = None) -> None:
        self._loop = asyncio.new_event_loop()
        self.sender = WeightSender(cfg)
        self._sending: asyncio.Task[Any] | None = None
        self._interrupted: str | None = None
        self._lock = threading.Lock()  # `interrupt` comes from another thread; it cancels a send once

    def _run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        if self._loop.is_closed():
            coro.close()
            raise WeightSyncError("BlockingWeightSender is closed; create a new one to send again")
        return self._loop.run_until_complete(coro)

    def interrupt(self, reason: str) -> None:
        """Stop the send in progress, from any thread (a signal watcher): it aborts the version to the
        receivers, drains its stream and raises `Interrupted(reason)`; a send that starts later raises
        it at once, until `clear_interrupt()`."""
        with self._lock:  # once: a second cancel could cut short the abort and the drain of the first
            if self._interrupted is not None:
                return
            self._interrupted = reason
            task = self._sending
        if task is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(task.cancel, reason)

    def clear_interrupt(self) -> None:
        self._interrupted = None

    @property
    def port(self) -> int:
        return self.sender.port

    def start(self) -> None:
        self._run(self.sender.start())

    def send_weights(
        self,
        weights: NamedTensors,
        *,
        version: int,
        options: VersionOptions | None = None,
        stable_tensors: bool | None = None,
        tied: Mapping[str, Iterable[str]] | None = None,
        sharding: Sharding | None = None,
        lora: LoraSpec | None = None,
    ) -> SendStats:
        """`WeightSender.send_weights`, run to completion on this object's loop (`interrupt()` stops it)."""
        options = _one_options(options, stable_tensors=stable_tensors, tied=tied, sharding=sharding, lora=lora)
        coro = self.sender.send_weights(weights, version=version, options=options)
        if self._loop.is_closed():
            return self._run(coro)  # raises: closed
        with self._lock:
            task = self._sending = self._loop.create_task(coro)
            interrupted = self._interrupted
        if interrupted is not None:  # before the task existed: `interrupt` could not cancel it
            task.cancel(interrupted)
        try:
            return self._loop.run_until_complete(task)  # type: ignore[no-any-return]
        except asyncio.CancelledError:
            if self._interrupted is None:
                raise
            raise Interrupted(f"version {version} not sent: {self._interrupted}") from None
        finally:
            self._sending = None

    def close(self) -> None:
        if not self._loop.is_closed():
            self._run(self.sender.close())
            self._loop.close()

    def __enter__(self) -> BlockingWeightSender:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
