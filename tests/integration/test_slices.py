"""Receivers that declare boxes get only those (versions/lanes.py), over real sockets and gloo groups in one
process: receivers with the same declaration share one lane's group, one that declared nothing takes whole
tensors beside them, and a declaration that does not fit the tensors is refused by name at Ready while the
version goes on for everyone (the refused receiver gets whole tensors)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch

from lightning_weightsync import WeightReceiver, WeightSender
from lightning_weightsync.protocol.boxes import Box
from lightning_weightsync.protocol.chunks import TensorMeta
from lightning_weightsync.transport.backends import NUM_SLOTS
from lightning_weightsync.versions.lanes import lane_bucket_size
from tests.support.mp import free_port
from tests.support.transfer import engine_cfg, with_timeout

VERSIONS = (1, 2, 3)
ROWS = {"top": Box((0, 0), (3, 6)), "bottom": Box((3, 0), (5, 6))}  # of "w", an (8, 6) tensor


def _weights(version: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(version)
    return [
        ("w", torch.randn(8, 6, generator=gen)),
        ("e", torch.randn(16, 4, generator=gen).to(torch.bfloat16)),
        ("b", torch.randn(6, generator=gen)),
    ]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _local_shaped(meta: TensorMeta) -> torch.Tensor:
    """A destination of what the sender sends: the box's shape where it took the declaration, else the whole."""
    return torch.empty(meta.local_shape, dtype=meta.dtype)


async def _receive(
    receiver: WeightReceiver, boxes: dict[str, Box] | None
) -> tuple[dict[str, torch.Tensor], int, int, int]:
    """One version: declared boxes land in tensors of the box's shape (what a sender that took the declaration
    sends), everything else in whole ones; returns what arrived, the bytes taken off the wire, the buckets
    that named a held layout (transport.layout_once) instead of listing their entries, and the bytes it forwarded
    along its lane's chain (transport.fanout=chain)."""
    receiver.declare_boxes(boxes)
    got = {n: t.clone() async for n, t in receiver.receive_weights(into=_local_shaped)}
    stats = receiver.last_stats
    assert stats is not None
    return got, stats.nbytes, stats.layout_buckets, stats.relayed_bytes


Declared = dict[str, Box] | None | Callable[[int], dict[str, Box] | None]  # fixed, or per version


async def _run(
    declarations: dict[str, Declared],
    backend: str = "gloo",
    token: str | None = None,
    *,
    versions: tuple[int, ...] = VERSIONS,
    bucket_size_mb: float = 0.0625,
    after: Callable[[WeightSender], None] | None = None,
    **knobs: Any,
) -> tuple[dict[str, list[Any]], WeightSender]:
    """Every receiver takes `versions`, declaring its boxes before each (`after(sender)`: once each is sent);
    `knobs`: more of both sides' config. Each receiver's versions: (version, what arrived, bytes off the wire, its
    lane's world size, held-layout buckets, bytes it forwarded)."""
    both = {"backend": backend, "transport__verify": "full", "transport__auth_token": token, **knobs}
    both["bucket_size_mb"] = bucket_size_mb
    sender = WeightSender(engine_cfg(0, trainer__min_receivers=len(declarations), **both))
    await sender.start()
    receivers = {ident: WeightReceiver(engine_cfg(sender.port, **both), identity=ident) for ident in declarations}
    for r in receivers.values():
        await r.start()
    try:

        async def consume(ident: str) -> list[Any]:
            out = []
            declared = declarations[ident]
            for version in versions:
                boxes = declared(version) if callable(declared) else declared
                got, nbytes, layout, relayed = await _receive(receivers[ident], boxes)
                world = receivers[ident]._lane.backend.world_size  # its lane's group: the sender and the lane's members
                out.append((receivers[ident].version, got, nbytes, world, layout, relayed))
            return out

        async def send() -> None:
            for version in versions:
                await sender.send_weights(_weights(version), version=version)
                if after is not None:
                    after(sender)

        results = await with_timeout(asyncio.gather(send(), *(consume(i) for i in declarations)), 90)
    finally:
        for r in receivers.values():
            await r.close()
        await sender.close()
    return dict(zip(declarations, results[1:], strict=True)), sender


def _expected(version: int, boxes: dict[str, Box] | None) -> dict[str, torch.Tensor]:
    return {n: (boxes[n].of(t) if boxes and n in boxes else t) for n, t in _weights(version)}


