"""What every integration does to a framework's stream of `(name, tensor)` before our sender sees it, and how
each one lets go of what it holds."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..config import TrainerConfig
from ..trainer.gather import cast_floating, resolve_dtype
from ..trainer.names import NameMapper


class StreamRules:
    """`trainer.names.*` and `trainer.dtype` on a stream the framework gathers itself (TRL's `_streaming_iter`,
    vLLM's `WeightSource.iter_full`). An excluded tensor is still pulled from the stream: the framework's other
    ranks run the same gathers in lockstep."""

    def __init__(self, trainer: TrainerConfig) -> None:
        self._names = NameMapper.from_config(trainer.names)
        self._cast = resolve_dtype(trainer.dtype)

    def __call__(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            sent = self._names(name)
            if sent is not None:
                yield sent, cast_floating(tensor, self._cast)


def close_both(rollouts: Any, sender: Any) -> None:
    """The rollout clients, then the sender (its port is free again); either may be None. The caller has
    already cleared its own references, so a second call closes nothing twice."""
    if rollouts is not None:
        rollouts.close()
    if sender is not None:
        sender.close()


__all__ = ["StreamRules", "close_both"]
