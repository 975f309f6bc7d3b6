"""What a sent version leaves once its acks are in: which receivers failed it, the checksums, and the delta
copy kept (or dropped) and measured. The sender logs the line this returns; a failure raises `PeerError` with
the stats attached (the bytes went out, but not every rollout holds them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import PeerError
from ..protocol.messages import Ack
from .delta import DeltaBase, VersionDelta
from .stats import SendStats, human_bytes
from .verify import SenderFingerprints


@dataclass
class Sent:
    """What a version's stream leaves for its accounting."""

    delta: VersionDelta
    fingerprints: SenderFingerprints
    formed: bool  # the version formed the group: its time is not a measure of the link
    sharded: bool = False  # this rank sent a part of the version: its fingerprints are of shards
    acks: dict[str, Ack | None] = field(default_factory=dict)

    def account(self, stats: SendStats, base: DeltaBase) -> str:
        """Record the outcome in `stats` and `base`; the form the version went in (whole, or a delta of which
        version), or `PeerError` when a receiver did not take it."""
        stats.checksums = self.fingerprints.checksums if not self.sharded else {}  # a shard's is no tensor's
        stats.failed = {
            ident: ("no ack within transport.timeout_s" if ack is None else ack.error or "failed")
            for ident, ack in self.acks.items()
            if ack is None or not ack.ok
        }
        delta = self.delta
        delta.finish(stats.version, ok=not stats.failed)
        stats.delta_tensors = delta.payloads
        if not stats.failed and not self.formed:
            base.measured(delta.payloads > 0, stats.seconds, delta.model_bytes)
        if stats.failed:
            err = PeerError(f"version {stats.version}: receivers failed: {stats.failed}")
            err.stats = stats
            raise err
        if not delta.payloads:
            return "whole"
        return (
            f"delta of version {delta.policy.base_version}: {delta.payloads} tensors as deltas, "
            f"{human_bytes(delta.model_bytes)} of tensors in {human_bytes(stats.nbytes)}"
        )


__all__ = ["Sent"]
