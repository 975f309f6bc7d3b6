"""`lightning-weightsync rollout rollout.sink.type=vllm`: the `vllm serve` command it execs."""

from __future__ import annotations

import json
import os
import stat

import pytest
from omegaconf import OmegaConf

from lightning_weightsync.config import load_config
from lightning_weightsync.errors import BackendUnavailable, ConfigError
from lightning_weightsync.rollout.vllm.launch import launch, serve_command, write_config


def test_serve_command_selects_our_engine_dev_routes_and_config() -> None:
    cfg = load_config(overrides=["vllm.model=Qwen/Qwen3-8B", "vllm.serve_args=[--port,8001,--tensor-parallel-size,2]"])
    argv, env = serve_command(cfg, "/tmp/sync.yaml", "/bin/vllm")
    assert argv == ["/bin/vllm", "serve", "Qwen/Qwen3-8B", "--weight-transfer-config",
                    '{"backend": "lightning_weightsync"}', "--port", "8001", "--tensor-parallel-size", "2"]  # fmt: skip
    assert json.loads(argv[4]) == {"backend": "lightning_weightsync"}
    assert env == {"VLLM_SERVER_DEV_MODE": "1", "LIGHTNING_WEIGHTSYNC_CONFIG": "/tmp/sync.yaml"}
    # rollout.sink.target is the fallback model
    assert serve_command(load_config(overrides=["rollout.sink.target=m"]), "p")[0][2] == "m"


def test_serve_command_refuses_no_model_and_a_second_weight_transfer_config() -> None:
    with pytest.raises(ConfigError, match=r"vllm\.model"):
        serve_command(load_config(), "p")
    cfg = load_config(overrides=["vllm.model=m", "vllm.serve_args=[--weight-transfer-config,{}]"])
    with pytest.raises(ConfigError, match=r"sets --weight-transfer-config"):
        serve_command(cfg, "p")


def test_the_config_file_is_private_and_keeps_the_secret() -> None:
    path = write_config(load_config(overrides=["transport.auth_token=s3cret", "vllm.model=m"]))
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert OmegaConf.load(path).transport.auth_token == "s3cret"  # the engine needs it to verify messages
    finally:
        os.unlink(path)


def test_launch_without_vllm_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    with pytest.raises(BackendUnavailable, match=r"no `vllm` executable.*lightning_weightsync\[vllm\]"):
        launch(load_config(overrides=["vllm.model=m"]))
