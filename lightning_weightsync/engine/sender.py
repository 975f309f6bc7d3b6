"""WeightSender: split, pack, publish, broadcast, swap.

    for each chunk from split_weight_chunks(weights, bucket_size, alone_from=direct_min):
        when the chunk starts a new bucket: publish the full bucket's metadata (ZeroMQ), start its
        broadcast on the executor thread, swap to the other slot, and wait until that slot's
        previous broadcast is complete (not merely enqueued) before packing into it
        a chunk of a large tensor (>= transport.direct_min_mb) has a bucket of its own: it is not
        packed but broadcast straight from the caller's tensor (where the backend can)
        otherwise pack: bucket[offset : offset + size] = chunk
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
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig

from ..config import DeltaMode, VerifyMode, auth_token, bucket_size_bytes, direct_min_bytes, load_config
from ..errors import Interrupted, PeerError, ProtocolError, WeightSyncError, WeightSyncTimeout, explain
from ..protocol.chunks import (
    MAX_BUCKET_ENTRIES,
    NamedTensors,
    TensorMeta,
    TensorShard,
    aiter_any,
    chunk_goes_alone,
    split_weight_chunks,
)
from ..protocol.dtypes import dtype_name
from ..protocol.fingerprint import NO_FINGERPRINT
from ..protocol.messages import (
    BucketMeta,
    Entry,
    GroupSpec,
    LoraSpec,
    Member,
    SenderAddress,
    check_tensor,
    validate_lora,
    validate_tied,
)
from ..transport.backends import NO_SLOT, NUM_SLOTS, Backend, backend_class, next_slot
from ..transport.control import Peer, SenderControl
from ..transport.device import resolve_device
from ..transport.executor import SerialExecutor, forget
from .delta import DeltaBase, DeltaPolicy, VersionDelta
from .endpoint import Endpoint
from .session import SenderSession
from .stats import SendStats, human_bytes
from .verify import SenderFingerprints

logger = logging.getLogger(__name__)


_HOLDING_TYPES: tuple[type, ...] = (list, tuple, type({}.items()), type({}.values()))
_HOLDING_TYPES += tuple({type(iter(c)) for c in ([], (), {}.items(), {}.values())})
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

    def __init__(self, weights: NamedTensors, fingerprints: SenderFingerprints | None = None) -> None:
        self._it: AsyncIterator[tuple[str, torch.Tensor]] = aiter_any(weights)
        self.fingerprints = fingerprints  # taken as each tensor is pulled (transport.verify)
        self.exhausted = False
        self.failed = False  # the caller's iterable raised (a local failure: the group is fine)
        self.check = True  # validate each tensor with the receivers' rules (off while draining)
        self.names: set[str] = set()  # sent in this version: a second one would fail every receiver's merge

    def __aiter__(self) -> _Drainable:
        return self

    async def __anext__(self) -> tuple[str, torch.Tensor]:
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
            if self.fingerprints is not None:
                self.fingerprints.take(*item)
        return item

    async def drain(self) -> None:
        self.check = False
        if not self.exhausted:
            async for _ in self:
                pass


@dataclass(frozen=True)
class Sharding:
    """This sender's part in a sharded version (`trainer.send_mode: sharded`): every trainer rank sends the
    bytes it owns, each over its own data-plane group, and receivers tile the union.

    `index` 0 coordinates: it gathers the receivers (`trainer.min_receivers`, as always), hands their
    identities to `on_members` (which passes them to the other ranks; called exactly once per version,
    with [] when it gathered none or failed first, so no rank waits for it), and lists `others` in its
    plan so that each receiver also connects to them. Index i > 0 serves exactly `members`, the
    coordinator's receivers, and marks its buckets as sender i."""

    index: int
    others: tuple[SenderAddress, ...] = ()
    on_members: Callable[[list[str]], None] | None = None
    members: tuple[str, ...] = ()


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
        check_tensor(name, shape, dtype_name(dtype))
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


