"""What `WeightSender` and `WeightReceiver` share: a control plane, a data-plane backend and the
one executor thread that runs its blocking collectives, and closing them in the right order."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

from ..transport.backends import Backend, build_backend, groups_draining
from ..transport.executor import SerialExecutor

if TYPE_CHECKING:
    from ..transport.control import ReceiverControl, SenderControl

logger = logging.getLogger(__name__)


class Endpoint(ABC):
    _backend: Backend | None
    _executor: SerialExecutor | None
    _control: SenderControl | ReceiverControl  # each subclass declares its own
    device: torch.device
    timeout_s: float
    _key: bytes | None

    def _new_backend(self, name: str, *, bucket_size: int, is_sender: bool, session: str, **extra: Any) -> Backend:
        """The data-plane backend `name` on this endpoint's device, timeout, key and control plane
        (the rendezvous goes through it when a token is set): what both sides build alike."""
        return build_backend(
            name,
            bucket_size=bucket_size,
            device=self.device,
            timeout_s=self.timeout_s,
            is_sender=is_sender,
            session=session,
            auth_key=self._key,
            rendezvous=self._control,
            **extra,
        )

    @abstractmethod
    async def start(self) -> None: ...

    async def close(self) -> None:
        """Free buckets and the group first, then stop the executor, then the sockets."""
        if groups_draining():
            logger.warning(
                "a data-plane group given up after a failure still waits for a transfer to a peer that stopped "
                "answering (its backend cannot cancel it; it ends within transport.timeout_s=%ss): a process that "
                "exits before then is aborted on the way out (exit code 134)",
                self.timeout_s,
            )
        if self._backend is not None:
            self._backend.close()
            self._backend = None
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
        await self._control.close()

    def _fail_group(self) -> None:
        """After a transport failure: forget the group (the next version rebuilds it). A collective
        may still be stuck on the executor thread until the backend's own timeout, so later
        versions get a new thread instead of queueing behind it."""
        if self._backend is not None:
            self._backend.broken()
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = SerialExecutor(self._executor_name)

    _executor_name = "weightsync"

    async def __aenter__(self) -> Any:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
