"""One send of a version, whatever its source and whoever runs it.

A version leaves a trainer rank the same way in all four cases (blocking or background runner; gather or
sharded mode): this rank's part of the version (`Outbound`: gathered tensors, its own shards, or a
snapshot's copies of either) goes through this rank's `BlockingWeightSender`, wrapped in the rollouts'
update when there are rollout servers to drive (global rank 0). In sharded mode global rank 0 coordinates:
it gathers the receivers and tells the other ranks who they are (`MembersRelay`), exactly once per version,
whatever failed; the others wait for that list and serve exactly those receivers.

    blocking runner (driver.py):    send_version(...) in the training thread, then the agreement
    background runner (overlap.py): send_version(...) on its thread, from the snapshot; agreed at the next sync
    integrations (TRL, vLLM's trainer API): send_version(...) on the framework's own gathered stream

A rank without a sender (gather mode, not rank 0) still drains the stream: FSDP's all-gathers are
collectives, and the sending rank's gather of the rest needs this rank's part.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..versions.options import Sharding, VersionOptions
from .gather import drain

if TYPE_CHECKING:
    from ..protocol.messages import SenderAddress
    from ..versions.sender import BlockingWeightSender
    from ..versions.stats import SendStats
    from .fleet import RolloutFleet
    from .sharded import MembersRelay


@dataclass
class Outbound:
    """This rank's part of one version, ready to send: built by a source (the gather, the shards, a snapshot)."""

    version: int
    weights: Iterable[tuple[str, Any]]  # (name, tensor | TensorShard); exhausted by `send_version` whatever fails
    options: VersionOptions  # tied names, LoRA spec, stable tensors (sharding is added here)
    sharded: bool = False
    replica_drift: int = 0  # sharded mode: tensors whose whole copies differed between ranks (reported by rank 0)
    # what is exhausted whatever fails (None: `weights`): the framework's own stream under a mapping of it (an
    # integration's name and dtype rules), so the rest is pulled as it is, not renamed and cast on the way
    drains: Iterable[Any] | None = None
    drained: int = 0  # tensors `send_version` drained after a failure (set by it)


@dataclass(frozen=True)
class SendRoute:
    """What this rank sends through, fixed once the sender started: its sender (None: it only gathers), the
    rollout servers it drives around each version (global rank 0), and in sharded mode the other ranks'
    senders (rank 0 lists them in its plan) and this rank's place among them."""

    rank: int
    sender: BlockingWeightSender | None
    rollouts: RolloutFleet | None = None
    others: tuple[SenderAddress, ...] = ()
    paused: bool = False  # the caller paused every rollout itself (`RolloutFleet.pause`) and resumes them

    @property
    def coordinates(self) -> bool:
        return self.rank == 0


def send_version(out: Outbound, route: SendRoute, relay: MembersRelay | None = None) -> SendStats | None:
    """Send this rank's part of `out.version` (None: this rank sends nothing). Raises what the send raised;
    `out.weights` (or `out.drains`) is exhausted and, in sharded mode on rank 0, the relay told (once) whatever
    happened."""
    sender = route.sender
    try:
        if sender is None:
            return None
        if out.sharded and not route.coordinates:
            assert relay is not None
            members = tuple(relay.receive())  # rank 0's receivers; its plan carries the version's tie and spec
            part = VersionOptions(sharding=Sharding(route.rank, members=members), stable_tensors=True)
            return sender.send_weights(out.weights, version=out.version, options=part)
        options = out.options
        if out.sharded:
            sharding = Sharding(0, others=route.others, on_members=relay)
            options = dataclasses.replace(options, sharding=sharding, stable_tensors=True)

        def send() -> SendStats:
            stats = sender.send_weights(out.weights, version=out.version, options=options)
            stats.replica_drift = out.replica_drift
            return stats

        if route.rollouts is None:
            return send()
        return route.rollouts.run_version(out.version, send, lora=options.lora, paused=route.paused)
    finally:
        if out.sharded and route.coordinates and relay is not None:
            relay.finish()  # the send never reached its receivers: the other ranks hear [] and send nothing
        # whatever failed: the other ranks' gathers of the rest need this rank's
        out.drained = drain(out.weights if out.drains is None else out.drains)


__all__ = ["Outbound", "SendRoute", "send_version"]
