"""A feature of a version is one two-sided module with one seam per side (versions/features.py): a toy feature,
registered here, travels from a sender to a receiver with no change to `WeightSender` or `WeightReceiver`
(docs/concepts.md, "Adding a feature to a version")."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator

import pytest
import torch

from lightning_weightsync import WeightReceiver, WeightSender
from lightning_weightsync.protocol.chunks import as_bytes
from lightning_weightsync.versions import features
from lightning_weightsync.versions.planner import Outgoing, Transform
from tests.support.transfer import engine_cfg, with_timeout

KEY = 0x5A


def _flipped(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s bytes XOR KEY, as a new tensor of its dtype and shape."""
    return (as_bytes(tensor).clone() ^ KEY).view(tensor.dtype).reshape(tensor.shape)


@dataclasses.dataclass
class Scramble:
    """The toy: every tensor's bytes go out XOR KEY, and are put back on arrival (where `undo`)."""

    undo: bool = True
    name: str = "toy-scramble"
    sent: list[str] = dataclasses.field(default_factory=list)
    undone: list[str] = dataclasses.field(default_factory=list)

    def outgoing(self, version: int) -> Transform | None:
        def scramble(item: Outgoing) -> Outgoing:
            assert isinstance(item.tensor, torch.Tensor)
            self.sent.append(item.name)
            return dataclasses.replace(item, tensor=_flipped(item.tensor))

        return scramble

    def arriving(self, version: int) -> features.Arriving | None:
        if not self.undo:
            return None

        def unscramble(name: str, tensor: torch.Tensor) -> None:
            self.undone.append(name)
            as_bytes(tensor).bitwise_xor_(KEY)  # in place: it may be the consumer's destination

        return unscramble


@pytest.fixture
def toy() -> Iterator[Scramble]:
    feature = Scramble()
    features.register_feature(feature)
    try:
        yield feature
    finally:
        features.unregister_feature(feature.name)


def _weights() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [("a", torch.randn(64, 33, generator=gen)), ("b", torch.randn(5000, generator=gen)), ("c", torch.ones(3))]


async def _one_version(verify: str, into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    sender = WeightSender(engine_cfg(0, bucket_size_mb=1 / 64, transport__verify=verify))
    await sender.start()
    receiver = WeightReceiver(engine_cfg(sender.port, bucket_size_mb=1 / 64, transport__verify=verify), identity="r")
    try:
        await receiver.start()

        async def consume() -> dict[str, torch.Tensor]:
            where = None if into is None else (lambda meta: into[meta.name])
            return {n: t.clone() async for n, t in receiver.receive_weights(into=where)}

        got, _ = await with_timeout(asyncio.gather(consume(), sender.send_weights(_weights(), version=1)))
        return got
    finally:
        await receiver.close()
        await sender.close()


@pytest.mark.parametrize("destinations", [False, True], ids=["new-tensors", "into-destinations"])
async def test_a_registered_feature_travels_end_to_end_without_touching_the_sender_or_receiver(
    toy, destinations: bool
) -> None:
    """Both seams run (the sending side on every tensor, the receiving side on every arrival, before the
    fingerprint is checked: `transport.verify=full` passes), and what arrives is bitwise what was sent, in the
    consumer's own destinations too."""
    into = {n: torch.empty_like(t) for n, t in _weights()} if destinations else None
    got = await _one_version("full", into)
    assert toy.sent == ["a", "b", "c"] and sorted(toy.undone) == ["a", "b", "c"]
    for name, tensor in _weights():
        assert got[name].dtype == tensor.dtype and torch.equal(as_bytes(got[name]), as_bytes(tensor)), name
        if into is not None:
            assert torch.equal(as_bytes(into[name]), as_bytes(tensor)), name


async def test_the_wire_carries_what_the_sending_side_put_out(toy) -> None:
    """Without its receiving half, the receiver holds the scrambled bytes: the feature's output is what travelled."""
    toy.undo = False
    got = await _one_version("off")
    assert toy.undone == []
    for name, tensor in _weights():
        assert torch.equal(as_bytes(got[name]), as_bytes(_flipped(tensor))), name
