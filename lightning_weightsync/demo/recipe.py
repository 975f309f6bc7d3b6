"""The one `main()` of every recipe: one YAML, validated once at start-up, then `train(recipe, cfg)`.

A recipe YAML is a weightsync config (`transport:`, `trainer:`, `rollout:`) plus a `recipe:`
section with the training script's own knobs. `load_config` accepts the whole file (the `recipe:`
section is free-form there), so the same file serves the training script, `lightning-weightsync
rollout --config` and `lightning-weightsync config show --config`. The training script then checks
its `recipe:` section against its own dataclass (`schema`), so a typo such as `recipe.stepz=3`
still fails at start-up with the key's name, as torchtune's recipes do.

    python recipes/tiny_lm_cpu.py --config recipes/tiny_lm_cpu.yaml recipe.steps=8 transport.port=29600

`key=value` overrides go through `load_config` like the CLI's, `recipe.*` ones included.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..config import load_config
from ..errors import ConfigError

R = TypeVar("R")

#: recipe fields that count things and must be >= 1 when a schema has them
POSITIVE_FIELDS = ("steps", "batch_size", "seq_len", "devices", "num_nodes", "accumulate_grad_batches")


SCHEMA_KEY = "_schema_"
"""`recipe._schema_: package.module:Dataclass` names the recipe's schema in its YAML, so that
`lightning-weightsync config show` checks the `recipe:` keys too, not only the script at start-up."""


def recipe_schema(section: Any) -> type | None:
    """The dataclass a `recipe:` section names in `_schema_`, imported; None where it names none."""
    from ..rollout.sinks.base import load_object

    path = section.get(SCHEMA_KEY) if section is not None else None
    if path is None:
        return None
    schema = load_object(path, f"recipe.{SCHEMA_KEY}")
    if not (isinstance(schema, type) and is_dataclass(schema)):
        raise ConfigError(f"recipe.{SCHEMA_KEY}={path!r} is not a dataclass; name the recipe's schema class")
    return schema


def validate_recipe(section: Any, schema: type[R]) -> R:
    """The `recipe:` section (a mapping) as an instance of the dataclass `schema`; unknown keys,
    wrong types and non-positive counts are a `ConfigError` naming `recipe.<key>`."""
    assert is_dataclass(schema), f"{schema!r} is not a dataclass"
    if section is not None and SCHEMA_KEY in section:
        section = {k: v for k, v in dict(section).items() if k != SCHEMA_KEY}
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), section or {})
        recipe = cast(R, OmegaConf.to_object(merged))  # the dataclass, nested ones (recipe.lora) built too
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or getattr(exc, "key", None)
        raise ConfigError(f"invalid recipe key 'recipe.{key}': {str(exc).strip().splitlines()[0]}") from None
    assert isinstance(recipe, schema)
    for f in fields(schema):
        if f.name in POSITIVE_FIELDS and getattr(recipe, f.name) < 1:
            raise ConfigError(f"recipe.{f.name}={getattr(recipe, f.name)} must be >= 1")
    return recipe


def load_recipe(
    path: str | Path | None = None, overrides: Sequence[str] = (), *, schema: type[R]
) -> tuple[R, DictConfig]:
    """(recipe, weightsync cfg) from one YAML file + `key=value` overrides, validated once."""
    cfg = load_config(path, overrides)
    return validate_recipe(cfg.recipe, schema), cfg


def setup_logging(level: str) -> None:
    """Our loggers only (Lightning configures its own; the root logger would print its lines twice)."""
    pkg = logging.getLogger("lightning_weightsync")
    if not pkg.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        pkg.addHandler(handler)
    pkg.setLevel(level.upper())


def build_parser(prog: str | None, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--config", "-c", metavar="FILE.yaml", help="recipe YAML (recipe: + weightsync sections)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. recipe.steps=8 transport.port=29600")
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return p


def recipe_main(
    train: Callable[[R, DictConfig], str | None],
    schema: type[R],
    argv: Sequence[str] | None = None,
    *,
    description: str | None = None,
    prog: str | None = None,
    config_required: bool = False,
) -> int:
    """Parse `--config FILE.yaml key=value ...`, validate everything, run `train(recipe, cfg)` and
    print the line it returns (it returns None on the ranks that should stay quiet). Exit code 2,
    one line, for a config error: it is the user's to fix, not a bug."""
    first_line = (description or "").strip().splitlines()[0] if (description or "").strip() else None
    parser = build_parser(prog, first_line or f"train with {schema.__name__}")
    args = parser.parse_args(argv)
    if config_required and args.config is None:
        parser.error("--config FILE.yaml is required")
    setup_logging(args.log_level)
    try:
        recipe, cfg = load_recipe(args.config, args.overrides, schema=schema)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    line = train(recipe, cfg)
    if line:
        print(line, flush=True)
    return 0


__all__ = ["SCHEMA_KEY", "load_recipe", "recipe_main", "recipe_schema", "setup_logging", "validate_recipe"]
