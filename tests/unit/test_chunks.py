"""The chunk protocol: split -> pack into buckets -> unpack -> merge must be bitwise and must fail loudly.

Every stream here goes through the same path the engine uses: the split plans each chunk's bucket
offset, `pack_and_unpack` copies chunks into one reused send bucket at those offsets, "transfers"
each full bucket into one reused receive bucket, and hands the merge uint8 views of it. Reusing both
buckets checks the lifetimes the engine relies on: a chunk is only read until the next one is asked
for, and merged tensors never alias the receive bucket.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import AsyncIterator, Callable, Iterable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_weightsync import ProtocolError, TensorMeta, merge_weight_chunks, split_weight_chunks
from lightning_weightsync.protocol.dtypes import DTYPES

FLOAT8 = [name for name in DTYPES if name.startswith("float8")]
REQUIRED_DTYPES = [
    "float32", "float16", "bfloat16", "float64", *FLOAT8,
    "int8", "int16", "int32", "int64", "uint8", "bool", "complex64",
]  # fmt: skip
ALL_DTYPES = list(DTYPES)


# ----------------------------------------------------------------------------------------------- helpers


def make_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random *bytes* viewed as `dtype`: NaN payloads, -0.0, subnormals all included, so only a
    bitwise round trip passes (bool gets valid 0/1 bytes)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8).bool()
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8)


def assert_bitwise(got: torch.Tensor, want: torch.Tensor, name: str = "") -> None:
    assert got.dtype == want.dtype, name
    assert tuple(got.shape) == tuple(want.shape), name
    # torch.equal is not implemented for float8 on CPU and treats NaN != NaN: compare the bytes.
    assert torch.equal(raw_bytes(got), raw_bytes(want)), f"{name}: bytes differ"


async def collect(items: AsyncIterator) -> list:
    return [item async for item in items]


def run(coro):
    return asyncio.run(coro)


async def pack_and_unpack(
    chunks: AsyncIterator[tuple[TensorMeta, torch.Tensor]], bucket_size: int
) -> AsyncIterator[tuple[TensorMeta, torch.Tensor]]:
    """What sender + receiver do to a chunk stream: pack at meta.offset, ship full buckets, unpack.

    Checks the split's bucket plan on the way: offsets in range, chunks back to back, a new bucket
    only when the previous one is full to the last byte or holds MAX_BUCKET_ENTRIES chunks.
    """
    from lightning_weightsync.protocol.chunks import MAX_BUCKET_ENTRIES

    send_bucket = torch.empty(bucket_size, dtype=torch.uint8)
    recv_bucket = torch.empty(bucket_size, dtype=torch.uint8)
    pending: list[TensorMeta] = []
    filled = 0

    def ship() -> list[TensorMeta]:
        recv_bucket.fill_(0xAB)  # the previous bucket's bytes are gone: merge must have copied them
        recv_bucket[:filled].copy_(send_bucket[:filled])
        send_bucket.fill_(0xCD)
        return list(pending)

    async for meta, data in chunks:
        assert meta.offset is not None
        assert meta.offset >= 0 and meta.offset + meta.chunk_size <= bucket_size
        assert data.dtype == torch.uint8 and data.numel() == meta.chunk_size
        if meta.offset != filled:
            assert meta.offset == 0 and (filled == bucket_size or len(pending) == MAX_BUCKET_ENTRIES), (
                f"chunk of {meta.name} at offset {meta.offset}, bucket filled to {filled}/{bucket_size}"
            )
            for m in ship():
                yield m, recv_bucket[m.offset : m.offset + m.chunk_size]
            pending, filled = [], 0
        send_bucket[meta.offset : meta.offset + meta.chunk_size].copy_(data)
        pending.append(meta)
        filled += meta.chunk_size
    if pending:
        for m in ship():
            yield m, recv_bucket[m.offset : m.offset + m.chunk_size]


async def roundtrip_async(
    weights, bucket_size: int, into: Callable[[TensorMeta], torch.Tensor | None] | None = None
) -> list[tuple[str, torch.Tensor]]:
    chunks = pack_and_unpack(split_weight_chunks(weights, bucket_size), bucket_size)
    return await collect(merge_weight_chunks(chunks, bucket_size, into=into))


def roundtrip(weights, bucket_size: int, into=None) -> list[tuple[str, torch.Tensor]]:
    return run(roundtrip_async(weights, bucket_size, into))


def assert_roundtrip(named: list[tuple[str, torch.Tensor]], bucket_size: int) -> None:
    got = roundtrip(named, bucket_size)
    assert [n for n, _ in got] == [n for n, _ in named]
    for (name, want), (_, tensor) in zip(named, got, strict=True):
        assert_bitwise(tensor, want, name)


def split_list(named, bucket_size: int) -> list[tuple[TensorMeta, torch.Tensor]]:
    return run(collect(split_weight_chunks(named, bucket_size)))


def merge_list(chunks: Iterable, bucket_size: int, into=None) -> list[tuple[str, torch.Tensor]]:
    return run(collect(merge_weight_chunks(chunks, bucket_size, into=into)))


def bucket_fills(metas: list[TensorMeta], bucket_size: int) -> list[int]:
    """Bytes in each bucket, following the split's plan (a bucket starts when offset returns to 0)."""
    fills: list[int] = []
    end = None
    for m in metas:
        if end is None or (m.offset == 0 and end == bucket_size):
            fills.append(0)
        fills[-1] += m.chunk_size
        end = m.offset + m.chunk_size
    return fills


