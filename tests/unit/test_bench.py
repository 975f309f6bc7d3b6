"""`lightning-weightsync bench` runs from an installed package: the engine benchmark's process entry
point must be importable by name in a spawned child (it used to live in a `benchmarks` folder that only
a source checkout has, and the child could not unpickle it)."""

from __future__ import annotations

import pickle

from lightning_weightsync import cli
from lightning_weightsync.bench import BENCHMARKS


def test_every_cli_benchmark_is_a_module_of_the_package() -> None:
    assert cli.BENCHMARKS == BENCHMARKS
    for name in BENCHMARKS:
        module = cli._find_benchmark(name)
        assert module is not None and module.__name__ == f"lightning_weightsync.bench.{name}"
        assert callable(module.run)


def test_engine_worker_pickles_by_reference_to_the_package() -> None:
    from lightning_weightsync.bench import engine

    restored = pickle.loads(pickle.dumps(engine._worker))  # what spawn does with a Process target
    assert restored is engine._worker
    assert b"lightning_weightsync.bench.engine" in pickle.dumps(engine._worker)
