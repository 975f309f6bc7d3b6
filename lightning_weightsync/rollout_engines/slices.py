"""Which box of each checkpoint tensor a tensor-parallel engine worker reads, learnt from the engine's own loaders.

An engine worker (a vLLM worker, an SGLang TP rank) at TP > 1 keeps a slice of most checkpoint tensors: a
column-parallel weight its rows, a row-parallel one its columns, the vocab-parallel embedding and LM head a range
of rows, and a fused parameter (`qkv_proj`, `gate_up_proj`, an MoE layer's `w13_weight`) a box of each of the
tensors fused into it (`q_proj`, `k_proj`, `v_proj`; with GQA, a KV head that TP ranks share is read whole by
each); a block-quantized layer's FP8 weight a box of the checkpoint's FP8 weight and its `weight_scale_inv` a box
of the block scales. `derive_boxes` finds each such box by *running* the model's own `load_weights` on probe
tensors and seeing which elements of each tensor reached a parameter, so any model the engine can load is
covered without a table of model or layer names, and what a loader does that the trace cannot follow makes that
tensor go whole (said once in the log, with the parameter's name and why). Engine-neutral: it touches only
`load_weights` and the parameters; `vllm/slices.py` and `sglang/slices.py` name the engine's default loader.

How the trace runs, and why this way:

- Against the worker's own model instance, never its values: every parameter is swapped, for the trace only,
  for a *probe* of the same class and attributes (`output_dim`, `packed_dim`, `tp_rank`, its `weight_loader`:
  the loader is the real layer's bound method, reading the layer's `tp_rank`, `output_sizes`, KV-head
  replicas...; a parameter whose `weight_loader` is a read-only property, SGLang's, gets it under
  `_weight_loader`). A probe's data is a 4-byte stride-0 stand-in of the parameter's shape until its loader is
  called; then the loader writes into a fresh CPU tensor, which is read and dropped. So nothing of the model is
  written (a loader writes the `param` it is handed, which is the probe), the real parameters are put back
  whatever happens, and the trace takes no GPU memory. A second model built at a tiny config would not do:
  the boxes depend on the real sizes; a second model at the real config would double the worker's memory and
  register its attention layers twice with the engine.
- The whole `load_weights` runs, name mapping included (`q_proj` -> `qkv_proj` shard "q", prefixes, a tied
  LM head the model skips), exactly as a version's tensors go through it.
- Values, not ops (the probe is float32 whatever the tensor's dtype: an FP8 weight and its float32 block scales
  are traced as any other tensor, since a loader that only copies, narrows and views does the same to any dtype):
  each tensor is loaded once per dimension `k`, as a stride-0 view of `arange(shape[k])`
  (offset, see below) broadcast along the other dims. What a parameter holds afterwards says, for each element
  it copied, that element's coordinate `k` in the tensor, however the loader cut, viewed or permuted it
  (narrow, chunk, slicing, a transpose, a permutation of heads): no op needs to be understood. The set of
  elements read is then checked to be exactly a box (its bounding box, every element of it hit); one is, or
  the tensor goes whole. Memory: the checkpoint probe is a view (no memory); a parameter's probe is its shape
  in float32 (float64 for a dimension of 2^23 elements or more), one per dimension, one parameter at a time.
- Values are `index + OFFSET`, and the probe starts at -1: a zero a loader writes (the vocab embedding
  zero-fills its padding rows) is out of that range and counts as not read. A loader that does arithmetic on
  values (quantizing, scaling, any other constant) is not followed: a quantized (non-float) parameter that
  `checkpoint_params` does not replace (below) is refused up front, and a value written that is neither a
  copied index, -1 nor 0 fails the trace.
- A tensor no parameter reads (a tied LM head the model skips) is declared as a box of one element: the
  name still arrives (a box is never empty), the bytes do not. A tensor named as a parameter the model ties
  to another (`tied_aliases`) is that without a trace: vLLM 0.33.0's `load_weights` raises on it alone.

A quantized model (vLLM's online quantization: `--quantization fp8_per_block`, `mxfp8`, ...) serves kernel-format
parameters (FP8 bytes and their scales, possibly transposed or repacked) that no checkpoint tensor maps onto; what
`load_weights` writes during an update are the checkpoint-format parameters vLLM's layerwise reload puts back
(bf16, the checkpoint's shapes) before it re-quantizes each module. `checkpoint_params` hands the trace those
(`vllm/weight_transfer.py` reads them from vLLM's reload metadata): a module whose live parameters differ from them (in
names, shapes or dtypes) is traced on them, so its boxes are the boxes of the bf16 tensors the reload receives.

What a box buys at receive time is only that the elements outside it are never sent: the worker still feeds a
whole-shaped tensor (the box in place, zeros elsewhere) to `load_weights`, which reads only the box, so the
model after a sliced version is what `load_weights` makes of the whole tensor, bitwise (post-load processing
and quantization see what they see today).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from ..protocol.boxes import Box
from .worker import tied_aliases

logger = logging.getLogger(__name__)

_CHUNK = 1 << 22
"""Elements of a parameter's probe examined at once (bounds the trace's temporaries)."""


CheckpointParams = Callable[[torch.nn.Module], Mapping[str, torch.Tensor] | None]
"""A module's checkpoint-format parameters (name: a tensor with the parameter's class, shape, dtype and
attributes, its `weight_loader` the layer's own), or None where it has none recorded."""


