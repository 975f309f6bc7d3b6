"""The rollout-engine registry: the names `rollout.engine` accepts are the registered ones, an engine's
trainer-side client module imports nothing of the rollout layer (the trainer loads it by path), and the
trainer builds clients without importing any engine's receiving side."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_weightsync
from lightning_weightsync.config import RolloutEngineName, load_config
from lightning_weightsync.errors import ConfigError
from lightning_weightsync.plugins import ROLLOUT_ENGINES, SINKS, register_rollout_engine, rollout_engine

PACKAGE = Path(lightning_weightsync.__file__).parent
BELOW_TRAINER = ("errors", "choice", "registry", "plugins", "protocol", "transport", "config", "versions")
OWN_TRAINER_HALF = ("api", "config", "")  # the engine's constants, its config section, `from . import api`


def test_config_choices_are_the_registry() -> None:
    assert {e.value for e in RolloutEngineName} == {"none", *ROLLOUT_ENGINES}
    assert load_config(overrides=["rollout.engine=sglang"]).rollout.engine == "sglang"
    with pytest.raises(ConfigError, match=r"rollout\.engine"):
        load_config(overrides=["rollout.engine=trtllm"])
    with pytest.raises(ConfigError, match=r"no such rollout engine.*vllm, sglang"):
        rollout_engine("trtllm")
    with pytest.raises(ConfigError, match="registered twice"):
        register_rollout_engine("vllm", "elsewhere")


@pytest.mark.parametrize("name", sorted(ROLLOUT_ENGINES))
def test_each_engine_is_one_folder_with_a_client_and_a_launcher(name: str) -> None:
    folder = PACKAGE / "rollout_engines" / name
    assert ROLLOUT_ENGINES[name].package == f"lightning_weightsync.rollout_engines.{name}"
    assert (folder / "client.py").is_file() and (folder / "launch.py").is_file()
    assert (folder / "config.py").is_file(), "an engine's config section lives in its folder"


@pytest.mark.parametrize("name", sorted(ROLLOUT_ENGINES))
def test_client_modules_import_nothing_of_the_rollout_layer(name: str) -> None:
    """The trainer imports an engine's client by path; the layering (trainer and rollout never import each
    other) holds because the client is the engine's trainer half and imports only what the trainer may."""
    folder = PACKAGE / "rollout_engines" / name
    bad = []
    for path in [folder / "client.py", *(folder / f for f in ("api.py",) if (folder / f).exists())]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                parts = (node.module or "").split(".")
                if node.level == 1 and parts[0] in OWN_TRAINER_HALF:
                    continue  # the engine's own constants (api.py, checked too) and config section
                if node.level != 3 or parts[0] not in BELOW_TRAINER:
                    bad.append(f"{path.name}:{node.lineno} from {'.' * node.level}{node.module}")
            elif isinstance(node, ast.Import | ast.ImportFrom) and not getattr(node, "level", 0):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                bad += [f"{path.name}:{node.lineno} {n}" for n in names if n.startswith("lightning_weightsync.rollout")]
    assert not bad, bad


def test_building_clients_loads_no_receiving_side() -> None:
    code = (
        "import sys\n"
        "from lightning_weightsync.config import load_config, settings\n"
        "from lightning_weightsync.trainer.fleet import RolloutFleet\n"
        "cfg = load_config(overrides=['vllm.urls=[http://v:1]', 'sglang.urls=[http://s:2]'])\n"
        "assert len(RolloutFleet.from_config(settings(cfg)).clients) == 2\n"
        "import json\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('lightning_weightsync.rollout'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    loaded = set(json.loads(out))
    # the sinks' config sections (config collects them) and their empty packages: nothing else of the rollout layer
    sections = {SINKS.section(n).__module__ for n in SINKS}
    allowed = {"lightning_weightsync.rollout", "lightning_weightsync.rollout.sinks", *sections}
    allowed.add("lightning_weightsync.rollout_engines")
    for name in ROLLOUT_ENGINES:  # the trainer half and the config section; no receiving code
        pkg = f"lightning_weightsync.rollout_engines.{name}"
        allowed |= {pkg, f"{pkg}.client", f"{pkg}.api", f"{pkg}.config"}
    assert loaded <= allowed, sorted(loaded - allowed)
