"""The rollout daemon's part in late joining (`versions/peer_serve.py`), set by `rollout.serve_*` and
`rollout.catch_up_*`:

    start-up   serve_port >= 0: a `PeerServer` at serve_host:serve_port; the receiver's next version releases it
               catch_up_from: the current version from the first peer that serves it, into the sink (begin,
               destinations, commit: a version like any other, every tensor checked against the peer's
               fingerprint), before the daemon's receiver first registers with the trainer; the trainer's next
               version then comes whole (no delta base is claimed on a version the trainer did not send)
    a version  committed by the sink: hold its installed tensors (`Sink.installed`, no copies) with the
               fingerprints the receiver checked them against, so the serve checks every tensor it pulls
    a failure  the trainer's version failed here for a cause outside this rollout: the same version from the peers
               of catch_up_from, beside the next receive, abandoned at the trainer's next Prepare (`recover.py`)
    shutdown   close the server

What the serve can check against the trainer is what the rollout checked on arrival: with the trainer's
`transport.verify=full` every tensor; `sample` one in 8 a version (the rest are served as installed, and the joiner
still gets them bitwise from this peer: its own check is against the peer's fingerprints); `off`, or this rollout's
`transport.verify=off`, none. A sink that keeps no tensors (safetensors, callable) cannot serve: start-up fails.
"""

from __future__ import annotations

import contextlib
import logging
import time

from ..config import ReceiverSettings, RolloutConfig
from ..errors import ConfigError, WeightSyncError, explain
from ..versions.peer_serve import CaughtUp, PeerServer, catch_up, serve_settings
from ..versions.receiver import WeightReceiver
from ..versions.verify import VerifyReport
from .consume import Call, consume_version
from .observability import PeerCounts
from .recover import Recovery, recoverable
from .sinks.base import Sink

logger = logging.getLogger(__name__)


class Peers:
    """The daemon's serve (`rollout.serve_port`) and catch-up (`rollout.catch_up_from`) around its one sink."""

    def __init__(self, rollout: RolloutConfig, settings: ReceiverSettings, sink: Sink) -> None:
        self.rollout, self.settings, self.sink = rollout, settings, sink
        self.server: PeerServer | None = None
        self.caught_up: CaughtUp | None = None
        self.recovery: Recovery | None = None  # the last failed version's recovery (`recover.py`)
        self._partial_said = False
        if rollout.serve_port >= 0 and not sink.holds_tensors:
            raise ConfigError(
                f"rollout.serve_port={rollout.serve_port}: the {sink.kind} sink keeps no tensors to serve late "
                "joiners from; serve from a rollout with the module sink, or set rollout.serve_port=-1 (off)"
            )

    def counts(self) -> PeerCounts:
        server = self.server
        served = sum(s.receivers for s in server.served) if server is not None else 0
        released = server.released if server is not None else 0
        return PeerCounts(served, released, 1 if self.caught_up is not None else 0)

    async def serve(self, receiver: WeightReceiver) -> None:
        """Start serving (nothing until the first `hold`); `receiver`'s next version releases what is held."""
        ro = self.rollout
        if ro.serve_port < 0:
            return
        server = PeerServer(serve_settings(self.settings, ro.serve_port, ro.serve_host))
        try:
            await server.start()
        except (OSError, WeightSyncError) as exc:
            with contextlib.suppress(Exception):
                await server.close()
            host = ro.serve_host or self.settings.transport.host
            raise ConfigError(
                f"rollout.serve_port={ro.serve_port} on {host} cannot be served ({explain(exc)}); pick a free port "
                "(0: any), set rollout.serve_host to this rollout's own address, or -1 (off)"
            ) from None
        self.server = server
        logger.info("serving the installed version to late joiners at %s (rollout.serve_port)", server.address)

    async def catch_up(self, identity: str, call: Call) -> CaughtUp | None:
        """The current version from `rollout.catch_up_from` into the sink; None (logged) when no peer served it."""
        peers, wait_s = list(self.rollout.catch_up_from), float(self.rollout.catch_up_wait_s)
        if not peers:
            return None
        start = time.perf_counter()

        async def take(receiver: WeightReceiver, wait_s: float) -> object:
            return await consume_version(receiver, self.sink, call=call, wait_s=wait_s, claim_base=False)

        caught = await catch_up(self.settings, peers, None, identity=identity, wait_s=wait_s, take=take)
        seconds = time.perf_counter() - start
        if caught is None:
            logger.warning(
                "caught up with nothing: no peer of rollout.catch_up_from=%s served a version within %gs each "
                "(rollout.catch_up_wait_s) in %.3f s; the trainer's next version is this rollout's first",
                peers, wait_s, seconds,
            )  # fmt: skip
            return None
        self.caught_up = caught
        logger.info("caught up with version %d from the peer at %s in %.3f s", caught.version, caught.peer, seconds)
        self.hold(caught.version, caught.verify)
        return caught

    def version_starts(self, version: int) -> None:
        """The trainer's `version` starts (its Prepare, answered right after): what is held is about to change and
        a recovery of an older version is over. Never waits."""
        if self.server is not None:
            self.server.release(version)
        if self.recovery is not None:
            self.recovery.abandon(f"the trainer's version {version} started")

    def recover(self, exc: BaseException, version: int | None, identity: str, call: Call) -> Recovery | None:
        """Start recovering `version`, which failed here with `exc`, from the peers of `rollout.catch_up_from`;
        None where it is not to be (`rollout.recover_from_peers`, no peers, not a failure a peer mends, not newer
        than what the sink holds)."""
        ro, held = self.rollout, self.sink.version
        if not (ro.recover_from_peers and ro.catch_up_from) or version is None or not recoverable(exc):
            return None
        if held is not None and version <= held:
            return None
        if self.recovery is not None:
            self.recovery.abandon(f"version {version} failed after it")
        peers, wait_s = list(ro.catch_up_from), float(ro.catch_up_wait_s)
        self.recovery = Recovery(self.settings, self.sink, version, peers, wait_s)
        self.recovery.start(identity, call)
        logger.info("version %d failed here (%s): recovering it from the peers %s", version, explain(exc), peers)
        return self.recovery

    def hold(self, version: int, report: VerifyReport | None) -> None:
        """Serve `version`, which the sink just committed, checked against `report`'s fingerprints."""
        tensors = self.sink.installed() if self.server is not None else None
        if self.server is None or tensors is None:
            if self.server is not None:
                logger.info("version %d is not served to late joiners: the sink keeps it otherwise than sent", version)
            return
        checksums = report.checksums if report is not None and report.version == version else {}
        if len(checksums) < len(tensors) and not self._partial_said:
            self._partial_said = True
            logger.info(
                "serving version %d with %d of its %d tensors checked against the trainer's fingerprints as the serve "
                "pulls them (transport.verify=full on the trainer and this rollout checks every one)",
                version, len(checksums), len(tensors),
            )  # fmt: skip
        self.server.hold(version, tensors, checksums)

    async def close(self) -> None:
        if self.recovery is not None:
            await self.recovery.close()
        if self.server is not None:
            await self.server.close()


__all__ = ["Peers"]
