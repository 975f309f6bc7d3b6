"""The one plug-in seam (`lightning_weightsync/registry.py`) and the four tables built with it: listing
names imports nothing, an unknown name is a `ConfigError` naming the knob and every choice, config
validation lists every backend, sink and engine without importing one (nor cupy, torch_npu, nixl, vllm),
and the backend-neutral `groups_draining` asks only the backends this process loaded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_weightsync.config import SINKS, BackendName, SinkType, load_config
from lightning_weightsync.errors import ConfigError
from lightning_weightsync.plugins import ROLLOUT_ENGINES
from lightning_weightsync.registry import Registry
from lightning_weightsync.transport.backends import BACKENDS, Backend, backend_class, groups_draining


@pytest.fixture
def plugin_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module `lws_test_plugin` with one class in it, importable but not imported yet."""
    (tmp_path / "lws_test_plugin.py").write_text("class Thing:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lws_test_plugin", raising=False)
    return "lws_test_plugin"


def test_names_are_listed_without_importing_and_built_on_first_use(plugin_module: str) -> None:
    table: Registry[type] = Registry("test.kind", "test plug-in")
    table.add("thing", f"{plugin_module}:Thing")
    assert list(table) == ["thing"] and "thing" in table and len(table) == 1
    assert table.loaded() == {}
    assert plugin_module not in sys.modules  # listing, `in` and `loaded` import nothing
    thing = table["thing"]
    assert thing.__name__ == "Thing" and table["thing"] is thing and plugin_module in sys.modules
    assert table.loaded() == {"thing": thing}


def test_an_entry_names_its_config_section_imported_only_when_asked(plugin_module: str) -> None:
    table: Registry[type] = Registry("test.kind", "test plug-in")
    table.add("thing", "json:dumps", section=f"{plugin_module}:Thing")
    table.add("bare", "json:loads")
    assert plugin_module not in sys.modules  # registering a section imports nothing
    assert table.section("thing").__name__ == "Thing" and table.section("bare") is None
    with pytest.raises(ConfigError, match=r"test\.kind=nope: no such test plug-in"):
        table.section("nope")


def test_two_sinks_that_declare_one_knob_unalike_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """`rollout.sink` is built from every sink's section: a knob two sinks read must mean one thing."""
    import dataclasses

    from lightning_weightsync.config import sinks

    a = dataclasses.make_dataclass("A", [("dir", str, dataclasses.field(default="x"))], frozen=True)
    b = dataclasses.make_dataclass("B", [("dir", str, dataclasses.field(default="y"))], frozen=True)
    monkeypatch.setattr(sinks, "SINK_SECTIONS", {"a": a, "b": a})
    assert [k[0] for k in sinks._knobs()] == ["dir"]  # declared alike by both: one knob
    monkeypatch.setattr(sinks, "SINK_SECTIONS", {"a": a, "b": b})
    with pytest.raises(TypeError, match=r"rollout\.sink\.dir: sink 'b' declares it unlike another sink"):
        sinks._knobs()


def test_unknown_names_name_the_knob_and_every_choice() -> None:
    table: Registry[object] = Registry("test.kind", "test plug-in")
    table.add("a", "json:dumps")
    table.add("b", "json:loads")
    with pytest.raises(ConfigError, match=r"test\.kind=c: no such test plug-in; choose one of: a, b"):
        table["c"]
    assert "c" not in table and 3 not in table


def test_a_name_registered_twice_or_after_freezing_is_refused() -> None:
    table: Registry[object] = Registry("test.kind", "test plug-in")
    table.add("a", "json:dumps")
    with pytest.raises(ConfigError, match="'a' is registered twice"):
        table.add("a", "json:loads")
    table.freeze("the union was built")
    with pytest.raises(ConfigError, match="'b' is registered after the union was built"):
        table.add("b", "json:loads")


@pytest.mark.parametrize(
    ("table", "knob"),
    [(BACKENDS, "transport.backend"), (SINKS, "rollout.sink.type"), (ROLLOUT_ENGINES, "rollout.engine")],
)
def test_each_seam_names_its_knob(table: Registry[object], knob: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{knob}=nope: no such .*; choose one of: {', '.join(table)}$"):
        table["nope"]


def test_config_choices_are_the_tables() -> None:
    assert {b.value for b in BackendName} == set(BACKENDS)
    assert {s.value for s in SinkType} == set(SINKS)
    with pytest.raises(ConfigError, match=r"transport\.backend"):
        backend_class("mpi")


def test_config_validation_imports_no_plug_in() -> None:
    """Loading (and validating) a config for every choice imports no backend, sink or engine module and
    none of their optional dependencies: the choices come from the tables' names alone."""
    overrides = [
        *(f"transport.backend={b}" for b in BACKENDS),
        *(f"rollout.sink.type={s}" for s in SINKS),
        *(f"rollout.engine={e}" for e in ROLLOUT_ENGINES),
    ]
    code = (
        "import json, sys\n"
        "from lightning_weightsync.config import load_config\n"
        f"for o in {overrides!r}:\n"
        "    load_config(overrides=[o])\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    loaded = set(json.loads(out))
    plug_ins = {BACKENDS.module(b) for b in BACKENDS} | {SINKS.module(s) for s in SINKS}
    assert not loaded & plug_ins, sorted(loaded & plug_ins)
    # an engine's package holds its config section (`<engine>/config.py`, part of the config tree, so loaded
    # with it, and the package's empty __init__ with it); none of its other modules
    engine_config = {f"{ROLLOUT_ENGINES.module(e)}.config" for e in ROLLOUT_ENGINES}
    engine_code = {
        m for e in ROLLOUT_ENGINES for m in loaded if m.startswith(f"{ROLLOUT_ENGINES.module(e)}.")
    } - engine_config
    assert engine_config <= loaded and not engine_code, sorted(engine_code)
    assert not loaded & {"cupy", "torch_npu", "nixl", "nixl._api", "vllm", "sglang"}
    assert load_config(overrides=["rollout.sink.type=callable"]).rollout.sink.type == "callable"


def test_groups_draining_asks_only_loaded_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    """Backend-neutral: the engine and the CLI ask this, never a backend's module; a backend whose module
    is not loaded has no group to drain, and two backends sharing one drain (gloo, hccl) count it once."""
    asked: list[str] = []

    def fake_loaded() -> dict[str, type[Backend]]:
        gloo = backend_class("gloo")

        class Draining(Backend):  # type: ignore[misc]
            @classmethod
            def draining(cls) -> int:
                asked.append("draining")
                return 2

        return {"gloo": gloo, "hccl": gloo, "x": Draining}

    monkeypatch.setattr(BACKENDS, "loaded", fake_loaded)
    assert groups_draining() == 2 and asked == ["draining"]


def test_get_returns_the_default_for_an_unknown_name() -> None:
    table: Registry[object] = Registry("test.kind", "test plug-in")
    table.add("a", "json:dumps")
    assert table.get("nope") is None and table.get("nope", 1) == 1
    assert table.get("a") is json.dumps
