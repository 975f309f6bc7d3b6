"""How the trainer ranks agree on a sync's outcome: one tiny all-reduce of outcome codes.

Without it the sending rank would raise (or not) on its own while the other ranks walk into the next step's
collectives alone. Blocking and background syncs (driver.py, overlap.py) agree the same way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import ConfigError, WeightSyncError

OK, RECOVERABLE, FATAL = 0, 1, 2


class SyncFailed(WeightSyncError):
    """Raised on ranks that did not send when the sending rank's sync failed (`on_failure: raise`)."""


def outcome_code(error: BaseException | None) -> int:
    """OK, RECOVERABLE (a failed send: `trainer.on_failure` decides) or FATAL (a bad config, a bug)."""
    if error is None:
        return OK
    if isinstance(error, WeightSyncError) and not isinstance(error, ConfigError):
        return RECOVERABLE
    return FATAL


def all_ranks_max(code: int, device: torch.device | None) -> int:
    """The largest `code` over every rank of the default process group (identity without one).

    `device` must suit the group's backend (the strategy's root device: CUDA for NCCL, NPU for HCCL).
    """
    return all_ranks_max_each([code], device)[0]


def all_ranks_max_each(values: list[int], device: torch.device | None) -> list[int]:
    """Element-wise maximum of `values` over every rank (one all-reduce; identity without a group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(values)
    flags = torch.tensor(values, dtype=torch.int32, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [int(v) for v in flags.tolist()]


__all__ = ["FATAL", "OK", "RECOVERABLE", "SyncFailed", "all_ranks_max", "all_ranks_max_each", "outcome_code"]
