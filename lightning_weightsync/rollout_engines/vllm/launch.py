"""`lightning-weightsync rollout rollout.engine=vllm`: one command, a vLLM server that generates
and receives every version.

It execs a stock `vllm serve <model> --weight-transfer-config '{"backend": "lightning_weightsync"}'
--worker-extension-cls lightning_weightsync.rollout_engines.vllm.extension.WeightSyncWorkerExtension` (the worker
method the trainer's verify asks through /collective_rpc) with `VLLM_SERVER_DEV_MODE=1` (vLLM registers its
RL routes /pause, /start_weight_update, /update_weights, /finish_weight_update, /resume and
/reset_prefix_cache only then; they take no credentials, `--api-key` covers /v1 only: docs/security.md) and
`LIGHTNING_WEIGHTSYNC_CONFIG` pointing at the resolved config (written by `rollout_engines/launch.py`: no
secret in it, the token goes to the server's environment). Our engine reaches vLLM through the
`vllm.general_plugins` entry point, so vLLM must run from the environment this package is installed in. The
trainer then drives each version through the server's URL (`vllm.urls` on the trainer side)."""

from __future__ import annotations

import json
import logging
import os
import shutil

from ...config import UserConfig, settings
from ...errors import BackendUnavailable, ConfigError
from ..launch import config_dir, write_config
from ..worker import CONFIG_ENV
from .config import VLLMConfig
from .extension import EXTENSION_CLASS
from .worker import BACKEND_NAME

logger = logging.getLogger(__name__)

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"


def serve_command(v: VLLMConfig, config_path: str, vllm_exe: str = "vllm") -> tuple[list[str], dict[str, str]]:
    """The `vllm serve` argv and the environment additions, from the `vllm` section's `model` / `serve_args`."""
    model = v.model
    if not model:
        raise ConfigError(
            "rollout.engine=vllm needs the model to serve: set vllm.model (e.g. vllm.model=Qwen/Qwen3-8B)"
        )
    args = list(v.serve_args)
    if any(a == "--weight-transfer-config" or a.startswith("--weight-transfer-config=") for a in args):
        raise ConfigError("vllm.serve_args sets --weight-transfer-config; the launcher sets it itself, remove it")
    if not any(a == "--host" or a.startswith("--host=") for a in args):
        logger.warning(
            "vllm.serve_args has no --host: vLLM listens on every interface, and the weight-update routes "
            "(VLLM_SERVER_DEV_MODE) take no credentials (--api-key covers /v1 only); pass --host <private address> "
            "and let only the trainer reach the port (docs/security.md)"
        )
    argv = [vllm_exe, "serve", model, "--weight-transfer-config", json.dumps({"backend": BACKEND_NAME}), *args]
    if any(a == "--worker-extension-cls" or a.startswith("--worker-extension-cls=") for a in args):
        logger.warning(
            "vllm.serve_args sets --worker-extension-cls; vLLM takes one, so the trainer cannot ask the workers which "
            "weights they hold (verify) unless that class inherits %s",
            EXTENSION_CLASS,
        )
    else:
        argv += ["--worker-extension-cls", EXTENSION_CLASS]  # the method /collective_rpc names (verify)
    return argv, {DEV_MODE_ENV: "1", CONFIG_ENV: config_path}


def launch(cfg: UserConfig) -> int:
    """Replace this process with `vllm serve` (signals and exit code are vLLM's own). `cfg`: what the CLI
    loaded, converted here (the edge)."""
    config = settings(cfg)
    exe = shutil.which("vllm")
    if exe is None:
        raise BackendUnavailable(
            "rollout.engine=vllm needs vLLM (no `vllm` executable on PATH); install vLLM first (it pins "
            "torch), then: pip install 'lightning_weightsync[vllm]'"
        )
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailable(
            f"rollout.engine=vllm: this vLLM has no weight-transfer API ({exc}); "
            "pip install 'lightning_weightsync[vllm]' for a tested version"
        ) from None
    argv, env = serve_command(config.vllm, "", exe)  # validate before writing anything
    path, secret_env = write_config(config)
    argv, env = serve_command(config.vllm, path, exe)
    os.execvpe(exe, argv, {**os.environ, **secret_env, **env})
    return 0  # pragma: no cover - exec does not return


__all__ = ["config_dir", "launch", "serve_command", "write_config"]
