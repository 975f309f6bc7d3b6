"""Delta: send only the elements that changed since the version every receiver holds (`transport.delta`).

    sender:   VersionDelta.encode(name, tensor) per tensor (`transform`: a stage on the planned stream):
              compare with the host copy of the last version every receiver acknowledged (`DeltaBase`),
              send a payload of the changed elements when it is worth it (else the tensor whole), and
              update the copy
    wire:     the payload goes through the same split into buckets as any tensor; its entries keep the
              tensor's name, shape and dtype, and `BucketMeta.deltas` says the payload's size (-1: whole)
    receiver: apply_delta(payload, meta, held, target): the held version's values (the sink's tensor),
              with the changed elements written over them, bit for bit

Payload (little-endian): `format u8, 7 pad bytes, changed count u64`, then either a bitmask of the
tensor's elements (`ceil(n / 8)` bytes, bit i of byte i // 8 = element i changed) or the changed
elements' indices (u32 each), then the changed elements' raw bytes in index order. The smaller of the
two formats is sent (indices win below 1 element in 32 changed, less with wider elements). Values are
moved as raw bits (an integer view of the dtype), so NaN payloads and -0.0 survive: lossless.

When a delta is sent at all (`DeltaPolicy`, per version): every receiver said in its `Ready` that it holds
the version the sender's copy is of (a new receiver, one that missed or failed a version, one whose sink
cannot take deltas says -1); the sender's copy is whole (a failed version drops it, the next sync is full
and rebuilds it); no full sync was requested. Per tensor, under `auto`: the payload is below
`AUTO_MAX_PAYLOAD_FRACTION` of the tensor's bytes (measured: docs/backends.md), else the tensor goes whole;
under `always`: whenever the payload is smaller at all.

Memory, trainer side: one host-memory copy of every tensor sent (the model's size in the sent dtype, e.g.
15.3 GiB for Qwen3-8B in bf16), allocated on the first version with `transport.delta` not off. Finding
*which elements* changed needs the old values: a checksum per block finds changed blocks only, and at
the learning rates RL uses nearly every 4 KiB block holds a changed element (docs/backends.md measures
it), so blocks would save little. Receivers need nothing extra: they apply into the tensors their sink
holds (module sink), and a sink that holds none (safetensors files, a callable, vLLM's fused weights)
announces -1 and always gets whole tensors.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..config import DeltaMode
from ..errors import DeltaError, ProtocolError
from ..protocol.boxes import is_dtensor
from ..protocol.chunks import TensorMeta, TensorShard
from .planner import Outgoing

logger = logging.getLogger(__name__)

HEADER_BYTES = 16
FORMAT_BITMASK = 0
FORMAT_INDICES = 1
AUTO_MAX_PAYLOAD_FRACTION = 0.5
"""`transport.delta=auto`: a tensor goes as a delta only when its payload is below this fraction of its bytes
(above it the diff, the scatter and the base copy cost more than the bytes they save: docs/backends.md)."""
PROBE_EVERY = 8
"""`transport.delta=auto`: after a delta version measured slower than a whole one (per byte of the model),
this many versions go whole before a delta is tried again (the changed fraction falls as training settles)."""
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor's elements as same-width integers (a view), or None for dtypes without one (complex128)."""
    view = _INT_VIEW.get(tensor.element_size())
    if view is None:
        return None
    flat = tensor.reshape(-1)
    return flat.view(torch.uint8) if tensor.dtype == torch.bool else flat.view(view)


def payload_size(numel: int, changed: int, itemsize: int) -> tuple[int, int]:
    """(format, payload bytes) of the smaller encoding of `changed` elements of `numel`."""
    bitmask = HEADER_BYTES + (numel + 7) // 8 + changed * itemsize
    indices = HEADER_BYTES + changed * (4 + itemsize)
    if numel < 1 << 32 and indices < bitmask:
        return FORMAT_INDICES, indices
    return FORMAT_BITMASK, bitmask


