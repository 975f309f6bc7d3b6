"""vLLM's trainer-side weight-transfer API selects us by name: `lightning_weightsync`.

vLLM (0.33.0 and 0.34.0: vllm/distributed/weight_transfer/base.py and factory.py are the same file in both) has
a trainer half: `WeightTransferTrainerFactory.trainer_init(init_info, *, client, source)` builds the engine named
by `init_info.backend` from a `WeightSource` (the trainer's weights: `metadata`, `iter_full()`, `iter_local()`,
`owned_names(rank)`) and a `VLLMWeightSyncClient` (the server's control plane: init, start, update, finish);
`engine.send_weights()` then sends one version, on every trainer rank; `engine.shutdown()` releases it. That
factory reads no entry points, so importing this module registers our engine (idempotent):

    import lightning_weightsync.integrations.vllm_trainer as lws
    engine = WeightTransferTrainerFactory.trainer_init(
        lws.LightningWeightSyncTrainerInitInfo(config="sync.yaml", rank=rank), client=client, source=ModuleSource(model)
    )
    engine.send_weights()   # every rank, every version

What each call does here:
    trainer_init    every rank: checks the source (full tensors, every one owned by rank 0); rank 0 binds our sender
                    and calls `client.init_weight_transfer_engine({"overrides": worker_overrides})`, which (re)starts
                    the receiver of our vLLM worker engine (`--weight-transfer-config '{"backend":
                    "lightning_weightsync"}'`, rollout_engines/vllm/) from its own config
    send_weights    rank 0: `RolloutFleet.run_version` over the client (start_weight_update, update_weights in a
                    thread while our sender streams `source.iter_full()`, finish_weight_update(str(version))); other
                    ranks: walk `iter_full()` (its FSDP all-gathers); a failure drains the stream first, then raises
    shutdown        rank 0: close the sender

Only gather mode: `iter_full()` on rank 0, which must own every parameter (`ParamMeta.owners` None or holding 0).
`iter_local()` into our sharded mode (each rank sends its own shards) is not built yet: a `ConfigError` says so.
The version the workers announce is `initial_version`, then one more per `send_weights`; vLLM calls
`finish_weight_update(weight_version=str(version))`, as the server's `/finish_weight_update` records it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..config import SenderSettings, load_config, settings
from ..errors import ConfigError
from ..plugins import RolloutClient
from ..trainer.fleet import RolloutFleet
from ..trainer.gather import drain
from ..trainer.send import Outbound, SendRoute, send_version
from ..versions.options import VersionOptions
from . import require
from .common import StreamRules, close_both

_base = require("vllm.distributed.weight_transfer.base", "vllm", "the vLLM trainer-side engine")
_factory = require("vllm.distributed.weight_transfer.factory", "vllm", "the vLLM trainer-side engine")

logger = logging.getLogger(__name__)

BACKEND_NAME = "lightning_weightsync"  # the worker engine's name too (rollout_engines/vllm/worker.py BACKEND_NAME)


@dataclass
class LightningWeightSyncTrainerInitInfo(_base.TrainerInitInfo):  # type: ignore[name-defined]
    """Our trainer init info (`rank`, keyword-only, from vLLM's base: this trainer process's rank).

    config: our YAML's path (None: the defaults); `overrides`: `key=value` onto it (trainer side: `transport.*`,
        `trainer.min_receivers`, `trainer.names.*`, `trainer.dtype`).
    worker_overrides: sent as the workers' `init_info.overrides` (only the keys our worker engine accepts over HTTP:
        waits and how bytes move, never the address or the token).
    initial_version: the first version `send_weights` sends.
    """

    backend: ClassVar[str] = BACKEND_NAME
    config: str | None = None
    overrides: list[str] = field(default_factory=list)
    worker_overrides: list[str] = field(default_factory=list)
    initial_version: int = 1


class _VLLMServer(RolloutClient):
    """The `VLLMWeightSyncClient` as a `RolloutClient` (plugins.py), so `RolloutFleet` runs the
    version's steps, with its bounds and error lines, as it does for `vllm.urls`. Pause and resume are the
    caller's (vLLM's trainer API has none); `workers()` is unknown (the client cannot say)."""

    engine = "vllm"
    timeout_knob = "transport.timeout_s"

    def __init__(self, client: Any) -> None:
        self.client = client
        self.name = type(client).__name__

    def workers(self) -> int | None:
        return None

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def start_update(self) -> None:
        self.client.start_weight_update()

    def update(self, version: int, receive_timeout_s: float | None) -> None:
        self.client.update_weights({"version": version, "timeout_s": receive_timeout_s})

    def finish_update(self, weight_version: str | None) -> None:
        self.client.finish_weight_update(weight_version)

    def after_update(self, version: int) -> None:
        pass

    def verify(self, version: int) -> None:
        pass

    def weight_version(self) -> str | None:
        return None  # the client cannot ask


class LightningWeightSyncTrainerEngine(_base.TrainerWeightTransferEngine):  # type: ignore[name-defined]
    """vLLM's `TrainerWeightTransferEngine` with our sender (built by `WeightTransferTrainerFactory.trainer_init`)."""

    init_info_cls = LightningWeightSyncTrainerInitInfo

    @classmethod
    def trainer_init(
        cls, init_info: LightningWeightSyncTrainerInitInfo, *, client: Any, source: Any = None
    ) -> LightningWeightSyncTrainerEngine:
        _check_source(source, init_info.rank)  # the same on every rank: every rank raises alike
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, rank=init_info.rank)
        engine._start(init_info)
        return engine

    def _start(self, info: LightningWeightSyncTrainerInitInfo) -> None:
        self.config = settings(load_config(info.config, list(info.overrides)))
        self.next_version = int(info.initial_version)
        self._rules = StreamRules(self.config.trainer)
        self.sender: Any = None
        self.rollouts: RolloutFleet | None = None
        if not self.is_sender:
            return
        from ..versions.sender import BlockingWeightSender

        sender = BlockingWeightSender(SenderSettings.of(self.config))
        sender.start()
        try:
            self.client.init_weight_transfer_engine({"overrides": list(info.worker_overrides)})
        except BaseException:
            sender.close()
            raise
        self.sender = sender
        t = self.config.transport
        self.rollouts = RolloutFleet([_VLLMServer(self.client)], timeout_s=t.timeout_s, receive_timeout_s=t.timeout_s)
        logger.info("vLLM trainer engine %r: weight sender listening on %s:%d", BACKEND_NAME, t.host, sender.port)

    @property
    def port(self) -> int | None:
        """The sender's control port (rank 0), for `transport.port=0`."""
        return self.sender.port if self.sender is not None else None

    def send_weights(self) -> None:
        """One version of `source.iter_full()`; every rank. Raises on failure, on rank 0, after draining."""
        version = self.next_version
        self.next_version += 1
        weights: Iterator[tuple[str, torch.Tensor]] = iter(self.source.iter_full())
        if not self.is_sender:
            drain(weights)  # the gathers, in step with rank 0
            return
        sender, rollouts = self.sender, self.rollouts
        if sender is None or rollouts is None:
            drain(weights)
            raise ConfigError("LightningWeightSyncTrainerEngine.send_weights() after shutdown()")
        # drained whatever fails (`drains`): the gathers, in step with the other ranks
        out = Outbound(version, self._rules(weights), VersionOptions(stable_tensors=True), drains=weights)
        send_version(out, SendRoute(0, sender, rollouts, paused=True))  # vLLM's caller paused the engine

    def shutdown(self) -> None:
        rollouts, self.rollouts = self.rollouts, None
        sender, self.sender = self.sender, None
        close_both(rollouts, sender)


def _check_source(source: Any, rank: int) -> None:
    if source is None or not source.implements_iter_full():
        raise ConfigError(
            f"the {BACKEND_NAME} trainer engine sends full tensors: pass a WeightSource that implements iter_full() "
            "(vLLM's ModuleSource does); iter_local() into sharded mode is not supported yet"
        )
    for meta in source.metadata:
        if meta.owners is not None and 0 not in meta.owners:
            raise ConfigError(
                f"the {BACKEND_NAME} trainer engine sends every tensor from trainer rank 0, but {meta.name!r} is owned "
                f"by ranks {meta.owners} (pipeline stages): not supported; gather it onto rank 0 in the source"
            )


def register() -> None:
    """Register the trainer engine with vLLM's `WeightTransferTrainerFactory` (idempotent; done at import)."""
    registry = _factory.WeightTransferTrainerFactory._registry
    if BACKEND_NAME not in registry:
        _factory.WeightTransferTrainerFactory.register_engine(BACKEND_NAME, LightningWeightSyncTrainerEngine)


register()

__all__ = ["BACKEND_NAME", "LightningWeightSyncTrainerEngine", "LightningWeightSyncTrainerInitInfo", "register"]
