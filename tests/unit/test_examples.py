"""The integrations' config files in examples/ say what the docs say and load as the frameworks load them:
the TRL example's `sync.yaml` (run whole by tests/integration/test_trl_async_grpo.py) and its vLLM layout, whose
`trainer.min_receivers` counts every worker of every server; verl's checkpoint-engine snippet, whose command-line
form (Hydra's `+` for the key verl does not declare, quoted list elements) is derived from its keys here and built
into our engine as verl builds it."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from lightning_weightsync import load_config
from lightning_weightsync.config import settings
from tests.support import verl_standin

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
VERL_SNIPPET = EXAMPLES / "verl_checkpoint_engine.yaml"
ENGINE = "actor_rollout_ref.rollout.checkpoint_engine"
VERL_DECLARES = {"backend", "update_weights_bucket_megabytes", "custom_backend_module", "engine_kwargs"}  # 0.9.1


def test_the_trl_example_s_configs_load_and_name_what_the_example_uses() -> None:
    cpu = settings(load_config(EXAMPLES / "sync.yaml"))
    assert cpu.transport.backend.value == "gloo" and cpu.trainer.min_receivers == 1  # one CpuRolloutWorker
    assert cpu.rollout.identity == "trl-cpu-rollout"  # the name the example's fault drill expects in the error
    text = (REPO / "docs" / "integrations.md").read_text()
    assert 'WeightSyncTransfer("examples/sync.yaml")' in text and "examples/trl_async_grpo.py" in text


def test_the_vllm_layout_counts_every_worker_of_every_server() -> None:
    """The launch line in its header starts each server at some tensor-parallel size: min_receivers is their sum."""
    path = EXAMPLES / "sync_vllm.yaml"
    typed = settings(load_config(path))
    tp = [int(n) for n in re.findall(r"--tensor-parallel-size,(\d+)", path.read_text())]
    assert len(tp) == 1, "one launch line, run once per server"
    assert typed.trainer.min_receivers == tp[0] * len(typed.vllm.urls), (typed.trainer.min_receivers, tp)


def _flatten(node: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and not path.endswith(".engine_kwargs.lightning_weightsync"):
            out.update(_flatten(value, f"{path}."))
        else:
            out[path] = value
    return out


def hydra_lines(snippet: dict[str, Any]) -> list[str]:
    """The snippet as verl's command line: `+` where verl declares no such key, list elements quoted (Hydra's
    grammar refuses an unquoted `=` inside a list)."""
    lines = []
    for key, value in _flatten(snippet).items():
        if key.endswith(".engine_kwargs.lightning_weightsync"):
            for name, item in value.items():
                quoted = ",".join(f'"{v}"' for v in item)
                lines.append(shlex.quote(f"+{key}.{name}=[{quoted}]"))
            continue
        assert key.removeprefix(f"{ENGINE}.") in VERL_DECLARES, f"{key}: not a key verl declares"
        lines.append(f"{key}={value}")
    return lines


def _snippet() -> dict[str, Any]:
    loaded = yaml.safe_load(VERL_SNIPPET.read_text())
    assert isinstance(loaded, dict)
    return loaded


def test_the_verl_snippet_s_command_line_is_its_keys() -> None:
    lines = hydra_lines(_snippet())
    quoted = [line.removeprefix("#").strip() for line in VERL_SNIPPET.read_text().splitlines() if ENGINE in line]
    assert quoted == lines, "the command line in the snippet's header and its keys differ"
    assert any(line.startswith("'+") and '\\"' not in line for line in lines)  # the one new key, shell-quoted once


def test_the_docs_quote_the_verl_snippet() -> None:
    text = (REPO / "docs" / "integrations.md").read_text()
    assert "examples/verl_checkpoint_engine.yaml" in text
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    cited = [b for b in blocks if ENGINE in b]
    assert cited, "docs/integrations.md shows no verl command line"
    lines = [line.rstrip(" \\").strip() for line in cited[0].splitlines() if ENGINE in line]
    assert lines == hydra_lines(_snippet()), "docs/integrations.md's verl command line differs from the snippet"


def test_verl_builds_our_engine_from_the_snippet() -> None:
    """As verl 0.9.1 builds a checkpoint engine (engine_workers.py:679-688): import `custom_backend_module`, then
    `CheckpointEngineRegistry.new(backend, bucket_size=MB << 20, **engine_kwargs[backend])`."""
    engine = _snippet()["actor_rollout_ref"]["rollout"]["checkpoint_engine"]
    with verl_standin.installed(engine["custom_backend_module"]):
        from verl.checkpoint_engine.base import CheckpointEngineRegistry  # the stand-in
        from verl.utils.import_utils import import_external_libs

        import_external_libs(engine["custom_backend_module"])
        built = CheckpointEngineRegistry.new(
            engine["backend"],
            is_master=True,
            bucket_size=engine["update_weights_bucket_megabytes"] << 20,
            **engine["engine_kwargs"].get(engine["backend"], {}),
        )
        assert built.config.transport.bucket_size_mb == engine["update_weights_bucket_megabytes"]
        assert built.config.transport.verify.value == "full"


def test_the_verl_command_line_parses_as_hydra_parses_it() -> None:
    """Hydra is verl's dependency, not ours: run where it is installed (`./dev verl-contract`'s venv)."""
    parser_module = pytest.importorskip("hydra.core.override_parser.overrides_parser")
    parser = parser_module.OverridesParser.create()
    for line in hydra_lines(_snippet()):
        (word,) = shlex.split(line)  # what the shell hands verl
        override = parser.parse_override(word)
        if word.startswith("+"):
            assert override.value() == _flatten(_snippet())[override.key_or_group.rsplit(".", 1)[0]]["overrides"]
