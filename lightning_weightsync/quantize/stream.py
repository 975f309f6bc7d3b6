"""A trainer's (name, tensor) stream turned into what the rollout's contract says its model loads.

One tensor at a time, in the order given (a rollout's reload buffers a module until its last tensor arrives, so
the order the trainer sends is kept): a quantized name yields its FP8 weight and then its scale tensor, a kept
name yields the tensor itself, untouched. What is held at once is one weight's FP8 bytes and scales plus the
quantizer's tiles (`schemes.py`), never the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from ..errors import QuantizeError
from .contract import QuantContract, QuantRule
from .schemes import DEFAULT_MAX_TEMP_ELEMS, SCHEMES
from .shards import quantize_shard


@dataclass
class QuantStats:
    """Counts of one pass over a stream: tensors and bytes that came in, and what went out for them."""

    quantized: int = 0  # tensors quantized (each yields a weight and a scale)
    kept: int = 0  # tensors passed through
    bytes_in: int = 0
    bytes_out: int = 0

    @property
    def ratio(self) -> float:
        """Bytes out per byte in (block FP8 of bf16: just over 0.5)."""
        return self.bytes_out / self.bytes_in if self.bytes_in else 1.0


@dataclass(frozen=True)
class QuantizedPart:
    """A byte range of a quantized tensor (a shard's FP8 bytes, or its run of scales): the whole tensor's name,
    shape and dtype, where `data`'s bytes start in it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    byte_offset: int
    data: torch.Tensor


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Quantizer:
    """One tensor at a time (what an async sender pulls): a quantized name gives its weight and then its scale,
    a kept name itself; the names already seen are remembered so that a scale's name cannot collide."""

    def __init__(self, contract: QuantContract, max_temp_elems: int = DEFAULT_MAX_TEMP_ELEMS) -> None:
        if max_temp_elems < 1:
            raise QuantizeError(f"max_temp_elems must be positive, got {max_temp_elems}")
        self.contract, self.max_temp_elems = contract, max_temp_elems
        self.stats = QuantStats()
        self._seen: set[str] = set()
        self._scale_names: set[str] = set()

    def _rule(self, name: str, nbytes: int) -> QuantRule | None:
        """The contract's rule for `name` (None: kept, counted so), with the names seen and the scales' names."""
        if name in self._scale_names or name in self._seen:
            raise QuantizeError(f"{name}: sent twice, or also the name of a scale tensor the contract makes")
        self._seen.add(name)
        rule = self.contract.rule_for(name)
        self.stats.bytes_in += nbytes
        if rule is None:
            self.stats.kept += 1
            self.stats.bytes_out += nbytes
            return None
        scale_name = rule.scale_name(name)
        if scale_name in self._seen:
            raise QuantizeError(f"{name}: its scale's name {scale_name} is a tensor the trainer sent too")
        self._scale_names.add(scale_name)
        return rule

    def one(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        rule = self._rule(name, _nbytes(tensor))
        if rule is None:
            return [(name, tensor)]
        scale_name = rule.scale_name(name)
        weight, scale = SCHEMES[rule.scheme].quantize(name, tensor.detach(), rule.block, self.max_temp_elems)
        self.stats.quantized += 1
        self.stats.bytes_out += _nbytes(weight) + _nbytes(scale)
        return [(name, weight), (scale_name, scale)]

    def shard(
        self, name: str, shape: tuple[int, ...], byte_offset: int, data: torch.Tensor
    ) -> list[QuantizedPart] | None:
        """A sender's shard of `name` (bytes from `byte_offset` of the whole tensor of `shape`), quantized on its
        own (`shards.py`: refused where it cuts a block); None where the contract keeps the tensor (it goes as it
        is). Counted as one tensor quantized: each rank counts its own shards."""
        rule = self._rule(name, _nbytes(data))
        if rule is None:
            return None
        if byte_offset % data.element_size():
            raise QuantizeError(f"{name}: a shard at byte {byte_offset} does not start on an element")
        (weight_at, weight), (scale_at, scale) = quantize_shard(
            name, shape, byte_offset // data.element_size(), data, rule, self.max_temp_elems
        )
        scheme = SCHEMES[rule.scheme]
        self.stats.quantized += 1
        self.stats.bytes_out += _nbytes(weight) + _nbytes(scale)
        return [
            QuantizedPart(name, shape, scheme.element_dtype, weight_at, weight),
            QuantizedPart(rule.scale_name(name), scheme.scale_shape(shape, rule.block), scheme.scale_dtype, scale_at,
                          scale),
        ]  # fmt: skip


class QuantizedStream(Iterator[tuple[str, torch.Tensor]]):
    """The iterator `quantize_stream` returns; `stats` grows as it is consumed."""

    def __init__(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], contract: QuantContract, max_temp_elems: int
    ) -> None:
        self._quantizer = Quantizer(contract, max_temp_elems)
        self.stats = self._quantizer.stats
        self._items = (item for name, tensor in named_tensors for item in self._quantizer.one(name, tensor))

    def __next__(self) -> tuple[str, torch.Tensor]:
        return next(self._items)


def quantize_stream(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    contract: QuantContract,
    *,
    max_temp_elems: int = DEFAULT_MAX_TEMP_ELEMS,
) -> QuantizedStream:
    """`named_tensors` as the rollout's `contract` says its model loads them (lazily: nothing is quantized
    before it is asked for). Raises `QuantizeError`, naming the tensor, for a name the contract does not cover,
    a weight its scheme cannot take, or a NaN / inf in a weight to quantize; never sends bf16 in FP8's place."""
    return QuantizedStream(named_tensors, contract, max_temp_elems)
