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

Names: the wrapper components (`_fsdp_wrapped_module`, `_orig_mod`, `_checkpoint_wrapped_module`,
and DDP's `module`) are dropped from the module path by type, then `prefix` (the attribute of a
LightningModule that holds the served network, e.g. ``"model"``) selects that submodule and strips
it, then the config's `trainer.names` applies, in this order:
``strip_prefixes`` (plain string prefixes, the first that matches is removed), ``rename`` (regular
expressions, `re.sub(pattern, replacement, name, count=1)` applied in order, each to the previous
result; anchor them with ``^``/``$``), then ``exclude`` (shell-style `fnmatch` patterns matched
against the final name, i.e. the name as sent). Excluded tensors are skipped before any collective.
Finally, with `dtype`, floating-point tensors are cast one at a time (e.g. fp32 master weights to
bf16 for the rollout); integer and bool tensors keep their dtype.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import CAST_DTYPES
from ..errors import ConfigError

log = logging.getLogger(__name__)

try:  # torch >= 2.5
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch 2.4
    from torch.distributed._tensor import DTensor  # type: ignore[no-redef]

try:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp._flat_param import FlatParameter
except ImportError:  # pragma: no cover - builds without distributed FSDP
    FSDP = None  # type: ignore[assignment,misc]
    FlatParameter = None  # type: ignore[assignment,misc]

# Attribute names under which wrappers hold the wrapped module; always dropped from names.
WRAPPER_ATTRS = ("_fsdp_wrapped_module", "_orig_mod", "_checkpoint_wrapped_module")
# DDP / DataParallel hold the wrapped module as `module`; dropped only when the parent is one of them.
DDP_ATTR = "module"

NamedTensor = tuple[str, torch.Tensor]


def strip_wrapper_prefixes(name: str) -> str:
    """Drop wrapper components from a dotted name that came from anywhere (e.g. a state dict key).

    `_fsdp_wrapped_module`, `_orig_mod` and `_checkpoint_wrapped_module` are dropped wherever they
    occur; `module` only as a *leading* component (a DDP/Accelerate wrapper at the root), because a
    real submodule may well be called `module` deeper down. `iter_full_parameters` does not need
    this: it drops wrappers by type while walking the tree, which is exact.
    """
    parts = [p for p in name.split(".") if p not in WRAPPER_ATTRS]
    while len(parts) > 1 and parts[0] == DDP_ATTR:
        parts = [p for p in parts[1:] if p not in WRAPPER_ATTRS]
    return ".".join(parts)


def _strip_module_prefix(name: str, prefix: str) -> str | None:
    """`name` relative to the submodule `prefix`, or None when it lies outside it."""
    if not prefix:
        return name
    head = prefix.rstrip(".") + "."
    return name[len(head) :] if name.startswith(head) else None


