"""Sharded send mode, the trainer's half: what each rank owns, and what the ranks tell each other.

    every rank:  iter_local_shards(model)    its own bytes of every tensor, from the DTensor placements
                 and mesh (`LocalShards`): a tensor's local box (FSDP2 / TP `Shard`, uneven as torch cuts
                 it) and how many ranks hold that same box (the mesh's Replicate dims, and the copies of
                 a mesh that covers a subset of the ranks: FSDP2 on a data-parallel submesh, HSDP's
                 replicate dim, plain tensors on every rank); of a box held by R ranks each sends one
                 of R stripes, so exactly one rank sends each byte and every rank sends. One small
                 all-gather per version carries each rank's meshes and the fingerprints of the tensors
                 it holds whole (which must agree). A layout it cannot send (`Partial`, a strided box)
                 is a ConfigError on every rank before anything is sent. FSDP1 flat parameters: their
                 slices, with no collective (`_fsdp1_local_shards`).
    at start:    exchange_addresses          each rank's control endpoint, to every rank (rank 0 lists
                                             the others in its plans)
    per version: MembersRelay                rank 0's gathered receivers, to every other rank (each serves
                                             exactly those)

The two exchanges are tiny collectives on the trainer's own default process group (JSON in a uint8
tensor: nothing is pickled), run while every rank is inside the same sync.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import NamesConfig
from ..errors import ConfigError
from ..protocol.chunks import TensorShard
from .gather import DTensor, cast_floating, fsdp1_units, resolve_dtype, walk_tensors
from .names import NameMapper, SentNames, own_tensors, walk_modules

logger = logging.getLogger(__name__)

ADDRESS_BYTES = 512  # a rank's JSON [host, port] fits (hosts are bounded at 256 on the wire)


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def exchange_addresses(host: str, port: int, device: torch.device | None) -> list[tuple[str, int]]:
    """Every rank's control endpoint, in rank order (an all-gather: call on every rank)."""
    mine = json.dumps([host, port]).encode()
    if len(mine) > ADDRESS_BYTES:
        raise ConfigError(f"transport.sender_host {host[:80]!r} is too long ({len(mine)} bytes)")
    _rank, world = _world()
    if world == 1:
        return [(host, port)]
    buf = torch.zeros(ADDRESS_BYTES, dtype=torch.uint8, device=device)
    buf[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    parts = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(parts, buf)
    out = []
    for part in parts:
        raw = bytes(part.cpu().tolist()).rstrip(b"\0")
        got_host, got_port = json.loads(raw)
        out.append((str(got_host), int(got_port)))
    return out


def _broadcast_json(value: Any, device: torch.device | None, group: Any = None) -> Any:
    """`value` from rank 0 on every rank (None elsewhere going in); on `group` (None: the default one)."""
    rank, _ = _world()
    payload = json.dumps(value).encode() if rank == 0 else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0, group=group)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if rank == 0 and payload:
        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(buf, src=0, group=group)
    return json.loads(bytes(buf.cpu().tolist()))


class MembersRelay:
    """Rank 0's receivers of one version, to every other rank, exactly once per sync.

    Rank 0 calls it from inside its send (once it gathered the receivers), or `finish()` afterwards
    when the send never got that far ([]: the other ranks send nothing); the other ranks call
    `receive()` before they send. One broadcast per sync on every rank, whatever failed.

    `group`: the process group it broadcasts on (None: the default one). A background send
    (trainer.overlap) passes a gloo group of its own: training owns the default group meanwhile."""

    def __init__(self, device: torch.device | None, group: Any = None) -> None:
        self.device = device
        self.group = group
        self.sent = False

    def __call__(self, members: list[str]) -> None:
        if not self.sent:
            self.sent = True
            _broadcast_json(list(members), self.device, self.group)

    def finish(self) -> None:
        self(list())

    def receive(self) -> list[str]:
        got = _broadcast_json(None, self.device, self.group)
        if not isinstance(got, list) or not all(isinstance(m, str) for m in got):
            raise ConfigError("the sharded members exchange returned garbage (trainer ranks out of step?)")
        return got


GATHER_KNOB = "trainer.send_mode=gather"


def _mesh_text(mesh: Any) -> str:
    names = f" {tuple(mesh.mesh_dim_names)}" if getattr(mesh, "mesh_dim_names", None) else ""
    return f"a {'x'.join(str(n) for n in mesh.mesh.shape)} mesh{names} of global ranks {mesh.mesh.tolist()}"


