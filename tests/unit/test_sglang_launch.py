"""`lightning-weightsync rollout rollout.engine=sglang`: the `sglang serve` command it execs, and the
limits it checks before anything runs."""

from __future__ import annotations

import pytest

from lightning_weightsync.config import load_config, settings
from lightning_weightsync.errors import BackendUnavailable, ConfigError
from lightning_weightsync.rollout_engines.sglang.api import LOADER
from lightning_weightsync.rollout_engines.sglang.launch import launch, serve_command
from lightning_weightsync.rollout_engines.sglang.loader import load_weights


def test_serve_command_names_our_loader_and_the_config() -> None:
    cfg = load_config(overrides=["sglang.model=Qwen/Qwen3-8B", "sglang.serve_args=[--port,30001,--tp-size,2]"])
    argv, env = serve_command(settings(cfg).sglang, "/tmp/sync.yaml", "/bin/sglang")
    assert argv == ["/bin/sglang", "serve", "--model-path", "Qwen/Qwen3-8B", "--custom-weight-loader", LOADER,
                    "--port", "30001", "--tp-size", "2"]  # fmt: skip
    assert env == {"LIGHTNING_WEIGHTSYNC_CONFIG": "/tmp/sync.yaml"}
    module, _, name = LOADER.rpartition(".")  # SGLang's dynamic_import: module path, then the attribute
    assert getattr(__import__(module, fromlist=[name]), name) is load_weights


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ("[--dp-size,2]", r"data-parallel size of 2.*dp_size 1"),
        ("[--data-parallel-size=4]", r"data-parallel size of 4"),
        ("[--custom-weight-loader,x.y]", r"sets --custom-weight-loader"),
        ("[--model-path,other]", r"sets --model-path"),
    ],
)
def test_limits_and_our_own_flags_are_refused_up_front(args: str, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        serve_command(settings(load_config(overrides=["sglang.model=m", f"sglang.serve_args={args}"])).sglang, "p")
    serve_command(
        settings(load_config(overrides=["sglang.model=m", "sglang.serve_args=[--dp-size,1]"])).sglang, "p"
    )  # 1 is fine


def test_no_model_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"sglang\.model"):
        serve_command(settings(load_config()).sglang, "p")


def test_launch_without_sglang_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    with pytest.raises(BackendUnavailable, match=r"no `sglang` executable.*lightning_weightsync\[sglang\]"):
        launch(load_config(overrides=["rollout.engine=sglang", "sglang.model=m"]))
