"""The `sglang` config section: SGLang's knobs, both halves (the servers the trainer drives, the server
`lightning-weightsync rollout rollout.engine=sglang` starts), and their choices.

It lives in the engine's folder so adding or changing an engine touches that folder (and one table line in
`plugins.py`, whose `section=` names `SGLangConfig`); config collects it from that table into `WeightSyncConfig` as
the `sglang` section while config itself is being imported, so this module imports only `Choice` (choice.py) and
never `config`, which would be a cycle. Documented in configs/default.yaml.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...choice import Choice


class SGLangPauseMode(Choice):
    """`sglang.pause_mode`: SGLang's `/pause_generation` modes (io_struct.py `PauseGenerationReqInput`)."""

    abort = "abort"
    retract = "retract"
    in_place = "in_place"


@dataclass
class SGLangConfig:
    """SGLang rollouts: the servers the trainer drives (trainer side) and the server the launcher starts."""

    urls: list[str] = field(default_factory=list)
    """Trainer side: base URLs of the SGLang servers driven around every version; [] = none."""
    pause_mode: SGLangPauseMode = SGLangPauseMode.retract
    """What SGLang does with running requests while a version loads: abort | retract | in_place (retract:
    they re-prefill on the new weights; in_place keeps their old KV, so the cache is not flushed)."""
    flush_cache: bool = True
    """After each version, flush the KV/radix cache computed with the old weights (not with in_place)."""
    request_timeout_s: float = 600.0
    """Seconds: bound on each HTTP call to an SGLang server (the update itself spans the whole transfer)."""
    model: str | None = None
    """Rollout side: the model SGLang serves (its --model-path)."""
    serve_args: list[str] = field(default_factory=list)
    """Rollout side: extra `python -m sglang.launch_server` arguments, e.g. ["--port", "30000", "--tp-size", "2"]."""
    lora_name: str = "policy"
    """Adapter versions (trainer.lora=adapter, a server started with --enable-lora): the adapter name the server
    serves each version under (requests name it as their `lora_path`); unloaded and loaded again every version."""
    lora_dir: str | None = None
    """Adapter versions: the directory, as the server's machine sees it, where TP rank 0 writes each version as a
    PEFT adapter directory (`step_<version>/`) that the trainer then has SGLang load; the same value on both sides.
    null = adapter versions are refused (set it, or trainer.lora=merged)."""


__all__ = ["SGLangConfig", "SGLangPauseMode"]
