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

What the rank declares to the sender: at the receiver's start, the quantization contract of a model SGLang built
from a serialized block-FP8 checkpoint (`quant_contract.py`), so that the trainer sends FP8 bytes and
`weight_scale_inv` from its bf16 weights (a model this library cannot feed is refused there, by module, and no
receiver starts); with tensor parallelism (`transport.slices`), once per checkpoint layout and after the first
version, the box of each tensor its parameters read (`slices.py`, traced on SGLang's own loaders), so that the
next versions send it only those boxes. Deriving the boxes failing only costs the slices: logged, tensors keep
coming whole.

Never raises: SGLang dispatches this call without an exception handler and quits the server on one
(scheduler.py:2253, 6370-6373). A failed version is logged and nacked with its reason (the trainer's
error names it); the trainer then closes the session and marks the weight version incomplete.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from ...errors import ConfigError
from ...protocol.dtypes import itemsize
from ...quantize import QuantContract
from ..adapter import AdapterDirectory, EngineVersionSink
from ..worker import CONFIG_ENV, WorkerReceiver, worker_identity, worker_rank

logger = logging.getLogger(__name__)


class RankReceiver:
    """This TP rank's receiver and its loop thread, started once per process."""

    def __init__(
        self, device: torch.device, config_path: str | None = None, *, contract: QuantContract | None = None
    ) -> None:
        """`contract`: what the model loads quantized (`quant_contract.declared_contract`), declared before the
        receiver's first Ready."""
        from ...config import ReceiverSettings, load_config, settings

        path = config_path if config_path is not None else os.environ.get(CONFIG_ENV)
        if not path:
            raise ConfigError(
                f"lightning_weightsync SGLang loader: ${CONFIG_ENV} is not set in the server's environment; start "
                "it with `lightning-weightsync rollout rollout.engine=sglang ...`"
            )
        cfg = load_config(path)
        self.rank, self.tp_size = tp_rank_size()
        self.identity = worker_identity(cfg.rollout.identity, self.rank)
        overrides = [f"transport.device={device}", f"rollout.device={device}", f"rollout.identity={self.identity}"]
        config = settings(load_config(base=cfg, overrides=overrides))  # the edge: this process read the YAML
        self.worker = WorkerReceiver(ReceiverSettings.of(config), device)
        self.receiver = self.worker.receiver
        self.receiver.declare_contract(contract)  # before the receiver's first Ready (it reads it there)
        if contract is not None:
            logger.info("%s: declares its model's quantization contract %s (%d rules, %d kept patterns): the trainer "
                        "sends it FP8 bytes and scales", self.identity, contract.digest()[:12], len(contract.rules),
                        len(contract.keep))  # fmt: skip
        self.checkpoint: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}  # the last whole version's tensors
        self._sliced_for: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
        # trainer.lora=adapter: TP rank 0 writes each version to sglang.lora_dir for /load_lora_adapter
        self.adapters = AdapterDirectory(config.sglang.lora_dir, "sglang.lora_dir", writes=self.rank == 0)
        self.version: int | None = None  # the version the model holds, when whole
        self.last_report: dict[str, Any] = {}
        logger.info("lightning_weightsync SGLang loader: rank %d is %s on %s", self.rank, self.identity, device)

    def receive_into(self, model: torch.nn.Module) -> int:
        """One version into `model`; its number. Raises on a failed version (recorded in `last_report`)."""
        self.declare_slices(model)
        sink = EngineVersionSink(model, None, self.adapters)  # SGLang passes no version: whichever comes next
        try:
            record = self.worker.receive(sink)
        except Exception as exc:
            version = self.receiver.version
            self.last_report = {"ok": False, "version": version, "error": str(exc), "touched": sink.touched}
            raise
        assert record.version is not None
        self.version = record.version
        if not sink.is_adapter:
            self.checkpoint = dict(sink.model_sink.shapes)
        self.last_report = {"ok": True, "version": record.version, "nbytes": record.nbytes, "seconds": record.seconds}
        logger.info(
            "%s: version %d loaded (%d tensors, %.1f MB, %.2fs)",
            self.identity, record.version, record.num_tensors, record.nbytes / 1e6, record.seconds,
        )  # fmt: skip
        return record.version

    def declare_slices(self, model: torch.nn.Module) -> None:
        """With tensor parallelism and `transport.slices`: once per checkpoint layout (the names and shapes the last
        version sent: FP8 weights and their scales where the contract quantizes), derive the box of each tensor this
        rank's parameters read and declare them, with the next Ready. A failure only costs the slices."""
        if not self.checkpoint or self.checkpoint == self._sliced_for:
            return
        if not self.receiver.settings.transport.slices or self.tp_size < 2:
            return
        from .slices import derive_boxes

        layout = self._sliced_for = dict(self.checkpoint)
        shapes = {name: shape for name, (shape, _) in layout.items()}
        try:
            slices = derive_boxes(model, shapes)
        except Exception as exc:
            logger.warning("%s: deriving tensor-parallel slices failed (%s: %s); tensors keep coming whole",
                           self.identity, type(exc).__name__, exc)  # fmt: skip
            return

        async def declare() -> None:
            self.receiver.declare_boxes(slices.boxes)

        self.worker.loop.call(declare(), timeout_s=30)
        whole = sum(math.prod(shape) * itemsize(dtype) for shape, dtype in layout.values())
        sliced = slices.nbytes(shapes, lambda name: itemsize(layout[name][1]))
        logger.info("%s: declared the boxes of %d of %d tensors (TP rank %d of %d): %.1f of %.1f MB a version",
                    self.identity, len(slices.boxes), len(layout), self.rank, self.tp_size, sliced / 1e6,
                    whole / 1e6)  # fmt: skip

    def close(self) -> None:
        self.worker.close()


_rank: RankReceiver | None = None
_lock = threading.Lock()


def rank_receiver(model: torch.nn.Module) -> RankReceiver:
    """This process's receiver (one per TP rank: SGLang runs a scheduler process per rank), started on the
    model's device with the contract its model declares."""
    global _rank
    with _lock:
        if _rank is None:
            from .quant_contract import declared_contract

            _rank = RankReceiver(_device(model), contract=declared_contract(model))
        return _rank


def tp_rank_size() -> tuple[int, int]:
    """This scheduler's rank and size in SGLang's tensor-parallel group; outside SGLang (tests without it), the
    default process group's rank, and 1."""
    try:
        from sglang.srt.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        return int(get_tensor_model_parallel_rank()), int(get_tensor_model_parallel_world_size())
    except Exception:  # SGLang not installed, or its groups not made (no server around this loader)
        return worker_rank(), 1


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
        rank = rank_receiver(model)
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


__all__ = ["RankReceiver", "load_weights", "rank_receiver", "tp_rank_size"]
