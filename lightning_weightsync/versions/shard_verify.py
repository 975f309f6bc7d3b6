"""Verify in sharded send mode: every sender fingerprints the bytes it sends of a tensor; each receiver
checks each sender's bytes where they landed, once the tensor is tiled whole.

    sender i:  SenderFingerprints.take(name, TensorShard) -> the fingerprint of its shard's bytes, carried
               by every chunk of that shard (`BucketMeta.fingerprints`, one per entry, as in gather mode)
    receiver:  ShardVerifier.part(i).expect(bucket metadata) -> per (tensor, sender): that fingerprint and
               the byte range the sender's chunks cover; ShardVerifier.check(name, whole tensor) ->
               each sender's range re-fingerprinted in the tiled tensor, before the consumer sees it

Why per shard and not per tensor: no trainer rank holds a whole sharded tensor (that is what sharded mode
saves), and the fingerprint (`protocol/fingerprint.py`) of a byte range is only computable where those
bytes are. A sender sends at most one contiguous range of a tensor (its shard, or its stripe of a
replicated shard: `trainer/sharded.py`), so (tensor, sender) names one range. A tensor counts as verified
when the checked ranges cover all of its bytes (with `transport.verify=sample` each sender samples its own
tensors, so a tensor may be partly checked: that is reported, not counted as verified).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..config import VerifyMode
from ..errors import ProtocolError, VerifyError
from ..protocol.boxes import is_dtensor, local_of
from ..protocol.chunks import as_bytes
from ..protocol.fingerprint import NO_FINGERPRINT, checksum_hex, fingerprint
from ..protocol.messages import BucketMeta, check_tensor
from .verify import Verifier


def _range(meta: BucketMeta, i: int) -> tuple[int, int]:
    """The bytes of its tensor entry `i` fills: its chunk's, or for a delta payload's chunk the range the
    payload rebuilds (the fingerprint is of those bytes after the delta is applied)."""
    entry = meta.entries[i]
    if meta.deltas and meta.deltas[i] >= 0:
        if meta.delta_ranges:
            start, size = meta.delta_ranges[i]
            return start, start + size
        return 0, check_tensor(entry.name, entry.shape, entry.dtype)
    return entry.chunk_offset, entry.chunk_offset + entry.chunk_size


class _Part:
    """What one sender's bucket pipeline notes (the `verifier` a `BucketPipeline` calls `expect` on)."""

    def __init__(self, owner: ShardVerifier, sender: int) -> None:
        self.owner, self.sender = owner, sender

    def expect(self, meta: BucketMeta) -> None:
        self.owner.expect(self.sender, meta)


class ShardVerifier:
    """One sharded version's check on a receiver (module docstring); `senders` names them in errors."""

    def __init__(self, mode: VerifyMode, version: int, senders: Sequence[str]) -> None:
        self.mode = mode
        self.senders = list(senders)
        self.whole = Verifier(mode, version)  # the report, and the one "not fingerprinted" line, as gather mode's
        self.report = self.whole.report
        self.expected: dict[str, dict[int, list[int]]] = {}  # name -> sender -> [fingerprint, start, end]
        self.whole_from: dict[str, set[int]] = {}  # name -> senders that sent it as the whole tensor's ranges

    def part(self, sender: int) -> _Part:
        return _Part(self, sender)

    def expect(self, sender: int, meta: BucketMeta) -> None:
        if self.mode is VerifyMode.off or not meta.fingerprints:
            return
        for i, (entry, value) in enumerate(zip(meta.entries, meta.fingerprints, strict=True)):  # validated
            if value == NO_FINGERPRINT:
                continue
            start, end = _range(meta, i)
            if not entry.box:
                self.whole_from.setdefault(entry.name, set()).add(sender)
            shard = self.expected.setdefault(entry.name, {}).get(sender)
            if shard is None:
                self.expected[entry.name][sender] = [value, start, end]
                continue
            if shard[0] != value:
                raise ProtocolError(
                    f"version {self.report.version}: chunks of {entry.name!r} from {self._who(sender)} carry two "
                    f"different fingerprints ({checksum_hex(shard[0])}, {checksum_hex(value)})"
                )
            shard[1], shard[2] = min(shard[1], start), max(shard[2], end)

    def _who(self, sender: int) -> str:
        return f"sender {sender} ({self.senders[sender]})" if 0 <= sender < len(self.senders) else f"sender {sender}"

    def check(self, name: str, tensor: torch.Tensor) -> None:
        """Raise `VerifyError` naming the tensor, the bytes and the sender when a range is not what its
        sender fingerprinted."""
        self.report.tensors += 1
        shards = self.expected.pop(name, None)
        if not shards:
            self.whole.unchecked(name)
            return
        whole_from = self.whole_from.pop(name, set())
        if is_dtensor(tensor):
            local = local_of(tensor)
            if whole_from and local.shape != tensor.shape:  # it kept its box of ranges of the whole tensor
                self.whole.unchecked_box(name)
                return
            tensor = local  # every sender sent its part of this rank's box (fingerprints of those), or it is whole
        data = as_bytes(tensor)
        covered = 0
        for sender, (want, start, end) in sorted(shards.items(), key=lambda kv: kv[1][1]):
            got = fingerprint(data[start:end])
            if got != want:
                raise VerifyError(
                    f"version {self.report.version}: tensor {name!r} arrived corrupted in bytes [{start}, {end}) "
                    f"from {self._who(sender)} (fingerprint {checksum_hex(got)}, the sender's {checksum_hex(want)}); "
                    f"nothing of the version is applied (transport.verify={self.mode})"
                )
            covered += end - start
        if covered == data.numel():
            self.report.verified += 1
            self.report.checksums[name] = checksum_hex(fingerprint(tensor))


__all__ = ["ShardVerifier"]
