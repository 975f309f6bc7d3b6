"""`lightning-weightsync rollout rollout.sink.type=vllm`: one command, a vLLM server that generates
and receives every version.

It execs a stock `vllm serve <model> --weight-transfer-config '{"backend": "lightning_weightsync"}'`
with `VLLM_SERVER_DEV_MODE=1` (vLLM registers its RL routes /pause, /start_weight_update,
/update_weights, /finish_weight_update, /resume and /reset_prefix_cache only then) and
`LIGHTNING_WEIGHTSYNC_CONFIG` pointing at the resolved config (written 0600: it may hold
`transport.auth_token`). Our engine reaches vLLM through the `vllm.general_plugins` entry point, so
vLLM must run from the environment this package is installed in. The trainer then drives each
version through the server's URL (`vllm.urls` on the trainer side).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from omegaconf import DictConfig

from ...config import to_yaml
from ...errors import BackendUnavailable, ConfigError
from .worker import BACKEND_NAME, CONFIG_ENV

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"


def serve_command(cfg: DictConfig, config_path: str, vllm_exe: str = "vllm") -> tuple[list[str], dict[str, str]]:
    """The `vllm serve` argv and the environment additions, from `vllm.model` / `vllm.serve_args`."""
    model = cfg.vllm.model or cfg.rollout.sink.target
    if not model:
        raise ConfigError(
            "rollout.sink.type=vllm needs the model to serve: set vllm.model (e.g. vllm.model=Qwen/Qwen3-8B)"
        )
    args = [str(a) for a in cfg.vllm.serve_args]
    if any(a == "--weight-transfer-config" or a.startswith("--weight-transfer-config=") for a in args):
        raise ConfigError("vllm.serve_args sets --weight-transfer-config; the launcher sets it itself, remove it")
    argv = [vllm_exe, "serve", str(model), "--weight-transfer-config", json.dumps({"backend": BACKEND_NAME}), *args]
    return argv, {DEV_MODE_ENV: "1", CONFIG_ENV: config_path}


def write_config(cfg: DictConfig) -> str:
    """The resolved config (secrets included: the engine needs them) in a private temporary file."""
    fd, path = tempfile.mkstemp(prefix="lightning-weightsync-", suffix=".yaml")
    with os.fdopen(fd, "w") as f:  # mkstemp creates it 0600
        f.write(to_yaml(cfg, redact=False))
    return path


def launch(cfg: DictConfig) -> int:
    """Replace this process with `vllm serve` (signals and exit code are vLLM's own)."""
    exe = shutil.which("vllm")
    if exe is None:
        raise BackendUnavailable(
            "rollout.sink.type=vllm needs vLLM (no `vllm` executable on PATH); install vLLM first (it pins "
            "torch), then: pip install 'lightning_weightsync[vllm]'"
        )
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailable(
            f"rollout.sink.type=vllm: this vLLM has no weight-transfer API ({exc}); "
            "pip install 'lightning_weightsync[vllm]' for a tested version"
        ) from None
    argv, env = serve_command(cfg, "", exe)  # validate before writing anything
    path = write_config(cfg)
    argv, env = serve_command(cfg, path, exe)
    os.execvpe(exe, argv, {**os.environ, **env})
    return 0  # pragma: no cover - exec does not return
