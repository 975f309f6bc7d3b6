"""A tensor's fingerprint: 64 bits that say whether two copies of a weight hold the same bytes.

The sender computes it while it has the tensor in hand, it travels in the bucket metadata, and a
receiver recomputes it over the merged tensor (`versions/verify.py`). It must be cheap where the bytes
are (a GPU reduction on the trainer, a CPU pass on a rollout that merges on the host) and give the same
value on every device, so it is integer arithmetic over the raw bytes, modulo 2**64:

    the bytes, zero-padded to whole 8-byte words w, in rows of ROW_WORDS words (the last one padded);
    r_j = sum of row j's words;  fingerprint = (sum_j r_j * (2j + 1) + nbytes * GOLDEN) mod 2**64

One pass over the data (a row-sum, ~20 GB/s on one CPU core, far faster than the copies a sync makes
anyway: see docs/backends.md) plus a pass over the row sums (1/ROW_WORDS of the data).

What it catches, exactly: any change confined to one row (a flipped bit or byte, a torn word, a chunk
of zeros in place of data) changes r_j by some d != 0 and the fingerprint by d * (2j + 1), never 0
mod 2**64 since 2j + 1 is odd; rows swapped or shifted (a chunk at the wrong offset) unless their sums
collide; a different length. What it does not promise: words permuted *inside* one 4 KiB row, or
changes in several rows crafted to cancel. It is a check against faults, not an adversary (the control
plane's HMAC is what keeps a forger out).
"""

from __future__ import annotations

import torch

ROW_WORDS = 512  # 4 KiB rows
GOLDEN = 0x9E3779B97F4A7C15
MASK = (1 << 64) - 1
NO_FINGERPRINT = -1
"""On the wire: this entry's tensor carries no fingerprint (verify off or not sampled this version)."""


def _words(data: torch.Tensor) -> torch.Tensor:
    """`data` (flat uint8) as int64 words, the tail zero-padded; a copy only when it must be."""
    nbytes = data.numel()
    whole = nbytes - nbytes % 8
    aligned = data.storage_offset() % 8 == 0 and data.data_ptr() % 8 == 0
    if whole == nbytes and aligned:
        return data.view(torch.int64)
    padded = torch.zeros(whole // 8 + (whole != nbytes), dtype=torch.int64, device=data.device)
    padded.view(torch.uint8)[:nbytes].copy_(data)
    return padded


def _bytes_and_words(tensor: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The tensor's byte count and its bytes as int64 words (`_words`): what both digests read."""
    flat = tensor.detach().contiguous().reshape(-1)
    data = flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
    return data.numel(), _words(data)


def fingerprint(tensor: torch.Tensor) -> int:
    """The tensor's fingerprint (module docstring), an unsigned 64-bit int; blocks until it is computed.

    Few torch calls for a small tensor (most of a model's tensors are norms and biases: per-call overhead,
    not bandwidth, is their cost); one row-sum pass plus a pass over the row sums for a large one."""
    nbytes, words = _bytes_and_words(tensor)
    if nbytes == 0:
        return 0
    count = words.numel()
    if count <= ROW_WORDS:  # one row, weight 1
        return (int(words.sum()) + nbytes * GOLDEN) & MASK
    full_rows = count // ROW_WORDS
    rows = words[: full_rows * ROW_WORDS].view(full_rows, ROW_WORDS).sum(dim=1)  # int64 sums wrap mod 2**64
    total = int(rows.mul_(_odd_weights(full_rows, rows.device)).sum())
    if count > full_rows * ROW_WORDS:  # the last, partial row
        total += int(words[full_rows * ROW_WORDS :].sum()) * (2 * full_rows + 1)
    return (total + nbytes * GOLDEN) & MASK


REPLICA_BLOCK_ROWS = 4096  # rows weighted at once by `replica_digest` (a 16 MiB temporary at most)


def replica_digest(tensor: torch.Tensor) -> int:
    """64 bits that say whether two replicas of a weight (two trainer ranks' whole copies) hold the same bytes.

    `fingerprint` weights rows, not the words inside one: rounding drift between replicas is one ulp up in one
    element and one ulp down in another of the same row as often as not, and those cancel in a row's sum (seen:
    a 32-element norm weight, +-1 ulp at elements 9 and 13). Here every word has its own odd weight,
    `sum_p (2p + 1) * word_p mod 2**64`, computed per row as `sum_k (2k + 1) w_jk + 2 * ROW_WORDS * j * r_j`: a
    change of +d at one word and -d at another changes it by `2d(p - q)`, which is not 0 mod 2**64 for any
    drift a replica can show. One more pass over the data than `fingerprint`, in blocks."""
    nbytes, words = _bytes_and_words(tensor)
    if nbytes == 0:
        return 0
    count = words.numel()
    rows = -(-count // ROW_WORDS)
    if count != rows * ROW_WORDS:  # the tail row, zero-padded (a zero word adds nothing)
        padded = torch.zeros(rows * ROW_WORDS, dtype=torch.int64, device=words.device)
        padded[:count] = words
        words = padded
    columns = _odd_weights(ROW_WORDS, words.device)
    matrix = words.view(rows, ROW_WORDS)
    total = 0
    for start in range(0, rows, REPLICA_BLOCK_ROWS):
        block = matrix[start : start + REPLICA_BLOCK_ROWS]
        within = (block * columns).sum()
        row_sums = block.sum(dim=1)
        index = torch.arange(start, start + block.shape[0], dtype=torch.int64, device=words.device)
        total += int(within) + int((row_sums * index).sum()) * 2 * ROW_WORDS
    return (nbytes * GOLDEN + total) & MASK


_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _odd_weights(count: int, device: torch.device) -> torch.Tensor:
    """1, 3, 5, ... (`count` of them) on `device`; kept, grown by doubling, so a fingerprint allocates none."""
    have = _WEIGHTS.get(device)
    if have is None or have.numel() < count:
        size = max(count, 2 * (have.numel() if have is not None else 1024))
        have = _WEIGHTS[device] = torch.arange(size, dtype=torch.int64, device=device).mul_(2).add_(1)
    return have[:count]


def checksum_hex(value: int) -> str:
    """The fingerprint as 16 hex digits: what the verify reports and endpoints show."""
    return f"{value & MASK:016x}"


def sampled(index: int, version: int, every: int) -> bool:
    """`transport.verify=sample`: the `index`-th tensor of a version is fingerprinted when this is true;
    it rotates with the version, so every tensor is checked once every `every` versions."""
    return (index + version) % every == 0


__all__ = ["GOLDEN", "NO_FINGERPRINT", "ROW_WORDS", "checksum_hex", "fingerprint", "replica_digest", "sampled"]