# ----------------------------------------------------------------------------------------------- dtypes


def test_required_dtypes_present() -> None:
    assert FLOAT8, "torch should have float8 dtypes"
    for name in REQUIRED_DTYPES:
        assert name in DTYPES


@pytest.mark.parametrize("dtype_name", ALL_DTYPES)
@pytest.mark.parametrize("bucket_size", [1, 7, 64, 4096])
def test_roundtrip_every_dtype_bitwise(dtype_name: str, bucket_size: int) -> None:
    dtype = DTYPES[dtype_name]
    named = [
        ("a", make_tensor((5, 3), dtype, 1)),
        ("b.scalar", make_tensor((), dtype, 2)),
        ("c", make_tensor((33,), dtype, 3)),
        ("d.empty", make_tensor((0, 4), dtype, 4)),
    ]
    assert_roundtrip(named, bucket_size)


def test_float_specials_survive() -> None:
    """NaN payloads, -0.0 and infinities: equal-by-value is not enough, bytes must match."""
    x = torch.tensor([float("nan"), -0.0, 0.0, float("inf"), -float("inf"), 1e-45], dtype=torch.float32)
    x[0:1].view(torch.int32).fill_(0x7FC00123)  # a NaN with a payload
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        t = x.to(dtype) if dtype != torch.float32 else x
        assert_roundtrip([("x", t)], 3)


# ----------------------------------------------------------------------------------------------- shapes


def test_zero_dim_scalars() -> None:
    named = [(f"s{i}", make_tensor((), DTYPES[n], i)) for i, n in enumerate(REQUIRED_DTYPES)]
    got = roundtrip(named, 3)
    for (name, want), (_, t) in zip(named, got, strict=True):
        assert t.dim() == 0
        assert_bitwise(t, want, name)


@pytest.mark.parametrize("shape", [(0,), (0, 5), (5, 0), (3, 0, 2), (2**40, 0), (0, 2**40)])
def test_empty_tensors_arrive_with_shape_and_dtype(shape: tuple[int, ...]) -> None:
    named = [("before", make_tensor((10,), torch.float32)), ("empty", torch.empty(shape, dtype=torch.bfloat16))]
    named.append(("after", make_tensor((3,), torch.int64)))
    chunks = split_list(named, 16)
    empty_chunks = [m for m, _ in chunks if m.name == "empty"]
    assert len(empty_chunks) == 1 and empty_chunks[0].chunk_size == 0  # exactly one zero-size chunk
    got = dict(roundtrip(named, 16))
    assert list(got) == ["before", "empty", "after"]
    assert got["empty"].shape == shape and got["empty"].dtype == torch.bfloat16 and got["empty"].numel() == 0
    assert_bitwise(got["before"], named[0][1])
    assert_bitwise(got["after"], named[2][1])