def _refused(raw: str, tensor: Any, why: str) -> ConfigError:
    return ConfigError(
        f"trainer.send_mode=sharded cannot send {raw!r}: it is placed {tuple(tensor.placements)} on "
        f"{_mesh_text(tensor.device_mesh)}; {why}; use {GATHER_KNOB}"
    )


@dataclass
class _Held:
    """One tensor as this rank holds it: its box of the whole tensor (per-dim offsets and sizes) and who
    else holds the same box (`mesh_key`: the ranks of its mesh, None for a plain tensor; `replicas` and
    `replica`: the count and this rank's index over the mesh's Replicate dims)."""

    raw: str
    name: str
    local: torch.Tensor
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    mesh_key: tuple[int, ...] | None
    replicas: int
    replica: int

    @property
    def whole(self) -> bool:
        return self.sizes == self.shape


def _held(raw: str, name: str, tensor: Any) -> _Held:
    """What this rank holds of `tensor`, from its DTensor placements and mesh (refused: a layout whose
    local bytes are not one contiguous byte range of the whole tensor, or are not the tensor's at all)."""
    if not isinstance(tensor, DTensor):
        shape = tuple(tensor.shape)
        return _Held(raw, name, tensor.detach(), shape, (0,) * len(shape), shape, None, 1, 0)
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    shape, placements, mesh = tuple(tensor.shape), tuple(tensor.placements), tensor.device_mesh
    for placement in placements:
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, (Shard, _StridedShard)):  # _StridedShard: FSDP2 over TP (a box still)
            pending = type(placement).__name__ == "Partial"
            why = "no rank holds the tensor's bytes (a pending reduction)" if pending else "an unknown placement"
            raise _refused(raw, tensor, why)
        if any(size != 1 for size in shape[: placement.dim]):
            raise _refused(raw, tensor, f"a Shard({placement.dim}) local shard of a {list(shape)} tensor is a strided "
                                        "box, not one byte range (only Shard(0), and Shard(d) after size-1 dims, are "
                                        "sent)")  # fmt: skip
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise _refused(raw, tensor, f"global rank {_world()[0]} is not in that mesh")
    local = tensor.to_local().detach()
    local_shape, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    if tuple(local.shape) != tuple(local_shape):
        raise _refused(raw, tensor, f"its local shard is {list(local.shape)}, the placements say {list(local_shape)}")
    replicas, replica = 1, 0
    for dim, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            replicas, replica = replicas * mesh.size(dim), replica * mesh.size(dim) + coordinate[dim]
    key = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    return _Held(raw, name, local, shape, tuple(offsets), tuple(local_shape), key, replicas, replica)


def _all_gather_json(value: Any, device: torch.device | None) -> list[Any]:
    """`value` of every rank, in rank order (two tiny all-gathers: the sizes, then the padded payloads)."""
    _rank, world = _world()
    payload = json.dumps(value).encode()
    if world == 1:
        return [json.loads(payload)]
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8, device=device)
    buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    parts = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(parts, buf)
    return [json.loads(bytes(part.cpu().tolist()[: int(n.item())])) for part, n in zip(parts, sizes, strict=True)]


def mesh_copies(meshes: list[list[list[int]]], world: int) -> list[list[tuple[int, ...]]]:
    """Per mesh (in first-use order), the copies of it that the ranks hold: a tensor whose mesh covers a
    subset of the ranks (FSDP2 on a data-parallel submesh) is held alike by every copy. The copies must
    partition the ranks, or the ranks do not agree on who holds what."""
    if len({len(m) for m in meshes}) != 1:
        raise ConfigError(
            f"trainer.send_mode=sharded: the trainer ranks place their tensors on different numbers of meshes "
            f"({[len(m) for m in meshes]}, by rank); use {GATHER_KNOB}"
        )
    out = []
    for index in range(len(meshes[0])):
        copies = sorted({tuple(m[index]) for m in meshes})
        covered = sorted(r for copy in copies for r in copy)
        if covered != list(range(world)) or len({len(c) for c in copies}) != 1:
            raise ConfigError(
                f"trainer.send_mode=sharded: a mesh's copies over the trainer ranks ({[list(c) for c in copies]}) "
                f"do not split the {world} ranks into equal parts, so the ranks cannot agree who sends which "
                f"bytes; use {GATHER_KNOB}"
            )
        out.append(copies)
    return out


