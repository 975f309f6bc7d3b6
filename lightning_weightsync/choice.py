"""`Choice`, the base of every config choice: a `str` Enum that OmegaConf checks at load time.

It lives on its own, below `config`, because the config sections that live with their plug-in's code
(`rollout_engines/<engine>/config.py`, `rollout/sinks/config.py`) define choices too and `config` collects
those sections (through the tables in `plugins.py`) while it is being imported: with `Choice` inside `config`
a section would import `config` and `config` it, a cycle.
"""

from __future__ import annotations

import enum


class Choice(str, enum.Enum):
    """A config choice: OmegaConf rejects any other value at load time, and the code compares
    members, never strings. Formats as its value, so messages and YAML read `gloo`, not `Backend.gloo`."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


__all__ = ["Choice"]
