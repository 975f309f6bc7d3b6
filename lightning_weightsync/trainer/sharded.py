"""Sharded send mode, the trainer's half: what each rank owns, and what the ranks tell each other.

    every rank:  iter_local_shards(model)    its own bytes of every tensor, no collective at all:
                 FSDP2 `Shard(0)` parameters -> the local shard, at its byte offset in the whole tensor
                 (uneven shards as torch.chunk cuts them; an empty local shard is skipped)
                 everything else (replicated DTensors, buffers, unsharded parameters) -> the whole tensor,
                 from one owner: the i-th such tensor from rank i mod world (every rank walks the same
                 module tree in the same order, so every rank agrees on the owner without asking)
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
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError
from ..protocol.chunks import TensorShard
from .gather import DTensor, _fsdp1_units, _walk_tensors, cast_floating, resolve_dtype
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


def _shard0_offset(tensor: Any) -> int:
    """First row of this rank's `Shard(0)` local shard, as torch.chunk (and FSDP2) cut the rows."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = tuple(tensor.placements)
    if len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
        raise ConfigError(
            f"trainer.send_mode=sharded sends FSDP2 Shard(0) parameters on a 1-D mesh; this one is placed "
            f"{placements} on a {tensor.device_mesh.ndim}-D mesh; use trainer.send_mode=gather"
        )
    _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, placements)
    return int(offset[0])


def iter_local_shards(
    module: nn.Module,
    *,
    include_buffers: bool = True,
    names_cfg: Mapping[str, Any] | Any | None = None,
    dtype: torch.dtype | str | None = None,
    prefix: str | None = None,
) -> Iterator[tuple[str, TensorShard | torch.Tensor]]:
    """This rank's part of every tensor `iter_full_parameters` would send (same names, same exclusions,
    same cast), as `(name, TensorShard)` for a local shard or `(name, tensor)` for a whole tensor this
    rank owns. No collectives: every rank walks the same tree and decides alike."""
    named = SentNames(NameMapper.from_config(names_cfg, prefix=prefix))
    cast = resolve_dtype(dtype)
    rank, world = _world()
    if _fsdp1_units(module):
        yield from _fsdp1_local_shards(module, include_buffers, named, cast, rank, world)
        return
    mine = _WholeOwner(rank, world)
    for raw, tensor in _walk_tensors(module, (), lambda _: False, include_buffers):
        name = named(raw)
        if name is None:
            continue
        if isinstance(tensor, DTensor) and any(type(p).__name__ == "Shard" for p in tensor.placements):
            first_row = _shard0_offset(tensor)
            local = tensor.to_local().detach()
            if local.numel() == 0:
                continue  # fewer rows than ranks: this rank holds none of it
            local = cast_floating(local, cast)
            shape = tuple(tensor.shape)
            row_bytes = (local.numel() // local.shape[0]) * local.element_size()
            yield name, TensorShard(shape, local.dtype, first_row * row_bytes, local.contiguous())
            continue
        if not mine():
            continue
        if isinstance(tensor, DTensor):
            if any(type(p).__name__ != "Replicate" for p in tensor.placements):
                raise ConfigError(
                    f"trainer.send_mode=sharded: {raw!r} is placed {tuple(tensor.placements)} (only Shard(0) and "
                    "Replicate are sent without a collective); use trainer.send_mode=gather"
                )
            full = tensor.to_local()  # replicated: the local tensor is the whole one
        else:
            full = tensor
        yield name, cast_floating(full.detach(), cast)


class _WholeOwner:
    """Which rank sends a tensor that goes whole: the i-th such tensor in module order goes from rank
    i mod world (every rank walks the same tree, so every rank agrees without asking)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.index = rank, world, 0

    def __call__(self) -> bool:
        owner, self.index = self.index % self.world, self.index + 1
        return owner == self.rank


def _fsdp1_local_shards(
    module: nn.Module, include_buffers: bool, named: SentNames, cast: torch.dtype | None, rank: int, world: int
) -> Iterator[tuple[str, TensorShard | torch.Tensor]]:
    """FSDP1: each unit's flat parameter holds, on this rank, a slice of the concatenation of its original
    parameters; `_shard_param_infos` says which elements of which parameter it is. Those slices go as
    shards; tied aliases (`_shared_param_infos`) are the primary's bytes, sent once under the primary's
    name (the first in module order, as the gather does); everything FSDP does not manage (buffers, ignored
    parameters) goes whole from one owner, as for FSDP2."""
    paths = {id(mod): path for path, mod in walk_modules(module, (), lambda _: False)}
    managed: set[tuple[int, str]] = set()  # (module, attribute) of every parameter a flat parameter holds

    for _, unit in _fsdp1_units(module):
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
            data = cast_floating(local[shard.offset_in_shard : shard.offset_in_shard + shard.numel_in_shard], cast)
            yield name, TensorShard(tuple(shape), data.dtype, shard.intra_param_start_idx * data.element_size(), data)
    mine, seen = _WholeOwner(rank, world), set()
    for path, mod in walk_modules(module, (), lambda _: False):
        for attr, tensor in own_tensors(mod, include_buffers):
            if (id(mod), attr) in managed or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            name = named(".".join((*path, attr)))
            if name is None or not mine():
                continue
            yield name, cast_floating(tensor.detach(), cast)


__all__ = ["MembersRelay", "exchange_addresses", "iter_local_shards"]
