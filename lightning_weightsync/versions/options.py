"""What a version carries besides its tensors, as one value the caller builds once and the sender reads once.

One value, so that a feature of a version is not one more keyword threaded through every method on the way
to the wire. A new option of a version (say, a per-receiver slice plan) is one field here, read where the
sender resolves the version (`WeightSender._options`), one field of the wire's `BucketMeta` with its
validator (`protocol/messages.py`), and the receiver that acts on it (docs/concepts.md, "Adding an option
to a version").

What is not here is the sender's own (its config and state): the verify mode (`transport.verify`), the
delta base (`transport.delta`, the copy it holds), the layout every peer holds (`transport.layout_once`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from ..protocol.messages import LoraSpec, SenderAddress


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


__all__ = ["Sharding", "VersionOptions"]
