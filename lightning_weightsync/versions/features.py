"""Features of a version: what rides along with a tensor, added on the sending side and undone or checked on
arrival, with one seam on each side and no change to `WeightSender` or `WeightReceiver`.

    sending side   `outgoing(version)`: a planner transform (`Outgoing -> Outgoing`, versions/planner.py), run on
                   each lane's part of every tensor after verify's fingerprint (taken of the tensor itself) and
                   the delta's payload; what it puts out is what the wire carries
    receiving side `arriving(version)`: `(name, tensor) -> None`, run on each merged tensor as it arrived (a
                   delta payload before it is applied) and changing it in place (it may be the consumer's own
                   destination), so it undoes exactly what the sending side did, before the delta is applied
                   and the fingerprint checked: the mirror of the sending order

Built in (wired where they live, not through this table): verify (verify.py), delta (delta.py), layout once
(wire.py, pipeline.py), boxes (lanes.py, receiver_lane.py), shard tiling (sharded.py). A feature registered
here runs in every process that registered it (each side registers its own half, or both); today it sees
versions from one sender (a sharded version's tiled tensors are not handed to `arriving`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from .planner import Transform

Arriving = Callable[[str, torch.Tensor], None]


class Feature(Protocol):
    """One feature of a version, both sides; either may return None (not in this version, or not on this side)."""

    name: str

    def outgoing(self, version: int) -> Transform | None: ...

    def arriving(self, version: int) -> Arriving | None: ...


FEATURES: dict[str, Feature] = {}
"""The features registered in this process, by name, in registration order."""


def register_feature(feature: Feature) -> None:
    """Add `feature` (a name already registered is replaced)."""
    FEATURES[feature.name] = feature


def unregister_feature(name: str) -> None:
    FEATURES.pop(name, None)


def outgoing(version: int) -> tuple[Transform, ...]:
    """The sending side's transforms of every registered feature for `version`, in registration order."""
    return tuple(t for f in FEATURES.values() if (t := f.outgoing(version)) is not None)


def arriving(version: int) -> tuple[Arriving, ...]:
    """The receiving side's hooks for `version`, in the reverse of registration order (each undoes its own)."""
    return tuple(a for f in reversed(FEATURES.values()) if (a := f.arriving(version)) is not None)


__all__ = ["FEATURES", "Arriving", "Feature", "arriving", "outgoing", "register_feature", "unregister_feature"]
