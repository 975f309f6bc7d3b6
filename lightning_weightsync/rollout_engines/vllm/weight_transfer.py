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

import contextlib
import importlib
import logging
from collections.abc import Callable, Collection
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import BackendUnavailable, ConfigError
from ...quantize import QuantContract
from .reload_checks import ModuleLoad
from .slices import CheckpointParams
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
        self._reload = reload_hooks()
        self._largest: int | None = None
        self._modules: ModuleTable | None = None
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
        # start/finish_weight_update, ipc_engine.py likewise, in 0.33.0 and 0.34.0): not only quantized layers
        # derive weights after loading (FP8 scales) but unquantized ones too (MLA's W_UK/W_UV from kv_b_proj,
        # unquantized MoE on the FlashInfer TRTLLM/CUTLASS paths, CPU/ROCm repacking); loading raw
        # checkpoint tensors in place would leave those stale. The reload re-creates each layer, loads and
        # re-processes it. The one exception is CPU offload, which the reload does not compose with.
        return not self._cpu_offloaded()

    def _begin_layerwise_reload(self) -> None:
        self._reload.begin(self.model)

    def _finish_layerwise_reload(self) -> None:
        self._reload.finish(self.model, self.model_config, self.device)

    def _server_group(self) -> Any:
        # every worker of this server: vLLM's world group spans TP x PP x PCP and, with data parallelism, the DP
        # ranks too (distributed/parallel_state.py init_distributed_environment: world_size_across_dp); its
        # gloo cpu_group is what vLLM itself uses for small CPU collectives (GroupCoordinator.cpu_all_reduce_)
        from vllm.distributed import parallel_state

        if parallel_state._WORLD is None:  # not in a vLLM worker (vLLM's own tests build engines bare)
            return super()._server_group()
        world = parallel_state.get_world_group()
        return world.cpu_group if world.world_size > 1 else None

    def _tp_size(self) -> int:
        from vllm.distributed import parallel_state

        if parallel_state._TP is None:  # not in a vLLM worker (vLLM's own tests build engines bare)
            return 1
        return int(parallel_state.get_tensor_model_parallel_world_size())

    def _quant_contract(self) -> QuantContract | None:
        quant = getattr(self.vllm_config, "quant_config", None)
        if quant is None or not getattr(quant, "is_checkpoint_fp8_serialized", False):
            return None  # bf16, or quantized online by vLLM from bf16: it takes tensors as the trainer holds them
        from .quant_contract import learn_quant_contract

        contract = learn_quant_contract(self.model)
        return contract if contract.rules else None

    def _checkpoint_params(self) -> CheckpointParams | None:
        hooks = self._reload
        return lambda module: checkpoint_params(hooks, module)

    def _module_loads(self) -> list[ModuleLoad]:
        if self._modules is None:
            self._modules = module_table(self._reload, self.model)
        return module_loads(self._modules)

    def _quantized_tensors(
        self, modules: Collection[str] | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return quantized_tensors(self.model, modules)

    def _largest_module_bytes(self) -> int:
        if self._largest is None:
            self._largest = largest_module_bytes(self._reload, self.model)
        return self._largest

    def _after_restore(self) -> None:
        # HostCopy.restore put kernel-format tensors back: re-derive what layers keep outside them (MLA's
        # W_UK_T / W_UV from kv_b_proj), as vLLM's own reload of kernel-format weights ends
        self._reload.after_kernel_format_restore(self.model, getattr(self.model_config, "dtype", None))

    def _load_context(self) -> Any:
        # A version's stream may omit MTP layers the target does not load: vLLM's NCCL engine skips their
        # completeness check around load_weights (0.33.0; 0.34.0 skips it between start_reload and finish_reload)
        return self._reload.load_context()


@dataclass(frozen=True)
class ReloadHooks:
    """The model-loader calls of the vLLM release installed, found by what it has, never by its version string:

    - begin / finish a checkpoint-format update: 0.34.0's `start_reload` / `finish_reload(model, model_config,
      device)` (model_loader/reload/lifecycle.py:26,36; they honour `VLLM_RELOAD_MODE` and mark the update
      active, which is what turns off the MTP completeness checks there), else 0.33.0's
      `initialize_layerwise_reload` / `finalize_layerwise_reload(model, model_config)` (reload/layerwise.py:83,287)
    - `load_context`: 0.33.0's `disable_mtp_completeness_check()` (model_loader/mtp_validation.py:20), a module
      0.34.0 removed (a null context there)
    - after a kernel-format restore: 0.34.0's `finalize_model_weights` under `weights_already_processed`
      (model_loader/weight_utils.py:1549, reload/inplace.py:112-114: every module's post-load hook, taking no
      argument), else 0.33.0's `process_weights_after_loading(dtype)` of each deferred attention layer
      (reload/layerwise.py:303)
    """

    begin: Callable[[torch.nn.Module], None]
    finish: Callable[[torch.nn.Module, Any, torch.device], None]
    load_context: Callable[[], AbstractContextManager[Any]]
    after_kernel_format_restore: Callable[[torch.nn.Module, Any], None]
    layerwise_info: Callable[[torch.nn.Module], Any] | None = None
    """A module's `LayerReloadingInfo` (reload/layerwise.py `LAYERWISE_INFO`: its checkpoint-format metadata and,
    while an update runs, what its loaders buffered), or None; None here where this vLLM keeps no such table."""
    is_deferred_attention: Callable[[torch.nn.Module], bool] = lambda module: False
    """Attention-like layers, which vLLM processes only when the update finishes, loaded or not."""
    skip_load_tensors: frozenset[str] = frozenset()
    """Tensor names vLLM's reload never loads (reload/meta.py `SKIP_LOAD_TENSORS`; `bias` is never on meta)."""


def _optional(module: str, name: str) -> Any:
    """`module.name`, or None where this vLLM has no such module or attribute (an error inside a module that
    exists is raised)."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module == exc.name or module.startswith(exc.name + ".")):
            return None
        raise
    return getattr(mod, name, None)


def reload_hooks() -> ReloadHooks:
    """The installed vLLM's `ReloadHooks` (imports its model loader: call it when the engine is built)."""
    from vllm.model_executor.model_loader import reload

    start_reload = getattr(reload, "start_reload", None)
    finish_reload = getattr(reload, "finish_reload", None)
    if start_reload is not None and finish_reload is not None:
        begin, finish = start_reload, finish_reload
    else:
        begin, finalize = reload.initialize_layerwise_reload, reload.finalize_layerwise_reload

        def finish(model: torch.nn.Module, model_config: Any, device: torch.device) -> None:
            finalize(model, model_config)

    no_mtp_check = _optional("vllm.model_executor.model_loader.mtp_validation", "disable_mtp_completeness_check")
    finalize_model_weights = _optional("vllm.model_executor.model_loader.weight_utils", "finalize_model_weights")
    if finalize_model_weights is not None:
        from vllm.model_executor.utils import weights_already_processed

        def after_restore(model: torch.nn.Module, dtype: Any) -> None:
            with weights_already_processed():
                finalize_model_weights(model)

    else:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer

        def after_restore(model: torch.nn.Module, dtype: Any) -> None:
            for layer in model.modules():
                if is_deferred_attention_layer(layer):
                    # vLLM's layer method; torch types a Module's attributes as Tensor | Module
                    layer.process_weights_after_loading(dtype)  # type: ignore[operator]

    layerwise = _optional("vllm.model_executor.model_loader.reload.layerwise", "LAYERWISE_INFO")
    meta = importlib.import_module("vllm.model_executor.model_loader.reload.meta") if layerwise is not None else None
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    return ReloadHooks(
        begin,
        finish,
        no_mtp_check or contextlib.nullcontext,
        after_restore,
        layerwise_info=layerwise.get if layerwise is not None else None,
        is_deferred_attention=is_deferred_attention_layer,
        skip_load_tensors=frozenset(getattr(meta, "SKIP_LOAD_TENSORS", ())) | {"bias"},
    )


def unwrapped_loader(loader: Any) -> Any:
    """A parameter's own loader, without vLLM's layerwise wrappers (`online_process_loader`, which buffers into
    the live module's reload state: the trace must never call it)."""
    while getattr(loader, "__name__", "") == "online_process_loader" and hasattr(loader, "__wrapped__"):
        loader = loader.__wrapped__
    return loader


def checkpoint_params(hooks: ReloadHooks, module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """`module`'s checkpoint-format parameters as vLLM's reload restores them (fresh meta tensors of the
    recorded class, shape, dtype and attributes, each `weight_loader` the layer's own, unwrapped), plus the
    parameters the reload leaves live (`bias`); None where nothing was recorded (`slices.CheckpointParams`)."""
    if hooks.layerwise_info is None:
        return None
    info = hooks.layerwise_info(module)
    if info is None:
        return None
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    recorded, _ = info.restore_metadata
    out: dict[str, torch.Tensor] = {}
    for name, meta in recorded.items():
        tensor = meta.data.to("meta")
        tensor.__class__ = meta.__class__
        tensor.__dict__ = meta.__dict__.copy()
        restore_layer_refs(tensor, module)
        loader = getattr(tensor, "weight_loader", None)
        if loader is not None:
            tensor.weight_loader = unwrapped_loader(loader)
        out[name] = tensor
    for name, param in module._parameters.items():
        if param is not None and name not in out and name in hooks.skip_load_tensors:
            out[name] = param
    return out or None


ModuleTable = list[tuple[str, Any, dict[str, int]]]
"""Per module that holds checkpoint-format parameters in vLLM's reload: its name, its `LayerReloadingInfo`, and its
parameters' element counts; built once (the modules and their reload records live as long as the model)."""


def module_table(hooks: ReloadHooks, model: torch.nn.Module) -> ModuleTable:
    """The modules `module_loads` reads, attention-like layers left out (vLLM processes them when the update
    finishes, whatever they got) and modules without checkpoint-format parameters (a rotary cache); [] where this
    vLLM keeps no reload table."""
    if hooks.layerwise_info is None:
        return []
    table: ModuleTable = []
    for name, module in model.named_modules():
        info = hooks.layerwise_info(module)
        if info is None or hooks.is_deferred_attention(module):
            continue
        recorded, _ = info.restore_metadata
        params = {p: t.numel() for p, t in recorded.items() if p not in hooks.skip_load_tensors}
        if params:
            table.append((name, info, params))
    return table


def module_loads(table: ModuleTable) -> list[ModuleLoad]:
    """The modules of `table` still waiting in vLLM's reload (`reload_checks.ModuleLoad`; a module vLLM has
    processed is no longer pending and is left out). Cheap for the processed ones: it runs after every tensor."""
    loads: list[ModuleLoad] = []
    for name, info, params in table:
        if info.load_numel_total is None:  # processed (or no update running)
            continue
        buffered = 0
        for _, args in info.loaded_weights:
            for key, value in args.arguments.items():
                if key != "param" and isinstance(value, torch.Tensor):
                    buffered += value.numel() * value.element_size()
        loads.append(
            ModuleLoad(
                name=name,
                params=params,
                written=frozenset(p for p, _ in info.loaded_weights),
                loaded=int(info.load_numel),
                total=int(info.load_numel_total),
                buffered_bytes=buffered,
                pending=True,
            )
        )
    return loads


def largest_module_bytes(hooks: ReloadHooks, model: torch.nn.Module) -> int:
    """Bytes of the largest module's checkpoint-format parameters on this worker: the unit of vLLM's reload budget
    (`WEIGHT_UPDATE_PEAK_LAYER_FACTOR` x it; 0.34.0's `max_layer_reload_bytes` counts buffers too, such as a
    rotary embedding's cache, which no update loads); 0 where this vLLM keeps no reload table."""
    if hooks.layerwise_info is None:
        return 0
    sizes = [0]
    for module in model.modules():
        info = hooks.layerwise_info(module)
        if info is not None:
            recorded, _ = info.restore_metadata
            sizes.append(
                sum(t.numel() * t.element_size() for n, t in recorded.items() if n not in hooks.skip_load_tensors)
            )
    return max(sizes)


def quantized_tensors(
    model: torch.nn.Module, modules: Collection[str] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The scales (tensors named `*scale*`) and FP8 weights of every module a quantization method processes
    (its `quant_method` is not one of vLLM's `Unquantized*` methods), or of `modules` only, by qualified name."""
    scales: dict[str, torch.Tensor] = {}
    weights: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        if modules is not None and prefix not in modules:
            continue
        method = getattr(module, "quant_method", None)
        if method is None or type(method).__name__.startswith("Unquantized"):
            continue
        for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is None or tensor.is_meta:
                continue
            qualified = f"{prefix}.{name}" if prefix else name
            if "scale" in name:
                scales[qualified] = tensor
            elif tensor.dtype.itemsize == 1 and tensor.dtype.is_floating_point:
                weights[qualified] = tensor
    return scales, weights


__all__ = [
    "LightningWeightSyncEngine",
    "LightningWeightSyncInitInfo",
    "LightningWeightSyncUpdateInfo",
    "ReloadHooks",
    "checkpoint_params",
    "largest_module_bytes",
    "module_loads",
    "module_table",
    "quantized_tensors",
    "reload_hooks",
    "unwrapped_loader",
]
