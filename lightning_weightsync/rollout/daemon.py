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

Observability: an optional HTTP server on `rollout.metrics_host:metrics_port` serves Prometheus
metrics at `/metrics` and `/healthz` (200 once the sink holds a complete version, 503 before and
while it is incomplete); a rich progress bar shows the version in flight when stdout is a TTY.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from omegaconf import DictConfig
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..errors import ConfigError, SinkError, WeightSyncError, WeightSyncTimeout
from ..protocol.chunks import TensorMeta
from .sinks import RemoteSink, Sink, SinkState, VersionReport, build_sink

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class VersionRecord:
    """One line of the daemon's per-version record (log line, `--stats-jsonl`, metrics)."""

    version: int | None
    ok: bool
    nbytes: int = 0
    num_tensors: int = 0
    num_buckets: int = 0
    num_chunked_tensors: int = 0
    seconds: float = 0.0
    gbps: float = 0.0
    error: str | None = None
    outcome: str = "applied"  # applied | failed | aborted | timeout


class Metrics:
    """Prometheus metrics in a private registry (several daemons may live in one test process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.version = Gauge(
            "weightsync_rollout_version", "Last complete version held by the sink", registry=self.registry
        )
        self.complete = Gauge(
            "weightsync_rollout_complete", "1 when the sink holds a complete version", registry=self.registry
        )
        self.versions = Counter(
            "weightsync_rollout_versions", "Versions by outcome", ["outcome"], registry=self.registry
        )
        self.bytes = Counter("weightsync_rollout_bytes", "Payload bytes applied", registry=self.registry)
        self.seconds = Histogram(
            "weightsync_rollout_sync_seconds",
            "Seconds per applied version (first bucket to commit)",
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
            registry=self.registry,
        )
        self.gbps = Gauge("weightsync_rollout_last_gbps", "GB/s of the last applied version", registry=self.registry)
        self.in_flight = Gauge("weightsync_rollout_in_flight", "1 while a version is arriving", registry=self.registry)
        self.version.set(-1)

    def record(self, rec: VersionRecord, sink_state: SinkState) -> None:
        self.versions.labels(rec.outcome).inc()
        if rec.ok:
            self.bytes.inc(rec.nbytes)
            self.seconds.observe(rec.seconds)
            self.gbps.set(rec.gbps)
            if rec.version is not None:
                self.version.set(rec.version)
        self.complete.set(1 if sink_state is SinkState.COMPLETE else 0)


class HealthServer:
    """`/metrics` and `/healthz` on a small threaded HTTP server (port 0 = OS-chosen)."""

    def __init__(self, host: str, port: int, metrics: Metrics, health: Callable[[], tuple[bool, dict[str, Any]]]):
        registry = metrics.registry

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    ok, body = health()
                    self._reply(200 if ok else 503, json.dumps(body).encode(), "application/json")
                else:
                    self._reply(404, b"not found: try /metrics or /healthz\n", "text/plain")

            def _reply(self, code: int, body: bytes, content_type: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                logger.debug("http: " + format, *args)

        try:
            self.server = http.server.ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise ConfigError(
                f"rollout.metrics_port={port} on rollout.metrics_host={host!r} cannot be bound ({exc.strerror}); "
                "pick a free port, 0 for any, or null to disable"
            ) from None
        self.server.daemon_threads = True
        self.host, self.port = host, int(self.server.server_address[1])
        self._thread = threading.Thread(target=self.server.serve_forever, name="weightsync-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Progress:
    """A rich progress bar for the version in flight (bytes and rate; the total is not known ahead)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._progress: Any = None
        self._task: Any = None

    def bucket(self, version: int | None, nbytes: int) -> None:
        if not self.enabled:
            return
        if self._progress is None:
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

            self._progress = Progress(
                TextColumn("version {task.fields[version]}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                transient=True,
            )
            self._progress.start()
            self._task = self._progress.add_task("receive", total=None, version=version)
        self._progress.update(self._task, advance=nbytes)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        self._progress = self._task = None


async def _in_daemon_thread(fn: Callable[[], T]) -> T:
    """Run a blocking call in a daemon thread: unlike `to_thread`, it cannot delay process exit."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def target() -> None:
        try:
            result, error = fn(), None
        except BaseException as exc:
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (shutting down)
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=target, name="weightsync-sink", daemon=True).start()
    return await future


class _Version:
    """Bookkeeping for the version in flight."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.began = False
        self.failed: SinkError | None = None
        self.num_chunked_tensors = 0


class RolloutDaemon:
    """Receives versions and applies them to the configured sink until `stop()` (or a signal).

    Args:
        cfg: the validated config (`load_config`); uses `transport.*` and `rollout.*`.
        sink: a sink to use instead of building one from `rollout.sink` (tests, embedding).
        stats_path: append one JSON line per version outcome to this file.
        dump_path: on shutdown, write what a module sink holds to this safetensors file.
        handle_signals: stop on SIGTERM / SIGINT (only possible in the main thread).
    """

    def __init__(
        self,
        cfg: DictConfig,
        *,
        sink: Sink | RemoteSink | None = None,
        stats_path: str | os.PathLike[str] | None = None,
        dump_path: str | os.PathLike[str] | None = None,
        handle_signals: bool = True,
    ) -> None:
        self.cfg = cfg
        self.handle_signals = handle_signals
        self.sink: Sink | RemoteSink | None = sink
        self.stats_path = Path(stats_path) if stats_path else None
        self.dump_path = Path(dump_path) if dump_path else None
        self.metrics = Metrics()
        self.http: HealthServer | None = None
        self.receiver: Any = None
        self.records: list[VersionRecord] = []
        self._stop = asyncio.Event()  # not bound to a loop until first awaited (Python >= 3.10)
        self._progress = _Progress(bool(cfg.rollout.progress) and sys.stdout.isatty())

    # --- control --------------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the loop to finish (drops the version in flight); call from the daemon's loop thread."""
        self._stop.set()

    @property
    def metrics_port(self) -> int | None:
        return self.http.port if self.http is not None else None

    def _health(self) -> tuple[bool, dict[str, Any]]:
        sink = self.sink
        state = sink.state if sink is not None else SinkState.EMPTY
        version = sink.version if sink is not None else None
        return state is SinkState.COMPLETE, {"state": state.value, "version": version}

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
        logger.info("%s: shutting down (the version in flight, if any, is dropped)", sig.name)
        self.stop()

    async def _setup(self) -> None:
        if self.sink is None:
            self.sink = build_sink(self.cfg)
        ro = self.cfg.rollout
        if ro.metrics_port is not None:
            self.http = HealthServer(str(ro.metrics_host), int(ro.metrics_port), self.metrics, self._health)
            logger.info("metrics on http://%s:%d/metrics, health on /healthz", self.http.host, self.http.port)
        t = self.cfg.transport
        if isinstance(self.sink, RemoteSink):
            await _in_daemon_thread(self.sink.start)
        else:
            from ..engine.receiver import WeightReceiver

            self.receiver = WeightReceiver(self.cfg)
            self.receiver.on_bucket = lambda meta: self._progress.bucket(self.receiver.version, meta.nbytes)
            await self.receiver.start()
        logger.info(
            "rollout daemon ready: receiving from %s:%s (backend %s) into the %s sink (apply=%s)",
            t.host, t.port, t.backend, ro.sink.type, ro.apply,
        )  # fmt: skip

    async def _shutdown(self) -> None:
        self._progress.stop()
        sink = self.sink
        if isinstance(sink, Sink) and sink.in_flight is not None:
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
        from safetensors.torch import save_file

        from .sinks.module import ModuleSink

        sink = self.sink
        if not isinstance(sink, ModuleSink) or sink.version is None:
            logger.warning("nothing to dump to %s (needs a module sink holding a complete version)", self.dump_path)
            return
        assert self.dump_path is not None
        tmp = self.dump_path.with_name(f".{self.dump_path.name}.{os.getpid()}.tmp")
        meta = {"version": str(sink.version), "state": sink.state.value}
        save_file({k: v.cpu().contiguous() for k, v in sink.state_dict().items()}, str(tmp), metadata=meta)
        os.replace(tmp, self.dump_path)
        logger.info("wrote the module sink's version %d to %s", sink.version, self.dump_path)

    async def _one_version(self) -> None:
        """Receive and apply one version, racing the stop signal; log its outcome."""
        work = asyncio.ensure_future(self._receive_remote() if isinstance(self.sink, RemoteSink) else self._receive())
        stopper = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({work, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(BaseException):
                await work
            return
        self._progress.stop()
        try:
            rec = work.result()
        except WeightSyncError as exc:
            rec = self._failure_record(exc)
        self._report(rec)

    def _failure_record(self, exc: WeightSyncError) -> VersionRecord:
        from ..errors import VersionAborted

        version = getattr(self.receiver, "version", None) if self.receiver is not None else None
        if isinstance(exc, WeightSyncTimeout):
            outcome = "timeout"
        elif isinstance(exc, VersionAborted):
            outcome = "aborted"
        else:
            outcome = "failed"
        return VersionRecord(version=version, ok=False, error=f"{type(exc).__name__}: {exc}", outcome=outcome)

    def _report(self, rec: VersionRecord) -> None:
        sink = self.sink
        assert sink is not None
        self.records.append(rec)
        self.metrics.record(rec, sink.state)
        if rec.ok:
            logger.info(
                "version %d applied: %.2f MB in %.3f s (%.2f GB/s), %d tensors (%d chunked), %d buckets",
                rec.version, rec.nbytes / 1e6, rec.seconds, rec.gbps, rec.num_tensors, rec.num_chunked_tensors,
                rec.num_buckets,
            )  # fmt: skip
        else:
            logger.warning(
                "version %s not applied (%s): %s; sink %s on version %s",
                rec.version, rec.outcome, rec.error, sink.state.value, sink.version,
            )  # fmt: skip
        if self.stats_path is not None:
            with open(self.stats_path, "a") as f:
                f.write(json.dumps(asdict(rec)) + "\n")

    # --- local sinks ----------------------------------------------------------------------------
    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        sink = self.sink
        if isinstance(sink, Sink) and sink.blocking_io:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    async def _receive(self) -> VersionRecord:
        sink, receiver = self.sink, self.receiver
        assert isinstance(sink, Sink) and receiver is not None
        v = _Version()

        def begin() -> None:
            if not v.began:
                v.version = int(receiver.version)
                v.began = True
                sink.begin(v.version)

        def into(meta: TensorMeta) -> torch.Tensor | None:
            begin()
            if meta.chunk_size < meta.nbytes:
                v.num_chunked_tensors += 1
            if v.failed is not None:
                return None  # keep receiving, drop it: the group must stay in step
            try:
                return sink.destination(meta)
            except SinkError as exc:
                v.failed = exc
                return None

        self.metrics.in_flight.set(0)
        try:
            async for name, tensor in receiver.receive_weights(into=into, auto_ack=False):
                self.metrics.in_flight.set(1)
                if v.failed is not None:
                    continue
                try:
                    await self._call(sink.accept, name, tensor)
                except SinkError as exc:
                    v.failed = exc
            begin()  # a version with no tensors still begins and commits
            assert v.version is not None
            if v.failed is not None:
                raise v.failed
            commit_start = time.perf_counter()
            await self._call(sink.commit, v.version)
            commit_s = time.perf_counter() - commit_start
        except BaseException as exc:
            if v.began and sink.in_flight is not None:
                sink.abort(v.version if v.version is not None else -1, f"{type(exc).__name__}: {exc}")
            if isinstance(exc, SinkError) and v.version is not None:
                with contextlib.suppress(WeightSyncError):
                    await receiver.ack(ok=False, error=f"SinkError: {exc}")
            raise
        finally:
            self.metrics.in_flight.set(0)
        await receiver.ack(ok=True)
        stats = receiver.last_stats
        seconds = float(stats.seconds) + commit_s
        nbytes = int(stats.nbytes)
        return VersionRecord(
            version=v.version,
            ok=True,
            nbytes=nbytes,
            num_tensors=int(stats.num_tensors),
            num_buckets=int(stats.num_buckets),
            num_chunked_tensors=v.num_chunked_tensors,
            seconds=seconds,
            gbps=nbytes / seconds / 1e9 if seconds > 0 else 0.0,
        )

    # --- remote sinks (vLLM workers receive themselves) ------------------------------------------
    async def _receive_remote(self) -> VersionRecord:
        sink = self.sink
        assert isinstance(sink, RemoteSink)
        report: VersionReport = await _in_daemon_thread(sink.receive_version)
        return VersionRecord(
            version=report.version,
            ok=report.ok,
            nbytes=report.nbytes,
            num_tensors=report.num_tensors,
            num_buckets=report.num_buckets,
            seconds=report.seconds,
            gbps=report.gbps,
            error=report.error,
            outcome="applied" if report.ok else "failed",
        )


def run_daemon(
    cfg: DictConfig,
    *,
    stats_path: str | os.PathLike[str] | None = None,
    dump_path: str | os.PathLike[str] | None = None,
) -> RolloutDaemon:
    """Run a daemon in this thread until SIGTERM/SIGINT; returns it (records, sink) once stopped."""
    daemon = RolloutDaemon(cfg, stats_path=stats_path, dump_path=dump_path)
    asyncio.run(daemon.run())
    return daemon


__all__ = ["HealthServer", "Metrics", "RolloutDaemon", "VersionRecord", "run_daemon"]
