"""What one version cost, one type per side. `as_metrics()` is the form loggers and Prometheus take:
a flat dict of numbers in base units (bytes, seconds, bytes_per_second, counts), so nobody converts
GB/s back and forth and every exporter names the same quantity the same way."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Stats:
    version: int
    nbytes: int = 0  # payload bytes of the version (tensor bytes, not bucket padding)
    num_tensors: int = 0
    num_buckets: int = 0  # buckets that carried at least one chunk
    direct_buckets: int = 0  # full-bucket chunks that skipped the pack (sender) / merge (receiver) copy
    layout_buckets: int = 0  # buckets whose entries the held layout stood for (transport.layout_once)
    relayed_bytes: int = 0  # sent along chains (transport.fanout=chain): the sender to their heads, a receiver onward
    seconds: float = 0.0  # wall time of the whole version, group formation and acks included

    @property
    def bytes_per_second(self) -> float:
        return self.nbytes / self.seconds if self.seconds > 0 else 0.0

    @property
    def gbps(self) -> float:
        """Payload GB/s (1e9 bytes). Kept for existing callers; new code reads `as_metrics()`."""
        return self.bytes_per_second / 1e9

    def as_metrics(self) -> dict[str, float]:
        return {
            "version": self.version,
            "bytes": self.nbytes,
            "seconds": self.seconds,
            "bytes_per_second": self.bytes_per_second,
            "tensors": self.num_tensors,
            "buckets": self.num_buckets,
            "direct_buckets": self.direct_buckets,
            "layout_buckets": self.layout_buckets,
            "relayed_bytes": self.relayed_bytes,
        }


@dataclass
class SendStats(_Stats):
    """The sender's view of one version; `failed` maps a receiver to why it did not take the version."""

    num_chunked_tensors: int = 0  # tensors split over more than one bucket
    receivers: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    checksums: dict[str, str] = field(default_factory=dict)  # {name: fingerprint hex} sent (transport.verify)
    delta_tensors: int = 0  # tensors sent as a delta of the version every receiver held (transport.delta)
    replica_drift: int = 0  # sharded mode: tensors every trainer rank holds whole whose copies differed (rank 0's sent)
    quantized_tensors: int = 0  # weights quantized to the receivers' contract (versions/quantized.py)
    unquantized_bytes: int = 0  # what the tensors the caller yielded held, as the trainer holds them

    def as_metrics(self) -> dict[str, float]:
        return {
            **super().as_metrics(),
            "chunked_tensors": self.num_chunked_tensors,
            "receivers": self.receivers,
            "failed_receivers": len(self.failed),
            "delta_tensors": self.delta_tensors,
            "replica_drift": self.replica_drift,
            "quantized_tensors": self.quantized_tensors,
        }


@dataclass
class ReceiveStats(_Stats):
    """One receiver's view of one version; `verified`: tensors that matched the sender's fingerprint."""

    verified: int = 0
    delta_tensors: int = 0  # tensors that arrived as a delta and were applied onto the held version


def human_bytes(nbytes: float) -> str:
    """`16.0 MiB`, `977 KiB`, `1.16 GiB`: a unit that fits the size (a log line of `0.00 GB/s` says nothing)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


__all__ = ["ReceiveStats", "SendStats", "human_bytes"]
