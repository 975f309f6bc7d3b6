"""Benchmarks that ship with the package, so `lightning-weightsync bench` runs where it is installed
(the engine benchmark spawns worker processes, which must import its module by name). Every figure is
a ratio against a baseline measured in the same run, in the same processes: absolute numbers from a
shared 2-core machine mean little; ratios travel.

    lightning-weightsync bench [--json] [--only chunking|engine|latency|stall]
    python -m lightning_weightsync.bench.engine --help
"""

BENCHMARKS = ("chunking", "engine", "latency", "nixl", "stall")
