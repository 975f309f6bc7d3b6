"""The data-plane interface every backend implements, driven identically by sender and receiver.

Life cycle, sender (rank 0) and receivers (ranks 1..N) alike:
  `setup()` once (sender: create stores / shared segments), `plan_info()` (sender only: what the
  receivers need to join, carried in the `Plan` control message), `join(plan)` per version (builds
  the group when the generation changed, reuses it otherwise), then per bucket
  `broadcast(slot, nbytes)` (blocking until the bucket is complete on this rank; called from one
  executor thread so collectives stay in order) and, on receivers, `release(slot, bucket_index)`
  once the bytes were copied out. `broken()` marks the group unusable after a failure; `close()`
  frees everything.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ...errors import ConfigError
from ...protocol.messages import Plan
from ..device import empty_bucket, record_event

logger = logging.getLogger(__name__)

NUM_SLOTS = 2  # double buffering: pack / receive one bucket while the other is in flight


class Backend(ABC):
    name: str = "base"  # set by @register_backend
    natural_device: str = "cpu"  # where buckets live unless `transport.device` says otherwise
    # True where `broadcast` may read from / write to any contiguous tensor on `device` instead of
    # a slot: full-bucket chunks then skip the pack copy (sender) and the merge copy (receiver).
    direct_ok: bool = False
    # The control plane (`SenderControl` / `ReceiverControl`), set by the engine: process-group backends
    # rendezvous through it instead of an open TCPStore when transport.auth_token is set.
    rendezvous: Any = None

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
    ) -> None:
        self.session = session
        self.identity = identity  # the receiver's control-plane identity (names its releases)
        self.members: dict[str, int] = {}  # sender: receivers of the current group, identity -> pid
        self.auth_key = auth_key
        self.bucket_size = bucket_size
        self.device = device
        self.timeout_s = timeout_s
        self.is_sender = is_sender
        self.generation = -1
        self.rank = 0 if is_sender else -1
        self.world_size = 0
        self.buckets: list[torch.Tensor] = []
        self._fences: list[object | None] = [None] * NUM_SLOTS

    # -- set-up -----------------------------------------------------------------------------
    def setup(self, host: str, store_port: int) -> None:
        """Sender only, once: create whatever receivers will attach to."""
        self.buckets = [empty_bucket(self.bucket_size, self.device) for _ in range(NUM_SLOTS)]

    def plan_info(self, generation: int) -> dict[str, str]:
        """Sender only: backend-specific join information for the `Plan` of `generation`."""
        return {}

    def join(self, plan: Plan) -> None:
        """All ranks: make the group of `plan.generation` ready (blocking, bounded by timeout_s)."""
        stale = len(self.buckets) != NUM_SLOTS or self.bucket_size != plan.bucket_size
        # shared-memory slots belong to one sender session: a restarted sender has new ones
        if not self.is_sender and (stale or plan.session != self.session):
            self.bucket_size = plan.bucket_size
            self.buckets = self._receiver_buckets(plan)
        # a restarted sender (new session) numbers its generations afresh: never reuse a group across sessions
        if (
            plan.session != self.session
            or plan.generation != self.generation
            or plan.world_size != self.world_size
            or plan.rank != self.rank
        ):
            self._drop_group()
            self._build_group(plan)
            self.session = plan.session
            self.generation, self.rank, self.world_size = plan.generation, plan.rank, plan.world_size
            logger.debug(
                "%s group generation %d: rank %d of %d", self.name, plan.generation, plan.rank, plan.world_size
            )

    def _receiver_buckets(self, plan: Plan) -> list[torch.Tensor]:
        return [empty_bucket(plan.bucket_size, self.device) for _ in range(NUM_SLOTS)]

    @abstractmethod
    def _build_group(self, plan: Plan) -> None: ...

    def _drop_group(self) -> None:  # noqa: B027 - optional hook
        pass

    # -- data path --------------------------------------------------------------------------
    def fence(self, slot: int) -> None:
        """Record that work queued on the compute stream touches `slot` (the sender's packing copies,
        a receiver's copies out of it); the backend waits for it before it reads or reuses the slot."""
        self._fences[slot] = record_event(self.device)

    def wait_fence(self, slot: int) -> None:
        event = self._fences[slot]
        if event is not None:
            event.synchronize()  # type: ignore[attr-defined]
            self._fences[slot] = None

    @abstractmethod
    def broadcast(self, slot: int, nbytes: int, bucket_index: int, buffer: torch.Tensor | None = None) -> None:
        """Move `buckets[slot][:nbytes]` (or `buffer`, where `direct_ok`) from rank 0 to every rank;
        returns when complete here."""

    def release(self, slot: int, bucket_index: int) -> None:  # noqa: B027 - optional hook
        """Receiver: the bytes of `slot` were consumed (shared-buffer backends hand it back)."""

    def broken(self) -> None:
        """Forget the group after a failure; the next `join` rebuilds it."""
        self._drop_group()
        self.generation = -1

    def close(self) -> None:
        self._drop_group()
        self.buckets = []


B = TypeVar("B", bound=type[Backend])

BACKENDS: dict[str, type[Backend]] = {}
"""Every backend by its `transport.backend` name; filled by `@register_backend`, read by config
validation (the allowed names) and by `build_backend`."""


def register_backend(name: str, *, natural_device: str) -> Callable[[B], B]:
    """Class decorator: make a backend known under `name` (the one place a backend name is defined)."""

    def register(cls: B) -> B:
        if name in BACKENDS and BACKENDS[name] is not cls:
            raise ValueError(f"backend name {name!r} is registered twice ({BACKENDS[name].__name__}, {cls.__name__})")
        cls.name, cls.natural_device = name, natural_device
        BACKENDS[name] = cls
        return cls

    return register


def backend_class(name: str) -> type[Backend]:
    try:
        return BACKENDS[str(name)]
    except KeyError:
        raise ConfigError(f"transport.backend={name!r} is not allowed; choose one of: {', '.join(BACKENDS)}") from None


def build_backend(name: str, **kwargs: Any) -> Backend:
    return backend_class(name)(**kwargs)
