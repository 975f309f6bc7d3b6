"""Thin adapters that let other frameworks select us: each maps a framework's plug point onto the public API
(`BlockingWeightSender`, `WeightReceiver`, `load_config`, the rollout engines' `RolloutFleet`) and adds no
send path of its own. The framework is imported lazily; a missing one is an `ImportError` naming our extra.

- `trl`: TRL's `AsyncGRPOTrainer(weight_transfer=...)` (`WeightTransferProtocol`), `WeightSyncTransfer`;
- `trl_rollout`: a small CPU `RolloutWorkerProtocol` (a tiny Hugging Face model that receives every version and
  generates), so a whole AsyncGRPO run happens on CPU, and as an example of a rollout that is not vLLM;
- `vllm_trainer`: vLLM's trainer-side `WeightTransferTrainerFactory` engine (`lightning_weightsync`);
- `verl`: verl's checkpoint engine `lightning_weightsync` (selected by `custom_backend_module`);
- `common`: what each of them does to the framework's stream (`trainer.names.*`, `trainer.dtype`).
"""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str, what: str) -> ModuleType:
    """`import module`, or an ImportError that names the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{what} needs {module.split('.')[0]}; install it with pip install 'lightning_weightsync[{extra}]' ({exc})"
        ) from exc
