"""TRL's `AsyncGRPOTrainer` selects us with one argument: `weight_transfer=WeightSyncTransfer("sync.yaml")`.

`WeightSyncTransfer` satisfies TRL's `WeightTransferProtocol` (trl 1.16.0,
trl/experimental/async_grpo/async_grpo_trainer.py:155-183). Only TRL's main process holds it; TRL calls it so
(the same file, lines cited as of 1.16.0):

    on train begin   init_weight_transfer()                  (:230-231, main process)   -> bind our sender
    every sync       pause()                                 (:1766-1767)               -> pause the rollout engines
                     every rank: barrier                     (:1771)
                     send_weights(self._streaming_iter())    (:1780-1781, main process) -> one version
                     other ranks: for _ in _streaming_iter() (:1782-1785)  FSDP2 all-gathers, in lockstep
                     every rank: barrier; resume()           (:1791-1796)               -> resume them
    on train end     destroy()                               (:1905-1909)               -> close everything

The iterator is collective on FSDP2 (`full_tensor()` per parameter, :1723-1731): the other ranks walk it in
lockstep, so `send_weights` consumes it whole and in order whatever happens (a failed send drains the rest), and
only then raises (`trainer.on_failure: raise`) or logs and returns (`warn`). A lost rollout fails the version
within `transport.liveness_s`, never a hang.

Version numbers: the n-th `send_weights` sends version `initial_version + n - 1`, and TRL bumps its
`model_version` by one after each sync (:1797), so with the default `initial_version=1` our version N is what
TRL calls model version N (what it tags samples with via `rollout_worker.update_model_version`).

What TRL's protocol decides for us: the stream is TRL's (`_iter_vllm_named_params`, :663-689): trainable
parameters under their base-checkpoint names, a PEFT adapter merged into its base weights (TRL merges, calls
us, unmerges: :1775-1788); buffers and frozen parameters are never in it. So a PEFT model reaches the rollouts as
merged weights only: adapter-only versions (`trainer.lora=adapter`) are impossible through this protocol, since
the adapter tensors never reach `send_weights`. `trainer.names.*` and `trainer.dtype` apply to the stream;
`trainer.send_mode=sharded` and `trainer.overlap` do not (the gather is TRL's, and the protocol is blocking).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from ..config import FailurePolicy, SenderSettings, UserConfig, load_config, settings
from ..errors import WeightSyncError
from ..trainer.gather import drain
from ..trainer.send import Outbound, SendRoute, send_version
from ..versions.options import VersionOptions
from .common import StreamRules, close_both

if TYPE_CHECKING:
    from ..trainer.fleet import RolloutFleet
    from ..versions.sender import BlockingWeightSender
    from ..versions.stats import SendStats

logger = logging.getLogger(__name__)


class WeightSyncTransfer:
    """TRL `AsyncGRPOTrainer`'s `weight_transfer`: every sync goes out through our sender.

    Args:
        config: our YAML's path, a `load_config()` result, or None (the defaults). Uses `transport.*`,
            `trainer.min_receivers`, `trainer.on_failure`, `trainer.dtype`, `trainer.names.*`, and the rollout
            engines' sections (`vllm.urls`, `sglang.urls`): those servers are paused, updated and resumed around
            each version exactly as `WeightSyncCallback` does (`RolloutFleet`). Rollouts without an engine (our
            daemon, a `WeightReceiver`, `CpuRolloutWorker`) just receive.
        initial_version: the version number of the first sync (TRL's model version after it; module docstring).

    Build it on every rank if that is simpler: nothing binds before `init_weight_transfer()`, which TRL calls on
    its main process only.
    """

    def __init__(self, config: str | os.PathLike[str] | UserConfig = None, *, initial_version: int = 1) -> None:
        loaded = load_config(config) if isinstance(config, (str, os.PathLike)) else config
        self.config = settings(loaded)  # the edge: the one conversion to the typed config
        self.next_version = int(initial_version)
        self.sender: BlockingWeightSender | None = None
        self.rollouts: RolloutFleet | None = None
        self.last_stats: SendStats | None = None
        self.failures = 0
        self._rules = StreamRules(self.config.trainer)
        self._paused = False
        self._pause_error: Exception | None = None

    # -- WeightTransferProtocol --------------------------------------------------------------------
    def init_weight_transfer(self) -> None:
        """Bind the sender (`transport.host:port`) and connect the rollout engines' clients. Idempotent."""
        if self.sender is not None:
            return
        from ..trainer.fleet import RolloutFleet
        from ..versions.sender import BlockingWeightSender

        sender = BlockingWeightSender(SenderSettings.of(self.config))
        try:
            sender.start()
            self.rollouts = RolloutFleet.from_config(self.config)
        except BaseException:
            sender.close()
            raise
        self.sender = sender
        logger.info("weight sender listening on %s:%d (TRL weight_transfer)", self.config.transport.host, sender.port)

    def pause(self) -> None:
        """Pause the rollout engines (none: nothing to do). Never raises: a failure fails the next
        `send_weights`, after it drained its stream, so TRL's other ranks are not left in their gathers."""
        self._pause_error = None
        if self.rollouts is None:
            return
        self._paused = True
        try:
            self.rollouts.pause()
        except Exception as exc:
            self._pause_error = exc

    def send_weights(self, iterator: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send one version of `iterator`'s `(name, tensor)` pairs; the iterator is exhausted, in order, whatever
        happens. Raises the failure (`trainer.on_failure: raise`) or logs it and returns (`warn`)."""
        version = self.next_version
        self.next_version += 1
        weights = iter(iterator)
        # TRL yields live parameters (`param.detach()`) or fresh `full_tensor()`s, neither reused for the next one
        out = Outbound(version, self._rules(weights), VersionOptions(stable_tensors=True), drains=weights)
        try:
            stats = self._send(out)
        except Exception as exc:
            drained = out.drained + drain(weights)  # the rest: TRL's other ranks are in the same gathers
            self._failed(version, exc, drained)
            return
        self.last_stats = stats

    def resume(self) -> None:
        """Resume the rollout engines `pause()` paused (a failure is logged, never raised)."""
        if self.rollouts is not None and self._paused:
            self.rollouts.resume()
        self._paused = False

    def destroy(self) -> None:
        """Close the rollout clients and the sender (its port is free again). Idempotent."""
        rollouts, self.rollouts = self.rollouts, None
        sender, self.sender = self.sender, None
        close_both(rollouts, sender)

    # -- helpers -------------------------------------------------------------------------------------
    @property
    def port(self) -> int | None:
        """The sender's bound control port (useful with `transport.port=0`); None before init / after destroy."""
        return self.sender.port if self.sender is not None else None

    def _send(self, out: Outbound) -> SendStats:
        sender = self.sender
        if sender is None:
            raise WeightSyncError("WeightSyncTransfer.send_weights() before init_weight_transfer() or after destroy()")
        if self._pause_error is not None:
            raise self._pause_error
        stats = send_version(out, SendRoute(0, sender, self.rollouts, paused=self._paused))
        assert stats is not None  # a route with a sender sends
        return stats

    def _failed(self, version: int, error: Exception, drained: int) -> None:
        self.failures += 1
        rest = f"; {drained} tensors left unsent were drained" if drained else ""
        if self.config.trainer.on_failure is FailurePolicy.warn and isinstance(error, WeightSyncError):
            logger.warning(
                "weight sync of version %d failed, skipped (trainer.on_failure=warn): %s%s", version, error, rest
            )
            return
        logger.error("weight sync of version %d failed (trainer.on_failure=raise): %s%s", version, error, rest)
        raise error


__all__ = ["WeightSyncTransfer"]