@pytest.mark.parametrize(
    ("backend", "token"),
    [("gloo", None), ("shm", None), ("gloo", "lanes-secret-0123456")],
    ids=["gloo", "shm", "token"],
)
async def test_each_receiver_gets_its_boxes_and_those_with_the_same_share_a_lane(
    backend: str, token: str | None
) -> None:
    declarations = {
        "top-a": {"w": ROWS["top"]},
        "top-b": {"w": ROWS["top"]},  # the same box: the same lane (one broadcast for both)
        "bottom": {"w": ROWS["bottom"], "e": Box((8, 0), (8, 4))},
        "whole": None,
    }
    results, _ = await _run(declarations, backend, token)  # with a token: the lanes' groups meet via the control
    model = sum(_nbytes(t) for _, t in _weights(1))
    for ident, versions in results.items():
        for version, got, nbytes, world, layout, _ in versions:
            # the first version is sent whole (the sender checks a declaration on tensors it has sent)
            boxes = declarations[ident] if version > VERSIONS[0] else None
            want = _expected(version, boxes)
            assert sorted(got) == sorted(want), (ident, version)
            for name, tensor in want.items():
                assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, (ident, name)
                assert torch.equal(got[name].view(torch.uint8), tensor.contiguous().view(torch.uint8)), (ident, name)
            assert nbytes == sum(_nbytes(t) for t in want.values()), (ident, version, nbytes)
            if version > VERSIONS[0]:
                # lanes: {top-a, top-b}, {bottom}, {whole}; each group is the sender and its lane's receivers
                assert world == {"top-a": 3, "top-b": 3, "bottom": 2, "whole": 2}[ident], (ident, world)
                assert (nbytes < model) == (declarations[ident] is not None)
            if version == VERSIONS[-1]:  # each lane keeps its own held layout: the second sliced version names it
                assert layout > 0, (ident, version)


async def test_each_lane_of_boxes_chains_its_own_members_bitwise() -> None:
    """transport.fanout=chain with lanes: version 1 (whole tensors) chains all four receivers in one lane; from
    version 2 the three that hold the top rows form a lane of their own and chain only each other (head and
    middle forward their boxes' bytes, the tail keeps them), while the whole-tensor receiver is that lane's lone
    member, fed by the sender."""
    top = {"w": ROWS["top"]}
    declarations: dict[str, Declared] = {"top-a": top, "top-b": top, "top-c": top, "whole": None}
    results, _ = await _run(declarations, transport__fanout="chain", transport__chain_piece_mb=1 / 256)
    model, boxed = sum(_nbytes(t) for _, t in _weights(1)), sum(_nbytes(t) for t in _expected(1, top).values())
    for ident, versions in results.items():
        for version, got, nbytes, world, _, _ in versions:
            want = _expected(version, top if ident != "whole" and version > VERSIONS[0] else None)
            assert sorted(got) == sorted(want), (ident, version)
            assert all(torch.equal(got[n].view(torch.uint8), t.contiguous().view(torch.uint8)) for n, t in want.items())
            if version > VERSIONS[0]:
                assert world == {"top-a": 4, "top-b": 4, "top-c": 4, "whole": 2}[ident], (ident, world)
                assert nbytes == (model if ident == "whole" else boxed), (ident, version, nbytes)
    forwarded = {ident: [v[5] for v in versions] for ident, versions in results.items()}
    assert forwarded == {
        "top-a": [model, boxed, boxed], "top-b": [model, boxed, boxed], "top-c": [model, 0, 0], "whole": [0, 0, 0]
    }, forwarded  # fmt: skip


