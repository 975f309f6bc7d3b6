"""A host copy of an engine's model, taken before each version, so a version that fails on any worker of a
server can be undone on all of them.

An engine loads a version in place, tensor by tensor (`model.load_weights`): nothing is staged, so a
version that breaks half-way leaves layers of two versions, and on a tensor-parallel server one worker
that fails while the others succeed leaves shards of two versions in one model. vLLM's layerwise reload
keeps each layer's kernel tensors (the processed parameters and buffers the kernels and CUDA graphs use)
and copies the re-processed values into them, so those tensors are the model's whole state; a copy of
them, put back in place, is the model as it was. Anything derived outside them (attention layers'
`process_weights_after_loading`, e.g. MLA's W_UK/W_UV) the engine re-derives after `restore`.

The host buffers are allocated once, when the engine is built (pinned when the model is on a GPU, so the
copies run at PCIe speed): the memory is taken, and reported, before the first version, never during one.
Per version the copy costs one device-to-host pass over this worker's shard of the model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

logger = logging.getLogger(__name__)


def live_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, once (tied ones under their first name)."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if id(tensor) in seen or tensor.is_meta:
            continue
        seen.add(id(tensor))
        tensors[name] = tensor
    return tensors


class HostCopy:
    """`take(model)` before a version, `restore(model)` after one that must be undone."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.copies: dict[str, torch.Tensor] = {}
        for name, tensor in live_tensors(model).items():
            pin = tensor.is_cuda and torch.cuda.is_available()
            self.copies[name] = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
        self.nbytes = sum(t.numel() * t.element_size() for t in self.copies.values())
        self.taken = False

    def take(self, model: torch.nn.Module) -> None:
        """Copy the model's tensors now (before the version touches them)."""
        self.taken = False
        live = live_tensors(model)
        if live.keys() != self.copies.keys():
            logger.error(
                "the model's tensors changed since the engine was built (%d now, %d copied before); no rollback for "
                "this version",
                len(live),
                len(self.copies),
            )
            return
        with torch.no_grad():
            for name, tensor in live.items():
                self.copies[name].copy_(tensor.detach(), non_blocking=True)
        _synchronize(live.values())
        self.taken = True

    def restore(self, model: torch.nn.Module) -> list[str]:
        """Put the copy back into the model's own tensors (their storage: CUDA graphs keep pointing at it);
        returns the names that could not be restored ([] when the model is as it was at `take`)."""
        if not self.taken:
            return ["(no copy was taken before this version)"]
        live = live_tensors(model)
        lost = sorted(self.copies.keys() - live.keys())
        with torch.no_grad():
            for name, tensor in live.items():
                copy = self.copies.get(name)
                if copy is None or copy.shape != tensor.shape or copy.dtype != tensor.dtype:
                    lost.append(name)
                    continue
                tensor.data.copy_(copy, non_blocking=True)
        _synchronize(live.values())
        return lost


def _synchronize(tensors: Iterable[torch.Tensor]) -> None:
    """Non-blocking copies to or from pinned memory are done only once the device says so."""
    if torch.cuda.is_available() and any(t.is_cuda for t in tensors):
        torch.cuda.synchronize()


__all__ = ["HostCopy", "live_tensors"]
