"""`LightningWeightSyncEngine`: vLLM's `WeightTransferEngine` with our chunked, fixed-memory receiver.

Registered under the name `lightning_weightsync` by the `vllm.general_plugins` entry point
(`plugin.py`), so a stock server is a rollout:

    LIGHTNING_WEIGHTSYNC_CONFIG=sync.yaml VLLM_SERVER_DEV_MODE=1 \\
        vllm serve Qwen/Qwen3-8B --weight-transfer-config '{"backend": "lightning_weightsync"}'

What it adds over vLLM's built-in NCCL engine (vllm/distributed/weight_transfer/nccl_engine.py):
fixed-size buckets (a tensor larger than a bucket is chunked, never grows a buffer), two buckets
a side (no per-version allocation), versioned, signed control messages, every wait bounded by
`transport.timeout_s`, a failed version leaves the group usable for the next, and any of our
backends (gloo, nccl, hccl, shm, cuda_ipc). The engine body is vLLM-free (`worker.py`); this
module binds it to vLLM's base classes and model-loading hooks, and is only imported by vLLM.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import BackendUnavailable, ConfigError
from .worker import InitInfo, UpdateInfo, WeightSyncEngineBody

try:
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
except ImportError as exc:  # pragma: no cover - exercised by the vllm-contract venv
    raise BackendUnavailable(
        f"the lightning_weightsync vLLM engine needs vLLM ({exc}); install vLLM first (it pins torch), "
        "then: pip install 'lightning_weightsync[vllm]'"
    ) from None

logger = logging.getLogger(__name__)


@dataclass
class LightningWeightSyncInitInfo(WeightTransferInitInfo):
    """`init_info` (POST /init_weight_transfer_engine): see `worker.InitInfo`."""

    overrides: list[str] = field(default_factory=list)


@dataclass
class LightningWeightSyncUpdateInfo(WeightTransferUpdateInfo):
    """`update_info` (POST /update_weights): see `worker.UpdateInfo`."""

    version: int | None = None
    timeout_s: float | None = None


assert [f for f in InitInfo.__dataclass_fields__] == list(LightningWeightSyncInitInfo.__dataclass_fields__)
assert [f for f in UpdateInfo.__dataclass_fields__] == list(LightningWeightSyncUpdateInfo.__dataclass_fields__)


class LightningWeightSyncEngine(
    WeightSyncEngineBody,
    WeightTransferEngine[LightningWeightSyncInitInfo, LightningWeightSyncUpdateInfo],
):
    """One per vLLM GPU worker, built by `WeightTransferEngineFactory.create_engine` after the model
    loaded; `receive_weights` runs one version of our `WeightReceiver` into `model.load_weights`."""

    init_info_cls = LightningWeightSyncInitInfo
    update_info_cls = LightningWeightSyncUpdateInfo
    supports_draft_weight_update = False
    defers_processing = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        # imported here, not on the first version: a cold import inside receive_weights would delay
        # the worker's Ready past transport.ready_timeout_s
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        self._no_mtp_check = disable_mtp_completeness_check
        self._weightsync_setup()

    # -- vLLM model hooks ---------------------------------------------------------------------------
    def _check_model_supported(self) -> None:
        if getattr(self.vllm_config, "speculative_config", None) is not None:
            logger.warning(
                "lightning_weightsync engine: speculative decoding is on; only the target model is updated "
                "(draft updates are refused), so the drafter's acceptance rate drops as the policy moves"
            )
        if self._cpu_offloaded():
            if getattr(self.model_config, "quantization", None) is not None:
                raise ConfigError(
                    "lightning_weightsync engine: a quantized model with --cpu-offload-gb; vLLM's layerwise reload "
                    "does not compose with CPU offloading (vllm/model_executor/model_loader/reload); remove it"
                )
            logger.warning(
                "lightning_weightsync engine: --cpu-offload-gb is set, and vLLM's layerwise reload does not compose "
                "with CPU offloading: weights load in place, so layers that derive weights after loading (MLA's "
                "W_UK/W_UV, FlashInfer/CUTLASS MoE layouts, CPU/ROCm repacking) keep their old derived values"
            )

    def _check_awake(self) -> None:
        if not getattr(self.model_config, "enable_sleep_mode", False):
            return
        try:
            from vllm.device_allocator.cumem import CuMemAllocator

            asleep = any(
                d.tag == "weights" and d.is_asleep for d in CuMemAllocator.get_instance().pointer_to_data.values()
            )
        except Exception:  # another sleep-mode backend (XPU) or no allocator: nothing to check
            return
        if asleep:
            raise ConfigError(
                "lightning_weightsync engine: the model weights are asleep (sleep mode); wake them first "
                "(POST /wake_up?tags=weights), then update"
            )

    def _cpu_offloaded(self) -> bool:
        uva = getattr(getattr(self.vllm_config, "offload_config", None), "uva", None)
        return bool(getattr(uva, "cpu_offload_gb", 0))

    def _needs_layerwise_reload(self) -> bool:
        # Every model, as vLLM's own checkpoint-format engines do (distributed/weight_transfer/nccl_engine.py
        # start/finish_weight_update, ipc_engine.py likewise, in 0.33.0): not only quantized layers derive
        # weights after loading (FP8 scales) but unquantized ones too (MLA's W_UK/W_UV from kv_b_proj,
        # unquantized MoE on the FlashInfer TRTLLM/CUTLASS paths, CPU/ROCm repacking); loading raw
        # checkpoint tensors in place would leave those stale. The reload re-creates each layer, loads and
        # re-processes it. The one exception is CPU offload, which the reload does not compose with.
        return not self._cpu_offloaded()

    def _begin_layerwise_reload(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def _finish_layerwise_reload(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def _server_group(self) -> Any:
        # every worker of this server: vLLM's world group spans TP x PP x PCP and, with data parallelism, the DP
        # ranks too (distributed/parallel_state.py init_distributed_environment: world_size_across_dp); its
        # gloo cpu_group is what vLLM itself uses for small CPU collectives (GroupCoordinator.cpu_all_reduce_)
        from vllm.distributed import parallel_state

        if parallel_state._WORLD is None:  # not in a vLLM worker (vLLM's own tests build engines bare)
            return super()._server_group()
        world = parallel_state.get_world_group()
        return world.cpu_group if world.world_size > 1 else None

    def _after_restore(self) -> None:
        # As vLLM's reload ends (model_loader/reload/layerwise.py _finalize_attention_layer): attention layers
        # re-derive what they keep outside their kernel tensors (MLA's W_UK_T / W_UV from kv_b_proj) from the
        # restored weights.
        from vllm.model_executor.layers.attention import is_deferred_attention_layer

        dtype = getattr(self.model_config, "dtype", None)
        for layer in self.model.modules():
            if is_deferred_attention_layer(layer):
                # vLLM's layer method; torch types a Module's attributes as Tensor | Module
                layer.process_weights_after_loading(dtype)  # type: ignore[operator]

    def _load_context(self) -> Any:
        # As vLLM's NCCL engine: a checkpoint stream may omit MTP layers the target does not load.
        return self._no_mtp_check()


__all__ = ["LightningWeightSyncEngine", "LightningWeightSyncInitInfo", "LightningWeightSyncUpdateInfo"]
