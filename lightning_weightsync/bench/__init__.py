"""Benchmarks that ship with the package, so `lightning-weightsync bench` runs where it is installed
(the throughput benchmark spawns worker processes, which must import its module by name). Every figure is
a ratio against a baseline measured in the same run, in the same processes: absolute numbers from a
shared 2-core machine mean little; ratios travel.

    lightning-weightsync bench [--json] [--size small|default] [--only NAME]
    python -m lightning_weightsync.bench.throughput --help

Each benchmark module has `SIZES` (its `run()` keyword arguments per `--size`) and `ESTIMATE_S` (how
long that size took on the 2-core development machine), so the command says up front how long it will
sit there; benchmarks made of several cases say which case runs and how much is left, on stderr (also
with --json, whose stdout is the one JSON document).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

BENCHMARKS = ("bucketcost", "chunking", "delta", "latency", "lora", "nixl", "stall", "throughput")
BENCH_SIZES = ("small", "default")
"""`--size`: small = every benchmark scaled down to about a minute or less (a smoke run, ratios noisier);
default = the sizes the documented figures come from."""


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


class CaseProgress:
    """One stderr line per case of a benchmark: which one, how long it took, and about how long the rest
    will take (the mean case time so far times the cases left), so a run of minutes is never silent."""

    def __init__(self, name: str, total: int) -> None:
        self.name, self.total, self.done = name, total, 0
        self.started = time.monotonic()

    @contextmanager
    def case(self, label: str) -> Iterator[None]:
        print(f"  [{self.name} {self.done + 1}/{self.total}] {label} ...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        yield
        self.done += 1
        elapsed = time.monotonic() - self.started
        left = elapsed / self.done * (self.total - self.done)
        rest = f", about {duration(left)} left" if self.done < self.total else ""
        print(
            f"  [{self.name} {self.done}/{self.total}] done in {duration(time.monotonic() - t0)}{rest}",
            file=sys.stderr,
            flush=True,
        )