def test_empty_tensor_when_bucket_exactly_full() -> None:
    """A zero-byte tensor right after a tensor that filled the bucket, and as the very last item."""
    named = [
        ("full", make_tensor((16,), torch.uint8)),
        ("empty1", torch.empty(0, dtype=torch.float32)),
        ("next", make_tensor((4,), torch.float16)),
        ("fill", make_tensor((8,), torch.uint8)),
        ("empty2", torch.empty(0, 3, dtype=torch.int8)),
    ]
    assert_roundtrip(named, 16)
    assert_roundtrip(named[:2], 16)


def test_only_empty_tensors() -> None:
    named = [(f"e{i}", torch.empty(0, i, dtype=torch.float32)) for i in range(4)]
    assert_roundtrip(named, 8)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: make_tensor((6, 10), torch.float32).t(), id="transposed"),
        pytest.param(lambda: make_tensor((8, 10), torch.bfloat16)[::2, 1:7], id="strided-slice"),
        pytest.param(lambda: make_tensor((4, 5, 6), torch.int16).permute(2, 0, 1), id="permuted"),
        pytest.param(lambda: make_tensor((20,), torch.float64)[5:15], id="offset-slice"),
        pytest.param(lambda: make_tensor((20,), torch.float32)[::3], id="1d-strided"),
        pytest.param(lambda: make_tensor((20,), torch.uint8)[1::2], id="1d-strided-bytes"),
        pytest.param(lambda: make_tensor((1, 7), torch.complex64).expand(4, 7), id="expanded"),
        pytest.param(lambda: make_tensor((9, 9), torch.float8_e4m3fn).t()[2:, ::3], id="float8-transposed"),
    ],
)
def test_non_contiguous_and_offset_views(make) -> None:
    t = make()
    before = raw_bytes(t).clone()
    got = roundtrip([("w", t)], 13)
    assert_bitwise(got[0][1], t)
    assert torch.equal(raw_bytes(t), before)  # the source is not modified


def test_huge_first_dim() -> None:
    t = make_tensor((3_000_001, 1), torch.uint8, 7)
    u = make_tensor((2**20 + 3, 1, 1), torch.float16, 8)
    assert_roundtrip([("tall", t), ("tall16", u)], 1 << 20)


# ----------------------------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("nbytes", [1, 63, 64, 65, 127, 128, 129, 64 * 100, 64 * 100 + 1])
def test_sizes_around_the_bucket(nbytes: int) -> None:
    bucket = 64
    t = make_tensor((nbytes,), torch.uint8, nbytes)
    chunks = split_list([("w", t)], bucket)
    assert len(chunks) == math.ceil(nbytes / bucket)
    assert [m.chunk_size for m, _ in chunks] == [min(bucket, nbytes - i * bucket) for i in range(len(chunks))]
    assert_roundtrip([("w", t)], bucket)
    # and sharing buckets with neighbours on both sides
    assert_roundtrip([("pre", make_tensor((5,), torch.uint8)), ("w", t), ("post", make_tensor((3,), torch.int32))], 64)


@pytest.mark.parametrize("bucket_size", [1, 3, 5, 6, 7, 9, 10, 15, 1021])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64, torch.bfloat16, torch.int16])
def test_bucket_not_a_multiple_of_element_size(bucket_size: int, dtype: torch.dtype) -> None:
    named = [("a", make_tensor((170, 3), dtype, 1)), ("b", make_tensor((5,), dtype, 2))]
    if bucket_size % dtype.itemsize:
        # at least one chunk boundary falls inside an element
        metas = [m for m, _ in split_list(named, bucket_size)]
        assert any(m.chunk_offset % dtype.itemsize for m in metas)
    assert_roundtrip(named, bucket_size)


def test_split_fills_every_bucket_to_the_last_byte() -> None:
    bucket = 100
    sizes = [30, 50, 40, 100, 1, 250, 0, 99, 7]
    named = [(f"t{i}", make_tensor((n,), torch.uint8, i)) for i, n in enumerate(sizes)]
    metas = [m for m, _ in split_list(named, bucket)]
    for m in metas:
        assert m.offset is not None and m.offset >= 0 and m.offset + m.chunk_size <= bucket
    fills = bucket_fills(metas, bucket)
    assert fills[:-1] == [bucket] * (len(fills) - 1)
    assert sum(fills) == sum(sizes)
    assert len(fills) == math.ceil(sum(sizes) / bucket)
    # t2 (40 bytes) starts at offset 80: cut at the boundary (20 + 20), not pushed to the next bucket
    t2 = [(m.offset, m.chunk_offset, m.chunk_size) for m in metas if m.name == "t2"]
    assert t2 == [(80, 0, 20), (0, 20, 20)]


