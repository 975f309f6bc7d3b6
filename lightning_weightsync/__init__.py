"""lightning_weightsync: stream trainer weights to rollout engines, chunked and pickle-free.

Heavy pieces (the sender and receiver, integrations) are imported lazily so that `import lightning_weightsync`
stays cheap and optional extras (lightning, accelerate, cupy, torch_npu) are only needed when used.
"""

from __future__ import annotations

import importlib
from typing import Any

from .config import load_config
from .errors import (
    BackendUnavailable,
    ConfigError,
    PeerError,
    ProtocolError,
    SinkError,
    VerifyError,
    VersionAborted,
    WeightSyncError,
    WeightSyncTimeout,
)
from .protocol.chunks import TensorMeta, merge_weight_chunks, split_weight_chunks

__version__ = "0.1.0"

_LAZY = {
    "WeightSender": "versions.sender",
    "BlockingWeightSender": "versions.sender",
    "VersionOptions": "versions.options",
    "SendStats": "versions.stats",
    "WeightReceiver": "versions.receiver",
    "ReceiveStats": "versions.stats",
    "iter_full_parameters": "trainer.gather",
    "WeightSyncCallback": "trainer.lightning",
    "AccelerateWeightSync": "trainer.accelerate",
}

__all__ = [
    "BackendUnavailable",
    "ConfigError",
    "PeerError",
    "ProtocolError",
    "SinkError",
    "TensorMeta",
    "VerifyError",
    "VersionAborted",
    "WeightSyncError",
    "WeightSyncTimeout",
    "load_config",
    "merge_weight_chunks",
    "split_weight_chunks",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_weightsync' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
