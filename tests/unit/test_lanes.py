"""Declarations (protocol/declare.py) and what a lane takes of each tensor (versions/lanes.py), on their own."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from lightning_weightsync import ProtocolError
from lightning_weightsync.protocol.boxes import Box
from lightning_weightsync.protocol.chunks import TensorMeta, TensorShard, as_bytes
from lightning_weightsync.protocol.declare import Declaration, Declarations, check_declared
from lightning_weightsync.protocol.messages import BOXES_PAGE_BYTES, BoxEntry, Boxes, decode, encode
from lightning_weightsync.protocol.tiling import TilingMerger
from lightning_weightsync.versions.lanes import MIN_LANE_BUCKET, LaneView, lane_bucket_size


def _many(count: int) -> dict[str, Box]:
    return {f"model.layers.{i}.mlp.experts.{i % 64}.down_proj.weight": Box((i % 7, 0), (3, 5)) for i in range(count)}


def test_a_declaration_travels_in_pages_and_is_taken_only_once_every_page_arrived() -> None:
    boxes = _many(2000)
    declared = Declaration.of(boxes)
    pages = declared.pages("rollout-0")
    assert len(pages) > 2  # a large model's declaration is cut, each page within the frame budget
    assert all(len(encode(p)[0]) <= BOXES_PAGE_BYTES for p in pages)
    assert Declaration.of(dict(reversed(list(boxes.items())))).digest == declared.digest  # order-free
    held = Declarations()
    for page in reversed(pages[1:]):  # any order, through the wire's decoder
        held.add("rollout-0", decode(encode(page)))
        assert held.complete("rollout-0", declared.digest) is None
    held.add("rollout-0", decode(encode(pages[0])))
    assert held.complete("rollout-0", declared.digest) == boxes
    assert held.complete("rollout-1", declared.digest) is None  # pages are the sender's of that receiver only


def test_pages_that_do_not_hash_to_the_digest_they_name_are_refused() -> None:
    declared = Declaration.of({"w": Box((0, 0), (2, 4))})
    (page,) = declared.pages("r")
    forged = Boxes("r", page.digest, 0, 1, [BoxEntry("w", [0, 0], [8, 4])])  # another box under the same digest
    held = Declarations()
    held.add("r", forged)
    with pytest.raises(ProtocolError, match="do not hash"):
        held.complete("r", declared.digest)


def test_two_boxes_of_one_tensor_are_refused() -> None:
    """One box per tensor: a second (overlapping or not) would make the lane's part of it ambiguous."""
    entries = [BoxEntry("w", [0, 0], [2, 4]), BoxEntry("w", [1, 0], [2, 4])]
    from lightning_weightsync.protocol.declare import _digest

    held = Declarations()
    held.add("r", Boxes("r", _digest(entries), 0, 1, entries))
    with pytest.raises(ProtocolError, match="twice"):
        held.complete("r", _digest(entries))


SHAPES = {"w": (8, 6), "b": (6,)}


@pytest.mark.parametrize(
    ("boxes", "why"),
    [
        ({"w": Box((6, 0), (3, 6))}, "outside the tensor's shape"),
        ({"w": Box((0, 0), (9, 6))}, "outside the tensor's shape"),
        ({"w": Box((0, -1), (2, 6))}, "outside the tensor's shape"),
        ({"b": Box((0, 0), (1, 6))}, "a box of rank 2"),
    ],
    ids=["outside", "larger", "negative", "rank"],
)
def test_a_box_that_does_not_fit_its_tensor_is_refused_by_name(boxes: dict[str, Box], why: str) -> None:
    with pytest.raises(ProtocolError, match=why) as err:
        check_declared(boxes, SHAPES)
    assert repr(next(iter(boxes))) in str(err.value)


def test_a_box_of_the_whole_tensor_is_no_slice_and_one_of_a_tensor_not_sent_is_left_out() -> None:
    """A sharded rank may hold no part of a small tensor: another rank's receiver boxes cost it nothing."""
    declared = {"w": Box((0, 0), (8, 6)), "b": Box((2,), (4,)), "x": Box((0,), (1,))}
    assert check_declared(declared, SHAPES) == {"b": Box((2,), (4,))}


def _random_box(rng: random.Random, shape: tuple[int, ...]) -> Box:
    starts = [rng.randrange(d) for d in shape]
    return Box(tuple(starts), tuple(rng.randint(1, d - s) for s, d in zip(starts, shape, strict=True)))


@pytest.mark.parametrize("seed", range(40))
def test_the_parts_a_lane_takes_from_any_flat_cuts_tile_its_box_exactly(seed: int) -> None:
    """Sharded mode: each sender holds a flat byte range (cut anywhere, inside elements too); what a lane takes
    of each is one byte range of the box's local tensor, and together they tile it bitwise, nothing twice."""
    rng = random.Random(seed)
    shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 4)))
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.int8, torch.float64])
    tensor = torch.randint(-100, 100, shape).to(dtype)
    box = _random_box(rng, shape)
    data, nbytes = as_bytes(tensor), math.prod(shape) * tensor.element_size()
    cuts = sorted({0, nbytes, *(rng.randrange(nbytes + 1) for _ in range(rng.randint(0, 5)))})
    view = LaneView({"t": box})
    dest = torch.empty(box.sizes, dtype=dtype)
    merger = TilingMerger(1 << 20, lambda meta: dest, None, [f"s{i}" for i in range(len(cuts))])
    done = None
    for sender, (start, end) in enumerate(itertools.pairwise(cuts)):
        part = view.part("t", TensorShard(shape, dtype, start, data[start:end]))
        if part is None:
            continue
        assert isinstance(part, TensorShard) and part.box == box
        size = part.data.numel()
        meta = TensorMeta("t", shape, dtype, part.byte_offset, size, 0, box)
        done = merger.push(sender, meta, part.data) or done
    merger.finish()
    assert done is not None and done[1] is dest
    assert torch.equal(as_bytes(dest), as_bytes(box.of(tensor).contiguous()))
    whole = view.part("t", tensor)  # gather mode: the whole tensor's box, as its local tensor
    assert isinstance(whole, TensorShard) and torch.equal(whole.data, box.of(tensor))


def test_lanes_of_boxes_share_one_bucket_budget() -> None:
    assert lane_bucket_size(512 << 20, 1) == 512 << 20
    assert lane_bucket_size(512 << 20, 8) == 64 << 20
    assert lane_bucket_size(512 << 20, 4096) == MIN_LANE_BUCKET
    assert lane_bucket_size(4096, 4) == 4096  # never above the bucket itself


def test_a_box_lands_only_where_that_box_is_held() -> None:
    """Two senders that send two different boxes of one tensor to one receiver: the second is refused, naming
    both (a receiver holds one box of a tensor; a sender sending another is not its lane's)."""
    dest = torch.empty(2, 4)
    merger = TilingMerger(1 << 20, lambda meta: dest, None, ["s0", "s1"])
    first, other = Box((0, 0), (2, 4)), Box((2, 0), (2, 4))
    merger.push(0, TensorMeta("w", (4, 4), torch.float32, 0, 16, 0, first), torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(ProtocolError, match=r"box at \[2, 0\].*holds box at \[0, 0\]"):
        merger.push(1, TensorMeta("w", (4, 4), torch.float32, 16, 16, 0, other), torch.zeros(16, dtype=torch.uint8))
