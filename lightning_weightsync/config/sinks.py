"""Each sink's own config section: the `rollout.sink.*` knobs that sink reads, and nothing else.

Users keep writing one `rollout.sink` section (`rollout.sink.type: safetensors`, `rollout.sink.dir: ...`):
`SinkConfig` in `schema.py` is the shape that YAML is checked against (every sink's knobs, so a misspelt key
fails at load time). `SINK_SECTIONS` says which of those knobs each sink reads; `sink_section` hands a sink
only its own, and `unread_sink_knobs` names what was set that the chosen sink will not read.

The sections live here, not in the sinks' modules, because config sits below the rollout layer: the
table names them without importing any sink (`tests/unit/test_layers.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from omegaconf import DictConfig, OmegaConf

from .schema import ApplyMode, LoraApply, SinkConfig
from .settings import UserConfig, settings


@dataclass(frozen=True)
class ModuleSinkSection:
    """`rollout.sink.type=module`: the factory that builds the live module, its keyword options, and what
    adapter versions do to it."""

    factory: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    lora: LoraApply = LoraApply.keep


@dataclass(frozen=True)
class SafetensorsSinkSection:
    """`rollout.sink.type=safetensors`: where versions are written, how many are kept, the checkpoint whose
    non-weight files go next to each, and the written files' permission bits."""

    dir: str | None = None
    template_dir: str | None = None
    keep_last: int = 3
    file_mode: int | None = None


@dataclass(frozen=True)
class CallableSinkSection:
    """`rollout.sink.type=callable`: the function every version is handed to."""

    target: str | None = None


SinkSection = ModuleSinkSection | SafetensorsSinkSection | CallableSinkSection
"""Any sink's own section (what `sink_section` returns)."""

SINK_SECTIONS: dict[str, type[Any]] = {
    "module": ModuleSinkSection,
    "safetensors": SafetensorsSinkSection,
    "callable": CallableSinkSection,
}
"""Each name in `SINKS` (schema.py) and the dataclass of the knobs that sink reads (a test keeps the two in step)."""


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


@dataclass(frozen=True)
class SinkSettings:
    """All a sink is built from: its own section of `rollout.sink` and the three knobs outside it that sinks
    read. Made once, by `SinkSettings.of` at the sink's constructor (the edge: `ModuleSink(cfg)` with a
    `load_config()` result keeps working), so a sink reads no other part of the config."""

    section: SinkSection
    """The sink's `SINK_SECTIONS` dataclass."""
    apply: ApplyMode = ApplyMode.atomic
    """`rollout.apply`."""
    device: str = "cpu"
    """`rollout.device`: where a module sink puts the module its factory built."""
    timeout_s: float = 600.0
    """`transport.timeout_s`: how long a callable sink's hand-off waits for the user's function."""

    @classmethod
    def of(cls, cfg: UserConfig | SinkSettings | SinkSection, kind: str) -> SinkSettings:
        """`cfg` as the settings of sink `kind`: a user's config (converted here), `SinkSettings`, or the
        sink's own section alone (the other knobs at their defaults)."""
        if isinstance(cfg, SinkSettings):
            return cfg
        if isinstance(cfg, SINK_SECTIONS[kind]):
            return cls(cfg)
        assert not isinstance(cfg, SinkSection), f"a {type(cfg).__name__} is not the {kind} sink's section"
        typed = settings(cfg)
        ro = typed.rollout
        return cls(sink_section(ro.sink, kind), ro.apply, ro.device, typed.transport.timeout_s)


def unread_sink_knobs(sink: DictConfig | SinkConfig) -> list[str]:
    """`rollout.sink.*` knobs set away from their default that the chosen sink does not read."""
    values = _as_dict(sink)
    own = {f.name for f in fields(SINK_SECTIONS[str(values.get("type", "module"))])} | {"type"}
    defaults = _as_dict(SinkConfig())
    return [f"rollout.sink.{k}" for k, v in values.items() if k not in own and k in defaults and v != defaults[k]]
