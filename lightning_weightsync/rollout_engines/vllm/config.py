"""The `vllm` config section: vLLM's knobs, both halves (the servers the trainer drives, the server
`lightning-weightsync rollout rollout.engine=vllm` starts), and their choices.

It lives in the engine's folder so adding or changing an engine touches that folder (and one table line in
`plugins.py`, whose `section=` names `VLLMConfig`); config collects it from that table into `WeightSyncConfig` as
the `vllm` section while config itself is being imported, so this module imports only `Choice` (choice.py) and
never `config`, which would be a cycle. Documented in configs/default.yaml.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...choice import Choice


class RollbackMode(Choice):
    """`vllm.rollback`: what a vLLM server's workers do when a version fails on any of them."""

    host = "host"
    none = "none"


class PauseMode(Choice):
    """`vllm.pause_mode`: what a vLLM rollout does with in-flight requests while a version loads
    (vLLM's `pause_generation(mode=...)`)."""

    abort = "abort"
    wait = "wait"
    keep = "keep"


@dataclass
class VLLMConfig:
    """vLLM rollouts: the servers the trainer drives (trainer side) and the server the launcher starts."""

    urls: list[str] = field(default_factory=list)
    """Trainer side: base URLs of the vLLM servers driven around every version; [] = none."""
    pause_mode: PauseMode = PauseMode.keep
    """What vLLM does with in-flight requests while a version loads: abort | wait | keep."""
    reset_prefix_cache: bool = True
    """After each version, drop prefix-cache blocks computed with the old weights."""
    request_timeout_s: float = 600.0
    """Seconds: bound on each HTTP call to a vLLM server (update_weights spans the whole transfer)."""
    model: str | None = None
    """Rollout side: the model `vllm serve` serves."""
    serve_args: list[str] = field(default_factory=list)
    """Rollout side: extra `vllm serve` arguments, e.g. ["--port", "8000", "--tensor-parallel-size", "2"]."""
    rollback: RollbackMode = RollbackMode.host
    """Rollout side: host = every worker keeps a host copy of its model shard (taken before each version) and a
    version that fails on any worker of the server is undone on all; none = no copy (saves host memory the size
    of the model), and a failed version leaves the server torn until the next one lands."""
    lora_name: str = "policy"
    """Adapter versions (trainer.lora=adapter, a server started with --enable-lora): the adapter name the server
    serves each version under (requests name it as their `model`); replaced in place every version."""
    lora_dir: str | None = None
    """Adapter versions: the directory, as the server's machine sees it, where worker 0 writes each version as a
    PEFT adapter directory (`step_<version>/`) that the trainer then has vLLM load; the same value on both sides.
    null = adapter versions are refused (set it, or trainer.lora=merged)."""


__all__ = ["PauseMode", "RollbackMode", "VLLMConfig"]
