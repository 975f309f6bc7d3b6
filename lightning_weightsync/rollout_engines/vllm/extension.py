"""`--worker-extension-cls` for `vllm serve`: the one worker method our trainer asks over HTTP.

vLLM's POST /collective_rpc (dev mode) calls worker methods by name only (vllm 0.33.0
entrypoints/serve/dev/rpc/api_router.py:23-59: `method` is a string, args are strings; v1/serial_utils.py
`run_method` does `getattr(worker, method)`), so a check of what every worker holds needs a named method on
the worker. vLLM mixes the class named by `--worker-extension-cls` into its worker class
(v1/worker/worker_base.py:309-335, refusing a name the worker already has), which is how this one gets
there; the launcher passes it (`launch.py`). Without it the HTTP client's `verify` says which flag to add.
"""

from __future__ import annotations

from typing import Any

from .client import EXTENSION_CLASS, REPORT_METHOD, worker_weight_report


class WeightSyncWorkerExtension:
    """Mixed into vLLM's GPU worker: `self` is the worker, with its `weight_transfer_engine`."""

    def lightning_weightsync_weight_report(self) -> dict[str, Any]:
        """This worker's `weight_report` (which version it holds, whole or not, and the checksums of what was
        verified on arrival), JSON-ready for /collective_rpc."""
        return worker_weight_report(self)


assert REPORT_METHOD in vars(WeightSyncWorkerExtension)  # the name the trainer's client asks for
assert f"{__name__}.{WeightSyncWorkerExtension.__qualname__}" == EXTENSION_CLASS

__all__ = ["EXTENSION_CLASS", "REPORT_METHOD", "WeightSyncWorkerExtension"]
