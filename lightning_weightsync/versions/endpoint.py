"""What `WeightSender` and `WeightReceiver` share: a control plane, the data-plane backends their lanes build,
and closing them in the right order."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ..transport.backends import Backend, build_backend, groups_draining

if TYPE_CHECKING:
    from ..transport.control import ReceiverControl, SenderControl

logger = logging.getLogger(__name__)
_E = TypeVar("_E", bound="Endpoint")


class Endpoint(ABC):
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

    @abstractmethod
    def _close_lanes(self) -> None:
        """Free the lanes' buckets and groups, then stop their executor threads."""

    async def close(self) -> None:
        """Free buckets and the group first, then stop the executor, then the sockets."""
        if groups_draining():
            logger.warning(
                "a data-plane group given up after a failure still waits for a transfer to a peer that stopped "
                "answering (its backend cannot cancel it; it ends within transport.timeout_s=%ss): a process that "
                "exits before then is aborted on the way out (exit code 134)",
                self.timeout_s,
            )
        self._close_lanes()
        await self._control.close()

    async def __aenter__(self: _E) -> _E:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