class _Untraceable(Exception):
    """The trace cannot follow what a loader did with a tensor: it goes whole, for the reason given."""


def copy_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """What an engine's `default_weight_loader` does with a same-shaped tensor (the fallback outside an engine)."""
    assert param.shape == loaded.shape
    param.data.copy_(loaded)


@dataclass(frozen=True)
class Slices:
    """What `derive_boxes` learnt: `boxes`, the box of each tensor this worker reads a part of; `whole`, why
    each other tensor goes whole (`read whole`: every element reaches this worker, a replicated norm, a KV
    head TP ranks share; else the reason the trace gave); `params`, which parameters read each tensor; `unread`,
    the tensors no parameter reads (a tied LM head the model skips, a tensor it does not use): a box of one
    element each, since the name must still arrive (a box cannot be empty)."""

    boxes: dict[str, Box] = field(default_factory=dict)
    whole: dict[str, str] = field(default_factory=dict)
    params: dict[str, list[str]] = field(default_factory=dict)
    unread: list[str] = field(default_factory=list)

    def nbytes(self, shapes: Mapping[str, Sequence[int]], itemsize: Callable[[str], int]) -> int:
        """Bytes this worker receives a version: its boxes, and every other tensor whole."""
        total = 0
        for name, shape in shapes.items():
            box = self.boxes.get(name)
            total += (box.numel if box is not None else math.prod(shape)) * itemsize(name)
        return total


@dataclass
class _Call:
    """One call of a parameter's loader for the tensor traced: the parameter's name and what it held after each
    dimension's run."""

    param: str
    results: list[torch.Tensor]


def derive_boxes(
    model: torch.nn.Module,
    shapes: Mapping[str, Sequence[int]],
    *,
    load: Callable[[Iterable[tuple[str, torch.Tensor]]], Any] | None = None,
    checkpoint_params: CheckpointParams | None = None,
    default_loader: Callable[..., Any] = copy_loader,
) -> Slices:
    """The box of each checkpoint tensor (`{name: shape}`, the trainer's names) `model`'s parameters read, by
    running `model.load_weights` (or `load`) on probes (see the module docstring). The model is unchanged.
    `checkpoint_params(module)`: the parameters `load_weights` writes into that module during an update, where
    they differ from the ones it serves (a quantized model's; see the module docstring). `default_loader`: the
    engine's loader for a parameter that has none of its own (the model's `load_weights` falls back to it)."""
    # the engine model's own method; torch types a Module's attributes as Tensor | Module
    loader: Callable[[Iterable[tuple[str, torch.Tensor]]], Any] = load if load is not None else model.load_weights  # type: ignore[assignment]
    aliases = tied_aliases(model)
    out = Slices()
    with _probed(model, checkpoint_params, default_loader) as calls:
        for name, shape in shapes.items():
            shape = tuple(int(s) for s in shape)
            if name in aliases and shape:  # the sink does not load it: one element of it
                out.boxes[name] = Box((0,) * len(shape), (1,) * len(shape))
                out.unread.append(name)
                out.params[name] = []
                continue
            try:
                box, params = _trace(loader, calls, name, shape)
            except _Untraceable as exc:
                out.whole[name] = str(exc)
                continue
            out.params[name] = params
            if box is None:  # its values reach no parameter: one element of it is all this worker needs
                out.boxes[name] = Box((0,) * len(shape), (1,) * len(shape))
                out.unread.append(name)
            elif box.is_whole(shape):
                out.whole[name] = "read whole"
            else:
                out.boxes[name] = box
    for name, why in out.whole.items():
        if why != "read whole":
            logger.info("tensor-parallel slices: %r goes whole: %s", name, why)
    logger.info(
        "tensor-parallel slices: %d tensors sliced (%d read by no parameter: one element), %d read whole, %d whole "
        "for another reason",
        len(out.boxes),
        len(out.unread),
        sum(why == "read whole" for why in out.whole.values()),
        sum(why != "read whole" for why in out.whole.values()),
    )
    return out