class ReplicaDrift:
    """Tensors every trainer rank holds whole whose copies differ. Real replicas drift: two ranks that
    compute the same step apart (ModelParallelStrategy's defaults on 2 devices: 1 x 2, no TP plan) end
    a few ulps apart (1.9e-9 on a norm bias after one step). That is the model's, not ours, so it is
    reported rather than fatal: one WARNING per tensor (the ranks and the largest absolute difference,
    which costs one broadcast of that tensor the first time), and `last` / `total` counted for
    `SendStats.replica_drift` and the metrics. The caller keeps one per run, so the warning is once."""

    def __init__(self) -> None:
        self.warned: set[str] = set()
        self.last = 0  # tensors sent from global rank 0 because copies differed, in the latest version
        self.total = 0

    def seen(self, version: int | None, names: list[str], values: list[list[Any]], locals_: list[torch.Tensor]) -> None:
        """Called on every rank alike with the same `names` (from the all-gathered fingerprints): the
        largest-difference collective runs on every rank or on none."""
        self.last = len(names)
        self.total += len(names)
        for name, by_rank, local in zip(names, values, locals_, strict=True):
            if name in self.warned:
                continue
            self.warned.add(name)
            largest = _largest_differences(local)  # collective: every rank, then global rank 0 says it
            if _world()[0] != 0:
                continue
            groups: dict[Any, list[int]] = {}
            for rank, value in enumerate(by_rank):
                groups.setdefault(value, []).append(rank)
            logger.warning(
                "version %s: %r, which every trainer rank holds whole, differs between ranks (%s; largest absolute "
                "difference from global rank 0's copy: %s): trainer.send_mode=sharded sends global rank 0's, as "
                "gather mode does; counted in SendStats.replica_drift and weightsync/replica_drift (this warning is "
                "once per tensor)",
                version, name, ", ".join(f"ranks {ranks}" for ranks in groups.values()),
                ", ".join(f"rank {r}: {d:.3g}" for r, d in enumerate(largest)),
            )  # fmt: skip


def _largest_differences(local: torch.Tensor) -> list[float]:
    """Per rank, max |its copy - global rank 0's| (a broadcast of the tensor, then an all-gather of one
    float; call on every rank)."""
    _rank, world = _world()
    reference = local.detach().clone()
    dist.broadcast(reference, src=0)
    mine = (local.detach().double() - reference.double()).abs().max() if local.numel() else torch.zeros(())
    out = mine.reshape(1).to(local.device)
    parts = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(parts, out)
    return [float(p.item()) for p in parts]