class WeightSender(Endpoint):
    """Sends versions of a stream of `(name, tensor)` to every registered receiver.

    Args:
        cfg: the weightsync config (`load_config()`); uses `transport.*` and `trainer.min_receivers`.
    """

    def __init__(self, cfg: DictConfig | None = None) -> None:
        self.cfg = cfg if cfg is not None else load_config()
        t = self.cfg.transport
        self.bucket_size = bucket_size_bytes(self.cfg)
        self.direct_min = direct_min_bytes(self.cfg)
        self.direct_in_flight = int(t.direct_in_flight)
        self.timeout_s = float(t.timeout_s)
        self.session = secrets.token_hex(8)
        self.device = resolve_device(t.backend, t.device, backend_class(t.backend).natural_device)
        self._key = auth_token(self.cfg)
        self.liveness_s = float(t.liveness_s)
        self._control = SenderControl(
            t.host, int(t.port), self._key, self.bucket_size, session=self.session, liveness_s=self.liveness_s
        )
        self._steps = SenderSession(
            self._control,
            session=self.session,
            min_receivers=int(self.cfg.trainer.min_receivers),
            timeout_s=self.timeout_s,
            ready_timeout_s=float(t.ready_timeout_s),
            liveness_s=self.liveness_s,
        )
        self._backend: Backend | None = None
        self._executor: SerialExecutor | None = None
        self._group: tuple[tuple[str, int], ...] = ()
        self._generation = 0
        self._last_version: int | None = None
        self._delta_base = DeltaBase()  # the host copy deltas are taken against (transport.delta)
        self._pending: list[asyncio.Future[None] | None] = [None] * NUM_SLOTS  # broadcast per slot
        self._direct: deque[tuple[asyncio.Future[None], int]] = deque()  # direct broadcasts, oldest first

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
        mode = DeltaMode(self.cfg.transport.delta)
        base = self._delta_base
        usable = base.version is not None and not base.full_requested and bool(peers)
        usable = usable and all(p.delta_base == base.version for p in peers)
        base.full_requested = False
        if usable and mode is DeltaMode.auto and base.prefer_whole():  # measured: deltas lose on this link
            usable = False
        return DeltaPolicy(mode is not DeltaMode.off, base.version if usable else None, mode is DeltaMode.always)

    async def start(self) -> None:
        t = self.cfg.transport
        await self._control.start()
        self._executor = SerialExecutor(self._executor_name)
        self._backend = self._new_backend(t.backend, bucket_size=self.bucket_size, is_sender=True, session=self.session)
        await self._executor.submit(self._backend.setup, t.host, int(t.store_port))

    async def __aenter__(self) -> WeightSender:
        await self.start()
        return self

    # -- one version ------------------------------------------------------------------------------
    async def send_weights(
        self,
        weights: NamedTensors,
        *,
        version: int,
        stable_tensors: bool | None = None,
        tied: Mapping[str, Iterable[str]] | None = None,
        sharding: Sharding | None = None,
        lora: LoraSpec | None = None,
    ) -> SendStats:
        """Send one version; raises `WeightSyncError` (after draining `weights`) on failure.

        A receiver that nacks or does not ack in time makes this raise `PeerError` with the
        stats attached (`exc.stats`): the bytes went out, but not every rollout holds them.

        `stable_tensors`: the iterable yields tensors whose memory it does not reuse for the next
        one, so a direct broadcast may still read a tensor while the next is produced (overlap). None (the
        default): decided from the iterable (`holds_its_tensors`: a list, a dict's items, `named_parameters()`
        are; a generator of the caller's is not, and gets the safe path unless it says True).
        `tied`: {name sent: other names of that tensor} (tied embeddings, sent once); it travels
        with the first bucket so every sink can restore the tie.
        `lora`: what the version is of a PEFT LoRA model (`trainer/lora.py`); it travels with the first bucket.
        `sharding`: this sender's part in a sharded version (see `Sharding`); `weights` may then
        yield `(name, TensorShard)` items, the byte ranges this rank owns.
        """
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
        self._last_version = version
        # sharded: each shard's bytes are fingerprinted, and each receiver checks them where they land
        fingerprints = SenderFingerprints(VerifyMode(self.cfg.transport.verify), version)
        source = _Drainable(weights, fingerprints)
        stats = SendStats(version=version)
        start = time.perf_counter()
        peers: list[Peer] = []
        told = False  # sharded coordinator: whether the other ranks heard who the receivers are

        def tell(members: list[str]) -> None:
            nonlocal told
            if sharding is not None and sharding.on_members is not None and not told:
                told = True
                sharding.on_members(members)

        only = frozenset(sharding.members) if sharding is not None and sharding.index > 0 else None
        # a shard's chunks end before its tensor's last byte, so "the caller may reuse this tensor now" cannot be
        # read from the metadata: shards are the module's own local storage, untouched during a sync (stable)
        if stable_tensors is None:
            stable_tensors = holds_its_tensors(weights)
        stable_tensors = stable_tensors or sharding is not None
        index = sharding.index if sharding is not None else 0
        try:
            # the policy is read per version (a caller may lower min_receivers after losing a rollout)
            self._steps.min_receivers = int(self.cfg.trainer.min_receivers)
            self._steps.ready_timeout_s = float(self.cfg.transport.ready_timeout_s)
            tied_names = {str(k): [str(a) for a in v] for k, v in (tied or {}).items()}
            try:
                validate_tied(BucketMeta(version, 0, False, 0, [], tied_names))  # what every receiver checks
                if lora is not None:
                    validate_lora(lora)
            except ProtocolError:
                source.failed = True  # a local failure: the group is fine
                raise
            if only is not None and not only:
                logger.info("version %d: the coordinating sender gathered no receivers; nothing sent", version)
                await source.drain()
                return stats
            peers = await self._steps.gather_ready(version, only)  # 1-2: Prepare -> Ready
            tell([p.identity for p in peers])
            stats.receivers = len(peers)
            if not peers:
                logger.info("version %d: no receivers registered; nothing sent", version)
                await source.drain()
                return stats
            others = list(sharding.others) if sharding is not None and index == 0 else []
            generation = self._generation
            await self._join(version, peers, others)  # 3: Plan, and the data-plane group
            formed = self._generation != generation  # this version's time includes forming the group
            # a sharded version's parts are shards: no sender has a whole tensor to diff (delta is whole-only)
            policy = self._delta_policy(peers) if sharding is None else DeltaPolicy(False, None, False)
            delta = VersionDelta(self._delta_base, policy)
            # 4: bucket metadata, each ahead of its bytes
            await self._stream(
                source, version, peers, stats, stable_tensors=stable_tensors, tied=tied_names, sender=index,
                delta=delta, lora=lora,
            )  # fmt: skip
            acks = await self._steps.collect_acks(version, peers)  # 5: Ack
        except BaseException as exc:
            tell([])
            if peers:
                self._delta_base.invalidate()  # the copy may be part-updated, or some receivers lack the version
            await self._abandon(version, peers, exc, transport_failed=not source.failed)
            await source.drain()
            raise
        finally:
            stats.seconds = time.perf_counter() - start
        stats.checksums = fingerprints.checksums if sharding is None else {}  # shards' are no tensor's checksum
        stats.failed = {
            ident: ("no ack within transport.timeout_s" if ack is None else ack.error or "failed")
            for ident, ack in acks.items()
            if ack is None or not ack.ok
        }
        delta.finish(version, ok=not stats.failed)
        stats.delta_tensors = delta.payloads
        if not stats.failed and not formed:
            self._delta_base.measured(delta.payloads > 0, stats.seconds, delta.model_bytes)
        if stats.failed:
            err = PeerError(f"version {version}: receivers failed: {stats.failed}")
            err.stats = stats
            raise err
        logger.info(
            "version %d sent: %s in %.3f s (%s/s) to %d receivers, %d tensors, %d buckets",
            version, human_bytes(stats.nbytes), stats.seconds,
            human_bytes(stats.nbytes / stats.seconds if stats.seconds > 0 else 0.0), stats.receivers,
            stats.num_tensors, stats.num_buckets,
        )  # fmt: skip
        return stats

    async def _join(self, version: int, peers: list[Peer], others: list[SenderAddress] | None = None) -> None:
        """Tell every receiver its rank, then build (or reuse) the data-plane group."""
        assert self._backend is not None and self._executor is not None
        members = tuple(p.key for p in peers)
        lost = any(p.group_generation != self._generation for p in peers)
        if self.cfg.transport.rebuild_group or members != self._group or self._backend.generation < 0 or lost:
            self._generation += 1
            self._group = members
        group = GroupSpec(
            session=self.session,
            generation=self._generation,
            backend=self._backend.name,
            bucket_size=self.bucket_size,
            members=[Member(p.identity, p.pid) for p in peers],
            join=self._backend.join_spec(self._generation),
        )
        await self._steps.send_plans(version, peers, group, others or [])
        joined = self._executor.submit(self._backend.join, group, 0, version)
        try:  # the backend bounds the join by timeout_s itself; a member that is gone ends it sooner
            await self._steps.while_connected(joined, self.timeout_s, f"version {version}: joining the group")
        except asyncio.TimeoutError:
            forget(joined)
            who = await self._steps.laggards(version)
            raise WeightSyncTimeout(
                f"version {version}: the data-plane group not joined within transport.timeout_s={self.timeout_s}s; "
                f"{who}"
            ) from None
        except WeightSyncError:
            forget(joined)
            raise
        except Exception as exc:  # the backend's own failure to form the group: a peer's, not a bug here
            who = await self._steps.laggards(version)
            raise PeerError(f"version {version}: joining the data-plane group failed ({exc}); {who}") from exc
        except BaseException:
            forget(joined)
            raise

    async def _stream(
        self,
        source: _Drainable,
        version: int,
        peers: list[Peer],
        stats: SendStats,
        *,
        stable_tensors: bool = False,
        tied: dict[str, list[str]] | None = None,
        sender: int = 0,
        delta: VersionDelta | None = None,
        lora: LoraSpec | None = None,
    ) -> None:
        """Split, pack, publish, broadcast, swap: the bucket sequence of one version.

        Packed buckets take turns in the two slots (bucket metadata, then its broadcast, then on to the
        other slot once the broadcast that last read it is complete). A direct bucket (one chunk of a
        large tensor) needs no slot: its metadata leaves and its broadcast is queued at once, so the
        metadata runs ahead of the bytes and the data-plane thread issues broadcasts back to back.
        """
        assert self._backend is not None and self._executor is not None
        backend, executor = self._backend, self._executor
        pending = self._pending = [None] * NUM_SLOTS  # the last broadcast of each packed slot
        # Direct broadcasts queued or running, oldest first. Unless the producer's tensors are stable, the
        # caller may reuse a tensor's memory once it yields the next one, so its broadcasts must be
        # complete by then; with stable tensors, up to `direct_in_flight` of them may still be moving.
        direct = self._direct = deque()
        in_flight_limit = max(1, self.direct_in_flight) if stable_tensors else 0
        slot, bucket_index, fill = 0, 0, 0
        entries: list[Entry] = []
        prints: list[int] = []  # one fingerprint per entry (transport.verify), NO_FINGERPRINT where none
        fingerprints = source.fingerprints
        sizes: list[int] = []  # one per entry: the delta payload it is a chunk of, -1 where the tensor goes whole
        deltas: dict[str, tuple[TensorMeta, int]] = {}  # name -> (the tensor's own meta, payload bytes)
        delta_base = delta.policy.base_version if delta is not None and delta.policy.base_version is not None else -1
        whole = True  # every chunk packed in the bucket so far is a whole tensor

        async def announce(
            bucket_slot: int,
            is_last: bool,
            nbytes: int,
            bucket_entries: list[Entry],
            data: torch.Tensor | None,
            bucket_prints: list[int],
            bucket_sizes: list[int],
        ) -> asyncio.Future[None]:
            """A bucket's metadata to every receiver, then its broadcast onto the data-plane thread (from
            `bucket_slot`, or from the caller's tensor `data` for a direct bucket)."""
            nonlocal bucket_index
            index, bucket_index = bucket_index, bucket_index + 1
            first_tied = tied if index == 0 and tied else {}
            backend.fence(bucket_slot)
            checked = bucket_prints if any(p != NO_FINGERPRINT for p in bucket_prints) else []
            carried = bucket_sizes if any(size >= 0 for size in bucket_sizes) else []
            meta = BucketMeta(
                version, index, is_last, nbytes, bucket_entries, first_tied, sender, fingerprints=checked,
                deltas=carried, delta_base=delta_base if carried else -1, lora=lora if index == 0 else None,
            )  # fmt: skip
            await self._steps.publish(peers, meta)
            stats.num_buckets += bool(bucket_entries)
            return executor.submit_started(backend.start_broadcast, bucket_slot, nbytes, index, data)

        async def publish(is_last: bool) -> None:
            """The packed bucket, from its slot."""
            nonlocal fill, entries, prints, sizes
            pending[slot] = await announce(slot, is_last, fill, entries, None, prints, sizes)
            fill, entries, prints, sizes = 0, [], [], []

        async def publish_direct(entry: Entry, data: torch.Tensor) -> None:
            """A direct bucket, straight from the caller's tensor."""
            index = bucket_index
            prints_of, sizes_of = [print_of(entry)], [size_of(entry)]
            direct.append((await announce(NO_SLOT, False, entry.chunk_size, [entry], data, prints_of, sizes_of), index))

        def print_of(entry: Entry) -> int:
            return fingerprints.of(entry.name) if fingerprints is not None else NO_FINGERPRINT

        def size_of(entry: Entry) -> int:
            return deltas[entry.name][1] if entry.name in deltas else -1

        async def encoded() -> AsyncIterator[tuple[str, torch.Tensor]]:
            """The source, each tensor replaced by its delta payload where the version sends one."""
            async for name, tensor in source:
                if delta is None:
                    yield name, tensor
                    continue
                sendable, size = delta.encode(name, tensor)
                if size >= 0:
                    deltas[name] = (TensorMeta(name, tuple(tensor.shape), tensor.dtype, 0, 0), size)
                yield name, sendable

        async def swap() -> None:
            """On to the next slot, once the broadcast that last read it is complete."""
            nonlocal slot
            slot = next_slot(slot)
            await self._complete(pending, slot, version, bucket_index - NUM_SLOTS)

        async def settle_direct(keep: int) -> None:
            while len(direct) > keep:
                future, index = direct.popleft()
                await self._broadcast_done(future, version, index)

        direct_ok, bucket_size, alone_from = backend.direct_ok, self.bucket_size, self.direct_min
        async for meta, data in split_weight_chunks(
            encoded(), bucket_size, alone_from=alone_from if direct_ok else None
        ):
            assert meta.offset is not None
            # A chunk alone in its bucket needs no packing where the backend can send any tensor.
            is_direct = (
                direct_ok and meta.chunk_size > 0 and data.device == self.device
                and chunk_goes_alone(meta, bucket_size, alone_from)
            )  # fmt: skip
            # The packed bucket so far is complete when the split starts a new one (its offset goes back, or
            # it holds MAX_BUCKET_ENTRIES chunks: empty tensors do not move the offset). A direct chunk goes out
            # around it while it holds whole tensors only; one with a part of a tensor goes out first (a
            # receiver merges one tensor at a time: no other tensor may come between its chunks).
            if entries and (not whole if is_direct else meta.offset < fill or len(entries) >= MAX_BUCKET_ENTRIES):
                await publish(is_last=False)
                await swap()
            entry = Entry.from_meta(meta)
            if meta.name in deltas:  # a chunk of a delta payload: the entry describes the tensor it rebuilds
                real = deltas[meta.name][0]
                shape, dtype = list(real.shape), dtype_name(real.dtype)
                entry = Entry(meta.name, shape, dtype, meta.chunk_offset, meta.chunk_size, meta.offset)
            stats.nbytes += meta.chunk_size
            if meta.is_first:
                stats.num_tensors += 1
                stats.num_chunked_tensors += not meta.is_last
            if is_direct:  # a bucket of its own, published around the packed one being filled
                stats.direct_buckets += 1
                await publish_direct(entry, data)
                await settle_direct(in_flight_limit)
            else:
                if meta.chunk_size:
                    backend.pack(slot, meta.offset, data)
                whole = (whole or not entries) and meta.is_first and meta.is_last
                entries.append(entry)
                prints.append(print_of(entry))
                sizes.append(size_of(entry))
                fill = meta.offset + meta.chunk_size
            if meta.is_last and not stable_tensors:  # the caller may reuse this tensor's memory next
                await settle_direct(0)
        await publish(is_last=True)  # after a direct bucket: an empty terminator (no broadcast)
        await settle_direct(0)
        for age in range(NUM_SLOTS - 1, -1, -1):  # oldest broadcast first
            await self._complete(pending, (slot - age) % NUM_SLOTS, version, bucket_index - 1 - age)

    async def _complete(self, pending: list[asyncio.Future[None] | None], slot: int, version: int, index: int) -> None:
        """Wait until the broadcast that last used `slot` is complete on this rank."""
        future, pending[slot] = pending[slot], None
        await self._broadcast_done(future, version, index)

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

        If the caller's iterable failed, the group is healthy: let the broadcasts in flight finish
        (receivers are inside them) and keep the group. If the transport failed, forget the group.
        """
        reason = explain(exc)[:1000]
        # the caller gets `exc` (the trainer's driver logs it once, or raises it): not a second WARNING here
        logger.debug("version %d abandoned: %s", version, reason)
        if not transport_failed:
            try:
                while self._direct:
                    await self._broadcast_done(self._direct.popleft()[0], version, -1)
                for slot in range(NUM_SLOTS):
                    await self._complete(self._pending, slot, version, -1)
            except (WeightSyncError, asyncio.CancelledError):
                transport_failed = True
        for future in [*self._pending, *(f for f, _ in self._direct)]:
            forget(future)
        self._pending = [None] * NUM_SLOTS
        self._direct = deque()
        await self._steps.abort(version, peers, reason)
        if transport_failed:
            self._fail_group()


class BlockingWeightSender:
    """`WeightSender` for synchronous training loops: owns a private event loop.

    The loop runs only inside these calls, in the caller's thread, so a weights generator that
    runs FSDP collectives executes in the training thread as usual.
    """

    def __init__(self, cfg: DictConfig | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self.sender = WeightSender(cfg)
        self._sending: asyncio.Task[Any] | None = None
        self._interrupted: str | None = None
        self._lock = threading.Lock()  # `interrupt` comes from another thread; it cancels a send once

    def _run(self, coro: Any) -> Any:
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
        weights: Iterable[tuple[str, torch.Tensor]],
        *,
        version: int,
        stable_tensors: bool | None = None,
        tied: Mapping[str, Iterable[str]] | None = None,
        sharding: Sharding | None = None,
        lora: LoraSpec | None = None,
    ) -> SendStats:
        """`WeightSender.send_weights`, run to completion on this object's loop (`interrupt()` stops it)."""
        coro = self.sender.send_weights(
            weights, version=version, stable_tensors=stable_tensors, tied=tied, sharding=sharding, lora=lora
        )
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