# -- the probes --------------------------------------------------------------------------------------------
class _Recorder:
    """The calls of probe loaders while one tensor is traced."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, torch.Tensor]] = []
        self.dtype = torch.float32


def _stand_in(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of `shape` that takes 4 bytes (a parameter's data between calls)."""
    return torch.full((), -1, dtype=dtype).expand(*shape)


def _differs(live: Mapping[str, torch.Tensor | None], loaded: Mapping[str, torch.Tensor]) -> bool:
    """Whether the parameters a module serves are not the ones `load_weights` writes (names, shapes, dtypes)."""
    served = {name: (tuple(p.shape), p.dtype) for name, p in live.items() if p is not None}
    return served != {name: (tuple(p.shape), p.dtype) for name, p in loaded.items()}


@contextmanager
def _probed(
    model: torch.nn.Module, checkpoint_params: CheckpointParams | None, fallback: Callable[..., Any]
) -> Iterator[_Recorder]:
    """`model` with every parameter swapped for a probe (the real ones put back on exit); a module whose
    checkpoint-format parameters (`checkpoint_params`) differ from the ones it serves gets probes of those."""
    recorder = _Recorder()
    probes: dict[int, torch.nn.Parameter] = {}
    saved: list[tuple[torch.nn.Module, dict[str, torch.nn.Parameter | None]]] = []
    names = {id(p): n for n, p in model.named_parameters()}
    prefixes = {id(m): n for n, m in model.named_modules()}
    try:
        for module in model.modules():
            params: Mapping[str, torch.Tensor | None] = module._parameters
            loaded = checkpoint_params(module) if checkpoint_params is not None else None
            checkpoint = bool(loaded) and _differs(module._parameters, loaded or {})
            if checkpoint:
                params = dict(loaded or {})
            elif not any(p is not None for p in params.values()):
                continue
            saved.append((module, dict(module._parameters)))
            swapped: dict[str, torch.nn.Parameter | None] = {}
            for pname, param in params.items():
                if param is None:
                    swapped[pname] = None
                    continue
                qualname = ".".join(filter(None, (prefixes.get(id(module), ""), pname)))
                if checkpoint:  # vLLM's recorded parameter (a Parameter subclass): a fresh probe per trace
                    swapped[pname] = _probe(cast(torch.nn.Parameter, param), qualname, recorder, fallback)
                    continue
                probe = probes.get(id(param))
                if probe is None:
                    live = cast(torch.nn.Parameter, param)
                    probe = probes[id(param)] = _probe(live, names.get(id(param), qualname), recorder, fallback)
                swapped[pname] = probe
            module._parameters.clear()
            module._parameters.update(swapped)
        yield recorder
    finally:
        for module, parameters in reversed(saved):
            module._parameters.clear()
            module._parameters.update(parameters)


def _probe(
    param: torch.nn.Parameter, qualname: str, recorder: _Recorder, fallback: Callable[..., Any]
) -> torch.nn.Parameter:
    original = getattr(param, "weight_loader", None) or fallback
    shape, floating = tuple(param.shape), param.dtype.is_floating_point
    probe = torch.Tensor._make_subclass(type(param), _stand_in(shape, torch.float32), False)
    probe.__dict__.update(param.__dict__)

    def record(*args: Any, **kwargs: Any) -> Any:
        # the engines' loaders take (param, loaded_weight, ...), positionally (linear layers, `default_weight_loader`)
        # or by name (vLLM's FusedMoE experts: `param.weight_loader(param=..., loaded_weight=..., expert_id=...)`)
        target = args[0] if args else kwargs.get("param")
        if not isinstance(target, torch.Tensor):
            raise _Untraceable(f"parameter {qualname!r}: its loader was called without the parameter")
        if not floating:
            raise _Untraceable(f"parameter {qualname!r} holds {param.dtype} (a quantized layout): not traced")
        target.data = torch.full(shape, -1, dtype=recorder.dtype)
        try:
            result = original(*args, **kwargs)
            recorder.calls.append((qualname, target.data))
        finally:
            target.data = _stand_in(shape, recorder.dtype)
        return result

    _set_loader(probe, record)
    return probe


def _set_loader(probe: torch.nn.Parameter, loader: Callable[..., Any]) -> None:
    """`probe.weight_loader = loader`, also where the parameter class reads it through a property without a setter
    (SGLang's `BasevLLMParameter`: `_weight_loader`); vLLM's has a setter, a plain Parameter an attribute."""
    declared = getattr(type(probe), "weight_loader", None)
    if isinstance(declared, property) and declared.fset is None:
        probe._weight_loader = loader  # type: ignore[attr-defined]
    else:
        probe.weight_loader = loader  # type: ignore[attr-defined]


