"""`rollout.sink`: one section users write, made of every sink's own section, collected from the sink table.

Each sink declares the knobs it reads once, in its section (`rollout/sinks/config.py`, named by its line of
`plugins.SINKS`). `SinkConfig`, the shape users' YAML is checked against (so a misspelt key fails at load
time), is `type` plus the union of those sections' fields, built here; `sink_section` hands a sink only its
own, and `unread_sink_knobs` names what was set that the chosen sink will not read. Nothing of the rollout
layer but those section modules is imported (they import only `choice`).
"""

from __future__ import annotations

import typing
from dataclasses import MISSING, Field, dataclass, field, fields, make_dataclass
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from ..choice import Choice
from ..plugins import SINKS

if TYPE_CHECKING:  # the checker's view of the generated classes (the code looks members up by name)

    class SinkType(Choice): ...

    @dataclass(init=False)
    class SinkConfig:
        type: SinkType

        def __init__(self, **knobs: Any) -> None: ...

        def __getattr__(self, name: str) -> Any: ...  # a knob of some sink's section

else:
    SinkType = Choice("SinkType", {name: name for name in SINKS})
SinkType.__doc__ = """`rollout.sink.type`: where a rollout daemon puts each version (the names in `SINKS`).
A rollout engine that receives by itself (vLLM, SGLang) is `rollout.engine`, not a sink."""

SINK_SECTIONS: dict[str, type[Any]] = {name: SINKS.section(name) for name in SINKS}
"""Each name in `SINKS` and the dataclass of the knobs that sink reads (its entry's `section=`)."""


def _default(f: Field[Any]) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


def _knobs() -> list[tuple[str, Any, Any]]:
    """Every sink's knobs as (name, type, field), once each; a knob two sinks read must agree on both."""
    knobs: dict[str, tuple[str, Any, Any]] = {}
    for kind, section in SINK_SECTIONS.items():
        hints = typing.get_type_hints(section)
        for f in fields(section):
            same = knobs.get(f.name)
            if same is not None and (same[1] != hints[f.name] or _default(same[2]) != _default(f)):
                raise TypeError(f"rollout.sink.{f.name}: sink {kind!r} declares it unlike another sink")
            dflt = (
                field(default_factory=f.default_factory)
                if f.default_factory is not MISSING
                else field(default=f.default)
            )
            knobs[f.name] = (f.name, hints[f.name], dflt)
    return list(knobs.values())


if not TYPE_CHECKING:
    SinkConfig = make_dataclass(
        "SinkConfig",
        [("type", SinkType, field(default=SinkType["module"])), *_knobs()],
        namespace={"__module__": __name__},
    )
    SinkConfig.__doc__ = """`rollout.sink`: where a rollout puts each version (`type`, then every sink's knobs)."""


def _as_dict(sink: DictConfig | SinkConfig) -> dict[str, Any]:
    if isinstance(sink, SinkConfig):
        return {f.name: getattr(sink, f.name) for f in fields(sink)}
    tree = OmegaConf.to_container(sink, resolve=True)
    assert isinstance(tree, dict)  # a config section is a mapping
    return {str(k): v for k, v in tree.items()}


def sink_section(sink: DictConfig | SinkConfig, kind: str | None = None) -> Any:
    """The chosen sink's own section of `rollout.sink` (an instance of its `SINK_SECTIONS` dataclass); `kind`
    names the sink when it is not `rollout.sink.type` (a sink class built directly, `ModuleSink(cfg)`)."""
    values = _as_dict(sink)
    section = SINK_SECTIONS[kind or str(values.get("type", "module"))]
    return section(**{f.name: values[f.name] for f in fields(section) if f.name in values})


def check_sink_sections(sink: DictConfig | SinkConfig) -> None:
    """Every sink's section of `rollout.sink` checks its own knobs (`validate`: ranges types cannot express),
    whichever sink is chosen: a bad value fails at load time, not when another sink is picked."""
    for kind in SINK_SECTIONS:
        sink_section(sink, kind).validate()


def unread_sink_knobs(sink: DictConfig | SinkConfig) -> list[str]:
    """`rollout.sink.*` knobs set away from their default that the chosen sink does not read."""
    values = _as_dict(sink)
    own = {f.name for f in fields(SINK_SECTIONS[str(values.get("type", "module"))])} | {"type"}
    defaults = _as_dict(SinkConfig())
    return [f"rollout.sink.{k}" for k, v in values.items() if k not in own and k in defaults and v != defaults[k]]


__all__ = ["SINK_SECTIONS", "SinkConfig", "SinkType", "check_sink_sections", "sink_section", "unread_sink_knobs"]
