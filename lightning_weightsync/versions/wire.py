"""What a lane writes on the wire besides its bytes: each planned bucket's metadata for one version.

A lane's stream of one version (`versions/lanes.py`) is told its receivers, the version's tie and LoRA spec
(they travel with the first bucket), the delta base, this sender's index, and the layout every receiver of the
lane holds (`transport.layout_once`: a bucket cut as in it goes as a reference to it, not its entries). The
per-tensor part of an entry (a fingerprint, a delta payload's size or range) comes from the planner's
transforms (`versions/planner.py`); this is the per-bucket part.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..protocol.layout import Layout, LayoutRecorder
from ..protocol.messages import BucketMeta, LoraSpec
from ..transport.control import Peer
from .delta import VersionDelta
from .options import ResolvedOptions
from .planner import Flush


@dataclass(frozen=True)
class Wire:
    """One version's stream on one lane: to whom, what every bucket's metadata says besides its own layout, and
    how many direct broadcasts may still run while the next tensor is produced."""

    version: int
    peers: list[Peer]
    tied: dict[str, list[str]]
    sender: int
    lora: LoraSpec | None
    delta_base: int  # the version the deltas are against; -1: none
    direct_in_flight: int
    held: Layout | None = None  # the layout every peer holds: a bucket cut as in it goes as a reference
    recorder: LayoutRecorder | None = None  # this version's layout, for the next one (transport.layout_once)

    @classmethod
    def of(
        cls,
        version: int,
        peers: list[Peer],
        options: ResolvedOptions,
        delta: VersionDelta,
        direct_in_flight: int,
        layouts: tuple[Layout | None, LayoutRecorder | None] = (None, None),
    ) -> Wire:
        base = delta.policy.base_version
        # Unless the producer's tensors are stable, the caller may reuse a tensor's memory once it yields the next
        # one, so its broadcasts must be complete by then; with stable tensors, up to `direct_in_flight` of them
        # may still be moving.
        in_flight = max(1, direct_in_flight) if options.stable_tensors else 0
        delta_base = -1 if base is None else base
        return cls(version, peers, options.tied, options.index, options.lora, delta_base, in_flight, *layouts)

    def meta(self, step: Flush) -> BucketMeta:
        """The metadata of a planned bucket: the tie and the LoRA spec travel with the first one; its entries
        unless every peer holds them (layout once: the digest of the layout they hold stands for them)."""
        first = step.index == 0
        entries, layout = step.entries, ""
        if self.recorder is not None and self.recorder.add(step.nbytes, step.is_last, step.entries, self.held):
            assert self.held is not None
            entries, layout = [], self.held.digest
        return BucketMeta(
            self.version, step.index, step.is_last, step.nbytes, entries, self.tied if first else {},
            self.sender, fingerprints=step.fingerprints, deltas=step.deltas,
            delta_base=self.delta_base if step.deltas else -1, lora=self.lora if first else None,
            delta_ranges=step.delta_ranges, layout=layout,
        )  # fmt: skip


__all__ = ["Wire"]
