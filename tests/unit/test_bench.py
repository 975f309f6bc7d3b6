"""`lightning-weightsync bench` runs from an installed package: the throughput benchmark's process entry
point must be importable by name in a spawned child (it used to live in a `benchmarks` folder that only
a source checkout has, and the child could not unpickle it)."""

from __future__ import annotations

import inspect
import pickle

from lightning_weightsync import cli
from lightning_weightsync.bench import BENCHMARKS


def test_every_cli_benchmark_is_a_module_of_the_package() -> None:
    assert cli.BENCHMARKS == BENCHMARKS
    for name in BENCHMARKS:
        module = cli._find_benchmark(name)
        assert module is not None and module.__name__ == f"lightning_weightsync.bench.{name}"
        assert callable(module.run)


def test_throughput_worker_pickles_by_reference_to_the_package() -> None:
    from lightning_weightsync.bench import throughput as engine

    restored = pickle.loads(pickle.dumps(engine._worker))  # what spawn does with a Process target
    assert restored is engine._worker
    assert b"lightning_weightsync.bench.throughput" in pickle.dumps(engine._worker)


def test_every_benchmark_has_a_small_size_and_an_estimate() -> None:
    """Issue 25 item 7: `bench` sat for minutes with no size option and no idea of how long it takes."""
    from lightning_weightsync.bench import BENCH_SIZES

    assert cli.BENCH_SIZES == BENCH_SIZES
    for name in BENCHMARKS:
        module = cli._find_benchmark(name)
        assert set(module.SIZES) == set(BENCH_SIZES), name
        params = set(inspect.signature(module.run).parameters)
        assert set(module.SIZES["small"]) <= params, (name, set(module.SIZES["small"]) - params)
        assert all(module.ESTIMATE_S[size] > 0 for size in BENCH_SIZES), name


def test_engine_benchmark_reports_every_case_with_what_is_left(monkeypatch, capsys) -> None:
    from lightning_weightsync.bench import throughput as engine

    ran = []

    def fake_case(world, repeats, **case):
        ran.append(case)
        sender = {"nbytes": 2**20, "buckets": 1, "direct_buckets": 0, "engine_s": 1.0, "baseline_s": 1.0,
                  "peak_extra_bytes": 0}  # fmt: skip
        return sender, [{"peak_extra_bytes": 0}] * (world - 1)

    monkeypatch.setattr(engine, "_case", fake_case)
    engine.run(json_out=True, **engine.SIZES["small"])
    err = capsys.readouterr().err
    assert f"[engine {len(ran)}/{len(ran)}] done" in err and "left" in err, err
    assert err.count("done in") == len(ran) > 5


def test_engine_benchmark_reports_the_senders_cpu_per_bucket() -> None:
    from lightning_weightsync.bench.throughput import _throughput_row

    sender = {"nbytes": 2**30, "buckets": 8, "direct_buckets": 2, "engine_s": 1.0, "engine_cpu_s": 0.4,
              "baseline_s": 1.0, "peak_extra_bytes": 0}  # fmt: skip
    row = _throughput_row({"bucket_mb": 128}, sender, [{"peak_extra_bytes": 0, "engine_cpu_s": 0.1}])
    assert row["engine_sender_cpu_ms_per_bucket"] == 50.0  # 0.4 s over 8 buckets
    assert row["engine_sender_cpu_s_per_GiB"] == 0.4


def test_the_layout_bench_moves_every_entry_both_ways_and_names_the_held_layout() -> None:
    """bench.layout runs the library's metadata path with the knob off and on (no timing is asserted): every
    entry arrives either way (it asserts so itself), and a named bucket's frame carries none of them."""
    from lightning_weightsync.bench.layout import describe, measure

    row = measure(64, 1.0, number=1, repeat=1)
    assert row["entries"] > row["buckets"] > 1
    assert row["frame_bytes_per_bucket_on"] < 300 < row["frame_bytes_per_bucket_off"]
    assert "receiver" in describe(row)


def test_bucketcost_measures_each_backend_against_its_own_runs_baseline() -> None:
    """The small size end to end (two real processes, gloo and shm; the receiver checks its bytes): every
    figure is there, and every ratio divides this run's own baseline (shm: one memcpy; gloo: one raw broadcast
    of the same bytes), never a remembered number. No timing is asserted."""
    import math

    import pytest

    from lightning_weightsync.bench import bucketcost

    small = bucketcost.SIZES["small"]
    report = bucketcost.run(json_out=True, **small)
    measured = report["measured"]
    assert set(measured["raw_s"]) == {f"{mb:g}" for mb in small["bucket_mbs"]}
    assert [r["backend"] for r in report["backends"]] == list(bucketcost.BACKENDS)
    for row in report["backends"]:
        baseline = (
            measured["memcpy_s"] if row["backend"] == "shm" else measured["raw_s"][f"{max(small['bucket_mbs']):g}"]
        )
        assert row["baseline_s"] == baseline, row["backend"]
        assert row["direct_buckets"] == 0  # every byte packed and merged: the fit's line is the copy path's
        for key in ("fixed_us_per_bucket_fit", "fixed_us_per_bucket_tiny", "per_tensor_us", "version_ms"):
            assert math.isfinite(row[key]), (row["backend"], key)
        assert row["tiny_buckets"] > small["tiny_tensors"] // 2
        # each side's CPU a bucket is its own process's: measured in both, not one copied to the other
        for key in ("cpu_us_per_bucket", "cpu_us_per_tensor"):
            cpu = row[key]
            assert set(cpu) == {"sender", "receiver"} and all(math.isfinite(v) for v in cpu.values()), key
            assert cpu["sender"] != cpu["receiver"], key
        sizes = row["sizes"]
        assert [s["bucket_mb"] for s in sizes] == list(small["bucket_mbs"])
        assert [s["buckets"] for s in sizes] == sorted((s["buckets"] for s in sizes), reverse=True)
        assert sizes[-1]["buckets"] == 1
        for s in sizes:
            assert s["ratio"] == pytest.approx(baseline / s["seconds"])
        if row["copy_ratio"] is not None:
            assert row["copy_ratio"] == pytest.approx(baseline / (row["intercept_ms"] - row["version_ms"]) * 1e3)
        assert row["fixed_vs_baseline_1mib"] == pytest.approx(
            row["fixed_us_per_bucket_fit"] * 1e-6 * row["baseline_GBps"] * 1e9 / 2**20
        )
