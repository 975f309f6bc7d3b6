"""Verify: the rollout holds exactly the trainer's weights, tensor by tensor, or the version fails.

    sender:   SenderFingerprints.stamp, a transform on the planned stream: take(name, tensor) as each
              tensor is pulled (the bytes are in hand)
              -> one fingerprint per entry in the bucket metadata (`BucketMeta.fingerprints`)
    receiver: Verifier.expect(bucket metadata) -> Verifier.check(name, merged tensor) before the
              consumer sees it: a mismatch raises `VerifyError` naming the tensor, so the receive
              loop drains, the sink aborts (nothing applied with `rollout.apply=atomic`) and the
              version is nacked with the reason; the trainer's error names the tensor too.

`transport.verify` on the sender says what is fingerprinted (full: every tensor; sample: a rotating
one in `SAMPLE_EVERY`; off: none); on a receiver, whether it checks what arrives. The fingerprint is
`protocol/fingerprint.py` (what it catches and what it does not is said there).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypedDict

import torch

from ..config import VerifyMode
from ..errors import VerifyError
from ..protocol.boxes import is_dtensor, local_of
from ..protocol.chunks import TensorShard
from ..protocol.fingerprint import NO_FINGERPRINT, checksum_hex, fingerprint, sampled
from ..protocol.messages import BucketMeta
from .planner import Outgoing

logger = logging.getLogger(__name__)

SAMPLE_EVERY = 8
"""`transport.verify=sample`: one tensor in this many is fingerprinted per version (rotating)."""


class SenderFingerprints:
    """The fingerprints of one version's tensors, taken as the sender pulls them."""

    def __init__(self, mode: VerifyMode, version: int) -> None:
        self.mode, self.version = mode, version
        self.by_name: dict[str, int] = {}
        self._index = 0

    def take(self, name: str, tensor: torch.Tensor | TensorShard) -> None:
        """A shard (sharded send mode) is fingerprinted over its own bytes (`versions/shard_verify.py`)."""
        index, self._index = self._index, self._index + 1
        if self.mode is VerifyMode.full or (
            self.mode is VerifyMode.sample and sampled(index, self.version, SAMPLE_EVERY)
        ):
            self.by_name[name] = fingerprint(tensor.data if isinstance(tensor, TensorShard) else tensor)

    def of(self, name: str) -> int:
        return self.by_name.get(name, NO_FINGERPRINT)

    def stamp(self, item: Outgoing) -> Outgoing:
        """The planner's transform (`versions.planner.Transform`): fingerprint the tensor as it is pulled, before
        any delta replaces its bytes, and note the fingerprint for every entry of it."""
        self.take(item.name, item.tensor)
        value = self.of(item.name)
        return item if value == NO_FINGERPRINT else replace(item, fingerprint=value)

    @property
    def checksums(self) -> dict[str, str]:
        """{name: 16 hex digits} of what was fingerprinted: what a rollout's report is compared with."""
        return {name: checksum_hex(value) for name, value in self.by_name.items()}


@dataclass
class VerifyReport:
    """What a receiver checked of one version: the answer to "do my weights match it"."""

    version: int
    mode: str
    tensors: int = 0  # tensors received
    verified: int = 0  # ... of which matched the sender's fingerprint
    checksums: dict[str, str] = field(default_factory=dict)  # {name: hex} of the verified ones

    @property
    def complete(self) -> bool:
        """Every tensor of the version was checked (and matched: a mismatch fails the version)."""
        return self.verified == self.tensors

    def as_dict(self) -> dict[str, object]:
        return {
            "version": self.version,
            "verify": self.mode,
            "tensors": self.tensors,
            "verified": self.verified,
            "complete": self.complete,
            "checksums": dict(self.checksums),
        }


