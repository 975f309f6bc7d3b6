"""Overlap's background gather (gather mode): full tensors rebuilt from snapshotted local shards on process
groups of the sync's own, so the background thread never runs a collective on a group training uses.

Why not `full_tensor()` in the background: FSDP2's DTensors all-gather on their mesh's process groups, the
training groups, whose collectives the next step issues meanwhile; two threads issuing collectives on one
group interleave them and hang. Gathering synchronously (the other choice) stalls training for every
all-gather (`bench.stall`: most of a gather-mode sync). Instead the snapshot copies each rank's local shard
(a local copy, no collective, as sharded mode's snapshot) and the background thread rebuilds the DTensor
from that copy on a *mirror* mesh: the same ranks, dimensions and placements, over groups made for this.
The all-gather moves bytes and computes nothing, so the full tensor is bitwise the one `full_tensor()`
gives (tests/integration/test_side_gather.py compares them on 1-D, submesh and 2-D layouts).

The mirror groups: one per group of every dimension of every DTensor mesh the model uses, made once at the
first snapshot. `dist.new_group` is collective over the world (every rank makes every group, in the same
order, members or not), and a rank knows only the groups it is in, so the ranks first exchange the rank
lists they need as plain integers (one all-gather; no pickle) and then all make the union, sorted. gloo
when the snapshot lives in host memory; the default backend for device staging (NCCL: a communicator and
stream of its own).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

try:  # torch >= 2.5
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch 2.4
    from torch.distributed._tensor import DTensor

logger = logging.getLogger(__name__)

Ranks = tuple[int, ...]


@dataclass(frozen=True)
class StagedShard:
    """One DTensor of a snapshot: this rank's local shard, copied, and what rebuilds the full tensor from
    it on the mirror mesh (`full()`, a collective over the mirror groups: every rank, same order)."""

    local: torch.Tensor
    mesh: DeviceMesh
    placements: tuple[Any, ...]
    shape: torch.Size
    stride: tuple[int, ...]

    def full(self) -> torch.Tensor:
        with torch.no_grad():
            rebuilt = DTensor.from_local(
                self.local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
            )
            return rebuilt.full_tensor()


def _dim_ranks(mesh: DeviceMesh) -> list[Ranks]:
    """This rank's group of each dimension of `mesh`, as global ranks."""
    return [tuple(dist.get_process_group_ranks(mesh.get_group(dim))) for dim in range(mesh.ndim)]


def _exchange(needed: list[Ranks], device: torch.device | None) -> list[Ranks]:
    """The union over every rank of the rank lists each needs (one all-reduce, one all-gather of ints)."""
    flat = [v for ranks in needed for v in (len(ranks), *ranks)]
    width = torch.tensor([len(flat)], dtype=torch.int64, device=device)
    dist.all_reduce(width, op=dist.ReduceOp.MAX)
    mine = torch.full((int(width.item()),), -1, dtype=torch.int64, device=device)
    mine[: len(flat)] = torch.tensor(flat, dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    union: set[Ranks] = set()
    for row in rows:
        values, i = row.tolist(), 0
        while i < len(values) and values[i] > 0:
            n = values[i]
            union.add(tuple(values[i + 1 : i + 1 + n]))
            i += 1 + n
    return sorted(union)


class MirrorMeshes:
    """The mirror of every DTensor mesh a snapshot meets (see the module docstring); one per `OverlapSync`."""

    def __init__(self, timeout_s: float, device: torch.device | None) -> None:
        self.timeout = timedelta(seconds=timeout_s)
        self.device = device  # the training group's device (its collectives exchange the rank lists)
        self._groups: dict[tuple[Ranks, str], Any] = {}
        self._meshes: dict[tuple[Any, ...], DeviceMesh] = {}
        self._by_id: dict[tuple[int, str], tuple[DeviceMesh, DeviceMesh]] = {}  # the model's mesh -> its mirror

    @staticmethod
    def _key(mesh: DeviceMesh, device_type: str) -> tuple[Any, ...]:
        return device_type, tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()), tuple(_dim_ranks(mesh))

    def ensure(self, meshes: Iterable[DeviceMesh], device_type: str) -> None:
        """Make the groups the mirrors of `meshes` need. Every rank, in the training thread (collective on
        the training group; a rank with nothing new still takes part: it may be the only one)."""
        needed = sorted(
            {ranks for mesh in meshes for ranks in _dim_ranks(mesh) if (ranks, device_type) not in self._groups}
        )
        flag = torch.tensor([int(bool(needed))], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not int(flag.item()):
            return
        backend = "gloo" if device_type == "cpu" else None
        me = dist.get_rank()
        made = 0
        for ranks in _exchange(needed, self.device):
            if (ranks, device_type) in self._groups:
                continue  # this rank has it; every rank made it together, so every rank has it
            group = dist.new_group(list(ranks), backend=backend, timeout=self.timeout)
            made += 1
            if me in ranks:
                self._groups[(ranks, device_type)] = group
            else:
                self._groups[(ranks, device_type)] = None  # made by all, not ours: never asked for
        logger.info("trainer.overlap: %d process group(s) made for the background gather (%s)", made, backend or "nccl")

    def mirror(self, mesh: DeviceMesh, device_type: str) -> DeviceMesh:
        """`mesh` over the mirror groups (`ensure` first)."""
        seen = self._by_id.get((id(mesh), device_type))
        if seen is not None and seen[0] is mesh:
            return seen[1]
        key = self._key(mesh, device_type)
        found = self._meshes.get(key)
        if found is not None:
            self._by_id[(id(mesh), device_type)] = (mesh, found)
            return found
        groups = [self._groups[(ranks, device_type)] for ranks in _dim_ranks(mesh)]
        names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
        if mesh.ndim == 1:
            mirror = DeviceMesh.from_group(groups[0], device_type, mesh_dim_names=names)
        else:
            mirror = DeviceMesh.from_group(groups, device_type, mesh=mesh.mesh, mesh_dim_names=names)
        self._meshes[key] = mirror
        self._by_id[(id(mesh), device_type)] = (mesh, mirror)
        return mirror


__all__ = ["MirrorMeshes", "StagedShard"]