HOSTILE = {
    "outside the tensor": ({"w": Box((6, 0), (3, 6))}, "outside the tensor's shape"),
    "larger than the tensor": ({"w": Box((0, 0), (8, 7))}, "outside the tensor's shape"),
    "of another rank": ({"b": Box((0, 0), (1, 6))}, "a box of rank 2"),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
async def test_a_declaration_that_does_not_fit_is_refused_at_ready_and_the_version_goes_on(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    bad, why = HOSTILE[kind]
    caplog.set_level(logging.WARNING)
    results, _ = await _run({"good": {"w": ROWS["top"]}, "hostile": bad})
    for version, got, *_ in results["hostile"]:  # whole tensors, every version, bitwise
        want = _expected(version, None)
        assert all(torch.equal(got[n], t) for n, t in want.items()), version
    for version, got, *_ in results["good"]:  # the others' versions go on, sliced
        want = _expected(version, {"w": ROWS["top"]} if version > VERSIONS[0] else None)
        assert all(torch.equal(got[n], t) for n, t in want.items()), version
    refused = [r for r in caplog.records if "refused the boxes" in r.getMessage()]
    # the sender names the receiver and the tensor; the receiver hears why in its plan
    assert any(r.levelno == logging.WARNING and "hostile" in r.getMessage() and why in r.getMessage() for r in refused)
    assert any(r.levelno == logging.ERROR and why in r.getMessage() for r in refused), [r.getMessage() for r in refused]


async def test_lanes_keep_their_groups_across_versions_and_share_one_budget_when_their_number_changes() -> None:
    """Two lanes of boxes keep their data-plane groups from version to version (no rendezvous per lane per
    version); when a third receiver declares another box, every lane's slots are resized to the shared budget,
    so the sender holds no more than its whole lane's slots and one more bucket budget."""
    third = Box((5, 0), (3, 6))
    generations: list[int] = []
    slots: list[int] = []

    def after(sender: WeightSender) -> None:
        generations.append(sender.generation)
        slots.append(sender.slot_bytes)

    declarations: dict[str, Declared] = {
        "top": {"w": ROWS["top"]},
        "bottom": {"w": ROWS["bottom"]},
        "late": lambda version: {"w": third} if version >= 4 else None,  # taken at version 4: a third lane
    }
    results, _ = await _run(declarations, versions=(1, 2, 3, 4), bucket_size_mb=4, after=after)
    for ident, versions in results.items():  # each got its box (the first version whole), bitwise
        for version, got, *_ in versions:
            boxes = {"top": {"w": ROWS["top"]}, "bottom": {"w": ROWS["bottom"]}}.get(ident)
            if ident == "late":
                boxes = {"w": third} if version >= 4 else None
            want = _expected(version, boxes if version > 1 else None)
            assert all(torch.equal(got[n], t) for n, t in want.items()), (ident, version)
    assert generations[2] == generations[1], generations  # version 3: the same lanes, the same groups
    assert generations[3] > generations[2], generations  # version 4: a new lane (and the others resized)
    bucket = 4 << 20
    assert slots[1] == NUM_SLOTS * (bucket + 2 * lane_bucket_size(bucket, 2)), slots
    assert slots[3] == NUM_SLOTS * (bucket + 3 * lane_bucket_size(bucket, 3)), slots
    assert slots[3] <= 2 * NUM_SLOTS * bucket, slots


async def _receive_sliced_or_whole(receiver: WeightReceiver, version: int, seen: list[tuple[int, int, bool]]) -> None:
    """One version, "w" as its top rows or whole, bitwise; notes (version, bytes off the wire, sliced)."""
    got = {n: t.clone() async for n, t in receiver.receive_weights(into=_local_shaped)}
    sliced = got["w"].shape != (8, 6)
    want = _expected(version, {"w": ROWS["top"]} if sliced else None)
    assert all(torch.equal(got[n], t) for n, t in want.items()), version
    assert receiver.last_stats is not None
    seen.append((version, receiver.last_stats.nbytes, sliced))


async def test_after_a_trainer_restart_the_rollout_declares_again_and_slices_resume() -> None:
    """A receiver declares once. The first sender's first version takes no declaration (it has sent no tensors
    to check it on): not a refusal, the receiver keeps declaring and its second version is sliced. A restarted
    trainer (a new sender session on the same port) knows nothing of it: the receiver declares again, and the
    new sender's second version is sliced too."""
    port = free_port()
    cfg = engine_cfg(port, transport__verify="full")
    receiver = WeightReceiver(cfg, identity="top")
    receiver.declare_boxes({"w": ROWS["top"]})  # once, before the first version
    await receiver.start()
    seen: list[tuple[int, int, bool]] = []  # (version, bytes off the wire, "w" arrived as its box)
    try:
        for versions in ((1, 2), (3, 4)):  # two trainer runs, one sender session each
            async with WeightSender(cfg) as sender:
                for version in versions:
                    sent = sender.send_weights(_weights(version), version=version)
                    await with_timeout(asyncio.gather(_receive_sliced_or_whole(receiver, version, seen), sent))
    finally:
        await receiver.close()
    assert [(v, sliced) for v, _, sliced in seen] == [(1, False), (2, True), (3, False), (4, True)], seen
    whole = sum(_nbytes(t) for _, t in _weights(1))
    assert seen[1][1] == seen[3][1] == whole - _nbytes(_weights(1)[0][1]) + 3 * 6 * 4, seen
