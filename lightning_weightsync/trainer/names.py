"""Naming rules: a trainer-side module path -> the name the rollout expects, decided once per name.

Why a module of its own: names are the first thing a new user gets wrong (a LightningModule holds
the network as `self.model`, the rollout's model has no `model.` prefix), and every integration
(Lightning, Accelerate, `iter_full_parameters` used directly) must apply exactly the same rules on
every rank, or ranks would skip different tensors and deadlock in FSDP's collectives.

The rules, in order:

1. wrapper components (`_fsdp_wrapped_module`, `_orig_mod`, `_checkpoint_wrapped_module`, DDP's
   leading `module`) are dropped (by type while walking a module tree, by name in
   `strip_wrapper_prefixes`);
2. `prefix` (the LightningModule attribute that holds the served network, e.g. ``"model"``)
   selects that submodule and is stripped; `served_child` finds it when it is not given;
3. `trainer.names.strip_prefixes`: plain string prefixes, the first that matches is removed;
4. `trainer.names.rename`: exact renames, ``{old_name: new_name}``; only a whole name matches;
5. `trainer.names.rename_regex`: ``{pattern: replacement}``, ``re.sub`` (every match) applied in
   order, each to the previous result; anchor with ``^``/``$``;
6. `trainer.names.exclude`: shell-style `fnmatch` patterns matched against the final name.

Tied weights (one tensor reachable under two names, e.g. ``lm_head.weight`` and
``model.embed_tokens.weight`` with ``tie_word_embeddings``) are sent once, under the first name in
module order; `tied_names` lists the other names each sent tensor is also known as.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config import NamesConfig
from ..errors import ConfigError

try:
    from torch.distributed.fsdp._flat_param import FlatParameter
except ImportError:  # pragma: no cover - builds without distributed FSDP
    FlatParameter = None  # type: ignore[assignment,misc]

# Attribute names under which wrappers hold the wrapped module; always dropped from names.
WRAPPER_ATTRS = ("_fsdp_wrapped_module", "_orig_mod", "_checkpoint_wrapped_module")
# DDP / DataParallel hold the wrapped module as `module`; dropped only when the parent is one of them.
DDP_ATTR = "module"


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
    rename: tuple[tuple[str, str], ...] = ()
    rename_regex: tuple[tuple[re.Pattern[str], str], ...] = ()
    exclude: tuple[str, ...] = ()

    @classmethod
    def from_config(
        cls, names_cfg: NamesConfig | Mapping[str, Any] | None = None, *, prefix: str | None = None
    ) -> NameMapper:
        """`names_cfg` is the typed `trainer.names` section (`NamesConfig`), a plain mapping of the same keys
        (a caller of `iter_full_parameters` outside an integration), or None."""
        if names_cfg is None:
            return cls(prefix=prefix or None)
        section = names_cfg

        def field(key: str) -> Any:
            return section.get(key, None) if isinstance(section, Mapping) else getattr(section, key, None)

        strip = tuple(str(p) for p in (field("strip_prefixes") or ()))
        if any(not p for p in strip):
            raise ConfigError("trainer.names.strip_prefixes contains an empty prefix; remove it")
        rename = tuple((str(k), str(v)) for k, v in dict(field("rename") or {}).items())
        if any(not new for _, new in rename):
            raise ConfigError("trainer.names.rename maps a name to ''; use trainer.names.exclude to drop a tensor")
        regex: list[tuple[re.Pattern[str], str]] = []
        for pattern, repl in dict(field("rename_regex") or {}).items():
            try:
                regex.append((re.compile(str(pattern)), str(repl)))
            except re.error as exc:
                raise ConfigError(
                    f"trainer.names.rename_regex key {pattern!r} is not a valid regular expression: {exc}"
                ) from None
        exclude = tuple(str(p) for p in (field("exclude") or ()))
        return cls(
            prefix=prefix or None, strip_prefixes=strip, rename=rename, rename_regex=tuple(regex), exclude=exclude
        )

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
        for old, new in self.rename:
            if name == old:
                name = new
                break
        for pattern, repl in self.rename_regex:
            try:
                name = pattern.sub(repl, name)
            except re.error as exc:  # a bad group reference in the replacement
                raise ConfigError(
                    f"trainer.names.rename_regex {pattern.pattern!r} -> {repl!r} failed on {name!r}: {exc}"
                ) from None
        if not name:
            raise ConfigError(
                "trainer.names strip_prefixes/rename/rename_regex turned a tensor name into ''; check them"
            )
        if any(fnmatch.fnmatchcase(name, pat) for pat in self.exclude):
            return None
        return name


# --------------------------------------------------------------------------------- the module tree


def is_wrapper_edge(parent: nn.Module, attr: str) -> bool:
    if attr in WRAPPER_ATTRS:
        return True
    return attr == DDP_ATTR and isinstance(parent, (nn.parallel.DistributedDataParallel, nn.DataParallel))


class SentNames:
    """`NameMapper` plus the rule that two tensors are never sent under one name: every stream that names
    tensors (the gather, the sharded send) checks it the same way, on every rank at the same point."""

    def __init__(self, mapper: NameMapper) -> None:
        self.mapper = mapper
        self.emitted: dict[str, str] = {}  # name sent -> raw name, to report collisions

    def __call__(self, raw: str) -> str | None:
        name = self.mapper(raw)
        if name is None:
            return None
        if name in self.emitted:
            raise ConfigError(
                f"tensors {self.emitted[name]!r} and {raw!r} are both sent as {name!r}; "
                "fix trainer.names.rename / rename_regex / strip_prefixes"
            )
        self.emitted[name] = raw
        return name


def walk_modules(
    module: nn.Module, path: tuple[str, ...], stop: Callable[[nn.Module], bool]
) -> Iterator[tuple[tuple[str, ...], nn.Module]]:
    """Pre-order (path, module), paths without wrapper components; children for which `stop` is
    true are neither yielded nor entered."""
    yield path, module
    for attr, child in module._modules.items():
        if child is None or stop(child):
            continue
        yield from walk_modules(child, path if is_wrapper_edge(module, attr) else (*path, attr), stop)


def own_tensors(mod: nn.Module, include_buffers: bool) -> list[tuple[str, torch.Tensor]]:
    """A module's own parameters and (persistent) buffers, in state-dict order; FSDP1 flat params skipped."""
    named: list[tuple[str, torch.Tensor | None]] = list(mod._parameters.items())
    if include_buffers:
        named += [(n, b) for n, b in mod._buffers.items() if n not in mod._non_persistent_buffers_set]
    return [
        (n, t) for n, t in named if t is not None and not (FlatParameter is not None and isinstance(t, FlatParameter))
    ]


