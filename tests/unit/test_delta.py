"""The delta codec (versions/delta.py): lossless for every dtype, the smaller format, hostile payloads refused."""

from __future__ import annotations

import pytest
import torch

from lightning_weightsync.errors import DeltaError, ProtocolError
from lightning_weightsync.protocol.chunks import TensorMeta, as_bytes
from lightning_weightsync.protocol.dtypes import DTYPES
from lightning_weightsync.versions.delta import (
    AUTO_MAX_PAYLOAD_FRACTION,
    FORMAT_BITMASK,
    FORMAT_INDICES,
    HEADER_BYTES,
    DeltaBase,
    DeltaPolicy,
    VersionDelta,
    apply_delta,
    encode,
    payload_size,
)

CPU = torch.device("cpu")


def meta_of(t: torch.Tensor, name: str = "w") -> TensorMeta:
    return TensorMeta(name, tuple(t.shape), t.dtype, 0, t.numel() * t.element_size())


def changed(old: torch.Tensor, fraction: float, seed: int = 0) -> torch.Tensor:
    """`old` with about `fraction` of its elements given other bits (any dtype: flips the low bit of a byte)."""
    new = old.clone()
    g = torch.Generator().manual_seed(seed)
    n = new.numel()
    pick = torch.randperm(n, generator=g)[: max(1, int(n * fraction))]
    flat = as_bytes(new).view(n, -1)
    flat[pick, 0] ^= 1
    return new