def encode(new: torch.Tensor, old: torch.Tensor, max_payload: int) -> torch.Tensor | None:
    """The payload that turns `old` into `new` (both on the CPU, same shape and dtype), or None when it would
    be `max_payload` bytes or more (then the tensor goes whole). NumPy, not torch, on the host: its compare,
    count and flatnonzero are 2-10x faster single-threaded (a bool `sum` in torch is the slowest step)."""
    new_bits, old_bits = _bits(new), _bits(old)
    if new_bits is None or old_bits is None or new.numel() == 0:
        return None
    values = new_bits.numpy()
    changed = values != old_bits.numpy()
    count = int(np.count_nonzero(changed))
    fmt, size = payload_size(new.numel(), count, new.element_size())
    if size >= max_payload:
        return None
    payload = np.empty(size, dtype=np.uint8)
    payload[:HEADER_BYTES] = np.array([fmt, count], dtype="<u8").view(np.uint8)
    at = HEADER_BYTES
    if fmt == FORMAT_INDICES:
        index = np.flatnonzero(changed)
        payload[at : at + 4 * count] = index.astype("<u4").view(np.uint8)
        payload[at + 4 * count :] = values[index].view(np.uint8)
    else:
        mask = np.packbits(changed, bitorder="little")
        payload[at : at + mask.size] = mask
        payload[at + mask.size :] = values[changed].view(np.uint8)
    return torch.from_numpy(payload)


def _decode(payload: torch.Tensor, meta: TensorMeta) -> tuple[np.ndarray, np.ndarray]:
    """(where: increasing int64 indices, or a bool mask of every element; values: their raw bytes) of a
    payload for `meta`, every size and range checked (the payload came from the network: a hostile one is
    refused, never written out of bounds)."""
    numel, itemsize = meta.numel, meta.dtype.itemsize
    data = payload.cpu().numpy()
    if data.size < HEADER_BYTES:
        raise ProtocolError(f"delta of {meta.name!r}: payload of {data.size} bytes has no header")
    fmt, count = (int(v) for v in data[:HEADER_BYTES].view("<u8"))
    if count > numel:
        raise ProtocolError(f"delta of {meta.name!r} changes {count} of {numel} elements")
    sizes = {
        FORMAT_BITMASK: HEADER_BYTES + (numel + 7) // 8 + count * itemsize,
        FORMAT_INDICES: HEADER_BYTES + count * (4 + itemsize),
    }
    if fmt not in sizes or sizes[fmt] != data.size:
        raise ProtocolError(f"delta of {meta.name!r}: format {fmt}, {count} changes, does not fill {data.size} B")
    body = data[HEADER_BYTES:]
    if fmt == FORMAT_INDICES:
        index = body[: 4 * count].view("<u4").astype(np.int64)
        if count and (index.max() >= numel or (count > 1 and not (np.diff(index) > 0).all())):
            raise ProtocolError(f"delta of {meta.name!r}: indices out of range or not increasing")
        values = body[4 * count :]
    else:
        mask_bytes = (numel + 7) // 8
        mask = np.unpackbits(body[:mask_bytes], bitorder="little")
        if mask[numel:].any() or int(np.count_nonzero(mask[:numel])) != count:
            raise ProtocolError(f"delta of {meta.name!r}: bitmask does not mark {count} of {numel} elements")
        index = mask[:numel].view(bool)
        values = body[mask_bytes:]
    return index, values.copy()


