"""The data-plane interface every backend implements, driven identically by sender and receiver.

Life cycle, sender (rank 0) and receivers (ranks 1..N) alike:
  `setup()` once (sender: create stores / shared segments), `join_spec()` (sender only: what the
  receivers need to join, a typed `Join` carried in the plan's `GroupSpec`), `join(group, rank, version)`
  per version (builds the group when the generation changed, reuses it otherwise), then per bucket the
  sender `pack()`s chunks into a slot, `broadcast(slot, nbytes)` runs (blocking until the bucket is
  complete on this rank; called from one executor thread so collectives stay in order), and a
  receiver reads the bytes through `view(slot, nbytes)` and `release()`s the slot once they were
  copied out. `broken()` marks the group unusable after a failure; `close()` frees everything.

The sender and receiver never touch a backend's buffers or private state: everything goes through these methods.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from ...errors import ProtocolError
from ...protocol.joins import JoinSpec
from ...protocol.messages import GroupSpec
from ..device import empty_bucket, record_event
from .relay import RelayCounters

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store

logger = logging.getLogger(__name__)

NUM_SLOTS = 2  # double buffering: pack / receive one bucket while the other is in flight
NO_SLOT = -1  # `broadcast(NO_SLOT, ..., buffer)`: a direct transfer from / into `buffer`, no slot involved


def next_slot(slot: int) -> int:
    """The slot after `slot` in the ring of `NUM_SLOTS` (bucket k always uses slot k % NUM_SLOTS)."""
    return (slot + 1) % NUM_SLOTS


class Rendezvous(Protocol):
    """Where process-group ranks meet when transport.auth_token is set: the control plane
    (`SenderControl` / `ReceiverControl`), which keeps the keys behind its authentication instead
    of an open TCPStore."""

    host: str
    port: int

    def rendezvous_store(self, prefix: str, timeout_s: float) -> Store: ...


class Backend(ABC):
    name: str = "base"  # its `transport.backend` name, the one its line in `BACKENDS` (__init__.py) registers
    natural_device: str = "cpu"  # where buckets live unless `transport.device` says otherwise
    # True where `broadcast` may read from / write to any contiguous tensor on `device` instead of
    # a slot: full-bucket chunks then skip the pack copy (sender) and the merge copy (receiver).
    direct_ok: bool = False
    # The `Join` kind this backend puts into (sender) and reads from (receivers) a group spec.
    join_type: type[JoinSpec]
    # True where a receiver's slots are plain memory of its own (not the sender's shared or registered
    # slots): they outlive a sender's restart and can be allocated before the first plan (`preallocate`).
    own_receiver_slots: bool = False
    # True where a receiver's `broadcast` does nothing (the bytes are already in the slot it maps: shm,
    # cuda_ipc): a receiver's pipeline then counts a bucket as arrived on its event loop, without the two
    # thread hops (data-plane thread, its waiter) a call through the executor costs on every bucket.
    receive_in_place: bool = False
    # True where a group may carry a relay (`GroupSpec.relay`, transport.fanout=chain): the backend moves a bucket
    # by point-to-point sends along it, each receiver forwarding what it receives (`backends/relay.py`).
    relays: bool = False

    def __init__(
        self,
        *,
        bucket_size: int,
        device: torch.device,
        timeout_s: float,
        is_sender: bool,
        session: str = "",
        auth_key: bytes | None = None,
        identity: str = "",
        rendezvous: Rendezvous | None = None,
    ) -> None:
        self.session = session
        self.rendezvous = rendezvous  # process-group backends meet through it when transport.auth_token is set
        self.identity = identity  # the receiver's control-plane identity (names its releases)
        self.auth_key = auth_key
        self.bucket_size = bucket_size
        self.device = device
        self.timeout_s = timeout_s
        self.is_sender = is_sender
        self.group: GroupSpec | None = None  # the group joined last (members, generation, join fields)
        self.generation = -1
        self.version = -1  # the version being moved (set by every `join`)
        self.rank = 0 if is_sender else -1
        self.world_size = 0
        self.buckets: list[torch.Tensor] = []
        self._fences: list[object | None] = [None] * NUM_SLOTS
        self.relayed = RelayCounters()  # bytes sent along chains (transport.fanout=chain; 0 for any other fan-out)

    # -- set-up -----------------------------------------------------------------------------
    def setup(self, host: str, store_port: int) -> None:
        """Sender only, once: create whatever receivers will attach to."""
        self.buckets = [empty_bucket(self.bucket_size, self.device) for _ in range(NUM_SLOTS)]

    def setup_lane(self, primary: Backend, host: str) -> None:
        """Sender only, once, for a lane of boxes (versions/lanes.py): set up beside `primary`, the whole lane's
        backend of the same kind. By default a set-up of its own on any free port; a backend that can share
        what `primary` created (a rendezvous store) does."""
        self.setup(host, 0)

    def preallocate(self) -> int:
        """Receiver: allocate the slots now, at the configured bucket size, where they are this process's
        own memory; returns the bytes taken (0 where the slots come from the sender at the first join).
        A vLLM worker does this when its engine is built, before vLLM measures free memory for the KV
        cache, so the cache is sized around the slots instead of the first sync running out of memory."""
        if self.is_sender or not self.own_receiver_slots:
            return 0
        self.buckets = [empty_bucket(self.bucket_size, self.device) for _ in range(NUM_SLOTS)]
        return NUM_SLOTS * self.bucket_size

    @abstractmethod
    def join_spec(self, generation: int) -> JoinSpec:
        """Sender only: what receivers need to join the group of `generation` (goes into its `GroupSpec`)."""

    def join(self, group: GroupSpec, rank: int, version: int) -> None:
        """All ranks, once per version: make `group` ready with this process as `rank` (blocking, bounded
        by timeout_s). The group itself is reused while its generation holds."""
        if not isinstance(group.join, self.join_type):
            raise ProtocolError(
                f"plan for backend {group.backend} carries {type(group.join).__name__} join fields, "
                f"backend {self.name} needs {self.join_type.__name__}"
            )
        # a receiver's own slots serve a group of smaller buckets too (a lane of boxes: versions/lanes.py)
        size, wanted = self.bucket_size, group.bucket_size
        fits = size >= wanted if self.own_receiver_slots else size == wanted
        stale = len(self.buckets) != NUM_SLOTS or not fits
        # shared slots belong to the sender's backend that made them: a restarted sender (another session), or
        # another of its lanes (another join: its own segments), has others
        moved = group.session != self.session or (self.group is not None and group.join != self.group.join)
        if not self.is_sender and (stale or (moved and not self.own_receiver_slots)):
            if self.buckets and not fits:
                logger.warning(
                    "the sender's buckets are %d bytes, this receiver's transport.bucket_size_mb gives %d: "
                    "the slots are allocated again at the sender's size (set the same bucket_size_mb on both "
                    "sides so memory sized at start-up stays right)",
                    group.bucket_size,
                    self.bucket_size,
                )
            self.bucket_size = group.bucket_size
            self.buckets = self._receiver_buckets(group)
        # a restarted sender (new session) numbers its generations afresh: never reuse a group across sessions
        if (
            group.session != self.session
            or group.generation != self.generation
            or group.world_size != self.world_size
            or rank != self.rank
        ):
            self._drop_group()
            self._build_group(group, rank)
            self.relayed.lost.clear()  # a new group: every rank it feeds is there again
            self.session = group.session
            self.generation, self.rank, self.world_size = group.generation, rank, group.world_size
            logger.debug("%s group generation %d: rank %d of %d", self.name, group.generation, rank, group.world_size)
        self.group, self.version = group, version

    @property
    def members(self) -> dict[str, int]:
        """The receivers of the current group, identity -> pid (empty before the first join)."""
        return {m.identity: m.pid for m in self.group.members} if self.group is not None else {}

    def _receiver_buckets(self, group: GroupSpec) -> list[torch.Tensor]:
        return [empty_bucket(group.bucket_size, self.device) for _ in range(NUM_SLOTS)]

    @abstractmethod
    def _build_group(self, group: GroupSpec, rank: int) -> None: ...

    def _drop_group(self) -> None:  # noqa: B027 - optional hook
        pass

    # -- data path --------------------------------------------------------------------------
    def pack(self, slot: int, offset: int, data: torch.Tensor) -> None:
        """Sender: copy the uint8 chunk `data` into `slot` at `offset` (asynchronous off CPU: `fence`
        before the slot is broadcast)."""
        self.buckets[slot][offset : offset + data.numel()].copy_(data, non_blocking=self.device.type != "cpu")

    def view(self, slot: int, nbytes: int) -> torch.Tensor:
        """Receiver: the first `nbytes` of `slot`, valid until `release(slot, ...)`."""
        return self.buckets[slot][:nbytes]

    def fence(self, slot: int) -> None:
        """Record that work queued on the compute stream touches `slot` (the sender's packing copies,
        a receiver's copies out of it); the backend waits for it before it reads or reuses the slot.
        `fence(NO_SLOT)` before a direct transfer: backends that order a caller's tensor against the compute
        stream inside `broadcast` (nccl) need nothing; those that cannot (hccl) synchronize here."""
        if slot != NO_SLOT:
            self._fences[slot] = record_event(self.device)

    def wait_fence(self, slot: int) -> None:
        if slot == NO_SLOT:
            return
        event = self._fences[slot]
        if event is not None:
            event.synchronize()  # type: ignore[attr-defined]
            self._fences[slot] = None

    @abstractmethod
    def broadcast(self, slot: int, nbytes: int, bucket_index: int, buffer: torch.Tensor | None = None) -> None:
        """Move `view(slot, nbytes)` (or `buffer`, where `direct_ok`) from rank 0 to every rank;
        returns when complete here."""

    def start_broadcast(
        self, slot: int, nbytes: int, bucket_index: int, buffer: torch.Tensor | None = None
    ) -> Callable[[], None] | None:
        """`broadcast`, split in two where the backend can: start the transfer and return a function that
        waits for it (None: already complete). A lane starts the next transfer before waiting for this
        one, so several are in flight. The default runs the blocking `broadcast`."""
        self.broadcast(slot, nbytes, bucket_index, buffer)
        return None

    def loop_broadcast(
        self, slot: int, nbytes: int, bucket_index: int, buffer: torch.Tensor | None = None
    ) -> asyncio.Future[None] | None:
        """Sender: `broadcast` as a future of the running event loop, where the backend can wait for it there
        without a thread (shared slots: the transfer is the receivers' releases); None where it cannot, and the
        caller posts `start_broadcast` to the data-plane thread. A backend does one or the other for every
        bucket of a slot, so the order of the thread's calls stays every rank's order."""
        return None

    def release(self, slot: int, bucket_index: int) -> None:  # noqa: B027 - optional hook
        """Receiver: the bytes of `slot` were consumed (shared-buffer backends hand it back)."""

    def broken(self) -> None:
        """Forget the group after a failure; the next `join` rebuilds it."""
        self._drop_group()
        self.generation = -1

    def close(self) -> None:
        self._drop_group()
        self.buckets = []

    @classmethod
    def draining(cls) -> int:
        """Groups of this backend given up after a failure that still wait for a stuck transfer in a thread
        of their own (a process exiting beside them aborts; see `backends.groups_draining`). Most have none."""
        return 0