def test_chunk_metadata_is_consistent() -> None:
    t = make_tensor((7, 11), torch.float32)
    chunks = split_list([("w", t)], 40)
    pos = 0
    for meta, _data in chunks:
        assert meta.name == "w" and meta.shape == (7, 11) and meta.dtype == torch.float32
        assert meta.nbytes == 7 * 11 * 4 and meta.numel == 77
        assert meta.chunk_offset == pos and meta.is_first == (pos == 0)
        pos += meta.chunk_size
        assert meta.is_last == (pos == meta.nbytes)
    assert pos == t.nbytes


def test_contiguous_tensors_are_not_copied() -> None:
    t = make_tensor((64, 64), torch.float32)
    base = t.untyped_storage().data_ptr()
    for meta, data in split_list([("w", t)], 1000):
        assert data.data_ptr() == base + meta.chunk_offset  # a view of the caller's bytes


def test_bucket_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="bucket_size"):
        split_list([("w", torch.zeros(3))], 0)


def test_non_tensor_is_rejected() -> None:
    with pytest.raises(TypeError, match="'w'"):
        split_list([("w", [1, 2, 3])], 16)


# ----------------------------------------------------------------------------------------------- inputs


def test_async_input_iterable() -> None:
    named = [(f"w{i}", make_tensor((i * 7 + 1,), torch.bfloat16, i)) for i in range(6)]

    async def produce():
        for name, t in named:
            await asyncio.sleep(0)
            yield name, t

    got = roundtrip(produce(), 10)
    for (name, want), (gname, t) in zip(named, got, strict=True):
        assert gname == name
        assert_bitwise(t, want, name)


def test_sync_generator_and_merge_from_sync_iterable() -> None:
    named = [("a", make_tensor((9,), torch.int32)), ("b", make_tensor((2, 2), torch.float64))]
    chunks = split_list((x for x in named), 12)
    got = merge_list(chunks, 12)  # merge takes a plain list too
    for (name, want), (_, t) in zip(named, got, strict=True):
        assert_bitwise(t, want, name)


def test_producer_may_reuse_its_tensor_after_yielding_the_next() -> None:
    """Documented lifetime: the next (name, tensor) is pulled only after every chunk of the
    current one was consumed, so one reused buffer (as an FSDP gather would reuse) is safe."""
    buf = torch.empty(100, dtype=torch.float32)
    log: list[str] = []

    def produce():
        for i in range(5):
            buf.fill_(float(i))
            log.append(f"yield {i}")
            yield f"w{i}", buf
            log.append(f"resume {i}")
            buf.fill_(-1.0)  # clobber it as soon as control comes back

    async def consume() -> list[tuple[str, torch.Tensor]]:
        out = []
        async for name, t in merge_weight_chunks(_logged(split_weight_chunks(produce(), 64), log), 64):
            out.append((name, t))
        return out

    got = run(consume())
    for i, (name, t) in enumerate(got):
        assert name == f"w{i}"
        assert torch.equal(t, torch.full((100,), float(i)))
        assert t.data_ptr() != buf.data_ptr()
    # every chunk of w{i} was consumed before the producer was resumed
    for i in range(4):
        last_chunk = max(k for k, e in enumerate(log) if e.startswith(f"chunk w{i} "))
        assert last_chunk < log.index(f"resume {i}")


async def _logged(chunks, log: list[str]):
    async for meta, data in chunks:
        log.append(f"chunk {meta.name} {meta.chunk_offset}")
        yield meta, data


def test_non_contiguous_producer_reuse() -> None:
    buf = torch.empty(10, 12, dtype=torch.float16)

    def produce():
        for i in range(3):
            buf.copy_(torch.arange(120, dtype=torch.float16).reshape(10, 12) + i)
            yield f"w{i}", buf.t()
            buf.fill_(0)

    got = roundtrip(produce(), 50)
    for i, (_, t) in enumerate(got):
        assert_bitwise(t, (torch.arange(120, dtype=torch.float16).reshape(10, 12) + i).t().contiguous())


