"""What we use of SGLang 0.5.23, named once (tests/data/sglang_api.json pins it against SGLang's source).

- `--custom-weight-loader <import path>` (srt/arg_groups/fields/model.py:292) lists the loaders
  `/update_weights_from_tensor` may name as `load_format`; SGLang then calls `loader(model, named_tensors)`
  on every TP rank's scheduler (srt/model_executor/model_runner_components/weight_updater.py:374-376).
- `named_tensors` is `serialized_named_tensors[tp_rank]`, unpickled by SGLang's SafeUnpickler
  (srt/managers/tp_worker.py:194-201, srt/utils/common.py:3085-3099): we send a pickled empty list per
  rank (bytes fixed below, never built by pickle here) since our bytes come over our own data plane.
- LoRA adapters are loaded by path (`/load_lora_adapter`, `LoadLoRAAdapterReqInput` in srt/managers/io_struct.py:
  lora_name, lora_path, pinned, lora_id) under a new `LoRARef` (a fresh lora_id) every time, and a name is
  loaded once: replacing one is `/unload_lora_adapter` then `/load_lora_adapter`. The unload unregisters
  the name, then waits until every request using it finished (srt/managers/tokenizer_control_mixin.py
  `_unload_lora_adapter_locked`: `lora_registry.wait_for_unload`), so requests kept while paused
  (`retract`, `in_place`) would hold it forever; both routes answer 400 with "--enable-lora" in the message
  when LoRA is off.
- An update must sit between `/begin_weight_update` and `/end_weight_update`
  (srt/managers/scheduler_components/weight_updater.py:232-240, 309-335), and requires dp_size 1
  (srt/managers/tokenizer_control_mixin.py:569-571, an assert).
"""

from __future__ import annotations

LOADER = "lightning_weightsync.rollout_engines.sglang.loader.load_weights"
"""The import path given to `--custom-weight-loader` and sent as `load_format`."""
EMPTY_NAMED_TENSORS = "gAJdcQAu"
"""base64 of pickle protocol 2 of `[]` (b"\\x80\\x02]q\\x00."): one per TP rank in `serialized_named_tensors`."""

PAUSE = "/pause_generation"  # {"mode": "abort" | "retract" | "in_place"}
RESUME = "/continue_generation"  # {}
BEGIN = "/begin_weight_update"  # {}
UPDATE = "/update_weights_from_tensor"  # {serialized_named_tensors, load_format, flush_cache, weight_version}
END = "/end_weight_update"  # {}
SET_VERSION = "/update_weight_version"  # {new_version, abort_all_requests}
MODEL_INFO = "/model_info"  # GET -> {"weight_version": str | None, ...}
SERVER_INFO = "/server_info"  # GET -> {"tp_size", "pp_size", "dp_size", ...}
LOAD_LORA = "/load_lora_adapter"  # {lora_name, lora_path, pinned}: a fresh lora_id each load (no in-place option)
UNLOAD_LORA = "/unload_lora_adapter"  # {lora_name}: waits for the requests using the adapter to finish

__all__ = ["BEGIN", "EMPTY_NAMED_TENSORS", "END", "LOADER", "LOAD_LORA", "MODEL_INFO", "PAUSE", "RESUME",
           "SERVER_INFO", "SET_VERSION", "UNLOAD_LORA", "UPDATE"]  # fmt: skip
