"""What an operator sees of a rollout daemon: one record per version, Prometheus metrics, `/healthz`,
a progress bar, and the per-version log line.

Metrics are in base units (bytes, seconds, bytes per second), every label series exists from the
start (a dashboard or alert on `outcome="failed"` works before the first failure), and a staleness
gauge says how long the sink has served the same version: the one number an RL team alerts on when
a trainer silently stopped syncing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from ..errors import ConfigError
from ..versions.stats import human_bytes
from .sinks.base import SinkState

logger = logging.getLogger(__name__)

# stopped: the daemon stopped mid-version; recovered: a version that failed here, then taken from a peer
OUTCOMES = ("applied", "failed", "aborted", "timeout", "stopped", "recovered")


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
    bytes_per_second: float = 0.0
    error: str | None = None
    outcome: str = "applied"  # one of OUTCOMES
    verified: int = 0  # tensors that matched the trainer's fingerprint (transport.verify)

    @property
    def gbps(self) -> float:
        """GB/s (1e9 bytes), for readers of the old record field."""
        return self.bytes_per_second / 1e9


def log_version(rec: VersionRecord, sink_state: SinkState, sink_version: int | None) -> None:
    if rec.ok:
        logger.info(
            "version %d applied: %s in %.3f s (%s/s), %d tensors (%d chunked), %d buckets",
            rec.version, human_bytes(rec.nbytes), rec.seconds, human_bytes(rec.bytes_per_second), rec.num_tensors,
            rec.num_chunked_tensors, rec.num_buckets,
        )  # fmt: skip
    else:
        logger.warning(
            "version %s not applied (%s): %s; sink %s on version %s",
            rec.version, rec.outcome, rec.error, sink_state.value, sink_version,
        )  # fmt: skip


@dataclass(frozen=True)
class PeerCounts:
    """Late joining, counted where it happens (`rollout/peers.py`): joiners this rollout served its installed
    version to, serves cut short by its own next version, versions it caught up with from a peer."""

    served: int = 0
    released: int = 0
    caught_up: int = 0


class _PeerCollector:
    """`PeerCounts` as Prometheus counters, read when scraped (every series exists from the start, at 0)."""

    def __init__(self) -> None:
        self.read: Callable[[], PeerCounts] = PeerCounts

    def collect(self) -> Iterator[CounterMetricFamily]:
        counts = self.read()
        yield CounterMetricFamily(
            "weightsync_rollout_peer_served",
            "Late joiners this rollout served its installed version to (rollout.serve_port)",
            value=counts.served,
        )
        yield CounterMetricFamily(
            "weightsync_rollout_peer_released",
            "Serves to late joiners cut short because this rollout's own next version started",
            value=counts.released,
        )
        yield CounterMetricFamily(
            "weightsync_rollout_caught_up",
            "Versions this rollout caught up with from a peer before it registered (rollout.catch_up_from)",
            value=counts.caught_up,
        )


class Metrics:
    """Prometheus metrics in a private registry (several daemons may live in one test process)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = CollectorRegistry()
        self._clock = clock
        self._started = clock()
        self._last_applied: float | None = None
        self.version = Gauge(
            "weightsync_rollout_version", "Last complete version held by the sink (-1: none)", registry=self.registry
        )
        self.complete = Gauge(
            "weightsync_rollout_complete", "1 when the sink holds a complete version", registry=self.registry
        )
        self.versions = Counter(
            "weightsync_rollout_versions", "Versions by outcome", ["outcome"], registry=self.registry
        )
        for outcome in OUTCOMES:  # every series exists at 0 before the first event
            self.versions.labels(outcome)
        self.bytes = Counter("weightsync_rollout_bytes", "Payload bytes applied", registry=self.registry)
        self.seconds = Histogram(
            "weightsync_rollout_sync_seconds",
            "Seconds per applied version (first bucket to commit)",
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
            registry=self.registry,
        )
        self.bytes_per_second = Gauge(
            "weightsync_rollout_last_bytes_per_second",
            "Payload bytes per second of the last applied version",
            registry=self.registry,
        )
        self.in_flight = Gauge("weightsync_rollout_in_flight", "1 while a version is arriving", registry=self.registry)
        self.staleness = Gauge(
            "weightsync_rollout_staleness_seconds",
            "Seconds since the last version was applied (since start-up while none was)",
            registry=self.registry,
        )
        self.staleness.set_function(self.staleness_seconds)
        self.version.set(-1)
        self.verified_tensors = Gauge(
            "weightsync_rollout_verified_tensors",
            "Tensors of the held version that matched the trainer's fingerprint on arrival (transport.verify); "
            "equal to the version's tensor count when every one was checked",
            registry=self.registry,
        )
        self.verify_failures = Counter(
            "weightsync_rollout_verify_failures",
            "Versions refused because a tensor's bytes did not match the trainer's fingerprint",
            registry=self.registry,
        )
        self.trainer_connected = Gauge(
            "weightsync_rollout_trainer_connected",
            "1 while a trainer (a sender) is connected to this rollout's control socket",
            registry=self.registry,
        )
        self.trainer_unseen = Gauge(
            "weightsync_rollout_trainer_unseen_seconds",
            "Seconds without a connected trainer (0 while one is): a wrong address or token, or no trainer",
            registry=self.registry,
        )
        self.peers = _PeerCollector()  # the daemon points `peers.read` at its late-joining counts
        self.registry.register(self.peers)

    def trainer_link(self, connected: bool, for_s: float) -> None:
        self.trainer_connected.set(1 if connected else 0)
        self.trainer_unseen.set(0.0 if connected else for_s)

    def staleness_seconds(self) -> float:
        since = self._last_applied if self._last_applied is not None else self._started
        return max(0.0, self._clock() - since)

    def record(self, rec: VersionRecord, sink_state: SinkState) -> None:
        self.versions.labels(rec.outcome).inc()
        if rec.ok:
            self.bytes.inc(rec.nbytes)
            self.seconds.observe(rec.seconds)
            self.bytes_per_second.set(rec.bytes_per_second)
            self._last_applied = self._clock()
            self.verified_tensors.set(rec.verified)
            if rec.version is not None:
                self.version.set(rec.version)
        self.complete.set(1 if sink_state is SinkState.COMPLETE else 0)


