"""One plug-in seam: a table of names to module paths, imported only when an entry is used.

Every pluggable part is named in one such table, one line an entry, all of them in `plugins.py` (low in the
stack, so every layer may read them): data-plane backends (`transport.backend`), the join kinds a plan can
carry, daemon sinks (`rollout.sink.type`) and rollout engines (`rollout.engine`). An entry may also name the
plug-in's config section (`section=`), which config collects from the table. As vLLM's
`WeightTransferEngineFactory`, an entry is a path, not an object: listing the names (config
validation, `--help`) imports nothing, so a part whose optional dependency (cupy, torch_npu, nixl, vllm)
is missing still shows up as a choice, and fails with its own message only when it is built.

    BACKENDS = Registry[type[Backend]]("transport.backend", "data-plane backend")
    BACKENDS.add("gloo", "lightning_weightsync.transport.backends.gloo:GlooBackend")
    BACKENDS["gloo"]          # imports the module, returns GlooBackend
    "gloo" in BACKENDS, list(BACKENDS)    # no import
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from .errors import ConfigError

T = TypeVar("T")


def import_object(path: str) -> Any:
    """`package.module:Attr` -> the attribute, `package.module` -> the module."""
    module, _, attr = path.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, attr) if attr else obj


class Registry(Mapping[str, T], Generic[T]):
    """Names -> `package.module:Attr` paths, loaded on first use (`registry[name]`) and cached.

    `knob` is the setting that picks an entry: an unknown name raises `ConfigError` naming it and
    listing every registered name. `load(name, path)` turns an entry into what the registry hands out
    (default: import the path); an engine's registry hands out a view that imports lazily itself.
    Iterating, `len` and `in` never import anything.
    """

    def __init__(self, knob: str, what: str, *, load: Callable[[str, str], T] | None = None) -> None:
        self.knob = knob
        self.what = what
        self._load: Callable[[str, str], T] = load or (lambda _name, path: import_object(path))
        self._paths: dict[str, str] = {}
        self._sections: dict[str, str] = {}
        self._built: dict[str, T] = {}
        self._frozen_by = ""

    def add(self, name: str, path: str, *, section: str | None = None) -> None:
        """Register `name` (the value `knob` takes) at `path`, with its config section's class at `section`
        (`package.module:Class`, a dataclass next to the plug-in's code); a name registered twice is a bug."""
        if name in self._paths:
            raise ConfigError(f"{self.knob}: {self.what} {name!r} is registered twice ({self._paths[name]}, {path})")
        if self._frozen_by:
            raise ConfigError(f"{self.knob}: {self.what} {name!r} is registered after {self._frozen_by}")
        self._paths[name] = path
        if section is not None:
            self._sections[name] = section

    def freeze(self, by: str) -> None:
        """No entries after this point (`by` says what was built from the complete table)."""
        self._frozen_by = by

    def path(self, name: str) -> str:
        """Where `name` lives (`package.module:Attr`), without importing it."""
        try:
            return self._paths[str(name)]
        except KeyError:
            raise self.unknown(name) from None

    def section(self, name: str) -> Any:
        """The config section class `name` declares (imports its module), or None when it has none."""
        self.path(name)  # an unknown name is a ConfigError listing the known ones
        path = self._sections.get(str(name))
        return import_object(path) if path else None

    def module(self, name: str) -> str:
        return self.path(name).partition(":")[0]

    def unknown(self, name: object) -> ConfigError:
        return ConfigError(f"{self.knob}={name}: no such {self.what}; choose one of: {', '.join(self._paths)}")

    def __getitem__(self, name: str) -> T:
        key = str(name)
        if key not in self._built:
            self._built[key] = self._load(key, self.path(key))
        return self._built[key]

    def get(self, name: str, default: Any = None) -> Any:
        """`registry[name]` for a registered name (importing it), else `default` (no ConfigError)."""
        return self[name] if name in self else default  # noqa: SIM401 - this is `get`

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and str(name) in self._paths

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)

    def loaded(self) -> dict[str, T]:
        """The entries whose module is imported already (by whoever built them): importing none."""
        return {name: self[name] for name in self._paths if self.module(name) in sys.modules}

    def __repr__(self) -> str:
        return f"Registry({self.knob}: {', '.join(self._paths)})"


__all__ = ["Registry", "import_object"]
