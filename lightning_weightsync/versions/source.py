"""A version's source as the sender pulls it: every tensor checked as it leaves, and always drained.

On FSDP every rank must run the same all-gathers, so the sender exhausts the caller's iterable whatever
fails; and what every receiver would refuse (a bad name, shape or dtype, a name sent twice, a tensor with no
dense bytes) is refused here first, naming the tensor and the knob, before any receiver drops the metadata.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Iterable, Mapping

import torch

from ..errors import ProtocolError, WeightSyncError
from ..protocol.chunks import NamedTensors, TensorShard, aiter_any
from ..protocol.dtypes import dtype_name
from ..protocol.messages import check_tensor
from .quantized import QuantizedSource

_HOLDING_TYPES: tuple[type, ...] = (list, tuple, type({}.items()), type({}.values()))
_HELD: tuple[Iterable[object], ...] = ([], (), {}.items(), {}.values())
_HOLDING_TYPES += tuple({type(iter(c)) for c in _HELD})
_MODULE_WALKS = torch.nn.Module.named_parameters.__code__.co_filename  # named_parameters(), state_dict walks, ...


def holds_its_tensors(weights: object) -> bool:
    """Whether `weights` cannot hand out memory it reuses for a later tensor, so the sender may still read a
    tensor after pulling the next (`stable_tensors` decided for the caller): a list, a tuple, a dict's items or
    values (a state_dict's), an iterator over one of those, or a module's own walk (`named_parameters()`,
    `named_buffers()`: the module's tensors themselves). Anything else, a user's generator above all, may
    yield views of one buffer it overwrites (FSDP1's unsharded walk does), and keeps the safe path."""
    if isinstance(weights, _HOLDING_TYPES):
        return True
    code = getattr(weights, "gi_code", None)
    return code is not None and code.co_filename == _MODULE_WALKS


class Drainable:
    """Wraps the caller's iterable so that, after a failure, the rest can still be consumed.

    On FSDP every rank must run the same all-gathers; if rank 0 stopped pulling from its gather
    generator mid-way, the other ranks would hang. So the sender always exhausts the iterable.
    """

    def __init__(self, weights: NamedTensors) -> None:
        self.weights = weights  # the caller's own object (`holds_its_tensors` reads what it is)
        self._it: AsyncIterator[tuple[str, torch.Tensor | TensorShard]] = aiter_any(weights)
        self.exhausted = False
        self.failed = False  # the caller's iterable raised, or a tensor was refused: a local failure, the group is fine
        self.check = True  # validate each tensor with the receivers' rules (off while draining)
        self.names: set[str] = set()  # sent in this version: a second one would fail every receiver's merge
        self.quantized: QuantizedSource | None = None  # the receivers' contract (versions/quantized.py), if any
        self._pending: list[tuple[str, torch.Tensor | TensorShard]] = []  # a weight's scale, after the weight

    def __aiter__(self) -> Drainable:
        return self

    async def __anext__(self) -> tuple[str, torch.Tensor | TensorShard]:
        if self._pending:
            return self._pending.pop(0)
        try:
            item = await self._it.__anext__()
        except StopAsyncIteration:
            self.exhausted = True
            raise
        except BaseException:
            self.exhausted = self.failed = True
            raise
        if not self.check:
            return item
        try:
            if self.quantized is not None:
                _check_outgoing(item, set())  # a (name, tensor) pair the receivers' rules allow, before quantizing
                name, tensor = item
                if isinstance(tensor, TensorShard):  # sharded mode: quantized here where it holds whole blocks
                    self._pending = await self.quantized.shard(name, tensor)
                else:
                    self._pending = list(await self.quantized.one(name, tensor))
            else:
                self._pending = [item]
            for out in self._pending:
                _check_outgoing(out, self.names)
        except (WeightSyncError, TypeError):
            self.failed = True  # a local failure: the group is fine, the rest is drained
            self._pending = []
            raise
        return self._pending.pop(0)

    async def drain(self) -> None:
        self.check = False
        if not self.exhausted:
            async for _ in self:
                pass


@functools.lru_cache(maxsize=1 << 16)
def _checked(name: str, shape: tuple[int, ...], dtype: str) -> int:
    """`check_tensor`, remembered for what passed (a pure rule): a model sends the same tensors every version."""
    return check_tensor(name, shape, dtype)


def _check_outgoing(item: object, names: set[str]) -> None:
    """What every receiver would refuse, refused here first (the same `check_tensor`, a name sent twice),
    and what cannot be sent at all (no dense bytes), so the version fails at once naming the tensor
    instead of every receiver dropping the metadata or a raw torch error from deep in the split."""
    if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], (torch.Tensor, TensorShard))):
        raise TypeError(f"weights must yield (name, tensor) pairs, got {type(item).__name__}")
    name, tensor = item
    shape, dtype = (
        (tensor.shape, tensor.dtype) if isinstance(tensor, TensorShard) else (tuple(tensor.shape), tensor.dtype)
    )
    if isinstance(tensor, TensorShard):
        tensor = tensor.data
    if not isinstance(name, str):
        raise TypeError(f"tensor names must be str, got {type(name).__name__} ({name!r:.80})")
    fix = "rename or exclude it (trainer.names.rename / trainer.names.exclude)"
    try:
        _checked(name, shape, dtype_name(dtype))
    except ProtocolError as exc:
        raise ProtocolError(f"cannot send {name[:120]!r}: {exc}; {fix}") from None
    if tensor.layout != torch.strided:
        raise ProtocolError(f"cannot send {name[:120]!r}: a {tensor.layout} tensor has no dense bytes; send "
                            f"tensor.to_dense(), or {fix}")  # fmt: skip
    if tensor.device.type == "meta":
        raise ProtocolError(f"cannot send {name[:120]!r}: it is on the meta device (no data: never materialized, "
                            f"or offloaded); materialize it, or {fix}")  # fmt: skip
    if name in names:
        raise ProtocolError(f"cannot send {name[:120]!r} twice in one version (every receiver would refuse the "
                            f"second); {fix}")  # fmt: skip
    names.add(name)


def check_call(weights: object, version: object) -> None:
    """`send_weights`' arguments that are wrong whoever receives: refused before anything is pulled."""
    iterable = hasattr(weights, "__iter__") or hasattr(weights, "__aiter__")
    if isinstance(weights, (Mapping, str, bytes)) or not iterable:
        hint = "; pass weights.items() for a dict" if isinstance(weights, Mapping) else ""
        raise TypeError(f"weights must be an iterable of (name, tensor) pairs, got {type(weights).__name__}{hint}")
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(f"version must be an int, got {type(version).__name__}")
    if version < 0:
        raise ValueError(f"version={version} is negative; versions are >= 0 and increase")


__all__ = ["Drainable", "check_call", "holds_its_tensors"]
