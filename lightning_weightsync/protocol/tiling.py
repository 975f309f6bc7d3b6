"""Merge one version's chunks from several senders (sharded send mode), bitwise and checked.

With one sender, chunks of a tensor arrive in order and `chunks.merge_weight_chunks` checks the order
as it goes. With several, every sender streams the byte ranges it owns (its shard of each tensor),
concurrently and in its own order, so a tensor's chunks interleave from all of them. What makes the
result trustworthy is then a tiling rule: each tensor's bytes must be covered exactly once, by the
union of every sender's chunks, before the tensor is handed on. A chunk that overlaps bytes already
received (a sender claiming another's range, or sending twice) and, at the end of the version, a tensor
with bytes nobody sent, are `ProtocolError`s naming the tensor, the byte range and the senders involved;
the version then fails as a whole, so nothing half-tiled is ever applied.

Memory: a tensor's destination is taken (the consumer's `into`) or allocated at its first chunk from any
sender and handed on when it is complete. Senders stream in the same (module) order, so the tensors in
assembly at once are the few that the senders are in the middle of, not the model.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch

from ..errors import ProtocolError
from .chunks import Landing, TensorMeta


class _Tile:
    """One tensor being tiled: its destination and the byte ranges received so far, sorted."""

    __slots__ = ("covered", "dest", "landing", "meta", "ranges")

    def __init__(self, meta: TensorMeta, dest: torch.Tensor) -> None:
        self.meta = meta
        self.dest = dest
        self.landing = Landing(meta, dest)
        self.ranges: list[tuple[int, int, int]] = []  # (start, end, sender), sorted by start
        self.covered = 0


class TilingMerger:
    """`push(sender, meta, chunk)` for every chunk of a version from any sender; returns `(name, tensor)`
    once that tensor is tiled exactly. `finish()` once every sender's stream ended: raises for any tensor
    left with a gap. `senders` names each sender index in errors (e.g. its address)."""

    def __init__(
        self,
        bucket_size: int,
        into: Callable[[TensorMeta], torch.Tensor | None] | None,
        device: torch.device | str | None,
        senders: Sequence[str],
    ) -> None:
        self.bucket_size = bucket_size
        self.into = into
        self.device = device
        self.senders = list(senders)
        self.open: dict[str, _Tile] = {}
        self.done: dict[str, int] = {}  # complete tensors -> the sender whose chunk completed them
        self.kept: dict[str, Landing] = {}  # complete tensors this rank holds a box of -> where the box landed

    def _who(self, sender: int) -> str:
        return f"sender {sender} ({self.senders[sender]})" if 0 <= sender < len(self.senders) else f"sender {sender}"

    def push(self, sender: int, meta: TensorMeta, data: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        name, start, size = meta.name, meta.chunk_offset, meta.chunk_size
        if size != data.numel() or data.dtype != torch.uint8:
            raise ProtocolError(
                f"chunk of {name!r} from {self._who(sender)} declares {size} bytes but carries {data.numel()} "
                f"{data.dtype} elements"
            )
        if size > self.bucket_size:
            raise ProtocolError(f"chunk of {name!r} from {self._who(sender)} is {size} bytes > bucket_size")
        tile, held = self._claim(sender, meta)
        if tile is None:  # bytes of the whole tensor outside this rank's box, which is complete: nothing to keep
            return None
        if size:
            tile.landing.write(meta, start, data)
        return self._covered(tile, sender, held)

    def write(
        self, sender: int, meta: TensorMeta, fill: Callable[[torch.Tensor], None]
    ) -> tuple[str, torch.Tensor] | None:
        """Like `push`, for bytes [chunk_offset, +chunk_size) of `meta`'s tensor that `fill` writes into the
        destination's bytes of that range itself (a shard's delta applied onto the held version, sharded send
        mode): the range is checked and counted as any chunk's; `fill` runs only once it is claimed."""
        tile, held = self._claim(sender, meta)
        whole = tile.landing.whole_bytes if tile is not None else None
        if tile is None or whole is None:
            raise ProtocolError(
                f"{meta.name!r} arrived as a delta, which does not apply into a DTensor's box; transport.slices=true "
                "(boxes come whole) or transport.delta=off for a tensor-parallel rollout"
            )
        fill(whole[meta.chunk_offset : meta.chunk_offset + meta.chunk_size])
        return self._covered(tile, sender, held)

    def _claim(self, sender: int, meta: TensorMeta) -> tuple[_Tile | None, int]:
        """Record `sender`'s byte range of what this receiver holds of `meta`'s tensor (the whole tensor's bytes,
        or its box's local bytes, whichever form the chunk came in); returns the tile and the bytes claimed (no
        tile: a chunk of the whole tensor that adds nothing to this rank's box, complete already).
        Raises for a range outside the tensor, or one that overlaps a range already received."""
        name, start, size = meta.name, meta.chunk_offset, meta.chunk_size
        nbytes = meta.nbytes
        end = start + size
        if start < 0 or end > nbytes:
            raise ProtocolError(
                f"chunk [{start}, {end}) of {name!r} from {self._who(sender)} is outside its {nbytes} bytes"
            )
        if size == 0 and nbytes:
            raise ProtocolError(f"empty chunk of {name!r} ({nbytes} bytes) from {self._who(sender)}")
        if name in self.done:
            kept = self.kept.get(name)  # a box complete: a later chunk of the whole tensor may lie outside it
            if kept is not None and meta.box is None:
                start_, end_ = kept.local_range(meta)
                if start_ == end_:
                    return None, 0
            raise ProtocolError(
                f"overlap in {name!r}: {self._who(sender)} sent bytes [{start}, {end}) of a tensor already complete "
                f"(completed by {self._who(self.done[name])}); two senders claim the same range"
            )
        tile = self.open.get(name)
        if tile is None:
            tile = self.open[name] = _Tile(meta, self._destination(meta))
        elif meta.shape != tile.meta.shape or meta.dtype != tile.meta.dtype:
            raise ProtocolError(
                f"{name!r} is {tile.meta.form} in one sender's chunks and {meta.form} in {self._who(sender)}'s"
            )
        else:
            tile.landing.fits(meta)
        start, end = tile.landing.local_range(meta)  # a chunk of the whole tensor: its part of this rank's box
        if start == end:
            return tile, 0
        ranges = tile.ranges
        at = bisect.bisect_left(ranges, (start, end, sender))
        for neighbour in ranges[max(at - 1, 0) : at + 1]:
            if neighbour[0] < end and start < neighbour[1]:
                raise ProtocolError(
                    f"overlap in {name!r}: {self._who(sender)} sent bytes [{start}, {end}), {self._who(neighbour[2])} "
                    f"sent [{neighbour[0]}, {neighbour[1]}); two senders claim the same range"
                )
        ranges.insert(at, (start, end, sender))
        return tile, end - start

    def _covered(self, tile: _Tile, sender: int, size: int) -> tuple[str, torch.Tensor] | None:
        name = tile.meta.name
        tile.covered += size
        if tile.covered == tile.landing.held.numel():
            del self.open[name]
            self.done[name] = sender
            if tile.landing.box is not None:
                self.kept[name] = tile.landing
            return name, tile.dest
        return None

    def _destination(self, meta: TensorMeta) -> torch.Tensor:
        dest = self.into(meta) if self.into is not None else None
        if dest is None:
            return torch.empty(meta.local_shape, dtype=meta.dtype, device=self.device)
        return dest  # checked by its Landing

    def gaps(self, name: str) -> list[tuple[int, int]]:
        """The byte ranges of an incomplete tensor that nobody sent (yet)."""
        tile = self.open[name]
        holes, at = [], 0
        for start, end, _ in tile.ranges:
            if start > at:
                holes.append((at, start))
            at = max(at, end)
        if at < tile.landing.held.numel():
            holes.append((at, tile.landing.held.numel()))
        return holes

    def finish(self) -> None:
        """Every sender's stream ended: a tensor still open has bytes that nobody sent."""
        if not self.open:
            return
        name, tile = next(iter(self.open.items()))
        holes = ", ".join(f"[{a}, {b})" for a, b in self.gaps(name)[:4])
        by = sorted({self._who(s) for _, _, s in tile.ranges})
        more = f" (and {len(self.open) - 1} more tensors incomplete)" if len(self.open) > 1 else ""
        kept = "" if tile.landing.box is None else " of this rank's box"
        raise ProtocolError(
            f"gap in {name!r}: bytes {holes} of {tile.landing.held.numel()}{kept} were sent by no sender "
            f"(received from {', '.join(by)}){more}"
        )


__all__ = ["TilingMerger"]