def test_merged_tensors_do_not_alias_chunks() -> None:
    t = make_tensor((50,), torch.float32)
    chunks = [(m, d.clone()) for m, d in split_list([("w", t)], 1000)]
    ((_name, out),) = merge_list(chunks, 1000)
    for _, d in chunks:
        d.fill_(0)
    assert_bitwise(out, t)


# ----------------------------------------------------------------------------------------------- into=


def test_into_writes_straight_into_destinations(monkeypatch: pytest.MonkeyPatch) -> None:
    named = [
        ("a", make_tensor((40, 3), torch.bfloat16, 1)),
        ("b", make_tensor((), torch.float32, 2)),
        ("c", make_tensor((0, 2), torch.int8, 3)),
        ("d", make_tensor((33,), torch.float8_e5m2, 4)),
    ]
    dests = {n: torch.zeros_like(t) for n, t in named}
    asked: list[TensorMeta] = []

    def into(meta: TensorMeta) -> torch.Tensor:
        asked.append(meta)
        return dests[meta.name]

    chunks = [(m, d.clone()) for m, d in split_list(named, 17)]
    # no staging: merge must not allocate any tensor of its own when every destination is given
    for fn in ("empty", "zeros", "empty_like", "zeros_like", "empty_strided"):
        monkeypatch.setattr(torch, fn, _forbidden(fn))
    got = merge_list(chunks, 17, into=into)
    monkeypatch.undo()
    assert [m.name for m in asked] == ["a", "b", "c", "d"]  # asked once per tensor, at its first chunk
    assert all(m.chunk_offset == 0 for m in asked)
    for (name, want), (gname, t) in zip(named, got, strict=True):
        assert gname == name
        assert t is dests[name]  # the yielded tensor IS the destination
        assert_bitwise(t, want, name)


def _forbidden(fn: str):
    def raise_(*args, **kwargs):
        raise AssertionError(f"merge allocated a staging tensor with torch.{fn}")

    return raise_


def test_into_none_falls_back_to_fresh_tensor() -> None:
    named = [("keep", make_tensor((10,), torch.float32, 1)), ("fresh", make_tensor((6,), torch.int64, 2))]
    dest = torch.zeros(10)
    got = dict(merge_list(split_list(named, 8), 8, into=lambda m: dest if m.name == "keep" else None))
    assert got["keep"] is dest
    assert_bitwise(got["keep"], named[0][1])
    assert_bitwise(got["fresh"], named[1][1])


def test_into_contiguous_view_of_a_larger_buffer() -> None:
    """Destinations may be views into a flat parameter buffer; bytes outside stay untouched."""
    flat = torch.full((30,), 7.0)
    named = [("a", make_tensor((2, 5), torch.float32, 1)), ("b", make_tensor((10,), torch.float32, 2))]
    views = {"a": flat[5:15].view(2, 5), "b": flat[20:30]}
    got = dict(merge_list(split_list(named, 12), 12, into=lambda m: views[m.name]))
    assert got["a"] is views["a"]
    assert_bitwise(flat[5:15].view(2, 5), named[0][1])
    assert_bitwise(flat[20:30], named[1][1])
    assert torch.equal(flat[:5], torch.full((5,), 7.0)) and torch.equal(flat[15:20], torch.full((5,), 7.0))


@pytest.mark.parametrize(
    "dest, match",
    [
        pytest.param(torch.zeros(5, 4), r"'w'.*\[5, 4\].*\[4, 5\]", id="wrong-shape"),
        pytest.param(torch.zeros(21), r"'w'", id="wrong-numel"),
        pytest.param(torch.zeros(4, 5, dtype=torch.int32), r"'w'.*torch.int32.*torch.float32", id="wrong-dtype"),
        pytest.param(torch.zeros(5, 4).t(), r"'w'.*contiguous", id="non-contiguous"),
        pytest.param([0.0] * 20, r"list for 'w', not a Tensor", id="not-a-tensor"),
    ],
)
def test_into_bad_destination_is_a_clear_error(dest, match: str) -> None:
    chunks = split_list([("w", make_tensor((4, 5), torch.float32))], 16)
    with pytest.raises(ProtocolError, match=match):
        merge_list(chunks, 16, into=lambda meta: dest)


