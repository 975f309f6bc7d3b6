"""The fingerprint (protocol/fingerprint.py) and the per-version check (versions/verify.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_weightsync import VerifyError, load_config
from lightning_weightsync.config import VerifyMode
from lightning_weightsync.protocol.chunks import as_bytes
from lightning_weightsync.protocol.fingerprint import (
    GOLDEN,
    MASK,
    NO_FINGERPRINT,
    REPLICA_BLOCK_ROWS,
    ROW_WORDS,
    checksum_hex,
    fingerprint,
    replica_digest,
    sampled,
)
from lightning_weightsync.protocol.messages import BucketMeta, Entry
from lightning_weightsync.versions.verify import (
    SAMPLE_EVERY,
    SenderFingerprints,
    Verifier,
    compare_checksums,
    held_checksums,
)


def reference(tensor: torch.Tensor) -> int:
    """The module docstring's definition, in plain Python integers (slow, obviously right)."""
    data = bytes(as_bytes(tensor).tolist())
    if not data:
        return 0
    padded = data + b"\0" * (-len(data) % 8)
    words = [int.from_bytes(padded[i : i + 8], "little", signed=True) for i in range(0, len(padded), 8)]
    rows = [sum(words[i : i + ROW_WORDS]) for i in range(0, len(words), ROW_WORDS)]
    return (sum(r * (2 * j + 1) for j, r in enumerate(rows)) + len(data) * GOLDEN) & MASK


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3 * ROW_WORDS + 5, generator=torch.Generator().manual_seed(0)),  # rows and a tail row
        torch.randn(7, 9, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),  # 126 bytes: a byte tail
        torch.tensor([True, False, True]),
        torch.arange(1000, dtype=torch.int64) * (1 << 60),  # sums that wrap
        torch.zeros(0),
    ],
    ids=["rows", "bf16-odd", "bool", "wrapping", "empty"],
)
def test_fingerprint_is_the_documented_formula(tensor: torch.Tensor) -> None:
    assert fingerprint(tensor) == reference(tensor)


