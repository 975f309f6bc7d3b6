"""What an operator sees of a rollout daemon: one record per version, Prometheus metrics, `/healthz`,
a progress bar, and the per-version log line.

Metrics are in base units (bytes, seconds, bytes per second), every label series exists from the
start (a dashboard or alert on `outcome="failed"` works before the first failure), and a staleness
gauge says how long the sink has served the same version: the one number an RL team alerts on when
a trainer silently stopped syncing.
"""

from __future__ import annotations

import http.server
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..engine.stats import human_bytes
from ..errors import ConfigError
from .sinks import SinkState

logger = logging.getLogger(__name__)

OUTCOMES = ("applied", "failed", "aborted", "timeout", "stopped")  # stopped: the daemon stopped mid-version


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
