"""`AccelerateWeightSync`: one line after `accelerator.prepare` syncs weights every N optimizer steps.

    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    weight_sync = AccelerateWeightSync(accelerator, model, load_config("sync.yaml"))
    ...  # train as usual; every `trainer.every_n_steps` real optimizer steps the weights go out
    weight_sync.close()

How it hooks in: a step post-hook on the *underlying* optimizer (`AcceleratedOptimizer.optimizer`;
the wrapper itself has no `register_step_post_hook`). Accelerate only calls the underlying
`step()` when gradients are synchronised (not on accumulation micro-steps) and not when the AMP
scaler skips a step, so the hook counts real optimizer steps; it also checks
`accelerator.sync_gradients`. The hook runs on every rank (every rank steps), which is what the
gather needs. `.sync(version)` is there for custom schedules.

The model may be what Accelerate prepared (DDP, FSDP1 or FSDP2 through the FSDP plugin) or a model
you sharded yourself (e.g. `fully_shard` where Accelerate will not, such as on CPU):
`iter_full_parameters` handles each, and drops wrapper names.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..config import UserConfig, settings
from ..errors import ConfigError, WeightSyncError
from .driver import SENDER_RANK, SyncDriver
from .gather import NamedTensor, is_sharded
from .record import SyncRecord, SyncRecordView

logger = logging.getLogger(__name__)


class AccelerateWeightSync(SyncRecordView):
    """Sync `model`'s weights to rollout receivers from an Accelerate training loop.

    Args:
        accelerator: the `accelerate.Accelerator` (its process group, device and gradient state).
        model: the model as training uses it (after `accelerator.prepare`, or sharded by hand).
        cfg: the weightsync config; None means the defaults. Converted once, here, to the typed
            `WeightSyncConfig` (`config.settings`). Uses `trainer.every_n_steps`,
            `trainer.sync_on_fit_start` (sync version `initial_step` right away),
            `trainer.on_failure`, `trainer.dtype`, `trainer.include_buffers`, `trainer.names.*`,
            `trainer.min_receivers` and `transport.*`.
        optimizer: the (prepared) optimizer whose steps are counted. Default: the one optimizer
            the accelerator prepared; required when it prepared several.
        module_attr: send only this submodule of `model` (its prefix is stripped from names).
        initial_step: optimizer steps already taken (when resuming); versions continue from it.

    Every rank must construct it (the start-up and every sync are collective). Global rank 0 owns
    the sender: torch.distributed's rank when it is initialised (so a plain `Accelerator()` under
    torchrun, which reports process 0 on every CPU rank, still has one sender), else
    `accelerator.process_index`. Logs `weightsync/*` through `accelerator.log` when trackers are
    configured.
    """

    def __init__(
        self,
        accelerator: Any,
        model: nn.Module,
        cfg: UserConfig = None,
        *,
        optimizer: Any | None = None,
        module_attr: str | None = None,
        initial_step: int = 0,
    ) -> None:
        self.accelerator = accelerator
        self.model = model
        self.config = settings(cfg)  # the edge: the one DictConfig -> typed conversion of the trainer side
        self.every_n_steps = self.config.trainer.every_n_steps
        self.step = int(initial_step)
        self.record = SyncRecord()  # last synced version, failures, last SendStats: kept by SyncDriver
        inner = self._inner_optimizer(optimizer)
        plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
        if plugin is not None and is_sharded(model):
            logger.info("Accelerate FSDP plugin active (fsdp_version=%s)", getattr(plugin, "fsdp_version", 1))
        elif plugin is not None:  # e.g. on CPU, where Accelerate prepares DDP whatever the plugin says
            logger.warning(
                "Accelerate's FSDP plugin is configured (fsdp_version=%s) but the model is not sharded: Accelerate "
                "did not apply FSDP (it does not on CPU), so every rank holds and gathers the whole model. Shard it "
                "yourself with fully_shard before AccelerateWeightSync (recipes/accelerate_tiny.py, "
                "recipe.fsdp2_by_hand=true), or run on GPUs",
                getattr(plugin, "fsdp_version", 1),
            )
        self._driver = SyncDriver(
            self.config,
            rank=int(accelerator.process_index),
            device=torch.device(accelerator.device),
            prefix=module_attr,
            record=self.record,
        )
        if self._driver.rank != int(accelerator.process_index):
            logger.warning(
                "Accelerator says process %d of %d but torch.distributed says global rank %d: this Accelerator "
                "did not see the launch (on CPU pass Accelerator(cpu=True)), so it will not synchronise gradients; "
                "the weight sync uses global rank %d as the sender",
                accelerator.process_index, accelerator.num_processes, self._driver.rank, SENDER_RANK,
            )  # fmt: skip
        self._driver.start()
        self._hook = inner.register_step_post_hook(self._after_optimizer_step)
        if self.config.trainer.sync_on_fit_start:
            self.sync(self.step)

    def _inner_optimizer(self, optimizer: Any | None) -> torch.optim.Optimizer:
        if optimizer is None:
            prepared = list(getattr(self.accelerator, "_optimizers", []))
            if len(prepared) != 1:
                raise ConfigError(
                    f"AccelerateWeightSync: the accelerator prepared {len(prepared)} optimizers; pass the one whose "
                    "steps count as `optimizer=`"
                )
            optimizer = prepared[0]
        inner = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer wraps the real one
        if not isinstance(inner, torch.optim.Optimizer):
            raise ConfigError(f"AccelerateWeightSync: {type(inner).__name__} is not a torch.optim.Optimizer")
        return inner

    # -- when ----------------------------------------------------------------------------------------
    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.accelerator.sync_gradients:
            return  # an accumulation micro-step (Accelerate does not step then; belt and braces)
        self.step += 1
        if self.step % self.every_n_steps == 0:
            self.sync(self.step)

    # -- how (delegated) ---------------------------------------------------------------------------------
    def sync(self, version: int) -> bool:
        """Gather and send `version` now; every rank must call it. True when delivered (trainer.overlap:
        when the previous version was; this one is sent in the background, see `finish`)."""
        if self._driver.sender is None and self._driver.is_sender:
            raise WeightSyncError("AccelerateWeightSync.sync() after close()")
        if not self._driver.sync(self.model, version):
            return False
        metrics = self.record.metrics(self.record.last_synced_version or version)
        if metrics is not None and getattr(self.accelerator, "trackers", None):
            self.accelerator.log(metrics, step=self.step)
        return True

    def weights(self, *, keep_on_rank: int | None = SENDER_RANK) -> Iterator[NamedTensor]:
        """The exact stream a sync sends (same names, dtype and exclusions); every rank must exhaust it."""
        return self._driver.weights(self.model, keep_on_rank=keep_on_rank)

    @property
    def port(self) -> int | None:
        """The sender's bound control port on global rank 0 (useful with `transport.port=0`)."""
        return self._driver.port

    @property
    def is_sender(self) -> bool:
        """True on the one process that sends (global rank 0 of torch.distributed when initialised)."""
        return self._driver.is_sender

    # -- life cycle / state ----------------------------------------------------------------------------
    def finish(self) -> bool:
        """With `trainer.overlap`: wait for the version in flight (send the final step's when `latest`
        skipped it) and apply `trainer.on_failure` to it; every rank. True when it was delivered."""
        if self._driver.finish(self.model, self.step):
            metrics = self.record.metrics(self.record.last_synced_version or 0)
            if metrics is not None and getattr(self.accelerator, "trackers", None):
                self.accelerator.log(metrics, step=self.step)
            return True
        return False

    def close(self) -> None:
        """Finish (trainer.overlap: the last version is sent or its failure raised), then release."""
        try:
            self._driver.finish(self.model, self.step)
        finally:
            self._release()

    def _release(self) -> None:
        self._hook.remove()
        self._driver.close()  # interrupts a background send still in flight

    def __enter__(self) -> AccelerateWeightSync:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:  # training failed: do not wait for a version in flight (close interrupts it)
            self._release()

    def state_dict(self) -> dict[str, Any]:
        """For `accelerator.register_for_checkpointing(weight_sync)`."""
        return {"step": self.step, **self.record.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state.get("step", self.step))
        self.record.load_state_dict(state)
