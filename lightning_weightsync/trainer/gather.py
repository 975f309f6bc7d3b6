"""Stream a model's full (unsharded) weights one tensor at a time, named as the rollout expects.

Why streaming: the sender only ever needs one tensor at a time (it chunks it into buckets), so the
gather must never materialise the whole state dict. `iter_full_parameters` walks the module tree
and, per tensor, does the smallest collective that yields it whole:

- FSDP2 (`fully_shard`, DTensor parameters): `DTensor.full_tensor()` per parameter. It is a
  collective, so every rank runs it, in the same order (module traversal order, identical on every
  rank because every rank holds the same module tree); only `keep_on_rank` keeps the result.
  Peak extra memory: one full tensor (plus the all-gather's own buffer).
- FSDP1 (`FullyShardedDataParallel`, `use_orig_params` True or False): one FSDP unit at a time
  under `FSDP.summon_full_params(unit, recurse=False, writeback=False)`, the unit's own tensors
  yielded as views of the unsharded flat parameter. Peak extra memory: the largest FSDP unit (set
  by your wrap policy). The `FULL_STATE_DICT` + `offload_to_cpu=True` route is avoided on purpose:
  it materialises everything at once and segfaults on CPU with torch 2.13.
- DDP / DataParallel, `torch.compile`'d (`OptimizedModule`), activation-checkpoint wrappers and
  plain modules: the tensors are already whole; nothing is copied.

Ranks that do not keep the tensors yield nothing, but they must still exhaust the iterator (FSDP's
all-gathers need every rank): `drain(iter_full_parameters(model))` on ranks != `keep_on_rank`,
`sender.send_weights(iter_full_parameters(model), ...)` on the keeping rank.

Tensor lifetime: a yielded tensor may alias a live parameter or FSDP1's temporary unsharded storage
(which is freed when the iterator moves to the next FSDP unit). It is valid until the next item is
requested; `.clone()` it to keep it (this is the contract `split_weight_chunks` already honours).
Do not run forward/backward or an optimizer step while the iterator is suspended.

Names: `names.py` holds the rules (wrappers dropped, `prefix` selected and stripped, then
`trainer.names`: strip_prefixes, rename (exact), rename_regex, exclude); excluded tensors are skipped
before any collective. A tensor reachable under two names (tied weights) is sent once, under the
first name in module order (`names.tied_names` lists the others).
Finally, with `dtype`, floating-point tensors are cast one at a time (e.g. fp32 master weights to
bf16 for the rollout); integer and bool tensors keep their dtype.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import CAST_DTYPES, NamesConfig
from ..errors import ConfigError
from .names import NameMapper, SentNames, own_tensors, strip_wrapper_prefixes, walk_modules

log = logging.getLogger(__name__)

try:  # torch >= 2.5
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch 2.4
    from torch.distributed._tensor import DTensor

try:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
except ImportError:  # pragma: no cover - builds without distributed FSDP
    FSDP = None  # type: ignore[assignment,misc]

NamedTensor = tuple[str, torch.Tensor]


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """`trainer.dtype` (a name from the cast allow-list) or a torch dtype -> torch dtype."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in CAST_DTYPES:
        raise ConfigError(f"trainer.dtype={dtype!r} is not allowed; choose one of: {', '.join(CAST_DTYPES)}")
    resolved = getattr(torch, dtype)
    assert isinstance(resolved, torch.dtype)  # every CAST_DTYPES name is one
    return resolved


def cast_floating(tensor: torch.Tensor, cast: torch.dtype | None) -> torch.Tensor:
    """`trainer.dtype`'s rule: floating-point tensors to `cast`; integer and bool tensors keep their dtype."""
    if cast is not None and tensor.is_floating_point() and tensor.dtype != cast:
        return tensor.to(cast)
    return tensor


@dataclass(frozen=True)
class PendingGather:
    """A DTensor not gathered yet (`iter_full_parameters(defer_gather=True)`): whoever holds it gathers it
    later on a group of its own, so the training group's collectives are not needed now (overlap's
    background gather, trainer/overlap.py). `dtype` is what the full tensor is sent as (`trainer.dtype`
    applied: casting is element-wise, so casting the local shard first gives the same bytes)."""

    tensor: DTensor
    dtype: torch.dtype


def _is_fsdp1(module: nn.Module) -> bool:
    return FSDP is not None and isinstance(module, FSDP)


def walk_tensors(
    root: nn.Module, path: tuple[str, ...], stop: Callable[[nn.Module], bool], include_buffers: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """(raw name, tensor) in state-dict order: per module its parameters, then its persistent
    buffers. A tensor reachable under two names (tied weights) is yielded once, under the first."""
    seen: set[int] = set()  # ids of tensors that stay alive (they are module attributes) during the walk
    for mod_path, mod in walk_modules(root, path, stop):
        for attr, tensor in own_tensors(mod, include_buffers):
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            yield ".".join((*mod_path, attr)), tensor


def fsdp1_units(module: nn.Module) -> list[tuple[tuple[str, ...], nn.Module]]:
    if FSDP is None:
        return []
    return [(p, m) for p, m in walk_modules(module, (), lambda _: False) if _is_fsdp1(m)]


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@dataclass(frozen=True)
class _Emit:
    """The per-tensor step of `iter_full_parameters`: select and name it, then gather it (every rank: a
    collective) or defer the gather, and yield it on the keeping rank, cast."""

    named: SentNames
    cast: torch.dtype | None
    keep: bool
    select: Callable[[str], bool] | None
    defer_gather: bool

    def emit(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor | PendingGather]]:
        cast = self.cast
        for raw, tensor in tensors:
            if self.select is not None and not self.select(raw):
                continue
            name = self.named(raw)
            if name is None:
                continue
            if isinstance(tensor, DTensor) and self.defer_gather:
                sent_as = cast if cast is not None and tensor.is_floating_point() else tensor.dtype
                detached = tensor.detach()
                assert isinstance(detached, DTensor)  # torch types detach() as a Tensor; a DTensor's is a DTensor
                yield name, PendingGather(detached, sent_as)
                continue
            if isinstance(tensor, DTensor):
                with torch.no_grad():
                    full = tensor.full_tensor()  # a collective: every rank, same order
            elif not self.keep:
                continue
            else:
                full = tensor
            if not self.keep:
                del full
                continue
            yield name, cast_floating(full.detach(), cast)
            del full