MAX_HTTP_CONNECTIONS = 512  # open connections the metrics server holds at once; more are closed at once
HTTP_IDLE_TIMEOUT_S = 5.0  # a connection that has not sent its whole request by then is closed
HTTP_MAX_HEADER_LINES = 64
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 503: "Service Unavailable"}


class HealthServer:
    """`/metrics` and `/healthz` over HTTP/1.0 (port 0 = OS-chosen), on one thread whatever the load.

    A thread per connection (`ThreadingHTTPServer`) let 1000 idle connections make 1000 threads. Here
    one asyncio loop serves every connection: at most MAX_HTTP_CONNECTIONS are open, each gets
    HTTP_IDLE_TIMEOUT_S to send its request, lines are bounded, and a reply closes the connection."""

    def __init__(
        self,
        host: str,
        port: int,
        metrics: Metrics,
        health: Callable[[], tuple[bool, dict[str, Any]]],
        weights: Callable[[], dict[str, Any]] | None = None,
    ):
        self._registry, self._health = metrics.registry, health
        self._weights = weights  # /weights: blocking (it may recompute fingerprints), run off this loop
        self._open = 0
        self.refused_connections = 0
        self._loop = asyncio.new_event_loop()  # its own thread: the caller's loop may be running (the daemon's)
        started: concurrent.futures.Future[asyncio.Server] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(host, port, started), name="weightsync-http", daemon=True
        )
        self._thread.start()
        try:
            self._server = started.result(timeout=30)
        except OSError as exc:
            self._thread.join(timeout=10)
            raise ConfigError(
                f"rollout.metrics_port={port} on rollout.metrics_host={host!r} cannot be bound ({exc.strerror}); "
                "pick a free port, 0 for any, or null to disable"
            ) from None
        self.host, self.port = host, int(self._server.sockets[0].getsockname()[1])

    def _run(self, host: str, port: int, started: concurrent.futures.Future[asyncio.Server]) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            server = self._loop.run_until_complete(asyncio.start_server(self._serve, host, port, limit=8192))
        except OSError as exc:
            started.set_exception(exc)
            self._loop.close()
            return
        started.set_result(server)
        self._loop.run_forever()

    def _route(self, path: str) -> tuple[int, bytes, str]:
        if path == "/metrics":
            return 200, generate_latest(self._registry), CONTENT_TYPE_LATEST
        if path == "/healthz":
            ok, body = self._health()
            return (200 if ok else 503), json.dumps(body).encode(), "application/json"
        return 404, b"not found: try /metrics, /healthz or /weights\n", "text/plain"

    async def _request(self, reader: asyncio.StreamReader) -> str:
        """The path of a GET; the headers are read (bounded) and ignored."""
        words = (await reader.readline()).decode("latin-1").split()
        for _ in range(HTTP_MAX_HEADER_LINES):
            if (await reader.readline()) in (b"\r\n", b"\n", b""):
                break
        if len(words) < 2 or words[0] != "GET":
            raise ValueError("not a GET request")
        return words[1].split("?", 1)[0]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._open >= MAX_HTTP_CONNECTIONS:
            self.refused_connections += 1
            writer.close()
            return
        self._open += 1
        try:
            try:
                path = await asyncio.wait_for(self._request(reader), HTTP_IDLE_TIMEOUT_S)
                if path == "/weights" and self._weights is not None:
                    body = json.dumps(await asyncio.to_thread(self._weights)).encode()
                    code, content_type = 200, "application/json"
                else:
                    code, body, content_type = self._route(path)
            except (ValueError, asyncio.LimitOverrunError):
                code, body, content_type = 400, b"bad request: GET /metrics or /healthz\n", "text/plain"
            head = (
                f"HTTP/1.0 {code} {_REASONS.get(code, '')}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode("latin-1") + body)
            await asyncio.wait_for(writer.drain(), HTTP_IDLE_TIMEOUT_S)
        except (asyncio.TimeoutError, ConnectionError) as exc:
            logger.debug("http: connection dropped (%s)", type(exc).__name__)
        finally:
            self._open -= 1
            writer.close()

    async def _shutdown(self) -> None:
        self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:  # the connections still open: each closes its socket on the way out
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            if not self._thread.is_alive():
                self._loop.close()


class Progress:
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

    @property
    def shown(self) -> tuple[int | None, int] | None:
        """(version, bytes) of the bar on screen, or None when nothing is drawn."""
        if self._progress is None:
            return None
        task = self._progress.tasks[0]
        return task.fields["version"], int(task.completed)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        self._progress = self._task = None


__all__ = ["OUTCOMES", "HealthServer", "Metrics", "Progress", "VersionRecord", "human_bytes", "log_version"]
