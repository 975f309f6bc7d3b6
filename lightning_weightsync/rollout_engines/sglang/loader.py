"""SGLang's custom weight loader: one version from our sender into `model.load_weights`, on each TP rank.

SGLang runs it as `load_weights(model, named_tensors)` on every TP rank's scheduler thread when the
trainer posts `/update_weights_from_tensor` with `load_format` set to this function's import path (the
server must list it in `--custom-weight-loader`; `launch.py` does). `named_tensors` is the empty list
the trainer sent: the bytes come over our data plane instead. The first call starts this rank's
`WeightReceiver` from `$LIGHTNING_WEIGHTSYNC_CONFIG` (SGLang imports the loader only then, so the first
version waits, within transport.timeout_s, for every rank to register); it stays registered, with its
heartbeats on its own loop thread, while the scheduler generates. Each call runs exactly one version
through the shared receive loop (`rollout/consume.py`); tensors are handed back to this thread one at
a time (`ModelLoadSink`), so memory beyond the model is two buckets plus one merged tensor, and SGLang's
own name mapping and TP sharding apply. A LoRA adapter version (`trainer.lora=adapter`) is written by TP
rank 0 to `sglang.lora_dir` instead (`rollout_engines/adapter.py`), for the trainer to have SGLang load by path.
The model holds exactly what the trainer sent (bitwise).

Never raises: SGLang dispatches this call without an exception handler and quits the server on one
(scheduler.py:2253, 6370-6373). A failed version is logged and nacked with its reason (the trainer's
error names it); the trainer then closes the session and marks the weight version incomplete.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from ...errors import ConfigError
from ..adapter import AdapterDirectory, EngineVersionSink
from ..worker import CONFIG_ENV, WorkerReceiver, worker_identity, worker_rank

logger = logging.getLogger(__name__)


class RankReceiver:
    """This TP rank's receiver and its loop thread, started once per process."""

    def __init__(self, device: torch.device, config_path: str | None = None) -> None:
        from ...config import ReceiverSettings, load_config, settings

        path = config_path if config_path is not None else os.environ.get(CONFIG_ENV)
        if not path:
            raise ConfigError(
                f"lightning_weightsync SGLang loader: ${CONFIG_ENV} is not set in the server's environment; start "
                "it with `lightning-weightsync rollout rollout.engine=sglang ...`"
            )
        cfg = load_config(path)
        self.rank = worker_rank()
        self.identity = worker_identity(cfg.rollout.identity, self.rank)
        overrides = [f"transport.device={device}", f"rollout.device={device}", f"rollout.identity={self.identity}"]
        config = settings(load_config(base=cfg, overrides=overrides))  # the edge: this process read the YAML
        self.worker = WorkerReceiver(ReceiverSettings.of(config), device)
        self.receiver = self.worker.receiver
        # trainer.lora=adapter: TP rank 0 writes each version to sglang.lora_dir for /load_lora_adapter
        self.adapters = AdapterDirectory(config.sglang.lora_dir, "sglang.lora_dir", writes=self.rank == 0)
        self.version: int | None = None  # the version the model holds, when whole
        self.last_report: dict[str, Any] = {}
        logger.info("lightning_weightsync SGLang loader: rank %d is %s on %s", self.rank, self.identity, device)

    def receive_into(self, model: torch.nn.Module) -> int:
        """One version into `model`; its number. Raises on a failed version (recorded in `last_report`)."""
        sink = EngineVersionSink(model, None, self.adapters)  # SGLang passes no version: whichever comes next
        try:
            record = self.worker.receive(sink)
        except Exception as exc:
            version = self.receiver.version
            self.last_report = {"ok": False, "version": version, "error": str(exc), "touched": sink.touched}
            raise
        assert record.version is not None
        self.version = record.version
        self.last_report = {"ok": True, "version": record.version, "nbytes": record.nbytes, "seconds": record.seconds}
        logger.info(
            "%s: version %d loaded (%d tensors, %.1f MB, %.2fs)",
            self.identity, record.version, record.num_tensors, record.nbytes / 1e6, record.seconds,
        )  # fmt: skip
        return record.version

    def close(self) -> None:
        self.worker.close()


_rank: RankReceiver | None = None
_lock = threading.Lock()


def rank_receiver(device: torch.device) -> RankReceiver:
    """This process's receiver (one per TP rank: SGLang runs a scheduler process per rank)."""
    global _rank
    with _lock:
        if _rank is None:
            _rank = RankReceiver(device)
        return _rank


def _device(model: torch.nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")


def load_weights(model: torch.nn.Module, named_tensors: Sequence[Any]) -> None:
    """SGLang's custom-loader signature (`loader(model, named_tensors)`): receive one version into `model`."""
    if len(named_tensors):
        logger.error(
            "lightning_weightsync SGLang loader: got %d tensors over SGLang's own path; this loader receives from "
            "the trainer's sender only (send an empty list); ignored",
            len(named_tensors),
        )
        return
    try:
        rank = rank_receiver(_device(model))
    except Exception:  # never into SGLang's scheduler loop (see the module docstring)
        logger.exception("lightning_weightsync SGLang loader: the receiver could not start; no version loaded")
        return
    try:
        rank.receive_into(model)
    except Exception as exc:  # never into SGLang's scheduler loop: the trainer hears it from our nack
        touched = rank.last_report.get("touched")
        logger.error(
            "%s: version %s failed (%s: %s)%s", rank.identity, rank.last_report.get("version"), type(exc).__name__,
            exc, "; the model holds part of it until the next version" if touched else "",
        )  # fmt: skip


__all__ = ["RankReceiver", "load_weights", "rank_receiver"]