@dataclass(frozen=True)
class NameMapper:
    """The raw (wrapper-free) module path of a tensor -> the name sent, or None to skip it.

    Built once from `trainer.names`; the same decisions on every rank, so skipping before a
    collective keeps the ranks in step.
    """

    prefix: str | None = None
    strip_prefixes: tuple[str, ...] = ()
    rename: tuple[tuple[re.Pattern[str], str], ...] = ()
    exclude: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, names_cfg: Mapping[str, Any] | Any | None = None, *, prefix: str | None = None) -> NameMapper:
        """`names_cfg` is `cfg.trainer.names` (DictConfig, dataclass or plain mapping) or None."""
        if names_cfg is None:
            return cls(prefix=prefix or None)
        get = names_cfg.get if isinstance(names_cfg, Mapping) or hasattr(names_cfg, "get") else None

        def field(key: str) -> Any:
            return get(key, None) if get is not None else getattr(names_cfg, key, None)

        strip = tuple(str(p) for p in (field("strip_prefixes") or ()))
        if any(not p for p in strip):
            raise ConfigError("trainer.names.strip_prefixes contains an empty prefix; remove it")
        rename: list[tuple[re.Pattern[str], str]] = []
        for pattern, repl in dict(field("rename") or {}).items():
            try:
                rename.append((re.compile(str(pattern)), str(repl)))
            except re.error as exc:
                raise ConfigError(
                    f"trainer.names.rename key {pattern!r} is not a valid regular expression: {exc}"
                ) from None
        exclude = tuple(str(p) for p in (field("exclude") or ()))
        return cls(prefix=prefix or None, strip_prefixes=strip, rename=tuple(rename), exclude=exclude)

    def __call__(self, name: str) -> str | None:
        if self.prefix is not None:
            stripped = _strip_module_prefix(name, self.prefix)
            if stripped is None:
                return None
            name = stripped
        for p in self.strip_prefixes:
            if name.startswith(p):
                name = name[len(p) :]
                break
        for pattern, repl in self.rename:
            try:
                name = pattern.sub(repl, name, count=1)
            except re.error as exc:  # a bad group reference in the replacement
                raise ConfigError(
                    f"trainer.names.rename {pattern.pattern!r} -> {repl!r} failed on {name!r}: {exc}"
                ) from None
        if not name:
            raise ConfigError("trainer.names strip_prefixes/rename turned a tensor name into ''; check them")
        if any(fnmatch.fnmatchcase(name, pat) for pat in self.exclude):
            return None
        return name


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """`trainer.dtype` (a name from the cast allow-list) or a torch dtype -> torch dtype."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in CAST_DTYPES:
        raise ConfigError(f"trainer.dtype={dtype!r} is not allowed; choose one of: {', '.join(CAST_DTYPES)}")
    return getattr(torch, dtype)


def _is_fsdp1(module: nn.Module) -> bool:
    return FSDP is not None and isinstance(module, FSDP)


def _is_wrapper_edge(parent: nn.Module, attr: str) -> bool:
    if attr in WRAPPER_ATTRS:
        return True
    return attr == DDP_ATTR and isinstance(parent, (nn.parallel.DistributedDataParallel, nn.DataParallel))


def _walk_modules(
    module: nn.Module, path: tuple[str, ...], stop: Callable[[nn.Module], bool]
) -> Iterator[tuple[tuple[str, ...], nn.Module]]:
    """Pre-order (path, module), paths without wrapper components; children for which `stop` is
    true are neither yielded nor entered."""
    yield path, module
    for attr, child in module._modules.items():
        if child is None or stop(child):
            continue
        yield from _walk_modules(child, path if _is_wrapper_edge(module, attr) else (*path, attr), stop)


def _walk_tensors(
    root: nn.Module, path: tuple[str, ...], stop: Callable[[nn.Module], bool], include_buffers: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """(raw name, tensor) in state-dict order: per module its parameters, then its persistent
    buffers. A tensor reachable under two names (tied weights) is yielded once, under the first."""
    seen: set[int] = set()  # ids of tensors that stay alive (they are module attributes) during the walk
    for mod_path, mod in _walk_modules(root, path, stop):
        named: list[tuple[str, torch.Tensor | None]] = list(mod._parameters.items())
        if include_buffers:
            named += [(n, b) for n, b in mod._buffers.items() if n not in mod._non_persistent_buffers_set]
        for attr, tensor in named:
            if tensor is None or (FlatParameter is not None and isinstance(tensor, FlatParameter)):
                continue
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            yield ".".join((*mod_path, attr)), tensor


def _fsdp1_units(module: nn.Module) -> list[tuple[tuple[str, ...], nn.Module]]:
    if FSDP is None:
        return []
    return [(p, m) for p, m in _walk_modules(module, (), lambda _: False) if _is_fsdp1(m)]


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def iter_full_parameters(
    module: nn.Module,
    *,
    include_buffers: bool = True,
    names_cfg: Mapping[str, Any] | Any | None = None,
    dtype: torch.dtype | str | None = None,
    keep_on_rank: int | None = 0,
    prefix: str | None = None,
) -> Iterator[NamedTensor]:
    """Yield `(name, full_tensor)` for every parameter (and persistent buffer) of `module`.

    Args:
        module: the model as training holds it: FSDP1/FSDP2/DDP-wrapped, compiled, or plain. For
            FSDP1 pass the root wrapper (what the strategy trains), not an inner submodule.
        include_buffers: also yield persistent buffers (`trainer.include_buffers`).
        names_cfg: `cfg.trainer.names` (strip_prefixes, rename, exclude); see the module docstring.
        dtype: cast floating-point tensors to this dtype (`trainer.dtype`), one tensor at a time.
        keep_on_rank: the global rank that receives the tensors; every other rank yields nothing
            but must still exhaust the iterator (see `drain`). None: every rank yields.
        prefix: keep only tensors under this submodule path (e.g. the LightningModule attribute
            ``"model"``) and strip it from their names.

    Raises:
        ConfigError: a bad `names_cfg`/`dtype`, or two tensors mapped to the same name (raised on
            every rank at the same point, so no rank is left waiting in a collective).
    """
    mapper = NameMapper.from_config(names_cfg, prefix=prefix)
    cast = resolve_dtype(dtype)
    keep = keep_on_rank is None or _global_rank() == keep_on_rank
    emitted: dict[str, str] = {}  # name sent -> raw name, to report collisions

    def emit(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[NamedTensor]:
        for raw, tensor in tensors:
            name = mapper(raw)
            if name is None:
                continue
            if name in emitted:
                raise ConfigError(
                    f"tensors {emitted[name]!r} and {raw!r} are both sent as {name!r}; "
                    "fix trainer.names.rename / strip_prefixes"
                )
            emitted[name] = raw
            if isinstance(tensor, DTensor):
                with torch.no_grad():
                    full = tensor.full_tensor()  # a collective: every rank, same order
            elif not keep:
                continue
            else:
                full = tensor
            if not keep:
                del full
                continue
            full = full.detach()
            if cast is not None and full.is_floating_point() and full.dtype != cast:
                full = full.to(cast)
            yield name, full
            del full

    units = _fsdp1_units(module)
    if not units:
        yield from emit(_walk_tensors(module, (), lambda _: False, include_buffers))
        return
    # FSDP1: tensors outside every FSDP unit first, then one unit at a time (pre-order, so a root
    # unit is lazily initialised before its children are summoned).
    if not _is_fsdp1(module):
        yield from emit(_walk_tensors(module, (), _is_fsdp1, include_buffers))
    assert FSDP is not None
    for path, unit in units:
        with FSDP.summon_full_params(unit, recurse=False, writeback=False):
            # the unit's own tensors: stop at nested units, they are summoned on their own turn
            yield from emit(_walk_tensors(unit, path, _is_fsdp1, include_buffers))


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
    "NameMapper",
    "drain",
    "iter_full_parameters",
    "named_full_state_dict",
    "resolve_dtype",
    "strip_wrapper_prefixes",
)
