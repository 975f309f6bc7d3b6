"""Peer serving: a receiver keeps the version it installed and serves it, so a rollout server that joins
mid-training catches up from a peer, never from the trainer, and the trainer's step is not held for it.

    peer (a receiver that installed version v)             joiner (a new rollout server)
    PeerServer.hold(v, its tensors, the trainer's checksums)
      a WeightSender of its own, on its own port:           catch_up(settings, [peer addresses], into)
        the same transport.auth_token (CURVE + signed),       a WeightReceiver at a peer's serve address,
        transport.verify=full, no deltas                      transport.verify=full: every tensor checked
      waits for a joiner to register, then `send_again(v)`:   against the peer's fingerprint; ack, Bye
        each tensor checked against the trainer's           then its own receiver registers with the trainer
        fingerprint of v as it is pulled                      and takes the next version (whole: it claims no
    its own next version starts (the trainer's Prepare,       delta base, so nothing it did not get from the
      `WeightReceiver.on_version_start`): `release()`         trainer's own stream is ever built on)
      cancels the serve in flight and serves nothing until
      the next `hold`

Why a whole `WeightSender`: auth, chunking, two-bucket memory, fingerprints and the abort path come with it. Why
`send_again`: a sender refuses a version it sent already, and a peer serves the same version to one joiner after
another (each joiner leaves once it holds it, so the receivers registered are the ones that lack it).

Torn tensors: the peer's receive is never held for a serve. Its Prepare cancels the serve before it answers the
trainer, so the serve has stopped pulling tensors long before the new version's first bucket lands (Ready, the
plan and the group's join come between). Should a byte still be read while it is overwritten (a direct broadcast
of the serve in flight on its executor thread), the joiner's check against the fingerprint taken when the tensor
was pulled fails the catch-up; and a tensor that no longer holds the trainer's bytes of v when it is pulled (the
sink changed it, or the new version was already landing) stops the serve (the trainer's checksums, with the
trainer's transport.verify=full: every tensor; sample: the ones it fingerprinted).

Discovery: the joiner is given the peers' serve addresses (`PeerServer.address`, host:port); the trainer
advertising them is not built.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from ..config import DeltaMode, ReceiverSettings, SenderSettings, VerifyMode, host_port
from ..errors import ConfigError, VerifyError, WeightSyncError, explain
from ..protocol.fingerprint import checksum_hex, fingerprint
from .options import VersionOptions
from .pipeline import Into
from .receiver import WeightReceiver
from .sender import WeightSender
from .stats import ReceiveStats, SendStats
from .verify import VerifyReport

logger = logging.getLogger(__name__)

POLL_S = 0.05  # how often the server reads its control plane for a joiner while it holds a version


@dataclass(frozen=True)
class Held:
    """The version a peer installed, as it serves it: its tensors (those it installed, not copies) and the
    trainer's checksums of them ({name: hex}, `VerifyReport.checksums`)."""

    version: int
    tensors: tuple[tuple[str, torch.Tensor], ...]
    checksums: Mapping[str, str]


class PeerServer:
    """Serves the version this receiver installed to late joiners, on a port of its own.

    Args:
        settings: the peer's sender settings: its receiver's transport section with `port` (and `host`) set to
            where it serves; deltas are off and every tensor fingerprinted, whatever the section says.
    """

    def __init__(self, settings: SenderSettings) -> None:
        serve = replace(settings.transport, delta=DeltaMode.off, verify=VerifyMode.full)
        self.sender = WeightSender(replace(settings, transport=serve, min_receivers=1))
        self._held: Held | None = None
        self._loop: asyncio.Task[None] | None = None
        self._serving: asyncio.Task[SendStats] | None = None
        self.served: list[SendStats] = []  # every serve that completed (its receivers: the joiners it reached)
        self.released = 0  # serves cut short because the peer's own next version started
        self.failed: list[str] = []  # why each other serve failed
        self._served_to: set[str] = set()  # joiners a serve of the held version reached (they hold it)

    @property
    def port(self) -> int:
        return self.sender.port

    @property
    def address(self) -> str:
        """The serve address, as a joiner's `catch_up` takes it (host:port)."""
        return f"{self.sender.settings.transport.host}:{self.port}"

    @property
    def holds(self) -> int | None:
        """The version served now; None while none is (before the first `hold`, after a `release`)."""
        return self._held.version if self._held is not None else None

    @property
    def serving(self) -> bool:
        """A serve is in flight (pulling the held tensors, or streaming them to joiners)."""
        return self._serving is not None and not self._serving.done()

    async def start(self) -> None:
        await self.sender.start()
        self._loop = asyncio.create_task(self._run(), name="peer-serve")

    def hold(self, version: int, tensors: Mapping[str, torch.Tensor], checksums: Mapping[str, str]) -> None:
        """Serve `version` from now on: `tensors` are the ones installed (they must not change until `release`),
        `checksums` the trainer's fingerprints of them (`WeightReceiver.last_verify.checksums`)."""
        self._held = Held(version, tuple(tensors.items()), dict(checksums))
        self._served_to.clear()  # a new version: every joiner registered lacks it

    def release(self, version: int | None = None) -> None:
        """The held tensors are about to change (`version`: the peer's next one starts): stop serving now. Never
        waits: a serve in flight is cancelled (its joiners get an Abort), and nothing is served until `hold`."""
        self._held = None
        if self._serving is not None and not self._serving.done():
            self._serving.cancel(f"the peer's own version {version} started")
            self.released += 1

    async def close(self) -> None:
        self.release()
        for task in (self._serving, self._loop):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        await self.sender.close()

    async def _run(self) -> None:
        """Serve the held version to whoever registered, one serve at a time, until closed."""
        while True:
            # a joiner served this version holds it: it leaves (its Bye may still be unread), and is not served again
            # (one restarted under the same identity takes the next version, from the trainer or a later hold)
            joiners = await self.sender.wait_registered(POLL_S, frozenset(self._served_to))
            held = self._held  # read after the wait: a release during it must not be served past
            if held is None or not joiners:
                if held is None:
                    await asyncio.sleep(POLL_S)
                continue
            self._serving = asyncio.create_task(self._serve(held), name=f"peer-serve-{held.version}")
            await asyncio.wait({self._serving})
            if self._settle(self._serving, held) and self._held is held:
                self._served_to.update(joiners)

    async def _serve(self, held: Held) -> SendStats:
        options = VersionOptions(stable_tensors=True)  # the held tensors stay put while they are served
        return await self.sender.send_again(self._checked(held), version=held.version, options=options)

    def _settle(self, serve: asyncio.Task[SendStats], held: Held) -> bool:
        """Account for a serve that ended; True when it completed."""
        if serve.cancelled():
            logger.info("peer serve of version %d stopped: the peer's next version started", held.version)
            return False
        if (exc := serve.exception()) is not None:
            self.failed.append(explain(exc))
            if isinstance(exc, VerifyError) and self._held is held:
                self._held = None  # its tensors are no longer the version: nothing to serve until the next hold
            logger.warning("peer serve of version %d failed: %s", held.version, explain(exc))
            return False
        stats = serve.result()
        self.served.append(stats)
        logger.info("peer served version %d to %d joiners in %.3f s", held.version, stats.receivers, stats.seconds)
        return True

    def _checked(self, held: Held) -> Iterator[tuple[str, torch.Tensor]]:
        """The held tensors as the serve pulls them, each still the trainer's bytes of the version, and none
        once the version is released."""
        for name, tensor in held.tensors:
            if self._held is not held:  # released: the serve is being cancelled, and drains what it pulls
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    return  # quietly, so the cancellation is what the serve ends with
                raise WeightSyncError(f"peer serve of version {held.version} released mid-way")
            want = held.checksums.get(name)
            if want is not None and (got := checksum_hex(fingerprint(tensor))) != want:
                raise VerifyError(
                    f"peer serve of version {held.version}: tensor {name!r} no longer holds the trainer's bytes "
                    f"(fingerprint {got}, the trainer's {want}); not served"
                )
            yield name, tensor


