"""`lightning-weightsync rollout rollout.engine=sglang`: one command, an SGLang server that generates and
receives every version.

It execs a stock `sglang serve --model-path <sglang.model> --custom-weight-loader <our loader>
<sglang.serve_args>` with `$LIGHTNING_WEIGHTSYNC_CONFIG` pointing at the resolved config (written by
`rollout_engines/launch.py`: no secret in it, the token goes to the server's environment). SGLang imports
our loader by path in each TP rank's scheduler, so it must run from the environment this package is
installed in. dp_size must be 1 (SGLang's tensor-update path asserts it): checked here, before the exec.
The trainer then drives each version through the server's URL (`sglang.urls` on the trainer side).
"""

from __future__ import annotations

import logging
import os
import shutil

from ...config import UserConfig, settings
from ...errors import BackendUnavailable, ConfigError
from ..launch import write_config
from ..worker import CONFIG_ENV
from .api import LOADER
from .config import SGLangConfig

logger = logging.getLogger(__name__)

DP_FLAGS = ("--dp-size", "--data-parallel-size")  # srt/arg_groups/fields/parallel.py:73-79
OWN_FLAGS = ("--custom-weight-loader", "--model-path", "--model")


def _flag_value(args: list[str], flags: tuple[str, ...]) -> str | None:
    for i, arg in enumerate(args):
        for flag in flags:
            if arg == flag and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    return None


def serve_command(s: SGLangConfig, config_path: str, sglang_exe: str = "sglang") -> tuple[list[str], dict[str, str]]:
    """The `sglang serve` argv and the environment additions, from the `sglang` section's `model` / `serve_args`."""
    model = s.model
    if not model:
        raise ConfigError(
            "rollout.engine=sglang needs the model to serve: set sglang.model (e.g. sglang.model=Qwen/Qwen3-8B)"
        )
    args = list(s.serve_args)
    for flag in OWN_FLAGS:
        if any(a == flag or a.startswith(flag + "=") for a in args):
            raise ConfigError(f"sglang.serve_args sets {flag}; the launcher sets it itself (sglang.model), remove it")
    dp = _flag_value(args, DP_FLAGS)
    if dp is not None and dp.strip() != "1":
        raise ConfigError(
            f"sglang.serve_args sets a data-parallel size of {dp}: SGLang updates weights from tensors (the path our "
            "loader runs on) only with dp_size 1; start one server per replica and list each in the trainer's "
            "sglang.urls"
        )
    argv = [sglang_exe, "serve", "--model-path", model, "--custom-weight-loader", LOADER, *args]
    return argv, {CONFIG_ENV: config_path}


def launch(cfg: UserConfig) -> int:
    """Replace this process with `sglang serve` (signals and exit code are SGLang's own). `cfg`: what the
    CLI loaded, converted here (the edge)."""
    config = settings(cfg)
    exe = shutil.which("sglang")
    if exe is None:
        raise BackendUnavailable(
            "rollout.engine=sglang needs SGLang (no `sglang` executable on PATH); install SGLang first (it pins "
            "torch), then: pip install 'lightning_weightsync[sglang]'"
        )
    serve_command(config.sglang, "", exe)  # validate before writing anything
    path, secret_env = write_config(config)
    argv, env = serve_command(config.sglang, path, exe)
    os.execvpe(exe, argv, {**os.environ, **secret_env, **env})
    return 0  # pragma: no cover - exec does not return


__all__ = ["launch", "serve_command"]
