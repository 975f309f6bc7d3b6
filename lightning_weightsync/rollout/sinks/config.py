"""Each sink's own section of `rollout.sink`: the knobs that sink reads, declared once, here, by the sink.

Users keep writing one `rollout.sink` section (`rollout.sink.type: safetensors`, `rollout.sink.dir: ...`):
config builds its shape (`SinkConfig`: `type` and every sink's knobs, so a misspelt key fails at load time)
from these sections, collected through the sink table (`plugins.SINKS`, `section=`), and hands a sink only
its own. A knob two sinks both read is declared by each, with the same type and default.

A section also checks its own knobs (`validate`: what types cannot express), run by `load_config` for every
sink's section. Config imports this module while it is itself being imported, so it imports only `choice` and
`errors` (documented in configs/default.yaml and docs/configuration.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...choice import Choice
from ...errors import ConfigError

MAX_KEEP_LAST = 1_000_000
"""Versions a safetensors sink may keep: beyond this it is a typo (as config's `MAX_COUNT`)."""


class LoraApply(Choice):
    """`rollout.sink.lora`: what the module sink does with adapter versions."""

    keep = "keep"
    merge = "merge"


@dataclass(frozen=True)
class SinkSectionBase:
    """What every sink's section has: `validate`, its own checks (none by default)."""

    def validate(self) -> None:
        """Raise `ConfigError` naming the `rollout.sink.*` knob whose value this sink cannot use."""


@dataclass(frozen=True)
class ModuleSinkSection(SinkSectionBase):
    """`rollout.sink.type=module`: the factory that builds the live module, its keyword options, and what
    adapter versions do to it."""

    factory: str | None = None
    """`package.module:function` returning the torch module to load into."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword options passed to the factory."""
    lora: LoraApply = LoraApply.keep
    """Adapter versions (trainer.lora=adapter): keep (the factory builds a PEFT model, the adapter is loaded
    into it) or merge (a plain module; W + scale * B @ A merged on arrival)."""


@dataclass(frozen=True)
class SafetensorsSinkSection(SinkSectionBase):
    """`rollout.sink.type=safetensors`: where versions are written, how many are kept, the checkpoint whose
    non-weight files go next to each, and the written files' permission bits."""

    dir: str | None = None
    """Output directory."""
    template_dir: str | None = None
    """A checkpoint directory whose non-weight files (config.json, tokenizer) are copied next to each version's
    model.safetensors, so each version is a directory from_pretrained/vLLM loads."""
    keep_last: int = 3
    """Complete versions kept on disk."""
    file_mode: int | None = None
    """Permission bits of the files it writes, e.g. 0600 (YAML octal) so only this user reads the weights;
    null = the process umask decides (usually 0644)."""

    def validate(self) -> None:
        if self.keep_last > MAX_KEEP_LAST:
            raise ConfigError(f"rollout.sink.keep_last={self.keep_last} is out of range (at most {MAX_KEEP_LAST})")
        mode = self.file_mode
        if mode is not None and not (0 <= mode <= 0o777 and mode & 0o600 == 0o600):
            raise ConfigError(
                f"rollout.sink.file_mode={mode:o} (octal) must be permission bits the owner can read and write, "
                "e.g. 0600 or 0640; null = the umask decides"
            )
        if self.keep_last < 1:
            raise ConfigError(f"rollout.sink.keep_last={self.keep_last} must be >= 1")


@dataclass(frozen=True)
class CallableSinkSection(SinkSectionBase):
    """`rollout.sink.type=callable`: the function every version is handed to."""

    target: str | None = None
    """`package.module:function` called with (version, iterator of (name, tensor))."""


SinkSection = ModuleSinkSection | SafetensorsSinkSection | CallableSinkSection
"""Any sink's own section (what `config.sink_section` returns)."""


__all__ = [
    "MAX_KEEP_LAST",
    "CallableSinkSection",
    "LoraApply",
    "ModuleSinkSection",
    "SafetensorsSinkSection",
    "SinkSection",
    "SinkSectionBase",
]