@pytest.mark.parametrize("dtype", [d for d in DTYPES.values() if d.itemsize <= 8], ids=str)
@pytest.mark.parametrize("fraction", [0.001, 0.05, 0.4])
def test_apply_rebuilds_the_new_tensor_bit_for_bit(dtype: torch.dtype, fraction: float) -> None:
    raw = torch.randint(0, 255, (37, 29), dtype=torch.uint8).view(-1)
    raw = raw & 1 if dtype == torch.bool else raw  # a bool byte is 0 or 1
    old = raw[: (raw.numel() // dtype.itemsize) * dtype.itemsize].view(dtype)
    before = as_bytes(old).clone()
    new = changed(old, fraction)
    payload = encode(new, old, max_payload=10**9)
    assert payload is not None
    got = apply_delta(payload, meta_of(new), old, None, CPU)
    assert torch.equal(as_bytes(got), as_bytes(new)), "not bitwise equal after apply"
    assert torch.equal(as_bytes(old), before), "the held tensor changed"


def test_nan_and_negative_zero_bits_survive() -> None:
    old = torch.zeros(64, dtype=torch.float32)
    new = old.clone()
    as_bytes(new).view(torch.int32)[3] = 0x7FC00001  # a NaN with a payload
    new[5] = -0.0
    payload = encode(new, old, max_payload=10**9)
    assert payload is not None
    got = apply_delta(payload, meta_of(new), old, None, CPU)
    assert torch.equal(as_bytes(got), as_bytes(new))


def test_the_smaller_format_is_chosen_and_in_place_apply_updates_the_held_tensor() -> None:
    old = torch.randn(4096).to(torch.bfloat16)
    few, many = changed(old, 0.001), changed(old, 0.3)
    assert encode(few, old, 10**9)[0] == FORMAT_INDICES
    assert encode(many, old, 10**9)[0] == FORMAT_BITMASK
    fmt, size = payload_size(4096, 1229, 2)
    assert fmt == FORMAT_BITMASK and size == HEADER_BYTES + 512 + 2 * 1229
    held = old.clone()
    out = apply_delta(encode(many, old, 10**9), meta_of(many), held, held, CPU)
    assert out is held and torch.equal(as_bytes(held), as_bytes(many))


def test_no_payload_when_it_would_not_be_smaller_than_the_limit() -> None:
    old = torch.randn(1000)
    assert encode(changed(old, 0.99), old, max_payload=4000) is None  # 16 + 125 + 3960 bytes
    assert encode(old.clone(), old, max_payload=4000).numel() == HEADER_BYTES  # nothing changed: a header


@pytest.mark.parametrize("always", [True, False], ids=["always", "auto"])
def test_a_payload_exactly_at_the_limit_goes_whole_and_one_byte_under_goes_as_a_delta(always: bool) -> None:
    """The documented rule (versions/delta.py): `always` sends a delta only when the payload is smaller than the
    tensor, `auto` only when it is below AUTO_MAX_PAYLOAD_FRACTION of it; at the limit the tensor goes whole
    (the wire refuses a payload not smaller than its tensor: protocol/messages.py). 32 float32 elements are 128
    bytes; a bitmask payload is 16 + 4 + 4 * changed bytes: 27 changes make 128 bytes, 11 make 64."""
    old = torch.zeros(32, dtype=torch.float32)
    at_limit = 27 if always else 11
    assert AUTO_MAX_PAYLOAD_FRACTION == 0.5 and payload_size(32, at_limit, 4) == (FORMAT_BITMASK, 128 if always else 64)
    limit = 128 if always else 64
    for changes, goes_whole in ((at_limit, True), (at_limit - 1, False)):
        new = old.clone()
        new[:changes] = 1.0
        assert (encode(new, old, limit) is None) is goes_whole, changes
        base = DeltaBase()
        first = VersionDelta(base, DeltaPolicy(keep=True, base_version=None, always=always))
        assert first.encode("w", old)[1] == -1
        first.finish(0, ok=True)
        sent, size = VersionDelta(base, DeltaPolicy(keep=True, base_version=0, always=always)).encode("w", new)
        if goes_whole:
            assert size == -1 and sent is new, f"a payload of exactly {limit} bytes was sent as a delta"
        else:
            assert size == limit - 4 and torch.equal(apply_delta(sent, meta_of(new), old, None, CPU), new)


def _payload(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    payload = encode(new, old, 10**9)
    assert payload is not None
    return payload


@pytest.mark.parametrize(
    "hostile",
    [
        "truncated", "count-over-numel", "index-out-of-range", "bad-format", "mask-tail", "index-repeated",
        "index-decreasing",
    ],
)  # fmt: skip
def test_hostile_payloads_are_refused_never_written_out_of_bounds(hostile: str) -> None:
    old = torch.zeros(1001, dtype=torch.float32)  # 1001 elements: 7 spare bits at the bitmask's end
    new = old.clone()
    new[2], new[5] = 1.0, 2.0  # two changes: the index format
    payload = _payload(old, new).clone()
    assert payload[0] == FORMAT_INDICES
    head = payload[:HEADER_BYTES].view(torch.int64)
    indices = payload[HEADER_BYTES : HEADER_BYTES + 8].view(torch.int32)
    if hostile == "index-repeated":  # [2, 2]: one element written twice, with the second value
        indices[1] = 2
    elif hostile == "index-decreasing":  # [5, 2]
        indices[0], indices[1] = 5, 2
    elif hostile == "truncated":
        payload = payload[:-1]
    elif hostile == "count-over-numel":
        head[1] = 1002
    elif hostile == "index-out-of-range":
        indices[1] = 1001
    elif hostile == "bad-format":
        head[0] = 7
    else:
        bitmask = _payload(old, changed(old, 0.9))
        assert bitmask[0] == FORMAT_BITMASK
        bitmask[HEADER_BYTES + 125] |= 0x80  # element 1007 of 1001
        payload = bitmask
    held = old.clone()
    with pytest.raises(ProtocolError, match="delta of 'w'"):
        apply_delta(payload, meta_of(new), held, held, CPU)
    assert torch.equal(held, old), "a refused delta wrote into the held tensor"


def test_a_held_tensor_of_another_shape_is_a_delta_error() -> None:
    old, new = torch.zeros(8), torch.ones(8)
    with pytest.raises(DeltaError, match="held tensor is"):
        apply_delta(_payload(old, new), meta_of(new), torch.zeros(9), None, CPU)


def test_the_sender_copy_follows_the_versions_and_auto_sends_whole_where_a_delta_would_not_pay() -> None:
    base = DeltaBase()
    a = {"small": torch.randn(100), "big": torch.randn(10000)}
    first = VersionDelta(base, DeltaPolicy(keep=True, base_version=None, always=False))
    assert [first.encode(n, t)[1] for n, t in a.items()] == [-1, -1]
    first.finish(0, ok=True)
    assert base.version == 0 and base.nbytes == 4 * 10100
    b = {"small": changed(a["small"], 0.9), "big": changed(a["big"], 0.01)}
    second = VersionDelta(base, DeltaPolicy(keep=True, base_version=0, always=False))
    sizes = {n: second.encode(n, t)[1] for n, t in b.items()}
    assert sizes["small"] == -1, f"90% changed must go whole under auto (limit {AUTO_MAX_PAYLOAD_FRACTION})"
    assert 0 < sizes["big"] < 4 * 10000 * AUTO_MAX_PAYLOAD_FRACTION
    assert torch.equal(base.tensors["big"], b["big"]), "the copy is of the version just sent"
    second.finish(1, ok=False)
    assert base.version is None, "a failed version must leave the copy unusable (next sync whole)"
    third = VersionDelta(base, DeltaPolicy(keep=True, base_version=None, always=False))
    third.encode("big", b["big"])
    third.finish(2, ok=True)
    assert list(base.tensors) == ["big"], "a tensor not in the version is dropped from the copy"


def test_auto_sends_whole_for_a_while_after_a_delta_measured_slower() -> None:
    from lightning_weightsync.versions.delta import PROBE_EVERY

    base = DeltaBase()
    assert not base.prefer_whole()
    base.measured(True, seconds=0.5, model_bytes=1000)
    assert base.prefer_whole(), "deltas measured and whole versions not: one whole version, to compare"
    base.measured(False, seconds=1.0, model_bytes=1000)
    base.measured(True, seconds=0.5, model_bytes=1000)  # faster: keep sending deltas
    assert not base.prefer_whole()
    base.measured(True, seconds=2.0, model_bytes=1000)  # slower than whole on this link
    assert [base.prefer_whole() for _ in range(PROBE_EVERY + 1)] == [True] * PROBE_EVERY + [False]