def test_every_single_byte_flip_changes_it() -> None:
    """Any change confined to one row changes the fingerprint (the odd row weight): each byte, both ways."""
    base = torch.randn(2 * ROW_WORDS + 3, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    want = fingerprint(base)
    data = as_bytes(base)
    same = []
    for i in range(0, data.numel(), 7):
        for flip in (0x01, 0x80):
            data[i] ^= flip
            if fingerprint(base) == want:
                same.append((i, flip))
            data[i] ^= flip
    assert not same, f"byte flips the fingerprint missed: {same[:5]}"


def test_misplaced_rows_and_truncation_change_it() -> None:
    base = torch.randn(4 * ROW_WORDS, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    swapped = base.clone().view(4, ROW_WORDS)[[1, 0, 2, 3]].reshape(-1)  # a chunk landed at the wrong offset
    assert fingerprint(swapped) != fingerprint(base)
    padded = torch.cat([base, torch.zeros(1, dtype=torch.float64)])
    assert fingerprint(padded) != fingerprint(base), "trailing zeros must not go unnoticed (the length counts)"


def test_views_and_copies_agree() -> None:
    """Non-contiguous and unaligned views give the fingerprint of their bytes, as a contiguous copy does."""
    base = torch.randn(33, 17, generator=torch.Generator().manual_seed(4))
    assert fingerprint(base.t()) == fingerprint(base.t().contiguous())
    unaligned = as_bytes(base)[3:-2]
    assert unaligned.data_ptr() % 8 != 0 and fingerprint(unaligned) == fingerprint(unaligned.clone())


def test_sample_rotates_over_every_tensor() -> None:
    covered = {i for version in range(SAMPLE_EVERY) for i in range(50) if sampled(i, version, SAMPLE_EVERY)}
    assert covered == set(range(50))
    assert sum(sampled(i, 3, SAMPLE_EVERY) for i in range(64)) == 64 // SAMPLE_EVERY


def test_sender_fingerprints_per_mode() -> None:
    tensors = [(f"t{i}", torch.full((4,), float(i))) for i in range(16)]
    counts = {}
    for mode in VerifyMode:
        prints = SenderFingerprints(mode, version=5)
        for name, tensor in tensors:
            prints.take(name, tensor)
        counts[mode.value] = len(prints.by_name)
        assert all(prints.of(n) == fingerprint(t) for n, t in tensors if n in prints.by_name)
        assert all(prints.of(n) == NO_FINGERPRINT for n, _ in tensors if n not in prints.by_name)
    assert counts == {"off": 0, "sample": 16 // SAMPLE_EVERY, "full": 16}


def _bucket(names: list[str], prints: list[int]) -> BucketMeta:
    entries = [Entry(n, [4], "float32", 0, 16, 16 * i) for i, n in enumerate(names)]
    return BucketMeta(0, 0, True, 16 * len(names), entries, fingerprints=prints)


def test_verifier_names_the_corrupted_tensor_and_reports_what_it_checked() -> None:
    good, bad = torch.arange(4.0), torch.ones(4)
    verifier = Verifier(VerifyMode.full, version=9)
    verifier.expect(_bucket(["good", "bad", "free"], [fingerprint(good), fingerprint(good), NO_FINGERPRINT]))
    verifier.check("good", good)
    verifier.check("free", bad)  # no fingerprint: not checked
    with pytest.raises(VerifyError, match=r"version 9: tensor 'bad' arrived corrupted.*transport\.verify=full"):
        verifier.check("bad", bad)
    report = verifier.report
    assert (report.tensors, report.verified, list(report.checksums)) == (3, 1, ["good"])
    off = Verifier(VerifyMode.off, version=9)
    off.expect(_bucket(["bad"], [fingerprint(good)]))
    off.check("bad", bad)  # a receiver with verify off checks nothing
    assert off.report.verified == 0


def test_compare_checksums_answers_like_vllms_weight_checker() -> None:
    """vllm 0.33.0 entrypoints/rl/online/api_router.py:259-266: names in either map whose values differ."""
    assert compare_checksums({"a": "1", "b": "2"}, {"a": "1", "b": "2"}) == {"match": True, "mismatches": []}
    assert compare_checksums({"a": "1", "b": "3", "c": "4"}, {"a": "1", "b": "2", "d": "5"}) == {
        "match": False,
        "mismatches": ["b", "c", "d"],
    }
    held = {"w": torch.arange(3.0)}
    assert held_checksums(held) == {"w": checksum_hex(fingerprint(held["w"]))}
    assert held_checksums(held, ["w", "gone"]) == held_checksums(held)


@pytest.mark.parametrize("text", ["off", "false", "sample", "full"])
def test_verify_off_in_yaml_is_the_choice_not_a_boolean(text: str, tmp_path) -> None:
    """YAML 1.1 reads a bare `off` as false; `transport.verify: off` still means the choice."""
    path = tmp_path / "c.yaml"
    path.write_text(f"transport:\n  verify: {text}\n")
    want = "off" if text == "false" else text
    assert str(load_config(path).transport.verify) == want
    assert str(load_config(overrides=[f"transport.verify={text}"]).transport.verify) == want


def _replica_reference(tensor: torch.Tensor) -> int:
    """`replica_digest` from its definition: every 8-byte word (zero-padded) times its own odd weight."""
    data = as_bytes(tensor.contiguous()).tolist()
    data += [0] * (-len(data) % 8)
    words = [int.from_bytes(bytes(data[i : i + 8]), "little", signed=True) for i in range(0, len(data), 8)]
    return (sum((2 * p + 1) * w for p, w in enumerate(words)) + len(as_bytes(tensor)) * GOLDEN) & MASK


@pytest.mark.parametrize("shape", [(7,), (32,), (3, ROW_WORDS * 2 + 5), (ROW_WORDS * 9 + 3,)])
def test_replica_digest_is_its_definition_and_sees_drift_that_cancels_in_a_row(shape):
    """Replicas drift by an ulp up here and an ulp down there, in one row as often as not (a 32-element norm
    weight, elements 9 and 13, in a real 2-rank run): the row sum of `fingerprint` cannot see that; the replica
    digest (trainer ranks comparing their whole copies in sharded mode) must."""
    torch.manual_seed(0)
    tensor = torch.randn(shape)
    assert replica_digest(tensor) == _replica_reference(tensor)
    drifted = tensor.clone()
    flat = drifted.view(-1).view(torch.int32)
    flat[1] += 1
    flat[min(5, flat.numel() - 1)] -= 1
    assert fingerprint(drifted) == fingerprint(tensor)  # the row sum: blind to it
    assert replica_digest(drifted) != replica_digest(tensor)
    assert replica_digest(tensor.clone()) == replica_digest(tensor)


def test_replica_digest_of_a_tensor_of_several_blocks_is_its_definition_and_sees_drift_across_blocks() -> None:
    """Past one block (`REPLICA_BLOCK_ROWS` rows, weighted at once) each block's rows must keep their own place:
    the definition, in numpy's wrapping uint64 (an independent reduction, fast enough at 16 MiB), and drift of
    +d and -d at the same place in two blocks, which a digest weighting each block alike would cancel."""
    words = (REPLICA_BLOCK_ROWS + 3) * ROW_WORDS + 5  # two blocks, the last row partial
    tensor = torch.randint(-(1 << 62), 1 << 62, (words,), generator=torch.Generator().manual_seed(3))
    weights = np.arange(words, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    with np.errstate(over="ignore"):
        want = int((tensor.numpy().view(np.uint64) * weights).sum(dtype=np.uint64))
    assert replica_digest(tensor) == (want + words * 8 * GOLDEN) & MASK
    drifted = tensor.clone()
    drifted[7] += 3
    drifted[7 + REPLICA_BLOCK_ROWS * ROW_WORDS] -= 3  # the same word of the same row, one block on
    assert replica_digest(drifted) != replica_digest(tensor)