def apply_delta(
    payload: torch.Tensor, meta: TensorMeta, held: torch.Tensor, target: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """The new version of `meta`'s tensor: `held` (the version the delta is based on) with the payload's
    elements written over it, in `target` (the sink's destination; `held` itself when the sink updates in
    place) or a new tensor on `device`. `held` is not changed unless it is the target."""
    if tuple(held.shape) != meta.shape or held.dtype != meta.dtype:
        raise DeltaError(
            f"delta of {meta.name!r}: the held tensor is {held.dtype}{list(held.shape)}, not "
            f"{meta.dtype}{list(meta.shape)}"
        )
    index, values = _decode(payload, meta)
    if target is None:
        target = torch.empty(meta.shape, dtype=meta.dtype, device=device)
    if target.data_ptr() != held.data_ptr():
        target.copy_(held)
    bits = _bits(target)
    if bits is None or not target.is_contiguous():
        raise DeltaError(f"delta of {meta.name!r}: cannot write elements of a {target.dtype} tensor in place")
    if not values.size:
        return target
    if target.device.type == "cpu":  # NumPy's scatter, as in `encode`
        array = bits.numpy()
        if index.dtype == bool:
            np.place(array, index, values.view(array.dtype))
        else:
            array[index] = values.view(array.dtype)
    else:
        where = torch.from_numpy(index).to(target.device)
        bits[where] = torch.from_numpy(values).view(bits.dtype).to(target.device)
    return target


class HeldVersion:
    """The receiving side: the consumer's tensors of the version it holds (`base(meta)`, valid while `version()`
    is the one a delta is based on), which a delta payload is applied to."""

    def __init__(self, base: Callable[[TensorMeta], torch.Tensor | None] | None, version: Callable[[], int | None]):
        self._base = base
        self.version = version

    def held(self, meta: TensorMeta, based_on: int) -> torch.Tensor:
        """The consumer's tensor of version `based_on`, which a delta of `meta`'s tensor applies to."""
        version = self.version()
        held = self._base(meta) if self._base is not None and version == based_on else None
        if held is None:
            raise DeltaError(
                f"{meta.name!r} arrived as a delta of version {based_on}, but this receiver holds "
                f"{'no version it can apply one to' if version is None else f'version {version}'}"
            )
        return held

    def apply(
        self,
        payload: torch.Tensor,
        delta: tuple[TensorMeta, int],
        into: Callable[[TensorMeta], torch.Tensor | None] | None,
        device: torch.device,
    ) -> torch.Tensor:
        """The tensor a delta payload rebuilds, in `into(meta)` (the consumer's destination) or a new tensor; the
        held version stays as it was unless the destination is that tensor itself (streaming in place)."""
        meta, based_on = delta
        held = self.held(meta, based_on)
        target = into(meta) if into is not None else None
        if is_dtensor(held) or is_dtensor(target):  # it holds a box: a delta rebuilds the whole tensor
            raise DeltaError(
                f"{meta.name!r} arrived as a delta, which does not apply into a DTensor's box; transport.slices=true "
                "(boxes come whole) or transport.delta=off for a tensor-parallel rollout"
            )
        return apply_delta(payload, meta, held, target, device)


def apply_range_delta(
    payload: torch.Tensor, meta: TensorMeta, start: int, size: int, held: torch.Tensor, target: torch.Tensor
) -> None:
    """Sharded send mode: write bytes [start, start + size) of `meta`'s tensor into `target` (those bytes of the
    destination, uint8): the held version's bytes of that range with the payload's elements over them. The
    range is whole elements (validated with the bucket: `protocol.messages.validate_deltas`)."""
    if tuple(held.shape) != meta.shape or held.dtype != meta.dtype:
        raise DeltaError(
            f"delta of {meta.name!r}: the held tensor is {held.dtype}{list(held.shape)}, not "
            f"{meta.dtype}{list(meta.shape)}"
        )
    part = TensorMeta(meta.name, (size // meta.dtype.itemsize,), meta.dtype, 0, size)
    held_range = held.detach().reshape(-1).view(torch.uint8)[start : start + size].view(meta.dtype)
    apply_delta(payload, part, held_range, target.view(meta.dtype), target.device)


class DeltaBase:
    """The sender's host copy of the last version every receiver acknowledged: what a delta is taken against."""

    def __init__(self) -> None:
        self.version: int | None = None  # None: the copy is not whole (nothing sent yet, or a version failed)
        # by name, or by (name, byte start, bytes) for a shard (sharded send mode: only this rank's ranges)
        self.tensors: dict[str | tuple[str, int, int], torch.Tensor] = {}
        self.full_requested = False
        # `auto` measures both ways on the link it has: seconds per byte of the model of the last whole version
        # and of the last delta version, and how many versions to send whole before trying deltas again
        self.whole_s_per_byte: float | None = None
        self.delta_s_per_byte: float | None = None
        self.whole_left = 0

    def measured(self, delta_version: bool, seconds: float, model_bytes: int) -> None:
        """A version went through in `seconds`: note its cost per byte of the model, and when a delta version
        was slower than whole ones, send the next `PROBE_EVERY` whole (`auto` only acts on it)."""
        if model_bytes <= 0:
            return
        rate = seconds / model_bytes
        if delta_version:
            self.delta_s_per_byte = rate
            if self.whole_s_per_byte is not None and rate > self.whole_s_per_byte:
                self.whole_left = PROBE_EVERY
                logger.info(
                    "transport.delta=auto: a delta version took %.3g s/GiB, a whole one %.3g s/GiB on this link; "
                    "sending the next %d versions whole before trying again",
                    rate * 2**30, self.whole_s_per_byte * 2**30, PROBE_EVERY,
                )  # fmt: skip
        else:
            self.whole_s_per_byte = rate

    def prefer_whole(self) -> bool:
        """`auto`: a whole version to measure (deltas were, whole versions not yet: the first version formed the
        group and is not counted), or the last delta measured slower and the interval has not run out."""
        if self.whole_s_per_byte is None and self.delta_s_per_byte is not None:
            return True
        if self.whole_left > 0:
            self.whole_left -= 1
            return True
        return False

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def invalidate(self) -> None:
        self.version = None

    def policy(self, mode: DeltaMode, held: list[int]) -> DeltaPolicy:
        """This version's: deltas only against the version every receiver says it holds (`held`: each one's
        `Ready.delta_base`), while the copy of it is whole."""
        usable = self.version is not None and not self.full_requested and bool(held)
        usable = usable and all(h == self.version for h in held)
        self.full_requested = False
        if usable and mode is DeltaMode.auto and self.prefer_whole():  # measured: deltas lose on this link
            usable = False
        return DeltaPolicy(mode is not DeltaMode.off, self.version if usable else None, mode is DeltaMode.always)


@dataclass
class DeltaPolicy:
    """What this version sends: deltas against `base_version` (or not), and whether the copy is kept."""

    keep: bool  # transport.delta is not off: keep (and update) the copy
    base_version: int | None  # the version every receiver holds and the copy is of; None: whole tensors
    always: bool  # transport.delta=always: a delta whenever it is smaller at all


class VersionDelta:
    """One version's encoder: `encode(name, tensor) -> (what to send, payload bytes or -1)`."""

    def __init__(self, base: DeltaBase, policy: DeltaPolicy) -> None:
        self.base, self.policy = base, policy
        self.sent: set[str | tuple[str, int, int]] = set()
        self.payloads = 0
        self.model_bytes = 0  # bytes of the tensors this version carried (whole or as deltas)

    def encode(self, name: str | tuple[str, int, int], tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
        if not self.policy.keep:
            return tensor, -1
        self.sent.add(name)
        self.model_bytes += tensor.numel() * tensor.element_size()
        new = tensor.detach()
        if new.device.type != "cpu":
            new = new.to("cpu")
        new = new.contiguous()
        old = self.base.tensors.get(name)
        if old is None or old.shape != new.shape or old.dtype != new.dtype:
            self.base.tensors[name] = new.clone() if new.data_ptr() == tensor.data_ptr() else new
            return tensor, -1
        payload = None
        if self.policy.base_version is not None:
            nbytes = new.numel() * new.element_size()
            limit = nbytes if self.policy.always else math.ceil(nbytes * AUTO_MAX_PAYLOAD_FRACTION)
            payload = encode(new, old, limit)
        old.copy_(new)
        if payload is None:
            return tensor, -1
        self.payloads += 1
        return payload, payload.numel()

    def transform(self, item: Outgoing) -> Outgoing:
        """The planner's transform (`versions.planner.Transform`): the tensor's delta payload where this version
        sends one (its entries still describe the tensor it rebuilds), else the tensor as it came. A shard's
        payload rebuilds its byte range of the tensor (`Outgoing.delta_range`)."""
        if isinstance(item.tensor, TensorShard):
            return self._shard(item, item.tensor)
        shape, dtype = tuple(item.tensor.shape), item.tensor.dtype
        sendable, size = self.encode(item.name, item.tensor)
        if size < 0:
            return item
        return Outgoing(item.name, sendable, item.fingerprint, size, (shape, dtype))

    def _shard(self, item: Outgoing, shard: TensorShard) -> Outgoing:
        """A shard (sharded send mode): diffed against this rank's copy of exactly that byte range, so no whole
        tensor is needed anywhere; the payload rebuilds `delta_range` of the tensor's bytes."""
        data = shard.data
        nbytes = data.numel() * data.element_size()
        if data.dtype != shard.dtype or shard.byte_offset % data.element_size():
            return item  # not whole elements of the tensor's dtype: a delta could not name them; goes as bytes
        sendable, size = self.encode((item.name, shard.byte_offset, nbytes), data)
        if size < 0:
            return item
        rebuilds = (shard.shape, shard.dtype)
        return Outgoing(item.name, sendable, item.fingerprint, size, rebuilds, (shard.byte_offset, nbytes))

    def finish(self, version: int, ok: bool) -> None:
        """After the version: the copy is of `version` when every receiver took it, else not whole."""
        if not self.policy.keep:
            return
        for name in [n for n in self.base.tensors if n not in self.sent]:
            del self.base.tensors[name]  # not in this version: a later one with that name starts whole
        self.base.version = version if ok else None


__all__ = [
    "AUTO_MAX_PAYLOAD_FRACTION",
    "PROBE_EVERY",
    "DeltaBase",
    "DeltaError",
    "DeltaPolicy",
    "HeldVersion",
    "VersionDelta",
    "apply_delta",
    "apply_range_delta",
    "encode",
    "payload_size",
]
