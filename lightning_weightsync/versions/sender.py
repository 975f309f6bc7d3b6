"""WeightSender: split, pack, publish, broadcast, swap, in the order of the protocol's steps.

    1-2 Prepare -> Ready (steps.py); the receivers grouped into lanes by what they hold (sender_lanes.py)
    3   Plan, and each lane's group
    4   on every lane (lanes.py `LaneStream`), for each step its bucket planner (versions/planner.py) makes of
        the lane's part of the stream (fingerprints, deltas: its transforms; the layout:
        protocol.chunks.BucketLayout):
        Pack: bucket[offset : offset + size] = chunk, in the slot being filled
        Flush of a packed bucket: publish its metadata (ZeroMQ), start its broadcast on the executor
            thread, and wait until the other slot's previous broadcast is complete (not merely
            enqueued) before packing into it
        Flush of a direct bucket (a chunk of a large tensor, >= transport.direct_min_mb, where the
            backend can): its metadata, then its broadcast straight from the caller's tensor, no slot
        publish + broadcast the last bucket (is_last); wait for both slots
    5   collect acks; account for the version (account.py)

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
import logging
import secrets
import threading
import time
from collections.abc import Coroutine, Iterable, Mapping
from typing import Any, TypeVar

from ..config import DeltaMode, SenderSettings, UserConfig, transport_token
from ..errors import Interrupted, ProtocolError, WeightSyncError, explain
from ..protocol.chunks import NamedTensors
from ..protocol.messages import LoraSpec, SenderAddress
from ..transport.backends import Backend, backend_class
from ..transport.control import Peer, SenderControl
from ..transport.device import resolve_device
from .account import Sent
from .delta import DeltaBase, VersionDelta
from .endpoint import Endpoint
from .lanes import LaneVersion
from .options import ResolvedOptions, Sharding, TellOnce, VersionOptions
from .quantized import version_quantizer
from .sender_lanes import SenderLanes
from .source import Drainable, check_call
from .stats import SendStats, human_bytes
from .steps import SenderSteps
from .verify import SenderFingerprints

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


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
        self.timeout_s = float(t.timeout_s)
        self.session = secrets.token_hex(8)
        self.device = resolve_device(t.backend, t.device, backend_class(t.backend).natural_device)
        self._key = transport_token(t)
        liveness_s = float(t.liveness_s)
        self._control = SenderControl(
            t.host, int(t.port), self._key, self.bucket_size, session=self.session, liveness_s=liveness_s
        )
        self._steps = SenderSteps(
            self._control, session=self.session, min_receivers=self.settings.min_receivers,
            timeout_s=self.timeout_s, ready_timeout_s=float(t.ready_timeout_s), liveness_s=liveness_s,
        )  # fmt: skip
        self._lanes = SenderLanes(self.settings, self._steps, self._control, self.session, self._lane_backend)
        self._started = False
        self._last_version: int | None = None
        self._delta_base = DeltaBase()  # the host copy deltas are taken against (transport.delta)

    def _lane_backend(self, bucket_size: int) -> Backend:
        return self._new_backend(
            self.settings.transport.backend, bucket_size=bucket_size, is_sender=True, session=self.session
        )

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
        """The data-plane group generation: it grows each time a group is (re)built, so a caller can
        tell that receivers joined, left or were replaced."""
        return self._lanes.generation

    @property
    def slot_bytes(self) -> int:
        """Bucket memory the sender holds now, over all its lanes: the whole lane's slots, and the lanes of boxes'
        slots sharing one more bucket budget (lanes.py), so at most 2 x NUM_SLOTS x bucket_size."""
        return self._lanes.slot_bytes

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

    async def start(self) -> None:
        await self._control.start()
        await self._lanes.start()
        self._started = True

    def _close_lanes(self) -> None:
        self._lanes.close()
        self._started = False

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
        options = VersionOptions.given(options, stable_tensors=stable_tensors, tied=tied, sharding=sharding, lora=lora)
        self._check_call(weights, version)
        return await self._send(weights, version, options)

    async def send_again(
        self, weights: NamedTensors, *, version: int, options: VersionOptions | None = None
    ) -> SendStats:
        """`send_weights` of the version sent last (or a newer one) once more, to the receivers registered now: a
        peer serving the version it installed to one late joiner after another (versions/peer_serve.py).

        Only receivers that lack `version` should be registered: one that took it from this sender already
        ignores its Prepare as stale, so it is dropped after transport.ready_timeout_s (and re-registers)."""
        options = VersionOptions.given(options)
        self._check_call(weights, version, again=True)
        return await self._send(weights, version, options)

    async def wait_registered(self, wait_s: float, exclude: frozenset[str] = frozenset()) -> list[str]:
        """Between versions: read the control plane (registrations, heartbeats, Byes) until a receiver not in
        `exclude` is registered or `wait_s` passed; the identities registered then, but those. What a sender that
        serves on demand waits in, instead of a version that would give up on too few receivers."""
        if not self._started:
            raise WeightSyncError("WeightSender.wait_registered() before start() (or after close())")
        return await self._steps.wait_registered(wait_s, exclude)

    async def _send(self, weights: NamedTensors, version: int, options: VersionOptions) -> SendStats:
        self._last_version = version
        stats = SendStats(version=version)
        start = time.perf_counter()
        try:
            sent = await self._send_version(Drainable(weights), version, stats, options)
        finally:
            stats.seconds = time.perf_counter() - start
        if sent is not None:
            self._account(sent, stats)
        return stats

    def _check_call(self, weights: object, version: object, *, again: bool = False) -> None:
        """What makes `send_weights` (`send_again`: the same version may go once more) fail before anything is
        sent or pulled."""
        check_call(weights, version)
        if not self._started:
            raise WeightSyncError("WeightSender.send_weights() before start() (or after close())")
        last = self._last_version
        if last is not None and again and version < last:  # type: ignore[operator]
            raise WeightSyncError(f"version {version} < last sent version {last}; a version is sent again, never older")
        if last is not None and not again and version <= last:  # type: ignore[operator]
            raise WeightSyncError(f"version {version} <= last sent version {last}; versions must increase")

    async def _send_version(
        self, source: Drainable, version: int, stats: SendStats, given: VersionOptions
    ) -> Sent | None:
        """Steps 1-5 of one version (None: nothing to send). On any failure the version is abandoned: the
        group is told, and `source` drained (every FSDP rank must run the same gathers)."""
        tell = TellOnce(given.sharding)
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
            try:  # to the contract the receivers declared, if they did; refused: a local failure, nothing sent
                self._steps.contract, source.quantized = version_quantizer(
                    version, peers, self._steps.readies, self._control.contracts
                )
            except WeightSyncError:
                source.failed = True
                raise
            generation = self._lanes.generation
            lanes = await self._lanes.of_version(version, peers)  # who holds what: a lane per declaration
            await self._join(version, lanes, options.others)  # 3: Plan, and each lane's data-plane group
            formed = self._lanes.generation != generation  # this version's time includes forming the group
            # sharded: each rank diffs its own shards against its own copy of them (`VersionDelta._shard`)
            held = [self._steps.readies[p.identity].delta_base for lane in lanes if lane.whole for p in lane.peers]
            policy = self._delta_base.policy(DeltaMode(self.settings.transport.delta), held)
            fingerprints = SenderFingerprints(options.verify, version)
            sent = Sent(VersionDelta(self._delta_base, policy), fingerprints, formed, options.sharded)
            # 4: bucket metadata, each ahead of its bytes, on every lane
            await self._lanes.stream(source, lanes, stats, options, (sent.fingerprints, sent.delta))
            if source.quantized is not None:
                stats.quantized_tensors = source.quantized.stats.quantized
                stats.unquantized_bytes = source.quantized.stats.bytes_in
            sent.acks = await self._steps.collect_acks(version, peers)  # 5: Ack
        except BaseException as exc:
            tell([])
            if peers:
                self._delta_base.invalidate()  # the copy may be part-updated, or some receivers lack the version
            await self._abandon(version, peers, exc, transport_failed=not source.failed)
            await source.drain()
            raise
        return sent

    async def _join(self, version: int, lanes: list[LaneVersion], others: list[SenderAddress] | None = None) -> None:
        """Step 3: each receiver told its rank in its lane's group (Plan, listing `others`, the other senders of a
        sharded version), and every lane's group built or reused."""
        await self._lanes.join(version, lanes, others or [])

    def _options(self, source: Drainable, version: int, given: VersionOptions) -> ResolvedOptions:
        """`send_weights`' arguments and the config, resolved once for the version; what every receiver would
        refuse is refused here (a local failure: the group is fine, `source` is marked so)."""
        # the policy is read per version (a caller may lower min_receivers after losing a rollout)
        t = self.settings.transport
        self._steps.min_receivers = self.settings.min_receivers
        self._steps.ready_timeout_s = float(t.ready_timeout_s)
        self._lanes.transport, self._lanes.timeout_s = t, self.timeout_s
        try:
            return given.resolve(version, t, source.weights)
        except ProtocolError:
            source.failed = True
            raise

    def _account(self, sent: Sent, stats: SendStats) -> None:
        """After the acks: what the version leaves (account.py), and its line in the log."""
        form = sent.account(stats, self._delta_base)
        logger.info(
            "version %d sent: %s in %.3f s (%s/s) to %d receivers, %d tensors, %d buckets; %s",
            stats.version, human_bytes(stats.nbytes), stats.seconds,
            human_bytes(stats.nbytes / stats.seconds if stats.seconds > 0 else 0.0), stats.receivers,
            stats.num_tensors, stats.num_buckets, form,
        )  # fmt: skip

    async def _abandon(self, version: int, peers: list[Peer], exc: BaseException, *, transport_failed: bool) -> None:
        """After a failure: tell the group to drop the version. If the caller's iterable failed, the groups are
        healthy and kept (the broadcasts in flight finish first); if the transport failed, they are forgotten."""
        reason = explain(exc)[:1000]
        # the caller gets `exc` (the trainer's driver logs it once, or raises it): not a second WARNING here
        logger.debug("version %d abandoned: %s", version, reason)
        transport_failed = await self._lanes.abandon(version, transport_failed)
        await self._steps.abort(version, peers, reason)
        if transport_failed:
            self._lanes.fail()
        self._lanes.refused = {}


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
        options = VersionOptions.given(options, stable_tensors=stable_tensors, tied=tied, sharding=sharding, lora=lora)
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