def serve_settings(settings: ReceiverSettings, port: int, host: str | None = None) -> SenderSettings:
    """A peer's serve settings: its receiver's transport section (the same token: a peer serves only the
    session's members) bound at `host` (None: the receiver's `transport.host`) and `port` (0: any free one)."""
    t = settings.transport
    return SenderSettings(replace(t, host=t.host if host is None else host, port=port))


@dataclass(frozen=True)
class CaughtUp:
    """What a late joiner took from a peer: the version, from where, its receive's stats and what it checked
    (every tensor, against the peer's fingerprints)."""

    version: int
    peer: str
    stats: ReceiveStats | None
    verify: VerifyReport | None = None


Take = Callable[[WeightReceiver, float], Awaitable[object]]
"""How a joiner takes the version a peer serves: `await take(receiver, wait_s)` receives it from the receiver
at the peer (waiting at most `wait_s` for it to start) and acks it (the rollout daemon: into its sink)."""


def peer_address(address: str) -> tuple[str, int]:
    """(host, port) of a serve address `host:port` (`PeerServer.address`)."""
    parsed = host_port(address)
    if parsed is None:
        raise ConfigError(f"catch_up: peer {address!r} is not host:port (a peer's PeerServer.address)")
    return parsed


async def catch_up(
    settings: ReceiverSettings,
    peers: Sequence[str],
    into: Into | None,
    *,
    identity: str,
    wait_s: float,
    take: Take | None = None,
) -> CaughtUp | None:
    """The current version from the first of `peers` (serve addresses, host:port) that serves it whole, into the
    joiner's destinations (`into`, as `receive_weights` takes it; or however `take` takes it), every tensor
    checked against the peer's fingerprint. None when no peer served one within `wait_s` each: then the joiner's
    destinations may hold a part of a version and nothing is claimed; it takes the trainer's next version whole,
    as any new receiver."""
    for address in peers:
        host, port = peer_address(address)
        t = replace(settings.transport, host=host, port=port, verify=VerifyMode.full, delta=DeltaMode.off)
        receiver = WeightReceiver(replace(settings, transport=t), identity=identity)
        try:
            await receiver.start()
            await (take or _into(into))(receiver, wait_s)
            report, version = receiver.last_verify, receiver.last_complete_version
            if version is None or report is None or not report.complete:
                raise VerifyError(f"the catch-up from {address} was not checked whole: {report}")
            logger.info("caught up with version %d from the peer at %s", version, address)
            return CaughtUp(version, address, receiver.last_stats, report)
        except WeightSyncError as exc:
            logger.warning("no catch-up from the peer at %s: %s", address, explain(exc))
        finally:
            await receiver.close()
    return None


def _into(into: Into | None) -> Take:
    async def take(receiver: WeightReceiver, wait_s: float) -> None:
        async for _ in receiver.receive_weights(into=into, wait_s=wait_s):
            pass

    return take


__all__ = ["POLL_S", "CaughtUp", "Held", "PeerServer", "Take", "catch_up", "peer_address", "serve_settings"]
