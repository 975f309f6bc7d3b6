"""The config file an engine's server reads, written by its launcher (`rollout_engines/<engine>/launch.py`).

A launcher execs the engine's server (`vllm serve`, SGLang's launch_server) with
`$LIGHTNING_WEIGHTSYNC_CONFIG` pointing at the resolved config; every worker's receiver reads it. That
file holds no secret: `transport.auth_token` goes to the server's environment instead
(`$LIGHTNING_WEIGHTSYNC_AUTH_TOKEN`, readable by this user only), and the file lives in this user's 0700
directory, named by the pid the server keeps across the exec; the next launch removes the files of
servers that are gone (nothing runs after an exec to do it).
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from ..config import AUTH_TOKEN_ENV, WeightSyncConfig, to_yaml
from ..errors import ConfigError
from ..transport.process import process_alive


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


def write_config(config: WeightSyncConfig) -> tuple[str, dict[str, str]]:
    """The resolved config for the engine's workers (typed: the launcher's edge converted it), and the
    environment that carries its token.

    The token never goes into the file (before: a 0600 copy of it stayed in /tmp for ever). Files that
    servers no longer running left behind are removed."""
    directory = config_dir()
    for old in directory.glob("rollout-*.yaml"):
        pid = old.stem.removeprefix("rollout-")
        if pid.isdigit() and int(pid) != os.getpid() and not process_alive(int(pid)):
            old.unlink(missing_ok=True)
    env: dict[str, str] = {}
    if config.transport.auth_token is not None:
        env[AUTH_TOKEN_ENV] = config.transport.auth_token
    path = directory / f"rollout-{os.getpid()}.yaml"  # the pid the server keeps: exec does not change it
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(to_yaml(config, redact=False, drop_token=True))
    return str(path), env


__all__ = ["config_dir", "write_config"]