class LocalShards:
    """This rank's part of one sharded version, planned before anything is sent (on every rank alike):

    1. walk the tensors (the names, exclusions and cast of `iter_full_parameters`); each one's box and
       holders come from its DTensor placements and mesh, and a layout that cannot be sent is a
       ConfigError here, on every rank, before any collective or socket;
    2. one small all-gather (JSON): each rank's meshes (so every rank knows the copies of a mesh that
       covers a subset of the ranks) and the fingerprint of every tensor it holds whole;
    3. a tensor held whole by every rank whose copies differ (replicas drift by rounding: two ranks
       that compute the same step apart) goes whole from global rank 0, the rank gather mode reads it
       from, so the version never mixes ranks' values; `ReplicaDrift` warns once per tensor and counts;
    4. `__iter__`: of a box held by R ranks, each sends one of R stripes (the box split along its first
       dim of more than one element, stripe p from replica (p + i) mod R for the i-th tensor, so small
       tensors spread over the ranks too): exactly one rank sends each byte, and every rank sends.
       Copies proven equal in 3 may be striped; shards of a box held by several replicas (HSDP's
       replicate dim) are not fingerprinted and are striped too (docs/concepts.md says why that is safe)."""

    def __init__(
        self,
        module: nn.Module,
        device: torch.device | None,
        *,
        include_buffers: bool = True,
        names_cfg: NamesConfig | Mapping[str, Any] | None = None,
        dtype: torch.dtype | str | None = None,
        prefix: str | None = None,
        version: int | None = None,
        drift: ReplicaDrift | None = None,
    ) -> None:
        from ..protocol.fingerprint import replica_digest

        self.drift = drift if drift is not None else ReplicaDrift()
        named = SentNames(NameMapper.from_config(names_cfg, prefix=prefix))
        self.cast = resolve_dtype(dtype)
        self.rank, self.world = _world()
        self.items: list[_Held] = []
        for raw, tensor in walk_tensors(module, (), lambda _: False, include_buffers):  # 1
            name = named(raw)
            if name is not None:
                self.items.append(_held(raw, name, tensor))
        keys = list(dict.fromkeys(h.mesh_key for h in self.items if h.mesh_key is not None))
        whole = self.world > 1  # a single rank has nobody to disagree with
        digests = [replica_digest(h.local) if whole and h.whole else None for h in self.items]
        mine = {"meshes": [list(k) for k in keys], "fingerprints": digests}
        everyone = _all_gather_json(mine, device)  # 2
        copies = mesh_copies([e["meshes"] for e in everyone], self.world) if keys else []
        self.holders: list[tuple[int, int]] = []  # per item: (how many ranks hold its box, this rank's index)
        for held in self.items:
            if held.mesh_key is None:  # a plain tensor: every rank holds it whole
                self.holders.append((self.world, self.rank))
                continue
            these = copies[keys.index(held.mesh_key)]
            copy = these.index(held.mesh_key)
            self.holders.append((len(these) * held.replicas, copy * held.replicas + held.replica))
        self._check_same(everyone, version)  # 3

    def _check_same(self, everyone: list[Any], version: int | None) -> None:
        values = [[e["fingerprints"][index] for e in everyone] for index in range(len(self.items))]
        differ = [i for i, v in enumerate(values) if None not in v and len(set(v)) > 1]
        self.drift.seen(version, [self.items[i].name for i in differ], [values[i] for i in differ],
                        [self.items[i].local for i in differ])  # fmt: skip
        self.first_rank_only = set(differ)

    def __iter__(self) -> Iterator[tuple[str, TensorShard | torch.Tensor]]:  # 4
        for index, (held, (replicas, replica)) in enumerate(zip(self.items, self.holders, strict=True)):
            if held.local.numel() == 0:
                continue  # fewer rows than ranks: this rank holds none of it
            if index in self.first_rank_only:
                if self.rank == 0:
                    yield held.name, cast_floating(held.local, self.cast)
                continue
            split = next((d for d, n in enumerate(held.sizes) if n > 1), None)
            length = held.sizes[split] if split is not None else 1
            step = -(-length // replicas)
            stripe = (replica - index) % replicas
            if stripe * step >= length:
                continue  # fewer stripes than holders: another replica sends this one
            offsets, data = list(held.offsets), held.local
            if split is not None:
                size = min(step, length - stripe * step)
                offsets[split] += stripe * step
                data = data.narrow(split, stripe * step, size)
            data = cast_floating(data, self.cast)
            if tuple(data.shape) == held.shape:
                yield held.name, data
                continue
            yield held.name, TensorShard(held.shape, data.dtype, _linear(offsets, held.shape) * data.element_size(),
                                         data.contiguous())  # fmt: skip


def _linear(offsets: list[int], shape: tuple[int, ...]) -> int:
    """The element index of `offsets` in a contiguous tensor of `shape`."""
    index = 0
    for offset, size in zip(offsets, shape, strict=True):
        index = index * size + offset
    return index


def iter_local_shards(
    module: nn.Module,
    *,
    include_buffers: bool = True,
    names_cfg: NamesConfig | Mapping[str, Any] | None = None,
    dtype: torch.dtype | str | None = None,
    prefix: str | None = None,
    device: torch.device | None = None,
    version: int | None = None,
    drift: ReplicaDrift | None = None,
) -> Iterable[tuple[str, TensorShard | torch.Tensor]]:
    """This rank's part of every tensor `iter_full_parameters` would send (same names, same exclusions,
    same cast), as `(name, TensorShard)` for a part or `(name, tensor)` for a whole tensor this rank sends.
    Call on every rank: the plan is made at once, with one small collective (the fingerprints of what
    every rank holds whole, and for FSDP2 / DTensor models the meshes), and a layout it cannot send
    raises ConfigError here. `drift`: one per run, so replicas that differ are warned about once."""
    drift = drift if drift is not None else ReplicaDrift()
    if fsdp1_units(module):
        rank, world = _world()
        named = SentNames(NameMapper.from_config(names_cfg, prefix=prefix))
        return _fsdp1_local_shards(module, include_buffers, named, resolve_dtype(dtype), rank, world,
                                   device=device, version=version, drift=drift)  # fmt: skip
    return LocalShards(module, device, include_buffers=include_buffers, names_cfg=names_cfg, dtype=dtype,
                       prefix=prefix, version=version, drift=drift)  # fmt: skip


class _WholeOwner:
    """Which rank sends a tensor that goes whole: the i-th such tensor in module order goes from rank
    i mod world (every rank walks the same tree, so every rank agrees without asking)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.index = rank, world, 0

    def __call__(self) -> bool:
        owner, self.index = self.index % self.world, self.index + 1
        return owner == self.rank


def _fsdp1_local_shards(
    module: nn.Module, include_buffers: bool, named: SentNames, cast: torch.dtype | None, rank: int, world: int,
    *, device: torch.device | None, version: int | None, drift: ReplicaDrift,
) -> Iterator[tuple[str, TensorShard | torch.Tensor]]:  # fmt: skip
    """FSDP1: each unit's flat parameter holds, on this rank, a slice of the concatenation of its original
    parameters; `_shard_param_infos` says which elements of which parameter it is. Those slices go as
    shards; tied aliases (`_shared_param_infos`) are the primary's bytes, sent once under the primary's
    name (the first in module order, as the gather does); everything FSDP does not manage (buffers, ignored
    parameters) goes whole, spread over the ranks where every rank's copy is the same, else from global
    rank 0, as for FSDP2. Planned eagerly (the fingerprint all-gather runs here, on every rank); the bytes
    are read and cast as the stream is consumed."""
    paths = {id(mod): path for path, mod in walk_modules(module, (), lambda _: False)}
    managed: set[tuple[int, str]] = set()  # (module, attribute) of every parameter a flat parameter holds
    parts: list[tuple[str, tuple[int, ...], int, torch.Tensor]] = []  # name, whole shape, first element, data
    for _, unit in fsdp1_units(module):
        handle = getattr(unit, "_handle", None)
        if handle is None:
            continue
        if handle.world_size != world and handle.uses_sharded_strategy:
            raise ConfigError(
                f"trainer.send_mode=sharded: an FSDP1 unit is sharded over {handle.world_size} of {world} ranks "
                "(hybrid sharding: every replica group holds the same shards); use trainer.send_mode=gather"
            )
        if not handle.uses_sharded_strategy and rank != 0:
            continue  # NO_SHARD: every rank holds everything; rank 0 sends it
        flat = handle.flat_param
        for info in flat._shared_param_infos:
            managed.add((id(info.module), info.param_name))
        local = flat.detach()
        for info, shard, shape in zip(flat._param_infos, flat._shard_param_infos, flat._shapes, strict=True):
            managed.add((id(info.module), info.param_name))
            name = named(".".join((*paths[id(info.module)], info.param_name)))
            if name is None or not shard.in_shard or not shard.numel_in_shard:
                continue
            span = local[shard.offset_in_shard : shard.offset_in_shard + shard.numel_in_shard]
            parts.append((name, tuple(shape), shard.intra_param_start_idx, span))
    wholes: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for path, mod in walk_modules(module, (), lambda _: False):
        for attr, tensor in own_tensors(mod, include_buffers):
            if (id(mod), attr) in managed or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            name = named(".".join((*path, attr)))
            if name is not None:
                wholes.append((name, tensor.detach()))
    first_rank_only = _drifted(wholes, device, version, drift, world)

    def stream() -> Iterator[tuple[str, TensorShard | torch.Tensor]]:
        for name, shape, first, span in parts:
            data = cast_floating(span, cast)
            yield name, TensorShard(shape, data.dtype, first * data.element_size(), data)
        mine = _WholeOwner(rank, world)
        for index, (name, tensor) in enumerate(wholes):
            owns = mine()
            if (rank == 0) if index in first_rank_only else owns:
                yield name, cast_floating(tensor, cast)

    return stream()


def _drifted(
    wholes: list[tuple[str, torch.Tensor]], device: torch.device | None, version: int | None, drift: ReplicaDrift,
    world: int,
) -> set[int]:  # fmt: skip
    """Indices into `wholes` (held whole on every rank, in the same order) whose copies differ between
    ranks: one all-gather of their fingerprints (none on a single rank); `drift` reports them."""
    from ..protocol.fingerprint import replica_digest

    if world == 1:
        drift.seen(version, [], [], [])
        return set()
    everyone = _all_gather_json([replica_digest(t) for _, t in wholes], device)
    if len({len(e) for e in everyone}) != 1:
        raise ConfigError(
            f"trainer.send_mode=sharded: the trainer ranks hold different numbers of unsharded tensors "
            f"({[len(e) for e in everyone]}, by rank); use {GATHER_KNOB}"
        )
    values = [[e[i] for e in everyone] for i in range(len(wholes))]
    differ = [i for i, v in enumerate(values) if len(set(v)) > 1]
    drift.seen(version, [wholes[i][0] for i in differ], [values[i] for i in differ], [wholes[i][1] for i in differ])
    return set(differ)


__all__ = ["LocalShards", "MembersRelay", "ReplicaDrift", "exchange_addresses", "iter_local_shards", "mesh_copies"]
