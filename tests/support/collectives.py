"""Check that every rank issues the same collectives in the same order, before each one runs.

A gather that issues collectives in a rank-dependent order (or skips one on some ranks) is the
classic FSDP sync bug: it hangs, deadlocks in gloo, or silently pairs two different tensors of the
same size. Tests used to notice only through a hang or a torch internal error. `Lockstep` makes it
an explicit, bounded assertion: a `TorchDispatchMode` sees every c10d collective a rank dispatches
(FSDP2's functional all-gathers, FSDP1's `allgather_`, DDP's broadcasts) and, before letting it
run, compares its fingerprint (op, tensor shapes and dtypes) with the other ranks' collective at the
same position, through the process group's store, never through the group itself (a mismatched
collective could hang). A mismatch or a rank that stops short is an `AssertionError` naming both.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
LOCAL_OPS = ("wait_tensor", "_wrap_tensor_autograd")  # bookkeeping on one rank, not collectives


def fingerprint(func: Any, args: Sequence[Any]) -> str:
    """The op and every tensor argument's shape and dtype (nested lists of tensors included)."""
    parts: list[str] = []

    def add(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            parts.append(f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}")
        elif isinstance(value, (list, tuple)):
            for item in value:
                add(item)

    for arg in args:
        add(arg)
    return f"{func.overloadpacket.__name__}({', '.join(parts)})"


class Lockstep(TorchDispatchMode):
    """Within `with Lockstep(store, rank, world, tag):` every collective this rank dispatches is
    checked against the other ranks' before it runs; on exit, the counts are compared too.
    `issued` is this rank's sequence (so a test can also assert that collectives happened at all)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, tag: str, timeout_s: float = 30.0) -> None:
        super().__init__()
        self.store = dist.PrefixStore(f"lockstep/{tag}/", store)
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.issued: list[str] = []

    def _others(self, key: str, mine: str) -> list[tuple[int, str | None]]:
        self.store.set(f"{key}/{self.rank}", mine)
        seen: list[tuple[int, str | None]] = []
        for other in range(self.world_size):
            if other == self.rank:
                continue
            try:
                self.store.wait([f"{key}/{other}"], timedelta(seconds=self.timeout_s))
                seen.append((other, self.store.get(f"{key}/{other}").decode()))
            except RuntimeError:  # timed out (DistStoreError): that rank never got here
                seen.append((other, None))
        return seen

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        if func.namespace in COLLECTIVE_NAMESPACES and func.overloadpacket.__name__ not in LOCAL_OPS:
            mine, index = fingerprint(func, args), len(self.issued)
            for other, theirs in self._others(f"op/{index}", mine):
                assert theirs == mine, (
                    f"collective #{index}: rank {self.rank} issued {mine}, rank {other} "
                    + (f"issued {theirs}" if theirs is not None else f"issued none within {self.timeout_s}s")
                    + f" (rank {self.rank} before it: {self.issued[-3:]})"
                )
            self.issued.append(mine)
        return func(*args, **(kwargs or {}))

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if exc[0] is not None:
            return
        for other, theirs in self._others("count", str(len(self.issued))):
            assert theirs == str(len(self.issued)), (
                f"rank {self.rank} issued {len(self.issued)} collectives, rank {other} "
                + (f"issued {theirs}" if theirs is not None else f"did not finish within {self.timeout_s}s")
            )
