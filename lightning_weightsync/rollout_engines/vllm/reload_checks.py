"""What a vLLM worker checks before it acknowledges a version: nothing half-written, no broken scale.

vLLM's layerwise reload (every update: `weight_transfer.py`) buffers what `load_weights` writes into each module
until the module's checkpoint-format elements have all arrived, then re-creates the module and re-runs its
post-load processing, which for an online-quantized model (`--quantization fp8_per_block`, `mxfp8`, ...) is where
the bf16 weights become FP8 bytes and scales. What it does with a module that did not get all its elements is
quiet: at the end of the update a module that got some is processed with zeros where the rest would be (a fused
`qkv_proj` missing `q_proj` serves q as zeros), and one that got none keeps its old kernel tensors (a mix of two
versions). Both are a model no trainer sent, so this worker refuses the version instead, naming the parameter,
and the engine rolls back (`vllm.rollback=host`). Checked when the version commits, on the worker's thread,
before the ack:

- `missing_names`: every tensor the last version sent arrived again (a trainer sends every tensor every version;
  the vLLM engine never takes deltas) -- names the checkpoint tensor.
- `incomplete_modules`: no module holding checkpoint-format parameters is left part-loaded, nor unloaded when the
  last version wrote it -- names vLLM's parameter and how many of its elements arrived. A module a whole version
  also leaves short (vocabulary padding: `VocabParallelEmbedding` zero-fills rows past the vocabulary, which vLLM
  does not count; a MoE layer block FP8 rounds up) is told apart by the count the last accepted version left it at
  (`expected`); the first version has no such count, so there only a parameter no call wrote, in a module that got
  some, is refused. A module that gets nothing, version after version (a tensor the trainer never sends, a frozen
  one it excludes), keeps its kernel tensors whole: it is not refused.
- `bad_scales`: every scale a module's post-load processing produced this version is finite and non-zero (an
  E8M0 scale byte is not 0xFF, its NaN), and no FP8 weight holds a NaN byte; names the tensor.

`BufferWatch` measures what vLLM holds buffered while a version streams in (modules at once and the bytes of
their buffered tensors), so the order (parent-module order: one module at a time) is held, not assumed.
vLLM-free: `weight_transfer.py` reads vLLM's reload state into `ModuleLoad`s.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

MAX_NAMED = 5
"""How many parameters a refusal names (then a count)."""

_FP8_DTYPES = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
    if hasattr(torch, name)
)  # fmt: skip
E8M0_CEILING = 254
"""The largest exponent byte vLLM's MXFP8 quantizer writes (`clamp(0, 254)`): only an infinite block reaches it
(the amax of finite fp32 values, over 448, needs at most 2^120, byte 247)."""
_CHUNK = 1 << 24
"""Bytes of an FP8 weight examined at once (bounds the temporaries of the NaN scan)."""


@dataclass(frozen=True)
class ModuleLoad:
    """One module's progress in vLLM's reload, read while a version loads: `name` its qualified name, `params`
    its checkpoint-format parameters (name: elements), `written` the parameters at least one loader call wrote
    this version, `loaded` / `total` vLLM's element counts (`total` counts its loadable buffers too),
    `buffered_bytes` what vLLM holds buffered for it (the tensors handed to its loaders), `pending` whether it
    still waits for elements (processed modules are not pending)."""

    name: str
    params: Mapping[str, int]
    written: frozenset[str]
    loaded: int
    total: int
    buffered_bytes: int
    pending: bool

    @property
    def waiting(self) -> bool:
        """Holds checkpoint-format parameters and got some of its elements, not yet all (it is buffered)."""
        return self.pending and bool(self.params) and 0 < self.loaded < self.total


def missing_names(expected: Iterable[str], arrived: Iterable[str]) -> list[str]:
    """The tensors of the last version's layout (`expected`) this version did not send, sorted."""
    return sorted(set(expected) - set(arrived))