def tied_names(
    module: nn.Module,
    *,
    include_buffers: bool = True,
    names_cfg: NamesConfig | Mapping[str, Any] | None = None,
    prefix: str | None = None,
) -> dict[str, tuple[str, ...]]:
    """{name sent: (other names of the same tensor, as mapped)} for every tensor reachable under
    more than one name. Local and cheap (no collectives): safe to call on any rank, any time.

    The first name in module order is the one `iter_full_parameters` sends; an alias that the
    rules exclude is not listed, nor is one that maps to the sent name itself.
    """
    mapper = NameMapper.from_config(names_cfg, prefix=prefix)
    first: dict[int, str | None] = {}
    groups: dict[str, list[str]] = {}
    for mod_path, mod in walk_modules(module, (), lambda _: False):
        for attr, tensor in own_tensors(mod, include_buffers):
            name = mapper(".".join((*mod_path, attr)))
            key = id(tensor)
            if key not in first:
                first[key] = name
                continue
            sent = first[key]
            if sent is None:  # the first name is excluded; the gather skips the tensor altogether
                continue
            if name is not None and name != sent and name not in groups.get(sent, ()):
                groups.setdefault(sent, []).append(name)
    return {sent: tuple(aliases) for sent, aliases in groups.items()}


def served_child(module: nn.Module, *, include_buffers: bool = True) -> str | None:
    """The attribute of `module` that holds the network to serve, when the rule decides it, else None.

    The rule (`WeightSyncCallback(cfg)` with no `module_attr`): when `module` has no tensors of its
    own and exactly one direct child holds parameters or persistent buffers (``self.model = ...``,
    loss modules and metrics without state do not count), that child is the served network and its
    attribute name is stripped from every name. Anything else (two networks, a tensor on the
    LightningModule itself): None, i.e. send the whole module under its state-dict names.
    """
    if own_tensors(module, include_buffers):
        return None

    def holds_tensors(child: nn.Module) -> bool:
        return any(own_tensors(m, include_buffers) for _, m in walk_modules(child, (), lambda _: False))

    holders = [attr for attr, child in module._modules.items() if child is not None and holds_tensors(child)]
    return holders[0] if len(holders) == 1 else None


__all__: Sequence[str] = (
    "DDP_ATTR",
    "WRAPPER_ATTRS",
    "NameMapper",
    "served_child",
    "strip_wrapper_prefixes",
    "tied_names",
    "walk_modules",
)
