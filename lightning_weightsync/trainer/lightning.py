"""`WeightSyncCallback`: push the trainer's weights to rollout processes every N optimizer steps.

    trainer = L.Trainer(..., callbacks=[WeightSyncCallback(load_config("sync.yaml"))])

The callback only decides *when*: after every `trainer.every_n_steps` real optimizer steps (and
once when training starts, if `trainer.sync_on_fit_start`). *How* is `gather.iter_full_parameters`
(all ranks gather, FSDP2/FSDP1/DDP/single device) and `BlockingWeightSender` (global rank 0 only).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from typing import Any

import torch

from ..config import UserConfig, settings
from ..errors import BackendUnavailable, WeightSyncError
from .driver import SENDER_RANK, SyncDriver
from .gather import NamedTensor
from .interrupt import raise_signal
from .names import served_child
from .record import SyncRecord, SyncRecordView

try:
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - the standalone `pytorch_lightning` package
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]
    except ImportError:
        raise BackendUnavailable(
            "WeightSyncCallback needs Lightning: pip install 'lightning_weightsync[lightning]' (lightning>=2.2; "
            "the standalone pytorch_lightning package works too). Accelerate users: AccelerateWeightSync needs "
            "neither"
        ) from None

logger = logging.getLogger(__name__)


def _hand_to_lightning(trainer: pl.Trainer, signum: int) -> None:
    """A signal that stopped a sync, handed to Lightning on every rank at the same point (`SyncDriver`).

    SIGTERM sets Lightning's own flag, which its loop checks on every rank (broadcast from rank 0 at the
    next batch) and turns into `SIGTERMException` everywhere; calling Lightning's handler instead would
    run its `dist.broadcast` once per delivery, and its launcher forwards SIGTERM to the other ranks, who
    would then broadcast twice. Anything else (SIGINT: `KeyboardInterrupt`, Lightning's graceful stop) is
    raised again on this process."""
    connector = getattr(trainer, "_signal_connector", None)
    if signum == getattr(signal, "SIGTERM", None) and hasattr(connector, "received_sigterm"):
        logger.info("SIGTERM during a weight sync: handed to Lightning, which stops every rank at the next batch")
        connector.received_sigterm = True  # type: ignore[union-attr]
        return
    raise_signal(signum)


class WeightSyncCallback(SyncRecordView, pl.Callback):
    """Gather the full weights and send them to every registered rollout receiver.

    Args:
        cfg: the weightsync config (`load_config(...)`); None means the defaults. Converted once, here, to
            the typed `WeightSyncConfig` (`config.settings`); the sync reads only its sections. Used keys:
            `trainer.every_n_steps` (1), `trainer.sync_on_fit_start` (True), `trainer.sync_on_train_end` (True),
            `trainer.on_failure` (`raise`), `trainer.dtype`, `trainer.include_buffers`,
            `trainer.names.*`, `trainer.min_receivers` and `transport.*` (for the sender).
        module_attr: the attribute of your LightningModule that holds the network the rollout
            serves (e.g. ``"model"`` for ``self.model = ...``). Only its tensors are sent, and the
            ``model.`` prefix is stripped from their names. None (default): the rule below.
            ``""``: the whole LightningModule, names as in its `state_dict()`.

    Which network (``module_attr=None``): when the LightningModule has no parameters or persistent
    buffers of its own and exactly one direct child holds them all (the usual ``self.model =
    AutoModelForCausalLM...``; a loss module without state does not count), that child is sent under
    its own names (``model.embed_tokens.weight``, as the rollout's copy of the same class names it).
    Otherwise the whole LightningModule is sent under its state-dict names. Decided once, at the
    first sync (after `configure_model`), identically on every rank, and logged.

    When:
        - `on_train_start` (after a resumed checkpoint is restored): version `trainer.global_step`
          (0 on a fresh run), if `trainer.sync_on_fit_start`. A resumed run re-sends its restored
          weights so rollouts never serve weights the trainer no longer has; receivers accept it
          because every sender process starts a new session.
        - `on_train_batch_end` after a batch in which the optimizer stepped (Lightning has already
          incremented `trainer.global_step` there) and `global_step % every_n_steps == 0`:
          version `global_step`. Gradient-accumulation micro-batches do not step, so they never
          sync; a version is attempted at most once.
        - `on_train_end`, if `trainer.sync_on_train_end` and the final step was not attempted yet
          (e.g. `max_steps` not a multiple of `every_n_steps`), so rollouts end on the final weights.

    Failure (`trainer.on_failure`): a rollout that is gone (stopped, killed, cut off) fails the sync
    within `transport.liveness_s`; a stalled one within `transport.timeout_s`; never a hang. `raise`
    stops training on every rank; `warn` logs once (then at most once a minute while it lasts), skips
    the version and keeps training. All ranks agree on the outcome with one tiny all-reduce, so no rank
    is left waiting in a collective.

    Overlap (`trainer.overlap: true`, trainer/overlap.py): a sync snapshots the version and returns; it
    is sent while the next steps compute, its outcome handled at the next sync (and at `on_train_end`,
    before fit returns). The metrics logged at a sync are then the previous version's.

    Signals: a SIGTERM or SIGINT on any rank during a sync ends the sync on every rank within seconds,
    then reaches Lightning as if it had come just after it (SIGTERM: Lightning's graceful stop on every
    rank at the next batch); see `trainer/interrupt.py`.

    Logged (global rank 0, through `trainer.loggers`, at step `global_step`): `weightsync/seconds`,
    `weightsync/GBps`, `weightsync/version`, `weightsync/receivers`, `weightsync/stall_seconds`,
    `weightsync/replica_drift` (sharded mode: tensors whose whole copies differed between ranks).

    State (`state_dict`, saved in Lightning checkpoints): `last_synced_version`, `failures`.
    """

    def __init__(self, cfg: UserConfig = None, *, module_attr: str | None = None) -> None:
        super().__init__()
        self.config = settings(cfg)  # the edge: the one DictConfig -> typed conversion of the trainer side
        self.module_attr = module_attr
        self.every_n_steps = self.config.trainer.every_n_steps
        self.record = SyncRecord()  # last synced version, failures, last SendStats (rank 0): see SyncDriver
        self._prefix: str | None = None  # resolved module_attr
        self._driver: SyncDriver | None = None
        self._seen_step = 0  # global_step at the last batch end: a change means the optimizer stepped
        self._last_attempted: int | None = None

    # -- life cycle ---------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self._driver is not None:
            return
        self._driver = SyncDriver(
            self.config,
            rank=trainer.global_rank,
            device=trainer.strategy.root_device,
            prefix=None,  # resolved at the first sync: configure_model may create the network later
            record=self.record,
        )
        self._driver.deliver_signal = lambda signum: _hand_to_lightning(trainer, signum)
        self._driver.start()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self._driver is not None:
            self._driver.close()
            self._driver = None

    @property
    def port(self) -> int | None:
        """The sender's bound control port on global rank 0 (useful with `transport.port=0`)."""
        return self._driver.port if self._driver is not None else None

    # -- when ----------------------------------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._seen_step = trainer.global_step
        if self.config.trainer.sync_on_fit_start:
            self.sync(trainer, trainer.global_step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the last steps may not be a multiple of every_n_steps: rollouts should end on the final weights
        if self.config.trainer.sync_on_train_end and trainer.global_step != self._last_attempted:
            self.sync(trainer, trainer.global_step)
        # trainer.overlap: the last version is sent (or its failure raised) before fit returns
        final = trainer.global_step if self.config.trainer.sync_on_train_end else None
        driver = self._driver
        # blocking syncs: nothing in flight
        if driver is not None and driver.overlap is not None and driver.finish(self._module(trainer), final):
            self._log_metrics(trainer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        stepped, self._seen_step = step != self._seen_step, step
        if stepped and step % self.every_n_steps == 0 and step != self._last_attempted:
            self.sync(trainer, step)

    # -- how (delegated) -------------------------------------------------------------------------------
    def sync(self, trainer: pl.Trainer, version: int) -> None:
        """Gather and send now (every rank must call this). Public for custom schedules."""
        if self._driver is None:
            raise WeightSyncError("WeightSyncCallback.sync() outside trainer.fit() (the sender is not set up)")
        self._last_attempted = version
        self._resolve_prefix(trainer)
        if self._driver.sync(self._module(trainer), version):
            self._log_metrics(trainer)

    def _log_metrics(self, trainer: pl.Trainer) -> None:
        """`weightsync/*` of the version just delivered (with trainer.overlap: the previous one)."""
        version = self.record.last_synced_version
        metrics = self.record.metrics(version) if version is not None else None
        if metrics is not None:  # the sending rank
            for lg in trainer.loggers:
                lg.log_metrics(metrics, step=trainer.global_step)

    def weights(self, trainer: pl.Trainer, *, keep_on_rank: int | None = SENDER_RANK) -> Iterator[NamedTensor]:
        """The exact stream a sync sends (same names, dtype and exclusions); every rank must exhaust it."""
        if self._driver is None:
            raise WeightSyncError("WeightSyncCallback.weights() outside trainer.fit()")
        self._resolve_prefix(trainer)
        return self._driver.weights(self._module(trainer), keep_on_rank=keep_on_rank)

    def _resolve_prefix(self, trainer: pl.Trainer) -> None:
        """`module_attr`, or the documented rule (see the class docstring), once per fit."""
        assert self._driver is not None
        if self._prefix is None:
            if self.module_attr is not None:
                self._prefix = self.module_attr
            else:
                self._prefix = (
                    served_child(trainer.lightning_module, include_buffers=self.config.trainer.include_buffers) or ""
                )
                logger.info(
                    "WeightSyncCallback: no module_attr given; sending %s (pass module_attr to choose)",
                    f"LightningModule.{self._prefix}, its one child holding tensors, under its own names"
                    if self._prefix
                    else "the whole LightningModule under its state-dict names",
                )
        self._driver.prefix = self._prefix or None

    def _module(self, trainer: pl.Trainer) -> torch.nn.Module:
        # the module as the strategy trains it (DDP/FSDP1 wrapper, or the FSDP2 LightningModule):
        # FSDP1 must be summoned from its root, and wrapper names are dropped by the gather
        model = trainer.strategy.model
        assert model is not None
        return model

    # -- state -----------------------------------------------------------------------------------------
    @property
    def state_key(self) -> str:
        # stable across subclasses and config changes, so a resumed run finds its state
        return f"WeightSyncCallback{{'module_attr': {self.module_attr!r}}}"

    def state_dict(self) -> dict[str, Any]:
        return self.record.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.record.load_state_dict(state_dict)
