"""The `vllm.general_plugins` entry point: makes `--weight-transfer-config '{"backend":
"lightning_weightsync"}'` resolve to `LightningWeightSyncEngine` in every vLLM process.

vLLM runs general plugins in each process it starts (API server, engine core, every worker;
vllm/plugins/__init__.py `load_general_plugins`), possibly more than once, and its factory raises on
a duplicate name, so registration checks first. The engine module is registered lazily (vLLM
imports it only when a worker builds the engine), so a vLLM install that never selects this
backend pays nothing.
"""

from __future__ import annotations

from .worker import BACKEND_NAME

ENGINE_MODULE = "lightning_weightsync.rollout_engines.vllm.weight_transfer"
ENGINE_CLASS = "LightningWeightSyncEngine"


def register() -> None:
    """Register the engine with vLLM's `WeightTransferEngineFactory` (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, ENGINE_MODULE, ENGINE_CLASS)


__all__ = ["ENGINE_CLASS", "ENGINE_MODULE", "register"]
