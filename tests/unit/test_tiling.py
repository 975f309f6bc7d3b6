"""Sharded send mode, the protocol half: shards split with offsets into the whole tensor, and the tiling
merge that puts several senders' chunks back together bitwise, or names the tensor, the bytes and the
senders when they do not tile (a gap, an overlap, a shape that differs between senders)."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from lightning_weightsync import ProtocolError
from lightning_weightsync.protocol.chunks import TensorMeta, TensorShard, as_bytes, split_weight_chunks
from lightning_weightsync.protocol.tiling import TilingMerger
from tests.unit.test_chunks import assert_bitwise, make_tensor


def shards_of(tensor: torch.Tensor, senders: int) -> list[TensorShard]:
    """Row shards as FSDP2 cuts them (torch.chunk: uneven, the last ones may be empty)."""
    out, row = [], 0
    row_bytes = tensor[0].numel() * tensor.element_size() if tensor.dim() and tensor.shape[0] else 0
    for part in torch.chunk(tensor, senders, dim=0) if tensor.dim() else [tensor]:
        out.append(TensorShard(tuple(tensor.shape), tensor.dtype, row * row_bytes, part))
        row += part.shape[0] if tensor.dim() else 0
    return out


def sender_streams(weights: dict[str, torch.Tensor], senders: int, bucket_size: int, alone_from: int | None):
    """Each sender's chunk stream (its own bucket plan, as each sender rank runs one)."""

    async def one(rank: int) -> list:
        items = []
        for name, tensor in weights.items():
            shards = shards_of(tensor, senders)
            if rank < len(shards) and (shards[rank].data.numel() or (tensor.numel() == 0 and rank == 0)):
                items.append((name, shards[rank]))
        return [
            (meta, data.clone()) async for meta, data in split_weight_chunks(items, bucket_size, alone_from=alone_from)
        ]

    return [asyncio.run(one(rank)) for rank in range(senders)]


def interleave(streams: list[list], seed: int) -> list[tuple[int, object, torch.Tensor]]:
    """The chunks of every sender, in a random interleaving that keeps each sender's own order."""
    rng = random.Random(seed)
    cursors = [0] * len(streams)
    out = []
    while any(c < len(s) for c, s in zip(cursors, streams, strict=False)):
        sender = rng.choice([i for i, s in enumerate(streams) if cursors[i] < len(s)])
        meta, data = streams[sender][cursors[sender]]
        out.append((sender, meta, data))
        cursors[sender] += 1
    return out


WEIGHTS = {
    "embed": make_tensor((37, 12), torch.bfloat16, 1),  # uneven over 2 and 4
    "tiny": make_tensor((3, 5), torch.float32, 2),  # fewer rows than senders: empty shards
    "scalar": make_tensor((), torch.float32, 3),
    "empty": make_tensor((0, 4), torch.float16, 4),
    "big": make_tensor((64, 33), torch.float32, 5),  # larger than the bucket
    "mask": make_tensor((9,), torch.bool, 6),
}


@pytest.mark.parametrize("senders", [1, 2, 3, 4])
@pytest.mark.parametrize("alone_from", [None, 1024])
def test_shards_from_several_senders_tile_bitwise(senders: int, alone_from: int | None) -> None:
    streams = sender_streams(WEIGHTS, senders, bucket_size=512, alone_from=alone_from)
    for seed in range(3):
        merger = TilingMerger(512, None, "cpu", [f"rank{i}" for i in range(senders)])
        got = {}
        for sender, meta, data in interleave(streams, seed):
            done = merger.push(sender, meta, data)
            if done is not None:
                got[done[0]] = done[1].clone()
        merger.finish()
        assert sorted(got) == sorted(WEIGHTS)
        for name, tensor in WEIGHTS.items():
            assert_bitwise(got[name], tensor, name)


def test_shard_chunks_carry_offsets_into_the_whole_tensor() -> None:
    tensor = make_tensor((10, 8), torch.float32)
    shard = TensorShard((10, 8), torch.float32, 4 * 32, tensor[4:7])
    metas = [m for m, _ in asyncio.run(_collect(split_weight_chunks([("w", shard)], 40)))]
    assert [(m.chunk_offset, m.chunk_size) for m in metas] == [(128, 40), (168, 40), (208, 16)]
    assert all(m.shape == (10, 8) for m in metas)


async def _collect(items):
    return [(m, d.clone()) async for m, d in items]


def test_a_shard_outside_its_tensor_is_refused() -> None:
    with pytest.raises(ValueError, match="outside"):
        TensorShard((4,), torch.float32, 8, torch.zeros(3))


def _push_all(merger: TilingMerger, chunks) -> None:
    for sender, meta, data in chunks:
        merger.push(sender, meta, data)


def test_a_gap_names_the_tensor_the_bytes_and_the_senders() -> None:
    streams = sender_streams({"w": WEIGHTS["big"]}, 4, bucket_size=512, alone_from=None)
    merger = TilingMerger(512, None, "cpu", ["a:1", "b:2", "c:3", "d:4"])
    _push_all(merger, interleave([streams[0], streams[1], [], streams[3]], 0))  # sender 2 never sent
    with pytest.raises(ProtocolError, match=r"gap in 'w': bytes \[4224, 6336\)") as info:
        merger.finish()
    assert "a:1" in str(info.value) and "d:4" in str(info.value) and "c:3" not in str(info.value)


