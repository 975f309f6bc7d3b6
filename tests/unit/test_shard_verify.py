"""Verify in sharded send mode (versions/shard_verify.py), one receiver's check of a version: each sender's byte
range of a tensor is checked against that sender's fingerprint once the tensor is tiled; a tensor counts as
verified only when the checked ranges cover all of its bytes. With `transport.verify=sample` each sender
samples its own stream, so one sender may fingerprint a tensor whose other shard went unchecked: that tensor
is not verified (the report is not complete), and no checksum is reported for it. The whole path through
real sender processes is tests/integration/test_sharded_verify.py."""

from __future__ import annotations

import pytest
import torch

from lightning_weightsync.config import VerifyMode
from lightning_weightsync.errors import VerifyError
from lightning_weightsync.protocol.chunks import TensorShard, as_bytes
from lightning_weightsync.protocol.fingerprint import NO_FINGERPRINT
from lightning_weightsync.protocol.messages import BucketMeta, Entry
from lightning_weightsync.versions.shard_verify import ShardVerifier
from lightning_weightsync.versions.verify import SenderFingerprints

W = torch.arange(32, dtype=torch.float32).reshape(4, 8)  # 128 bytes: rows 0-1 from sender 0, rows 2-3 from 1


def _bucket(sender: int, fingerprinted: bool) -> BucketMeta:
    """Sender `sender`'s bucket carrying its half of W in one chunk, with its fingerprint or none."""
    start = 64 * sender
    shard = TensorShard((4, 8), torch.float32, start, W[2 * sender : 2 * sender + 2])
    prints = SenderFingerprints(VerifyMode.full if fingerprinted else VerifyMode.off, version=3)
    prints.take("w", shard)
    entry = Entry("w", [4, 8], "float32", start, 64, 0)
    return BucketMeta(3, 0, True, 64, [entry], fingerprints=[prints.of("w")])


@pytest.mark.parametrize("checked", [(True, True), (True, False), (False, True), (False, False)])
def test_a_tensor_counts_as_verified_only_when_every_sender_s_range_was_checked(checked: tuple[bool, bool]) -> None:
    verifier = ShardVerifier(VerifyMode.sample, 3, ["rank0:1", "rank1:2"])
    for sender, fingerprinted in enumerate(checked):
        bucket = _bucket(sender, fingerprinted)
        assert (bucket.fingerprints[0] != NO_FINGERPRINT) is fingerprinted
        verifier.part(sender).expect(bucket)
    verifier.check("w", W)
    whole = all(checked)
    assert (verifier.report.tensors, verifier.report.verified) == (1, int(whole)), checked
    assert verifier.report.complete is whole and ("w" in verifier.report.checksums) is whole


def test_a_range_that_differs_from_its_sender_s_fingerprint_names_the_bytes_and_the_sender() -> None:
    verifier = ShardVerifier(VerifyMode.sample, 3, ["rank0:1", "rank1:2"])
    for sender in (0, 1):
        verifier.part(sender).expect(_bucket(sender, sender == 1))
    arrived = W.clone()
    as_bytes(arrived)[100] ^= 1  # a byte of sender 1's range
    with pytest.raises(VerifyError, match=r"bytes \[64, 128\) from sender 1 \(rank1:2\)"):
        verifier.check("w", arrived)