def iter_full_parameters(
    module: nn.Module,
    *,
    include_buffers: bool = True,
    names_cfg: NamesConfig | Mapping[str, Any] | None = None,
    dtype: torch.dtype | str | None = None,
    keep_on_rank: int | None = 0,
    prefix: str | None = None,
    select: Callable[[str], bool] | None = None,
    defer_gather: bool = False,
) -> Iterator[tuple[str, Any]]:
    """Yield `(name, full_tensor)` for every parameter (and persistent buffer) of `module`.

    Args:
        module: the model as training holds it: FSDP1/FSDP2/DDP-wrapped, compiled, or plain. For
            FSDP1 pass the root wrapper (what the strategy trains), not an inner submodule.
        include_buffers: also yield persistent buffers (`trainer.include_buffers`).
        names_cfg: `cfg.trainer.names` (strip_prefixes, rename, rename_regex, exclude); see names.py.
        dtype: cast floating-point tensors to this dtype (`trainer.dtype`), one tensor at a time.
        keep_on_rank: the global rank that receives the tensors; every other rank yields nothing
            but must still exhaust the iterator (see `drain`). None: every rank yields.
        prefix: keep only tensors under this submodule path (e.g. the LightningModule attribute
            ``"model"``) and strip it from their names.
        select: keep only tensors whose raw (wrapper-free, unprefixed) name it accepts, decided before
            the collective, so it must decide alike on every rank (`trainer/lora.py` sends only an adapter).
        defer_gather: yield each DTensor on every rank as a `PendingGather` instead of gathering it (no
            collective runs in the walk; FSDP1 is not deferred); other tensors as without it.

    Raises:
        ConfigError: a bad `names_cfg`/`dtype`, or two tensors mapped to the same name (raised on
            every rank at the same point, so no rank is left waiting in a collective).
    """
    named = SentNames(NameMapper.from_config(names_cfg, prefix=prefix))
    keep = keep_on_rank is None or _global_rank() == keep_on_rank
    emit = _Emit(named, resolve_dtype(dtype), keep, select, defer_gather).emit

    units = fsdp1_units(module)
    if not units:
        yield from emit(walk_tensors(module, (), lambda _: False, include_buffers))
        return
    # FSDP1: tensors outside every FSDP unit first, then one unit at a time (pre-order, so a root
    # unit is lazily initialised before its children are summoned).
    if not _is_fsdp1(module):
        yield from emit(walk_tensors(module, (), _is_fsdp1, include_buffers))
    assert FSDP is not None
    for path, unit in units:
        with FSDP.summon_full_params(unit, recurse=False, writeback=False):
            # the unit's own tensors: stop at nested units, they are summoned on their own turn
            yield from emit(walk_tensors(unit, path, _is_fsdp1, include_buffers))


def yields_stable_tensors(module: nn.Module) -> bool:
    """Whether `iter_full_parameters(module)` yields tensors whose memory it does not reuse for the
    next one, so a sender may still read a tensor while the next is gathered (overlap). FSDP2's
    `full_tensor()` allocates afresh and plain/DDP parameters are untouched during a sync; FSDP1's
    `summon_full_params` views are freed and reused unit by unit, so they are not stable."""
    return not fsdp1_units(module)


def is_sharded(module: nn.Module) -> bool:
    """Whether `module` is FSDP-sharded (FSDP1 units or FSDP2 DTensor parameters), i.e. whether the
    gather has collectives to run."""
    return bool(fsdp1_units(module)) or any(isinstance(p, DTensor) for p in module.parameters())


def drain(weights: Iterable[Any]) -> int:
    """Exhaust `weights` (what ranks that do not send do with `iter_full_parameters`); returns the count."""
    count = 0
    for _ in weights:
        count += 1
    return count


def named_full_state_dict(module: nn.Module, **kwargs: Any) -> dict[str, torch.Tensor]:
    """The whole gathered stream as a dict of clones (for tests, debugging and small models only).

    This holds every tensor at once, which `iter_full_parameters` exists to avoid; never use it on
    a model that does not fit in memory twice.
    """
    return {name: tensor.clone() for name, tensor in iter_full_parameters(module, **kwargs)}


__all__: Sequence[str] = (
    "DTensor",  # this torch's DTensor class (torch 2.4 keeps it in a private module)
    "NameMapper",
    "PendingGather",
    "drain",
    "is_sharded",
    "iter_full_parameters",
    "named_full_state_dict",
    "resolve_dtype",
    "strip_wrapper_prefixes",
    "yields_stable_tensors",
)
