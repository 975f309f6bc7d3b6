"""`lightning-weightsync rollout rollout.sink.type=vllm`: one command, a vLLM server that generates
and receives every version.

It execs a stock `vllm serve <model> --weight-transfer-config '{"backend": "lightning_weightsync"}'`
with `VLLM_SERVER_DEV_MODE=1` (vLLM registers its RL routes /pause, /start_weight_update,
/update_weights, /finish_weight_update, /resume and /reset_prefix_cache only then; they take no
credentials, `--api-key` covers /v1 only: docs/security.md) and `LIGHTNING_WEIGHTSYNC_CONFIG`
pointing at the resolved config. That file holds no secret: `transport.auth_token` goes to the
server's environment instead (`$LIGHTNING_WEIGHTSYNC_AUTH_TOKEN`, readable by this user only), and
the file lives in this user's 0700 directory, named by the pid `vllm serve` keeps across the exec;
the next launch removes the files of servers that are gone (nothing runs after an exec to do it).
Our engine reaches vLLM through the `vllm.general_plugins` entry point, so vLLM must run from the
environment this package is installed in. The trainer then drives each version through the
server's URL (`vllm.urls` on the trainer side).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ...config import AUTH_TOKEN_ENV, to_yaml
from ...errors import BackendUnavailable, ConfigError
from ...transport.process import process_alive
from .worker import BACKEND_NAME, CONFIG_ENV

logger = logging.getLogger(__name__)

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
    if not any(a == "--host" or a.startswith("--host=") for a in args):
        logger.warning(
            "vllm.serve_args has no --host: vLLM listens on every interface, and the weight-update routes "
            "(VLLM_SERVER_DEV_MODE) take no credentials (--api-key covers /v1 only); pass --host <private address> "
            "and let only the trainer reach the port (docs/security.md)"
        )
    argv = [vllm_exe, "serve", str(model), "--weight-transfer-config", json.dumps({"backend": BACKEND_NAME}), *args]
    return argv, {DEV_MODE_ENV: "1", CONFIG_ENV: config_path}


def config_dir() -> Path:
    """This user's private directory for launcher config files (created 0700; refused if it is not ours
    or others may enter it: a file there is what the engine trusts)."""
    path = Path(tempfile.gettempdir()) / f"lightning-weightsync-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ConfigError(
            f"{path} is not a private directory of this user (mode {info.st_mode & 0o777:o}); remove it, or set "
            "TMPDIR to a directory only you can write"
        )
    return path


def write_config(cfg: DictConfig) -> tuple[str, dict[str, str]]:
    """The resolved config for the engine, and the environment that carries its token.

    The token never goes into the file (before: a 0600 copy of it stayed in /tmp for ever). Files that
    servers no longer running left behind are removed."""
    directory = config_dir()
    for old in directory.glob("rollout-*.yaml"):
        pid = old.stem.removeprefix("rollout-")
        if pid.isdigit() and int(pid) != os.getpid() and not process_alive(int(pid)):
            old.unlink(missing_ok=True)
    env: dict[str, str] = {}
    if cfg.transport.auth_token is not None:
        env[AUTH_TOKEN_ENV] = str(cfg.transport.auth_token)
        cfg = OmegaConf.merge(cfg, {"transport": {"auth_token": None}})  # type: ignore[assignment]
    path = directory / f"rollout-{os.getpid()}.yaml"  # the pid `vllm serve` keeps: exec does not change it
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(to_yaml(cfg, redact=False))
    return str(path), env


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
    path, secret_env = write_config(cfg)
    argv, env = serve_command(cfg, path, exe)
    os.execvpe(exe, argv, {**os.environ, **secret_env, **env})
    return 0  # pragma: no cover - exec does not return