class Verifier:
    """One version's check on the receiver: fingerprints from the bucket metadata, checked per tensor."""

    def __init__(self, mode: VerifyMode, version: int) -> None:
        self.mode = mode
        self.expected: dict[str, int] = {}
        self.boxed: set[str] = set()  # tensors that came as this receiver's box: their fingerprint is of it
        self.report = VerifyReport(version, str(mode))
        self._warned = False

    def expect(self, meta: BucketMeta) -> None:
        """Note the fingerprints a bucket carries (every chunk of a tensor carries its tensor's)."""
        if self.mode is VerifyMode.off or not meta.fingerprints:
            return
        for entry, value in zip(meta.entries, meta.fingerprints, strict=True):  # validated: one per entry
            if value != NO_FINGERPRINT:
                self.expected[entry.name] = value
                if entry.box:
                    self.boxed.add(entry.name)

    def unchecked(self, name: str) -> None:
        """`name` arrived without a fingerprint: said once a version, where every tensor was to be checked."""
        if self.mode is VerifyMode.full and not self._warned:
            self._warned = True
            logger.info(
                "version %d: %r arrived without a fingerprint (the sender's transport.verify is not full); "
                "such tensors are not checked",
                self.report.version, name,
            )  # fmt: skip

    def unchecked_box(self, name: str) -> None:
        """`name` was received into a DTensor (a tensor-parallel rollout keeps its box): said once a version."""
        if not self._warned:
            self._warned = True
            logger.info(
                "version %d: %r was received into a DTensor, which keeps only this rank's box of it: the sender's "
                "fingerprint of the whole tensor cannot be checked here, and such tensors are not (transport.verify)",
                self.report.version, name,
            )  # fmt: skip

    def check(self, name: str, tensor: torch.Tensor) -> None:
        """Raise `VerifyError` when `tensor` is not what the sender fingerprinted."""
        self.report.tensors += 1
        want = self.expected.pop(name, None)
        if want is None:
            self.unchecked(name)
            return
        if is_dtensor(tensor):
            local = local_of(tensor)
            if name not in self.boxed and local.shape != tensor.shape:  # it kept its box of the whole tensor
                self.unchecked_box(name)
                return
            tensor = local  # it came as its box (the sender fingerprinted that), or this rank holds it whole
        got = fingerprint(tensor)
        if got != want:
            raise VerifyError(
                f"version {self.report.version}: tensor {name!r} arrived corrupted (fingerprint {checksum_hex(got)}, "
                f"the sender's {checksum_hex(want)}); nothing of the version is applied (transport.verify="
                f"{self.mode})"
            )
        self.report.verified += 1
        self.report.checksums[name] = checksum_hex(got)


class ChecksumComparison(TypedDict):
    """What `compare_checksums` answers, shaped like vLLM's weight checker."""

    match: bool
    mismatches: list[str]


def compare_checksums(checksums: Mapping[str, str], baseline: Mapping[str, str]) -> ChecksumComparison:
    """`{"match", "mismatches"}` as vLLM's POST /weight_checker `action=compare` answers (vllm 0.33.0,
    entrypoints/rl/online/api_router.py:259-266): a name in either map whose value differs or is missing."""
    mismatches = sorted(k for k in checksums.keys() | baseline.keys() if checksums.get(k) != baseline.get(k))
    return {"match": not mismatches, "mismatches": mismatches}


def held_checksums(tensors: Mapping[str, torch.Tensor], names: list[str] | None = None) -> dict[str, str]:
    """{name: hex} of what a sink holds now (all names, or `names`): recomputed, not remembered."""
    chosen = list(tensors) if names is None else [n for n in names if n in tensors]
    return {name: checksum_hex(fingerprint(tensors[name])) for name in chosen}


def weights_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """One digest of a set of weights: each tensor's fingerprint (`held_checksums`, what `transport.verify` checks)
    with its name, dtype and shape, in name order. A trainer takes it over what it sends, a rollout over what it
    generates with; equal digests mean the same weights, bitwise (the GRPO example and the TRL tests compare them)."""
    return tensors_digest({name: tensor.detach().cpu() for name, tensor in named})


def tensors_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """`weights_digest` of tensors where they are (a device's fingerprints come back as 8 bytes each): what a vLLM
    worker reports of its kernel-format tensors (`kernel_digest`)."""
    checksums = held_checksums(tensors)
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        digest.update(f"{name}|{t.dtype}|{list(t.shape)}|{checksums[name]}\n".encode())
    return digest.hexdigest()[:16]


def weight_problems(
    name: str, version: int, report: Mapping[str, Any], checksums: Mapping[str, str] | None
) -> list[str]:
    """What is wrong with one worker's `weight_report` after `version` (nothing: []): another version, a
    broken one, or (given the trainer's `SendStats.checksums`) tensors whose checksums differ."""
    who = f"rollout {name} worker {report.get('identity')}"
    if "error" in report:
        return [f"{who}: {report['error']}"]
    if report.get("version") != version or report.get("incomplete"):
        return [f"{who} holds version {report.get('version')} (incomplete: {report.get('incomplete')}), not {version}"]
    if checksums is not None:
        compared = compare_checksums(report.get("checksums") or {}, checksums)
        if not compared["match"]:
            return [f"{who}: version {version} does not match the trainer's fingerprints: {compared['mismatches'][:5]}"]
    return []


__all__ = [
    "SAMPLE_EVERY",
    "ChecksumComparison",
    "SenderFingerprints",
    "Verifier",
    "VerifyError",
    "VerifyReport",
    "compare_checksums",
    "held_checksums",
    "tensors_digest",
    "weight_problems",
    "weights_digest",
]