def test_a_chunk_at_a_negative_offset_is_refused_before_anything_is_written() -> None:
    merger = TilingMerger(512, None, "cpu", ["a", "b"])
    meta = TensorMeta("w", (16,), torch.float32, -4, 8)  # bytes [-4, 4): would land at the tensor's tail
    with pytest.raises(ProtocolError, match=r"chunk \[-4, 4\) of 'w' from sender 1 \(b\) is outside its 64 bytes"):
        merger.push(1, meta, torch.full((8,), 7, dtype=torch.uint8))
    assert not merger.open  # nothing claimed


@pytest.mark.parametrize("missing", [(63, 64), (0, 1), (31, 32)], ids=["last-byte", "first-byte", "middle-byte"])
def test_a_one_byte_gap_anywhere_is_named_in_the_error(missing: tuple[int, int]) -> None:
    """The gap check counts every byte: a single byte nobody sent at the end of a tensor is a gap too."""
    data = torch.arange(64, dtype=torch.uint8)
    merger = TilingMerger(512, None, "cpu", ["a", "b"])
    for sender, (start, end) in enumerate([(0, missing[0]), (missing[1], 64)]):
        if end > start:
            merger.push(sender, TensorMeta("w", (16,), torch.float32, start, end - start), data[start:end].clone())
    assert merger.gaps("w") == [missing]
    with pytest.raises(ProtocolError, match=rf"gap in 'w': bytes \[{missing[0]}, {missing[1]}\) of 64"):
        merger.finish()


def test_a_sender_claiming_another_senders_range_is_an_overlap() -> None:
    tensor = WEIGHTS["big"]
    streams = sender_streams({"w": tensor}, 2, bucket_size=512, alone_from=None)
    merger = TilingMerger(512, None, "cpu", ["a", "b"])
    meta, data = streams[0][0]
    merger.push(0, meta, data)
    with pytest.raises(ProtocolError, match=r"overlap in 'w': sender 1 \(b\)"):
        merger.push(1, meta, data)  # sender 1 replays sender 0's first chunk


def test_a_range_after_the_tensor_is_complete_is_an_overlap() -> None:
    streams = sender_streams({"w": WEIGHTS["tiny"]}, 1, bucket_size=512, alone_from=None)
    merger = TilingMerger(512, None, "cpu", ["a", "b"])
    meta, data = streams[0][0]
    assert merger.push(0, meta, data) is not None
    with pytest.raises(ProtocolError, match="already complete"):
        merger.push(1, meta, data)


def test_partial_overlap_inside_a_neighbour_is_caught() -> None:
    tensor = make_tensor((16,), torch.float32)
    merger = TilingMerger(512, None, "cpu", ["a", "b"])
    raw = as_bytes(tensor)
    from lightning_weightsync import TensorMeta

    merger.push(0, TensorMeta("w", (16,), torch.float32, 0, 32, 0), raw[0:32].clone())
    merger.push(0, TensorMeta("w", (16,), torch.float32, 48, 16, 0), raw[48:64].clone())
    with pytest.raises(ProtocolError, match="overlap"):
        merger.push(1, TensorMeta("w", (16,), torch.float32, 28, 8, 0), raw[28:36].clone())
    with pytest.raises(ProtocolError, match="overlap"):
        merger.push(1, TensorMeta("w", (16,), torch.float32, 40, 16, 0), raw[40:56].clone())
    assert merger.push(1, TensorMeta("w", (16,), torch.float32, 32, 16, 0), raw[32:48].clone()) is not None


def test_senders_disagreeing_on_shape_or_dtype_fail() -> None:
    from lightning_weightsync import TensorMeta

    merger = TilingMerger(512, None, "cpu", ["a", "b"])
    merger.push(0, TensorMeta("w", (4, 2), torch.float32, 0, 16, 0), torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(ProtocolError, match=r"is torch.float32\[4, 2\] in one sender's chunks"):
        merger.push(1, TensorMeta("w", (2, 4), torch.float32, 16, 16, 0), torch.zeros(16, dtype=torch.uint8))
    # the same shape and byte count, another dtype: the bytes would fit, the tensor would be garbage
    merger = TilingMerger(512, None, "cpu", ["a", "b"])
    merger.push(0, TensorMeta("w", (4, 2), torch.float32, 0, 16, 0), torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(ProtocolError, match=r"torch.float32\[4, 2\] in one sender's chunks and torch.int32\[4, 2\]"):
        merger.push(1, TensorMeta("w", (4, 2), torch.int32, 16, 16, 0), torch.zeros(16, dtype=torch.uint8))


def test_chunks_land_straight_in_the_consumers_destination() -> None:
    tensor = WEIGHTS["big"]
    dest = torch.zeros_like(tensor)
    streams = sender_streams({"w": tensor}, 3, bucket_size=512, alone_from=None)
    merger = TilingMerger(512, lambda meta: dest, "cpu", ["a", "b", "c"])
    done = [merger.push(s, m, d) for s, m, d in interleave(streams, 1)]
    assert next(d for d in done if d is not None)[1] is dest
    assert_bitwise(dest, tensor)
