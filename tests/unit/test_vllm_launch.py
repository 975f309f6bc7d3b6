"""`lightning-weightsync rollout rollout.engine=vllm`: the `vllm serve` command it execs."""

from __future__ import annotations

import importlib
import json
import os
import stat
import tempfile
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lightning_weightsync.config import AUTH_TOKEN_ENV, auth_token, load_config, settings
from lightning_weightsync.errors import BackendUnavailable, ConfigError
from lightning_weightsync.rollout_engines.vllm.extension import EXTENSION_CLASS, REPORT_METHOD
from lightning_weightsync.rollout_engines.vllm.launch import config_dir, launch, serve_command, write_config


def test_serve_command_selects_our_engine_dev_routes_and_config() -> None:
    cfg = load_config(overrides=["vllm.model=Qwen/Qwen3-8B", "vllm.serve_args=[--port,8001,--tensor-parallel-size,2]"])
    argv, env = serve_command(settings(cfg).vllm, "/tmp/sync.yaml", "/bin/vllm")
    assert argv == ["/bin/vllm", "serve", "Qwen/Qwen3-8B", "--weight-transfer-config",
                    '{"backend": "lightning_weightsync"}', "--port", "8001", "--tensor-parallel-size", "2",
                    "--worker-extension-cls", EXTENSION_CLASS]  # fmt: skip
    assert json.loads(argv[4]) == {"backend": "lightning_weightsync"}
    assert env == {"VLLM_SERVER_DEV_MODE": "1", "LIGHTNING_WEIGHTSYNC_CONFIG": "/tmp/sync.yaml"}
    # the class vLLM will import by that name has the method the trainer's verify names
    module, _, name = EXTENSION_CLASS.rpartition(".")
    assert callable(getattr(getattr(importlib.import_module(module), name), REPORT_METHOD))


def test_a_worker_extension_of_the_users_own_is_kept_and_the_launcher_says_what_verify_then_needs(caplog) -> None:
    cfg = load_config(overrides=["vllm.model=m", "vllm.serve_args=[--host,127.0.0.1,--worker-extension-cls,my.Ext]"])
    with caplog.at_level("WARNING"):
        argv, _ = serve_command(settings(cfg).vllm, "p")
    assert argv.count("--worker-extension-cls") == 1 and argv[-1] == "my.Ext"
    assert any("inherits" in r.message and EXTENSION_CLASS in r.message for r in caplog.records)


def test_serve_command_refuses_no_model_and_a_second_weight_transfer_config() -> None:
    with pytest.raises(ConfigError, match=r"vllm\.model"):
        serve_command(settings(load_config()).vllm, "p")
    cfg = load_config(overrides=["vllm.model=m", "vllm.serve_args=[--weight-transfer-config,{}]"])
    with pytest.raises(ConfigError, match=r"sets --weight-transfer-config"):
        serve_command(settings(cfg).vllm, "p")


def test_the_config_file_is_private_holds_no_token_and_is_cleaned_up(tmp_path, monkeypatch) -> None:
    """Issue 24 item 6: the launcher's 0600 copy of the token was never removed. Now the token goes to the
    server's environment, the file (in this user's 0700 directory) holds none, and the files of servers that
    are gone are removed by the next launch."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    cfg = load_config(overrides=["transport.auth_token=s3cret-0123456789", "vllm.model=m"])
    stale = config_dir() / "rollout-999999999.yaml"  # a pid no process has
    stale.write_text("transport: {}\n")
    path, env = write_config(settings(cfg))
    assert not stale.exists()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_IMODE(config_dir().stat().st_mode) == 0o700
    assert "s3cret" not in Path(path).read_text() and OmegaConf.load(path).transport.auth_token is None
    assert env == {AUTH_TOKEN_ENV: "s3cret-0123456789"}  # the engine gets it from the environment
    monkeypatch.setenv(AUTH_TOKEN_ENV, env[AUTH_TOKEN_ENV])
    assert auth_token(load_config(path)) == b"s3cret-0123456789"
    assert Path(path).exists()  # this launcher's own file stays (the server it execs reads it, maybe again)


def test_serve_command_warns_when_vllm_would_listen_everywhere(caplog) -> None:
    with caplog.at_level("WARNING", logger="lightning_weightsync.rollout_engines.vllm.launch"):
        serve_command(settings(load_config(overrides=["vllm.model=m", "vllm.serve_args=[--host,10.0.0.5]"])).vllm, "p")
        assert not caplog.records
        serve_command(settings(load_config(overrides=["vllm.model=m"])).vllm, "p")
    assert any("no --host" in r.getMessage() for r in caplog.records)


def test_launch_without_vllm_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    with pytest.raises(BackendUnavailable, match=r"no `vllm` executable.*lightning_weightsync\[vllm\]"):
        launch(load_config(overrides=["vllm.model=m"]))
