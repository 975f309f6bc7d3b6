"""Boxes (protocol/boxes.py): a rank's part of a tensor, and the bytes of it any flat byte range holds."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from lightning_weightsync.errors import ProtocolError
from lightning_weightsync.protocol.boxes import Box, byte_pieces, check_boxes, flat_boxes, local_range, place, take
from lightning_weightsync.protocol.chunks import as_bytes

SHAPES = [(), (7,), (6, 10), (4, 5, 6), (3, 1, 4, 5)]


def _random_box(rng: random.Random, shape: tuple[int, ...]) -> Box:
    offsets, sizes = [], []
    for dim in shape:
        start = rng.randrange(dim)
        offsets.append(start)
        sizes.append(rng.randint(1, dim - start))
    return Box(tuple(offsets), tuple(sizes))


def _cuts(rng: random.Random, nbytes: int) -> list[tuple[int, int]]:
    """`nbytes` cut into byte ranges at random places, inside elements too (as bucket boundaries cut them)."""
    points = sorted({0, nbytes, *(rng.randrange(nbytes + 1) for _ in range(rng.randint(0, 6)))})
    return list(itertools.pairwise(points))


@pytest.mark.parametrize("shape", SHAPES)
def test_flat_boxes_cover_exactly_the_range_in_order(shape):
    rng = random.Random(1)
    numel = max(1, int(torch.tensor(shape).prod().item()) if shape else 1)
    index = torch.arange(numel).reshape(shape)
    for _ in range(50):
        start = rng.randrange(numel)
        stop = rng.randint(start + 1, numel)
        boxes = flat_boxes(shape, start, stop)
        assert len(boxes) <= max(1, 2 * len(shape) - 1)
        got = torch.cat([box.of(index).reshape(-1) for box in boxes])
        assert torch.equal(got, torch.arange(start, stop))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("shape", SHAPES)
def test_chunks_cut_anywhere_land_in_a_box_bitwise(shape, dtype):
    """A box's local tensor receives every chunk of the whole tensor (cut at any byte, inside elements too)
    and ends equal to the box of the whole, byte for byte; each chunk's part of the box is one byte range of
    the local tensor, and `take` packs exactly those bytes, so a sender that holds only a flat range (an FSDP
    shard) can send a box's rank its part without the rest."""
    rng = random.Random(hash((shape, str(dtype))) & 0xFFFF)
    whole = (torch.randn(shape) * 100).to(dtype)
    raw = as_bytes(whole.contiguous())
    itemsize = whole.element_size()
    for _ in range(20):
        box = _random_box(rng, shape) if shape else Box((), ())
        expected = as_bytes(box.of(whole).contiguous())
        local = torch.zeros(box.sizes, dtype=dtype)
        sent = torch.zeros(expected.numel(), dtype=torch.uint8)
        covered = 0
        for start, stop in _cuts(rng, raw.numel()):
            covered += place(local, box, shape, start, raw[start:stop])
            first, packed = take(raw[start:stop], box, shape, itemsize, start)
            pieces = byte_pieces(shape, itemsize, box, start, stop)
            assert (first, first + packed.numel()) == (local_range(shape, itemsize, box, pieces) if pieces else (0, 0))
            sent[first : first + packed.numel()] = packed
        assert covered == expected.numel()
        assert torch.equal(as_bytes(local), expected)
        assert torch.equal(sent, expected)


def test_intersect_and_within():
    a, b = Box((0, 2), (4, 4)), Box((2, 0), (4, 3))
    assert a.intersect(b) == Box((2, 2), (2, 1))
    assert a.intersect(Box((0, 6), (4, 1))) is None
    assert Box((2, 2), (2, 1)).within(a) == Box((2, 0), (2, 1))
    assert Box.whole((3, 4)).is_whole((3, 4)) and not a.is_whole((4, 8))


@pytest.mark.parametrize(
    ("boxes", "words"),
    [
        ([Box((0, 8), (4, 1))], "outside"),  # past the last column
        ([Box((-1, 0), (2, 2))], "outside"),
        ([Box((0, 0), (5, 8))], "outside"),  # larger than the tensor
        ([Box((0, 0), (0, 8))], "empty"),
        ([Box((0,), (4,))], "rank 1"),
        ([Box((0, 0), (2, 8)), Box((1, 0), (2, 8))], "overlap"),
    ],
)
def test_a_wrong_or_hostile_box_is_refused_by_name(boxes, words):
    with pytest.raises(ProtocolError, match=words) as info:
        check_boxes("layers.0.w", (4, 8), boxes)
    assert "layers.0.w" in str(info.value)


def test_boxes_that_tile_are_accepted():
    check_boxes("w", (4, 8), [Box((0, 0), (4, 4)), Box((0, 4), (4, 4))])
    check_boxes("scalar", (), [Box((), ())])
