"""What a version carries besides its tensors, as one value the caller builds once and the sender reads once.

One value, so that a feature of a version is not one more keyword threaded through every method on the way
to the wire. A new option of a version (say, a per-receiver slice plan) is one field here, read where the
sender resolves the version (`VersionOptions.resolve`), one field of the wire's `BucketMeta` with its
validator (`protocol/messages.py`), and the receiver that acts on it (docs/concepts.md, "Adding an option
to a version").

What is not here is the sender's own (its config and state): the verify mode (`transport.verify`), the
delta base (`transport.delta`, the copy it holds), the layout every peer holds (`transport.layout_once`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from ..config import TransportConfig, VerifyMode
from ..protocol.messages import BucketMeta, LoraSpec, SenderAddress, validate_lora, validate_tied
from .source import holds_its_tensors


@dataclass(frozen=True)
class Sharding:
    """This sender's part in a sharded version (`trainer.send_mode: sharded`): every trainer rank sends the
    bytes it owns, each over its own data-plane group, and receivers tile the union.

    `index` 0 coordinates: it gathers the receivers (`trainer.min_receivers`, as always), hands their
    identities to `on_members` (which passes them to the other ranks; called exactly once per version,
    with [] when it gathered none or failed first, so no rank waits for it), and lists `others` in its
    plan so that each receiver also connects to them. Index i > 0 serves exactly `members`, the
    coordinator's receivers, and marks its buckets as sender i."""

    index: int
    others: tuple[SenderAddress, ...] = ()
    on_members: Callable[[list[str]], None] | None = None
    members: tuple[str, ...] = ()


@dataclass(frozen=True)
class VersionOptions:
    """One version's options (all optional; the default is a plain whole-model version).

    `tied`: {name sent: other names of that tensor} (tied embeddings, sent once); it travels with the
    first bucket so every sink can restore the tie.
    `lora`: what the version is of a PEFT LoRA model (`trainer/lora.py`); it travels with the first bucket.
    `sharding`: this sender's part in a sharded version (see `Sharding`); the stream may then yield
    `(name, TensorShard)` items, the byte ranges this rank owns.
    `stable_tensors`: the stream yields tensors whose memory it does not reuse for the next one, so a direct
    broadcast may still read a tensor while the next is produced. None: decided from the stream
    (`holds_its_tensors`: a list, a dict's items, `named_parameters()` are; a generator is not).
    """

    tied: Mapping[str, Iterable[str]] = field(default_factory=dict)
    lora: LoraSpec | None = None
    sharding: Sharding | None = None
    stable_tensors: bool | None = None

    @classmethod
    def given(
        cls,
        options: VersionOptions | None,
        *,
        stable_tensors: bool | None = None,
        tied: Mapping[str, Iterable[str]] | None = None,
        sharding: Sharding | None = None,
        lora: LoraSpec | None = None,
    ) -> VersionOptions:
        """`send_weights`' options from its `options`, or from its keywords (the same fields, for a caller that
        sets one or two), never both: the keywords are a shim onto this one value."""
        keywords = stable_tensors is not None or tied is not None or sharding is not None or lora is not None
        if options is None:
            return cls(tied or {}, lora, sharding, stable_tensors)
        if keywords:
            raise TypeError("send_weights takes options= or the keywords stable_tensors/tied/sharding/lora, not both")
        return options

    def resolve(self, version: int, transport: TransportConfig, weights: object) -> ResolvedOptions:
        """These options with the config, resolved once for `version`; what every receiver would refuse
        (`ProtocolError`) is refused here."""
        # sharded: each shard's bytes are fingerprinted, and each receiver checks them where they land
        verify = VerifyMode(transport.verify)
        # a shard's chunks end before its tensor's last byte, so "the caller may reuse this tensor now" cannot be
        # read from the metadata: shards are the module's own local storage, untouched during a sync (stable)
        given = self.stable_tensors
        stable = holds_its_tensors(weights) if given is None else bool(given)
        tied_names = {str(k): [str(a) for a in v] for k, v in self.tied.items()}
        validate_tied(BucketMeta(version, 0, False, 0, [], tied_names))  # what every receiver checks
        if self.lora is not None:
            validate_lora(self.lora)
        sharding, lora = self.sharding, self.lora
        if sharding is None:
            return ResolvedOptions(stable, tied_names, lora, verify)
        only = frozenset(sharding.members) if sharding.index > 0 else None
        others = list(sharding.others) if sharding.index == 0 else []
        return ResolvedOptions(True, tied_names, lora, verify, True, sharding.index, only, others)


@dataclass(frozen=True)
class ResolvedOptions:
    """One version's options as the sender acts on them: `VersionOptions` with the config, resolved once."""

    stable_tensors: bool
    tied: dict[str, list[str]]
    lora: LoraSpec | None
    verify: VerifyMode
    sharded: bool = False
    index: int = 0  # this sender's index in a sharded version (0: the coordinator, or the only sender)
    only: frozenset[str] | None = None  # a sharded part: exactly the coordinator's receivers
    others: list[SenderAddress] = field(default_factory=list)  # the coordinator's plan lists the other senders


class TellOnce:
    """`Sharding.on_members`, called exactly once per version (with [] when the version failed before it
    gathered anyone), so no other rank waits for it."""

    def __init__(self, sharding: Sharding | None) -> None:
        self._on_members = sharding.on_members if sharding is not None else None

    def __call__(self, members: list[str]) -> None:
        on_members, self._on_members = self._on_members, None
        if on_members is not None:
            on_members(members)


__all__ = ["ResolvedOptions", "Sharding", "TellOnce", "VersionOptions"]
