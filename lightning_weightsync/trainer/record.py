"""What a sync leaves for the integrations to report and checkpoint (`SyncRecord`), kept once for all of them.

Its own module because the driver and its background runner (overlap.py) both write it, and the runner must
not import the driver.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..versions.stats import SendStats


@dataclass
class SyncRecord:
    """What the integrations report and checkpoint, kept once for both (Lightning, Accelerate).

    The same on every rank, except `last_stats` (the sending rank's `SendStats`, None elsewhere).
    It exists before the driver does (a callback is built before the processes are), so resumed
    state can be loaded into it at any time.
    """

    last_synced_version: int | None = None
    failures: int = 0
    last_stats: SendStats | None = None
    last_stall_seconds: float = 0.0  # how long the last sync blocked the training loop on this rank
    overlap_skipped: int | None = None  # trainer.overlap_policy=latest: versions skipped (None: no overlap)
    _listeners: list[Callable[[int], None]] = field(default_factory=list, repr=False, compare=False)

    def on_delivered(self, listener: Callable[[int], None]) -> None:
        """Call `listener(version)` whenever a version is recorded delivered (every rank alike: LoRA's base)."""
        self._listeners.append(listener)

    def delivered(self, version: int, stats: SendStats | None) -> None:
        self.last_synced_version = version
        if stats is not None:
            self.last_stats = stats
        for listener in self._listeners:
            listener(version)

    def metrics(self, version: int) -> dict[str, float] | None:
        """The `weightsync/*` metrics both integrations log for a delivered `version` (sending rank only)."""
        stats = self.last_stats
        if stats is None or self.last_synced_version != version or stats.version != version:
            return None
        return {
            "weightsync/seconds": float(stats.seconds),
            "weightsync/GBps": float(stats.gbps),
            "weightsync/version": float(version),
            "weightsync/receivers": float(stats.receivers),
            # every rank leaves a sync at the same agreement all-reduce, so the sending rank's stall is
            # the training loop's stall
            "weightsync/stall_seconds": float(self.last_stall_seconds),
            **({} if self.overlap_skipped is None else {"weightsync/overlap_skipped": float(self.overlap_skipped)}),
            # sharded mode: tensors every rank holds whole whose copies differed (sent from global rank 0)
            "weightsync/replica_drift": float(stats.replica_drift),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"last_synced_version": self.last_synced_version, "failures": self.failures}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_synced_version = state.get("last_synced_version")
        self.failures = int(state.get("failures", 0))


class SyncRecordView:
    """What both integrations expose of their `SyncRecord` (one definition, not two copies)."""

    record: SyncRecord

    @property
    def last_synced_version(self) -> int | None:
        return self.record.last_synced_version

    @property
    def failures(self) -> int:
        return self.record.failures

    @property
    def last_stats(self) -> SendStats | None:
        """`SendStats` of the last delivered version (the sending rank; None elsewhere)."""
        return self.record.last_stats

    @property
    def last_stall_seconds(self) -> float:
        """How long the last sync blocked the training loop on this rank (`weightsync/stall_seconds`)."""
        return self.record.last_stall_seconds


__all__ = ["SyncRecord", "SyncRecordView"]