# -- one tensor --------------------------------------------------------------------------------------------
def _trace(
    load: Callable[[Iterable[tuple[str, torch.Tensor]]], Any], recorder: _Recorder, name: str, shape: tuple[int, ...]
) -> tuple[Box | None, list[str]]:
    """The box of `name` the probes were written from (None: nothing read), and the parameters that read it."""
    if not shape or math.prod(shape) == 0:
        raise _Untraceable("a scalar or empty tensor")
    wide = max(shape) >= 1 << 23
    recorder.dtype = torch.float64 if wide else torch.float32
    offset = float(1 << 40) if wide else float(1 << 23)
    runs: list[list[tuple[str, torch.Tensor]]] = []
    for dim, size in enumerate(shape):
        view = [1] * len(shape)
        view[dim] = size
        probe = (torch.arange(size, dtype=recorder.dtype) + offset).view(view).expand(shape)
        recorder.calls = []
        try:
            load([(name, probe)])
        except _Untraceable:
            raise
        except Exception as exc:
            raise _Untraceable(f"load_weights failed on the probe ({type(exc).__name__}: {exc})"[:300]) from None
        runs.append(recorder.calls)
    if any([p for p, _ in run] != [p for p, _ in runs[0]] for run in runs):
        raise _Untraceable("load_weights called different loaders for different values of the tensor")
    calls = [_Call(param, [run[i][1] for run in runs]) for i, (param, _) in enumerate(runs[0])]
    boxes = [box for call in calls if (box := _read_box(call, shape, offset)) is not None]
    params = sorted({call.param for call in calls})
    return _union(boxes, params), params


def _read_box(call: _Call, shape: tuple[int, ...], offset: float) -> Box | None:
    """The box of the tensor one loader call copied into its parameter (None: it copied nothing of it)."""
    flats = [r.reshape(-1) for r in call.results]
    count, lo, hi = 0, [math.inf] * len(shape), [-math.inf] * len(shape)
    for start in range(0, flats[0].numel(), _CHUNK):
        parts = [f[start : start + _CHUNK] - offset for f in flats]
        read = [(p >= 0) & (p < size) for p, size in zip(parts, shape, strict=True)]
        mask = read[0]
        if any(not torch.equal(mask, other) for other in read[1:]):
            raise _Untraceable(f"parameter {call.param!r}: its loader copies some elements in one coordinate only")
        untouched = (parts[0] == -1 - offset) | (parts[0] == -offset)  # the probe's -1, a zero fill (padding)
        if not bool((mask | untouched).all()):
            raise _Untraceable(f"parameter {call.param!r}: its loader writes values it did not copy from the tensor")
        for k, part in enumerate(parts):
            got = part[mask]
            if got.numel() == 0:
                continue
            if not torch.equal(got, got.round()):
                raise _Untraceable(f"parameter {call.param!r}: its loader changes the values it copies")
            lo[k], hi[k] = min(lo[k], float(got.min())), max(hi[k], float(got.max()))
        count += int(mask.sum())
    if count == 0:
        return None
    box = Box(tuple(int(v) for v in lo), tuple(int(h) - int(v) + 1 for v, h in zip(lo, hi, strict=True)))
    if count < box.numel:
        raise _Untraceable(
            f"parameter {call.param!r} reads {count} elements spread over a box of {box.numel}: not a box"
        )
    hit = torch.zeros(box.numel, dtype=torch.bool)
    for start in range(0, flats[0].numel(), _CHUNK):
        parts = [f[start : start + _CHUNK] - offset for f in flats]
        mask = (parts[0] >= 0) & (parts[0] < shape[0])
        index = torch.zeros(int(mask.sum()), dtype=torch.int64)
        for part, first, size in zip(parts, box.offsets, box.sizes, strict=True):
            index = index * size + (part[mask].to(torch.int64) - first)
        hit[index] = True
    if not bool(hit.all()):
        raise _Untraceable(f"parameter {call.param!r} reads elements that do not make a box (some read twice)")
    return box


def _union(boxes: list[Box], params: list[str]) -> Box | None:
    """The box several loader calls read together, if it is one."""
    if not boxes:
        return None
    first = boxes[0]
    if all(box == first for box in boxes):
        return first
    starts = [min(b.offsets[d] for b in boxes) for d in range(len(first.offsets))]
    ends = [max(b.offsets[d] + b.sizes[d] for b in boxes) for d in range(len(first.offsets))]
    outer = Box(tuple(starts), tuple(e - s for s, e in zip(starts, ends, strict=True)))
    hit = torch.zeros(outer.sizes, dtype=torch.bool)
    for box in boxes:
        box.within(outer).of(hit).fill_(True)
    if not bool(hit.all()):
        raise _Untraceable(f"parameters {params} read parts of it that together are not a box")
    return outer


__all__ = ["CheckpointParams", "Slices", "copy_loader", "derive_boxes"]
