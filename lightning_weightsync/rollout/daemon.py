"""The rollout daemon: receive every version, merge it, apply it to a sink, forever.

    loop until SIGTERM / SIGINT:
        receiver.receive_weights(into=sink.destination)  ->  sink.accept(name, tensor) per tensor
        -> sink.commit(version)  ->  ack(ok)  ->  one log line (version, bytes, seconds, GB/s)

What keeps it running:
- a trainer that dies or restarts is not fatal: the receiver keeps re-registering with whatever
  sender comes up at `transport.host:port`; `WeightSyncTimeout`, `VersionAborted`, `PeerError`,
  `ProtocolError` and `SinkError` end only the version in flight (the sink is told through
  `abort`) and are logged;
- a sink that cannot take a tensor does not stall the trainer: the rest of the version is still
  received (and dropped) so the data-plane group stays in step, then the version is nacked;
- SIGTERM / SIGINT drop the version in flight, close sockets and sink, and return normally (exit 0).
Anything else (a bug) propagates.

The daemon drives one interface, `Sink` (begin, destination, accept, commit, abort; `snapshot` for a
dump on exit), whatever the sink, through the receive loop every rollout shares (`consume.py`).
Late joining (`peers.py`, `rollout.serve_*`, `rollout.catch_up_*`): before it first registers, the daemon may
take the current version from a peer into its sink; and it may serve each version its sink committed to the
rollouts that join later. vLLM is not a daemon sink: vLLM workers receive by themselves through our
weight-transfer engine (`rollout_engines/vllm/`), on the same loop. Metrics, `/healthz`, the progress bar and the
log line live in `observability.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

from ..config import ApplyMode, ReceiverSettings, UserConfig, settings
from ..errors import VerifyError, VersionAborted, WeightSyncError, WeightSyncTimeout, explain
from ..transport.device import handoff
from ..versions.receiver import WeightReceiver
from .consume import consume_version
from .held import held_weights_report
from .observability import HealthServer, Metrics, Progress, VersionRecord, log_version
from .peers import Peers
from .recover import Recovery
from .sinks.base import Sink, SinkState
from .sinks.build import build_sink

logger = logging.getLogger(__name__)

T = TypeVar("T")
TRAINER_POLL_S = 1.0  # how often the daemon looks at its link to the trainer (metrics, /healthz, the log)
NO_TRAINER_WARN_S = 30.0  # no trainer connected this long: a WARNING ...
NO_TRAINER_REPEAT_S = 300.0  # ... and again this often while it lasts
WEIGHTS_REPORT_TIMEOUT_S = 30.0  # GET /weights waits this long for the daemon's loop (a commit in progress)


class RolloutDaemon:
    """Receives versions and applies them to the configured sink until `stop()` (or a signal).

    Args:
        cfg: the validated config (`load_config`; a `WeightSyncConfig`; None = the defaults), converted here,
            once, to typed sections: the receiver gets its `ReceiverSettings`, the sink its `SinkSettings`,
            the daemon reads `rollout.*` (metrics, progress) and the transport's address for its log lines.
        sink: a sink to use instead of building one from `rollout.sink` (tests, embedding).
        stats_path: append one JSON line per version outcome to this file.
        dump_path: on shutdown, write what a module sink holds to this safetensors file.
        handle_signals: stop on SIGTERM / SIGINT (only possible in the main thread).
    """

    def __init__(
        self,
        cfg: UserConfig,
        *,
        sink: Sink | None = None,
        stats_path: str | os.PathLike[str] | None = None,
        dump_path: str | os.PathLike[str] | None = None,
        handle_signals: bool = True,
    ) -> None:
        self.config = settings(cfg)  # the edge: the rollout side's one DictConfig -> typed conversion
        self.handle_signals = handle_signals
        self.sink: Sink | None = sink
        self.stats_path = Path(stats_path) if stats_path else None
        self.dump_path = Path(dump_path) if dump_path else None
        self.metrics = Metrics()
        self.http: HealthServer | None = None
        self.receiver: WeightReceiver | None = None
        self.records: list[VersionRecord] = []
        self._stop = asyncio.Event()  # not bound to a loop until first awaited (Python >= 3.10)
        self._stop_reason = "the rollout daemon is stopping"
        self._progress = Progress(self.config.rollout.progress and sys.stdout.isatty())
        self._trainer: tuple[bool, float] = (False, 0.0)  # (connected, for how long), see `_watch_trainer`
        self._watcher: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the daemon's: /weights reads the sink on it
        self.peers: Peers | None = None  # late joining: its serve and catch-up (`peers.py`)
        self._whole_next = False  # caught up from a peer: the trainer's next version comes whole (no delta base)

    # --- control --------------------------------------------------------------------------------
    def stop(self, reason: str | None = None) -> None:
        """Ask the loop to finish; call from the daemon's loop thread. A version being received is dropped
        and nacked with `reason`; one already committing is finished and reported first."""
        if reason:
            self._stop_reason = reason
        self._stop.set()

    @property
    def metrics_port(self) -> int | None:
        return self.http.port if self.http is not None else None

    def _health(self) -> tuple[bool, dict[str, Any]]:
        sink = self.sink
        state = sink.state if sink is not None else SinkState.EMPTY
        version = sink.version if sink is not None else None
        connected, for_s = self._trainer
        trainer = {"trainer_connected": connected, "trainer_unseen_s": 0.0 if connected else round(for_s, 1)}
        return state is SinkState.COMPLETE, {"state": state.value, "version": version, **trainer}

    def _weights(self) -> dict[str, Any]:
        """GET /weights (called off the daemon's loop): the held version and whether its weights match the
        trainer's fingerprints, computed on the daemon's loop so no commit runs meanwhile (`held.py`)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return held_weights_report(None, False, None, None)
        return asyncio.run_coroutine_threadsafe(self._held_report(), loop).result(timeout=WEIGHTS_REPORT_TIMEOUT_S)

    async def _held_report(self) -> dict[str, Any]:
        sink, receiver = self.sink, self.receiver
        if sink is None or receiver is None:
            return held_weights_report(None, False, None, None)
        # a version arriving with apply=atomic leaves the held one untouched until its commit (on this loop)
        quiet = sink.in_flight is None or sink.apply is ApplyMode.atomic
        complete = sink.state is SinkState.COMPLETE and quiet
        snapshot = sink.snapshot() if complete else None
        report = receiver.last_verify
        if report is None and self.peers is not None and self.peers.caught_up is not None:
            report = self.peers.caught_up.verify  # no version from the trainer yet: the one caught up with
        return held_weights_report(sink.version, complete, report, snapshot)

    async def _watch_trainer(self) -> None:
        """Whether a trainer is there, kept for `/healthz` and the metrics, and said in the log: one WARNING
        once none has been connected for `NO_TRAINER_WARN_S` (again every `NO_TRAINER_REPEAT_S` while that
        lasts: a daemon pointed at the wrong port or token must not wait in silence), one line when one is."""
        assert self.receiver is not None
        t = self.config.transport
        warn_at = NO_TRAINER_WARN_S  # seconds without a trainer at which to say so (next)
        was_connected = False
        while True:
            connected, for_s = self._trainer = self.receiver.sender_link()
            self.metrics.trainer_link(connected, for_s)
            if connected and not was_connected:
                logger.info("trainer connected at %s:%s", t.host, t.port)
                warn_at = NO_TRAINER_WARN_S
            elif not connected and for_s >= warn_at and (refused := self.receiver.handshake_refused):
                warn_at = for_s + NO_TRAINER_REPEAT_S
                logger.error(
                    "the trainer at %s:%s refuses this rollout's control connection for %.0fs: %s; set the same "
                    "transport.auth_token on both sides (still trying)",
                    t.host, t.port, for_s, refused,
                )  # fmt: skip
            elif not connected and for_s >= warn_at:
                warn_at = for_s + NO_TRAINER_REPEAT_S
                logger.warning(
                    "no trainer connected at %s:%s for %.0fs; is it running, with the same transport.host, "
                    "transport.port and transport.auth_token? (still trying)",
                    t.host, t.port, for_s,
                )  # fmt: skip
            was_connected = connected
            await asyncio.sleep(TRAINER_POLL_S)

    # --- main loop ------------------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        installed: list[signal.Signals] = []
        if self.handle_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_signal, sig)
                installed.append(sig)
        try:
            await self._setup()
            while not self._stop.is_set():
                await self._one_version()
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)
            await self._shutdown()

    def _on_signal(self, sig: signal.Signals) -> None:
        logger.info(
            "%s: shutting down (a version being received is dropped and nacked; one committing is finished)", sig.name
        )
        self.stop(f"the rollout daemon is stopping ({sig.name})")

    async def _setup(self) -> None:
        if self.sink is None:
            self.sink = build_sink(self.config)
        ro = self.config.rollout
        self._loop = asyncio.get_running_loop()
        if ro.metrics_port is not None:
            self.http = HealthServer(
                ro.metrics_host, ro.metrics_port, self.metrics, self._health, weights=self._weights
            )
            logger.info(
                "metrics on http://%s:%d/metrics, health on /healthz, held weights on /weights",
                self.http.host, self.http.port,
            )  # fmt: skip
        t = self.config.transport
        receiver = self.receiver = WeightReceiver(ReceiverSettings.of(self.config))
        receiver.on_bucket = lambda meta: self._progress.bucket(receiver.version, meta.nbytes)
        await self._join(receiver)
        await receiver.start()  # registers with the trainer
        self._watcher = asyncio.ensure_future(self._watch_trainer())
        logger.info(
            "rollout daemon ready: receiving from %s:%s (backend %s) into the %s sink (apply=%s)",
            t.host, t.port, t.backend, ro.sink.type, ro.apply,
        )  # fmt: skip

    async def _join(self, receiver: WeightReceiver) -> None:
        """Late joining (`peers.py`): serve what the sink installs, and catch up from peers before registering."""
        assert self.sink is not None
        peers = self.peers = Peers(self.config.rollout, receiver.settings, self.sink)
        self.metrics.peers.read = peers.counts
        await peers.serve(receiver)
        receiver.on_version_start = peers.version_starts
        self._whole_next = await peers.catch_up(receiver.identity, self._call) is not None

    async def _shutdown(self) -> None:
        self._progress.stop()
        if self.peers is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.peers.close(), 10)
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None
        sink = self.sink
        if sink is not None and sink.in_flight is not None:
            sink.abort(sink.in_flight, "daemon shutting down")
        if self.receiver is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.receiver.close(), 10)
            self.receiver = None
        if self.dump_path is not None:
            self._dump()
        if self.http is not None:
            self.http.close()
            self.http = None
        if sink is not None:
            try:
                sink.close()
            except Exception as exc:  # shutting down: report, do not mask the exit
                logger.warning("closing the sink failed: %s", exc)
            logger.info("rollout daemon stopped (last complete version: %s)", sink.version)

    def _dump(self) -> None:
        """Write what the sink serves to `dump_path` (for sinks that can say: `Sink.snapshot`)."""
        from .sinks.safetensors import write_safetensors

        sink, path = self.sink, self.dump_path
        snapshot = sink.snapshot() if sink is not None and sink.version is not None else None
        if path is None or sink is None or snapshot is None:
            logger.warning("nothing to dump to %s (needs a sink that holds its tensors, e.g. module)", path)
            return
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        meta = {"version": str(sink.version), "state": sink.state.value}
        write_safetensors(snapshot, tmp, meta)
        os.replace(tmp, path)
        logger.info("wrote the sink's version %d to %s", sink.version, path)

    async def _one_version(self) -> None:
        """Receive and apply one version, racing the stop signal; log its outcome."""
        work = asyncio.ensure_future(self._receive())
        stopper = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({work, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
        stopping = not work.done()
        in_flight = self.receiver.in_flight if self.receiver is not None else None
        if stopping:  # the receive loop nacks a version being received; one committing finishes first
            work.cancel(self._stop_reason)
            with contextlib.suppress(BaseException):
                await asyncio.wait({work})
        self._progress.stop()
        try:
            rec = work.result()
            self._installed(rec)
        except WeightSyncError as exc:
            rec = self._failure_record(exc)
            if isinstance(exc, VerifyError):
                self.metrics.verify_failures.inc()
            self._report(rec)
            self._recover(exc, rec.version)
            return
        except asyncio.CancelledError:
            if in_flight is None:
                return  # stopped between versions: nothing to report
            rec = VersionRecord(version=in_flight, ok=False, error=self._stop_reason, outcome="stopped")
        self._report(rec)

    def _installed(self, rec: VersionRecord) -> None:
        """The sink committed `rec.version`: serve it to late joiners (`rollout.serve_port`)."""
        self._whole_next = False
        if self.peers is not None and self.receiver is not None and rec.version is not None:
            self.peers.hold(rec.version, self.receiver.last_verify)

    def _recover(self, exc: WeightSyncError, version: int | None) -> None:
        """The failed `version` from a peer that installed it (`recover.py`), beside the next receive, which comes
        whole: the sink may hold the peer's copy by then, a version the trainer did not send to this rollout."""
        if self.peers is None or self.receiver is None:
            return
        recovery = self.peers.recover(exc, version, self.receiver.identity, self._call)
        if recovery is not None and recovery.task is not None:
            self._whole_next = True
            recovery.task.add_done_callback(lambda _: self._recovered(recovery))

    def _recovered(self, recovery: Recovery) -> None:
        """A recovery ended: one it installed is recorded (outcome `recovered`) and served on, unless the trainer's
        next version has started meanwhile (the held tensors are about to change)."""
        task = recovery.task
        caught = task.result() if task is not None and not task.cancelled() and task.exception() is None else None
        if caught is None:
            return
        stats = caught.stats
        nbytes = int(stats.nbytes) if stats is not None else 0
        rec = VersionRecord(
            version=caught.version, ok=True, nbytes=nbytes, num_tensors=int(stats.num_tensors) if stats else 0,
            num_buckets=int(stats.num_buckets) if stats else 0, seconds=recovery.seconds,
            bytes_per_second=nbytes / recovery.seconds if recovery.seconds > 0 else 0.0,
            verified=int(stats.verified) if stats else 0, outcome="recovered",
        )  # fmt: skip
        logger.info("recovered version %d from the peer at %s in %.3f s", caught.version, caught.peer, recovery.seconds)
        self._report(rec)
        if recovery.guard.abandoned is None and self.peers is not None:
            self.peers.hold(caught.version, caught.verify)

    def _failure_record(self, exc: WeightSyncError) -> VersionRecord:
        version = self.receiver.version if self.receiver is not None else None
        if isinstance(exc, WeightSyncTimeout):
            outcome = "timeout"
        elif isinstance(exc, VersionAborted):
            outcome = "aborted"
        else:
            outcome = "failed"
        return VersionRecord(version=version, ok=False, error=explain(exc), outcome=outcome)

    def _report(self, rec: VersionRecord) -> None:
        sink = self.sink
        assert sink is not None
        self.records.append(rec)
        self.metrics.record(rec, sink.state)
        log_version(rec, sink.state, sink.version)
        if self.stats_path is not None:
            with open(self.stats_path, "a") as f:
                f.write(json.dumps(asdict(rec)) + "\n")

    # --- one version into the sink -------------------------------------------------------------
    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Where the shared receive loop runs a sink method: a thread for blocking sinks."""
        self.metrics.in_flight.set(1)
        sink = self.sink
        if sink is not None and sink.blocking_io:
            return await asyncio.to_thread(_adopted, handoff(args), fn, *args)
        return fn(*args)

    async def _receive(self) -> VersionRecord:
        sink, receiver = self.sink, self.receiver
        assert sink is not None and receiver is not None  # set up by _setup() before the loop
        self.metrics.in_flight.set(0)
        try:
            return await consume_version(receiver, sink, call=self._call, claim_base=not self._whole_next)
        finally:
            self.metrics.in_flight.set(0)


def _adopted(adopt: Callable[[], None], fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a worker thread, once the accelerator tensors among `args` are ready on its stream."""
    adopt()
    return fn(*args)


def run_daemon(
    cfg: UserConfig,
    *,
    stats_path: str | os.PathLike[str] | None = None,
    dump_path: str | os.PathLike[str] | None = None,
) -> RolloutDaemon:
    """Run a daemon in this thread until SIGTERM/SIGINT; returns it (records, sink) once stopped."""
    daemon = RolloutDaemon(cfg, stats_path=stats_path, dump_path=dump_path)
    asyncio.run(daemon.run())
    return daemon


__all__ = ["RolloutDaemon", "VersionRecord", "run_daemon"]