# ----------------------------------------------------------------------------------------------- corruption


def _stream() -> list[tuple[TensorMeta, torch.Tensor]]:
    """Two tensors of 4 chunks each, plus a small one, bucket 10."""
    named = [
        ("a", make_tensor((10,), torch.float32, 1)),
        ("b", make_tensor((5, 4), torch.int16, 2)),
        ("c", make_tensor((3,), torch.uint8, 3)),
    ]
    return [(m, d.clone()) for m, d in split_list(named, 10)]


def _idx(chunks, name: str) -> list[int]:
    return [i for i, (m, _) in enumerate(chunks) if m.name == name]


def _replace(chunks, i: int, **changes):
    out = list(chunks)
    meta, data = out[i]
    out[i] = (dataclasses.replace(meta, **changes), data)
    return out


def test_valid_stream_merges() -> None:
    chunks = _stream()
    assert len(_idx(chunks, "a")) == 4 and len(_idx(chunks, "b")) == 4
    assert [n for n, _ in merge_list(chunks, 10)] == ["a", "b", "c"]


def _corruptions():
    s = _stream()
    a, b = _idx(s, "a"), _idx(s, "b")

    def swap(i, j):
        out = list(s)
        out[i], out[j] = out[j], out[i]
        return out

    def drop(i):
        return s[:i] + s[i + 1 :]

    yield "reorder", swap(a[1], a[2]), r"gap in 'a'"
    yield "reorder-first", swap(a[0], a[1]), r"first chunk of 'a' starts at byte \d+, expected 0"
    yield "gap", drop(a[2]), r"gap in 'a': chunk starts at byte 30, expected 20"
    yield "first-lost", drop(b[0]), r"first chunk of 'b'"
    yield "overlap-dup", [*s[: a[2]], s[a[1]], *s[a[2] :]], r"overlap in 'a'"
    m, d = s[a[2]]
    shifted = dataclasses.replace(m, chunk_offset=m.chunk_offset - 3)
    yield "overlap-shift", [*s[: a[2]], (shifted, d), *s[a[2] + 1 :]], r"overlap in 'a'"
    yield (
        "shape-change",
        _replace(s, b[2], shape=(4, 5)),
        r"'b' changed from torch.int16\[5, 4\] to torch.int16\[4, 5\]",
    )
    yield "dtype-change", _replace(s, b[1], dtype=torch.float16), r"'b' changed from torch.int16.* to torch.float16"
    yield "ends-mid-tensor", s[: b[-1]], r"stream ended mid-tensor: 'b' has 30 of 40 bytes"
    yield "ends-after-first-chunk", s[: a[0] + 1], r"ended mid-tensor: 'a'"
    yield "interleaved", [*s[: a[2]], s[b[0]], *s[a[2] :]], r"moved to 'b' while 'a' was incomplete"
    yield "duplicate-name", s + s[a[0] : a[-1] + 1], r"'a' appears twice"
    yield "duplicate-later-chunk", [*s, s[a[2]]], r"'a' appears twice|first chunk of 'a'"
    yield "size-mismatch", _replace(s, a[1], chunk_size=9), r"declares 9 bytes but carries 10"
    yield "outside-tensor", _replace(s, a[-1], chunk_offset=39), r"outside its 40 bytes"
    yield "negative-offset", _replace(s, a[0], chunk_offset=-1), r"outside"
    big = make_tensor((11,), torch.uint8)
    yield "chunk-over-bucket", [(TensorMeta("x", (11,), torch.uint8, 0, 11, 0), big)], r"11 bytes > bucket_size 10"
    yield "not-uint8", [(TensorMeta("x", (2,), torch.float32, 0, 8, 0), torch.zeros(8))], r"float32"


@pytest.mark.parametrize("case", list(_corruptions()), ids=lambda c: c[0])
def test_corrupted_streams_are_protocol_errors(case) -> None:
    _, chunks, match = case
    with pytest.raises(ProtocolError, match=match):
        merge_list(chunks, 10)


