"""Local processes: liveness (fault detection without any messages), free ports, and child process
groups that are always cleaned up."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any


def process_alive(pid: int) -> bool:
    """Whether a local process runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): fall back to signal 0
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_CHOSEN_PORT = 10_000
_RANDOM = random.SystemRandom()  # not the `random` module's state: forked workers share it, and tests seed it


def _ephemeral_low() -> int:
    """The first port the kernel hands to outgoing connections (0 where it does not say)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (tests, the demo and benchmarks; never fixed ports), below the kernel's
    ephemeral range where there is room: a port from bind(0) is ephemeral, and while the caller holds it only
    by its number an outgoing connection (a gloo group, a ZeroMQ connect) may take it as its local port, so the
    bind that follows fails with EADDRINUSE (seen in a test that binds minutes after choosing)."""
    low = _ephemeral_low()
    if low - LOWEST_CHOSEN_PORT >= 2_000:
        for _ in range(64):
            port = _RANDOM.randrange(LOWEST_CHOSEN_PORT, low)
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def process_group(
    cmd: Sequence[str], *, env: Mapping[str, str] | None = None, **popen_kwargs: Any
) -> Iterator[subprocess.Popen[Any]]:
    """A subprocess in its own session, killed together with its children (SIGKILL to the process
    group) and reaped on exit, also when the caller fails: a trainer with spawned ranks or a daemon
    never outlives the test, demo or benchmark that started it."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(list(cmd), env=full_env, start_new_session=True, **popen_kwargs)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
