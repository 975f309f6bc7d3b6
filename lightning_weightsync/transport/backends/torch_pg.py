"""Backends built on a standalone torch.distributed process group (gloo, hccl).

The group never touches the trainer's default process group. Where the ranks meet:
- with `transport.auth_token` set, through the control plane (`transport/rendezvous.py`): the keys
  live in the sender and every request is CURVE-authenticated and signed; no store port is opened;
- without a token, a TCPStore the sender creates on `transport.store_port`, which receivers connect to.
Every group generation gets its own key namespace.
"""

from __future__ import annotations

import logging
import threading
from abc import abstractmethod
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch._C._distributed_c10d import TCPStore  # its stub home: mypy sees no public torch.distributed.X
from torch.distributed.distributed_c10d import PrefixStore, Store

from ...errors import ConfigError, WeightSyncError, WeightSyncTimeout
from ...protocol.joins.store import StoreJoin
from ...protocol.messages import GroupSpec
from .base import Backend, Rendezvous
from .relay import start_relay

logger = logging.getLogger(__name__)


class TorchProcessGroupBackend(Backend):
    join_type = StoreJoin
    own_receiver_slots = True  # a receiver broadcasts into its own two tensors

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._store: TCPStore | None = None
        self._store_addr: tuple[str, int] | None = None
        self._pg: Any = None

    @property
    def _control_rendezvous(self) -> Rendezvous | None:
        """The control plane to meet through (with transport.auth_token), or None: an open TCPStore."""
        return self.rendezvous if self.auth_key else None

    def setup(self, host: str, store_port: int) -> None:
        super().setup(host, store_port)
        rendezvous = self._control_rendezvous
        if rendezvous is not None:  # nothing listens: keys go via the control plane
            self._store_addr = (rendezvous.host, int(rendezvous.port))
            logger.debug("%s rendezvous through the control plane at %s:%d", self.name, *self._store_addr)
            return
        try:
            self._store = TCPStore(
                host, store_port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=self.timeout_s)
            )
        except (RuntimeError, OSError) as exc:  # DistNetworkError is a RuntimeError
            raise ConfigError(
                f"{self.name}: cannot listen on {host}:{store_port} for the data-plane store ({exc}); "
                "set transport.store_port to a free port (0: any) or transport.host to a local address"
            ) from exc
        self._store_addr = (host, self._store.port)
        logger.debug("%s data-plane store listening on %s:%d", self.name, host, self._store.port)

    def setup_lane(self, primary: Backend, host: str) -> None:
        """A lane's groups meet in the whole lane's store (their generations are unique): no port of its own."""
        if not isinstance(primary, TorchProcessGroupBackend) or primary._store_addr is None:
            super().setup_lane(primary, host)
            return
        Backend.setup(self, host, 0)  # the slots
        self._store, self._store_addr = primary._store, primary._store_addr

    def join_spec(self, generation: int) -> StoreJoin:
        if self._store_addr is None:
            raise WeightSyncError(f"{self.name}: join_spec() before setup() (the sender sets up at start())")
        return StoreJoin(*self._store_addr)

    def _store_for(self, join: StoreJoin) -> TCPStore:
        """The sender's own store, or (receivers) a client of the sender's, reconnected when it moved."""
        addr = (join.host, join.port)
        if self._store is None or (not self.is_sender and self._store_addr != addr):
            try:
                self._store = TCPStore(join.host, join.port, is_master=False, timeout=timedelta(seconds=self.timeout_s))
            except RuntimeError as exc:
                raise WeightSyncTimeout(
                    f"{self.name}: could not reach the sender's data-plane store at {join.host}:{join.port} within "
                    f"transport.timeout_s={self.timeout_s}s: {exc}"
                ) from exc
            self._store_addr = addr
        return self._store

    def _build_group(self, group: GroupSpec, rank: int) -> None:
        join = group.join
        assert isinstance(join, StoreJoin)  # checked by Backend.join
        namespace = f"lws/{group.session}/{group.generation}"
        rendezvous = self._control_rendezvous
        if rendezvous is not None:
            prefix = rendezvous.rendezvous_store(namespace, self.timeout_s)
        else:
            prefix = PrefixStore(namespace, self._store_for(join))
        try:
            self._pg = self._new_group(prefix, rank, group.world_size, timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise WeightSyncTimeout(
                f"{self.name} group (generation {group.generation}, {group.world_size} ranks) did not form within "
                f"transport.timeout_s={self.timeout_s}s via store {join.host}:{join.port}: {exc}"
            ) from exc

    @abstractmethod
    def _new_group(self, store: Store, rank: int, world_size: int, timeout: timedelta) -> Any: ...

    def _drop_group(self) -> None:
        self._pg = None

    def broken(self) -> None:
        """Give the group up after a failure. Its destructor joins its worker threads, so while a transfer
        is stuck in it (a receiver frozen, its host or link gone: nothing ever fails the socket; or, on a
        receiver that stops, its own posted receives) destroying it blocks until that transfer's own
        timeout (`transport.timeout_s`). The last reference is therefore let go on a daemon thread: the
        failure is reported within `transport.liveness_s`, not after the timeout. (A healthy group, at
        `close()`, is destroyed in place.)"""
        box, self._pg = [self._pg], None
        if box[0] is not None:
            thread = threading.Thread(target=_let_go, args=(box,), name="weightsync-drop-group", daemon=True)
            _DRAINING.add(thread)
            thread.start()
        super().broken()

    def broadcast(self, slot: int, nbytes: int, bucket_index: int, buffer: torch.Tensor | None = None) -> None:
        wait = self._start_broadcast(slot, nbytes, bucket_index, buffer)
        if wait is not None:
            wait()

    def start_broadcast(
        self, slot: int, nbytes: int, bucket_index: int, buffer: torch.Tensor | None = None
    ) -> Callable[[], None] | None:
        """An asynchronous collective: the process group's own threads move the bytes; `Work.wait`
        returns once they are complete here."""
        return self._start_broadcast(slot, nbytes, bucket_index, buffer)

    def _start_broadcast(
        self, slot: int, nbytes: int, bucket_index: int, buffer: torch.Tensor | None
    ) -> Callable[[], None] | None:
        if nbytes == 0:
            return None
        self.wait_fence(slot)
        data = self.buckets[slot][:nbytes] if buffer is None else buffer
        group = self.group
        if group is not None and group.relay:
            return start_relay(self._pg, data, bucket_index, self.rank, group.relay, group.relay_piece, self.relayed)
        work = self._pg.broadcast(data, 0)
        return lambda: _wait(work)

    def close(self) -> None:
        super().close()
        self._store = None

    @classmethod
    def draining(cls) -> int:
        return groups_draining()


_DRAINING: set[threading.Thread] = set()  # groups being let go while a transfer is stuck in them


def _let_go(box: list[Any]) -> None:
    box.clear()  # the group's destructor runs here, however long its stuck transfer takes
    _DRAINING.discard(threading.current_thread())


def groups_draining() -> int:
    """Groups given up after a failure whose destructor still waits for a stuck transfer (at most
    `transport.timeout_s`). A process that exits meanwhile must not run C++ exit handlers beside them
    (libstdc++ aborts: "terminate called without an active exception"): the rollout CLI ends with
    `os._exit` then, once everything of its own is closed."""
    return sum(t.is_alive() for t in list(_DRAINING))


def _wait(work: Any) -> None:
    work.wait()