def test_duplicate_names_from_the_producer() -> None:
    named = [("w", torch.zeros(3)), ("v", torch.ones(2)), ("w", torch.zeros(3))]
    with pytest.raises(ProtocolError, match="'w' appears twice"):
        roundtrip(named, 8)


def test_duplicate_empty_tensor_names() -> None:
    named = [("e", torch.empty(0)), ("e", torch.empty(0))]
    with pytest.raises(ProtocolError, match="'e' appears twice"):
        roundtrip(named, 8)


def test_nothing_is_yielded_for_an_incomplete_tensor() -> None:
    s = _stream()
    cut = s[: _idx(s, "b")[2]]

    async def consume(got: list[str]) -> None:
        async for name, _ in merge_weight_chunks(cut, 10):
            got.append(name)

    got: list[str] = []
    with pytest.raises(ProtocolError):
        run(consume(got))
    assert got == ["a"]


# ----------------------------------------------------------------------------------------------- property

_SHAPES = st.lists(st.integers(0, 9), min_size=0, max_size=4).map(tuple)
_WEIGHTS = st.lists(
    st.tuples(_SHAPES, st.sampled_from(ALL_DTYPES), st.booleans(), st.integers(0, 2**31)), min_size=1, max_size=6
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(weights=_WEIGHTS, bucket_size=st.one_of(st.integers(1, 40), st.integers(41, 5000)), use_async=st.booleans())
def test_roundtrip_property(weights, bucket_size: int, use_async: bool) -> None:
    named = []
    for i, (shape, dtype_name, transpose, seed) in enumerate(weights):
        t = make_tensor(shape, DTYPES[dtype_name], seed)
        if transpose and t.dim() >= 2:
            t = t.transpose(0, -1)
        named.append((f"layer.{i}.w", t))

    async def produce():
        for item in named:
            yield item

    source = produce() if use_async else iter(named)
    metas = [m for m, _ in run(collect(split_weight_chunks(list(named), bucket_size)))]
    total = sum(t.numel() * t.element_size() for _, t in named)
    fills = bucket_fills(metas, bucket_size)
    assert sum(fills) == total
    assert all(f == bucket_size for f in fills[:-1])
    assert all(m.offset + m.chunk_size <= bucket_size for m in metas)
    got = roundtrip(source, bucket_size)
    assert [n for n, _ in got] == [n for n, _ in named]
    for (name, want), (_, t) in zip(named, got, strict=True):
        assert_bitwise(t, want, name)


# ----------------------------------------------------------------------------------------------- benchmark


def test_benchmark_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """The microbenchmark runs, checks its own bytes, and reports every field (no timing asserted)."""
    import json

    from lightning_weightsync.bench.chunking import run as run_bench

    result = run_bench(True, sizes=[64 * 1024, 1 << 20], bucket_size=300_000, total_bytes=2 << 20, repeats=1)
    printed = json.loads(capsys.readouterr().out)
    assert printed["results"] == json.loads(json.dumps(result["results"]))
    assert [r["tensor_size"] for r in result["results"]] == [64 * 1024, 1 << 20]
    for r in result["results"]:
        assert r["nbytes"] == 2 << 20
        for key in ("split_pack_ratio", "merge_into_ratio", "merge_fresh_ratio", "memcpy_pack_gbps"):
            assert r[key] > 0
    assert result["results"][1]["num_chunks"] > result["results"][1]["num_tensors"]  # 1 MiB > bucket: chunked


def test_a_bucket_holds_at_most_max_bucket_entries_chunks() -> None:
    """Bytes alone do not bound a bucket's metadata (empty tensors are chunks of 0 bytes): the split
    starts a new bucket, at offset 0, after MAX_BUCKET_ENTRIES chunks (issue 24 item 4)."""
    from lightning_weightsync.protocol.chunks import MAX_BUCKET_ENTRIES

    named = [(f"b{i}", torch.full((1,), i % 251, dtype=torch.uint8)) for i in range(MAX_BUCKET_ENTRIES + 2)]
    metas = [m for m, _ in split_list(named, 1 << 20)]
    assert [m.offset for m in metas[MAX_BUCKET_ENTRIES - 1 :]] == [MAX_BUCKET_ENTRIES - 1, 0, 1]
    assert_roundtrip(named, 1 << 20)