def incomplete_modules(
    loads: Sequence[ModuleLoad], expected: Mapping[str, int] | None, tied: Iterable[str] = ()
) -> list[str]:
    """What modules left part-loaded or unloaded at commit say, one line a parameter (see the module docstring).
    `expected`: each module's element count a whole version left pending (the last accepted version's); None on
    the first version. `tied`: parameters that are another one under a second name (a tied LM head): never loaded
    under their own name, they hold what the other one gets."""
    skip = set(tied)
    problems: list[str] = []
    for load in loads:
        if not (load.pending and load.params and load.loaded < load.total):
            continue
        if all(f"{load.name}.{name}" in skip for name in load.params):
            continue
        if load.loaded == 0:  # nothing arrived: vLLM keeps its kernel tensors whole (a module the trainer never sends)
            if expected is not None and load.name not in expected:  # ... but the last version wrote it
                problems.extend(f"{load.name}.{name}: not written (the last version wrote it)" for name in load.params)
            continue
        never = [name for name in load.params if name not in load.written]
        if never:
            problems.extend(f"{load.name}.{name}: not written" for name in never)
        elif expected is not None and expected.get(load.name) != load.loaded:
            size = sum(load.params.values())
            params = ", ".join(f"{load.name}.{name}" for name in load.params)
            problems.append(f"{params}: {load.loaded} of {size} elements written")
    return problems


def padding_counts(loads: Sequence[ModuleLoad]) -> dict[str, int]:
    """What a whole, accepted version left pending: the count `incomplete_modules` expects next time."""
    return {load.name: load.loaded for load in loads if load.pending and load.params and load.loaded < load.total}


def bad_scales(scales: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor]) -> list[str]:
    """The scales (name: tensor) that are NaN, infinite or zero, and the FP8 weights that hold a NaN, one line
    each. Float scales: finite and non-zero; uint8 scales are E8M0 exponents (MXFP8): 0xFF is NaN, and 254 is what an
    infinite block clamps to (vLLM's quantizer writes byte 0 for a NaN block, hence the NaN scan of the FP8 bytes); a
    zero exponent is 2^-127, a scale, not a zero."""
    problems: list[str] = []
    for name, scale in scales.items():
        if scale.is_meta or scale.numel() == 0:
            continue
        if scale.dtype == torch.uint8:
            if bool((scale == 0xFF).any()):
                problems.append(f"{name}: E8M0 scale 0xFF (NaN)")
            elif bool((scale >= E8M0_CEILING).any()):
                problems.append(f"{name}: E8M0 scale 2^127 (the quantizer's ceiling: an infinite weight)")
            continue
        values = scale.float()
        if not bool(torch.isfinite(values).all()):
            problems.append(f"{name}: scale holds {'NaN' if bool(values.isnan().any()) else 'inf'}")
        elif bool((values == 0).any()):
            problems.append(f"{name}: scale holds 0")
    for name, weight in weights.items():
        if weight.is_meta or weight.dtype not in _FP8_DTYPES:
            continue
        if _fp8_has_nan(weight):
            problems.append(f"{name}: FP8 weight holds NaN")
    return problems


def _fp8_has_nan(weight: torch.Tensor) -> bool:
    """NaN bytes of an FP8 tensor: e4m3fn S.1111.111; e4m3fnuz/e5m2fnuz 0x80; e5m2 S.11111.xx with xx != 0."""
    flat = weight.detach().reshape(-1).view(torch.uint8)
    for start in range(0, flat.numel(), _CHUNK):
        part = flat[start : start + _CHUNK]
        if weight.dtype == torch.float8_e4m3fn:
            nan = (part & 0x7F) == 0x7F
        elif weight.dtype == torch.float8_e5m2:
            nan = ((part & 0x7C) == 0x7C) & ((part & 0x03) != 0)
        else:
            nan = part == 0x80
        if bool(nan.any()):
            return True
    return False


def refusal(problems: Sequence[str], what: str) -> str:
    """One message for up to `MAX_NAMED` problems (and how many more)."""
    shown = "; ".join(problems[:MAX_NAMED])
    more = f" (and {len(problems) - MAX_NAMED} more)" if len(problems) > MAX_NAMED else ""
    return f"{what}: {shown}{more}"


@dataclass
class BufferWatch:
    """The most modules vLLM held buffered at once during a version, and the most bytes (of the tensors handed to
    their loaders): sampled after each `load_weights` call."""

    modules_peak: int = 0
    bytes_peak: int = 0
    names_at_peak: list[str] = field(default_factory=list)

    def sample(self, loads: Iterable[ModuleLoad]) -> None:
        waiting = [load for load in loads if load.waiting]
        nbytes = sum(load.buffered_bytes for load in waiting)
        if len(waiting) > self.modules_peak:
            self.modules_peak = len(waiting)
            self.names_at_peak = [load.name for load in waiting]
        self.bytes_peak = max(self.bytes_peak, nbytes)


__all__ = [
    "BufferWatch",
    "ModuleLoad",
    "bad_scales",
    "incomplete_modules",
    "missing_names",
    "padding_counts",
    "refusal",
]
