"""Load and diagnose: defaults <- base <- YAML file <- overrides, every OmegaConf failure turned into a
`ConfigError` that names the key (and a close spelling); the shared secret's sources; YAML dumps."""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from ..errors import ConfigError
from .schema import AUTH_TOKEN_ENV, TransportConfig, WeightSyncConfig, default_config
from .validate import check_token, validate_config

logger = logging.getLogger(__name__)


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Sequence[str] = (),
    *,
    base: DictConfig | dict[str, Any] | None = None,
) -> DictConfig:
    """Merge defaults <- `base` <- YAML file <- `key=value` overrides, then validate.

    Any OmegaConf failure (unknown key, wrong type) becomes a `ConfigError` naming the key.
    """
    secrets: list[str] = []  # token texts seen: never echoed in an error
    try:
        cfg = _load(path, overrides, base, secrets)
        validate_config(cfg)
    except ConfigError as exc:
        raise ConfigError(_scrub(str(exc), secrets)) from None
    return cfg


OFF_CHOICES = ("transport.verify", "transport.delta")
"""Choices with an `off` member: YAML 1.1 reads a bare `off` as the boolean false."""


def _off_is_a_choice(node: DictConfig) -> DictConfig:
    """`transport.verify: off` (YAML file or override) means the choice `off`, not the boolean YAML makes it."""
    for key in OFF_CHOICES:
        if OmegaConf.select(node, key, default=None) is False:
            OmegaConf.update(node, key, "off", merge=False)
    return node


def _load(
    path: str | os.PathLike[str] | None,
    overrides: Sequence[str],
    base: DictConfig | dict[str, Any] | None,
    secrets: list[str],
) -> DictConfig:
    """Defaults <- `base` <- the file at `path` <- `overrides`, merged; an OmegaConf failure diagnosed by key.
    `secrets` collects every token text seen, so no error message echoes one."""
    cfg: Any = default_config()  # OmegaConf.merge is typed loosely; it stays a DictConfig
    try:
        if base is not None:
            cfg = OmegaConf.merge(cfg, base)
        if path is not None:
            cfg = _merge_file(cfg, Path(path), secrets)
        if overrides:
            cfg = _merge_overrides(cfg, overrides, secrets)
    except TypeError as exc:  # from a base or a file: name the first key whose type is wrong
        raise ConfigError(f"{_wrong_type_key(cfg, base, path)}: wrong type ({exc})") from None
    except OmegaConfBaseException as exc:
        raise _diagnosed(exc, base, path, overrides) from None
    assert isinstance(cfg, DictConfig)
    return cfg


def _merge_file(cfg: Any, p: Path, secrets: list[str]) -> Any:
    """`cfg` with the YAML file at `p` merged on top: a file that is missing, not UTF-8, not YAML or not a
    mapping is a `ConfigError` that says which; its token is kept exactly as written (`_keep_token_text`)."""
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        text = p.read_text(encoding="utf-8")
        loaded = OmegaConf.load(p)
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {p} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
            "save it as UTF-8"
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {p} is not valid YAML: {_yaml_problem(exc)}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"config file {p} must hold a mapping at top level")
    cfg = OmegaConf.merge(cfg, _off_is_a_choice(loaded))
    _keep_token_text(cfg, _raw_token(yaml.load(text, Loader=yaml.BaseLoader)), secrets)
    return cfg


def _merge_overrides(cfg: Any, overrides: Sequence[str], secrets: list[str]) -> Any:
    """`cfg` with each `key=value` merged in turn, so a YAML or type error names its override; a token's value
    is remembered as a secret (and never shown), and an empty one is refused rather than meaning "no auth"."""
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"override {_shown(bad[0])!r} is not of the form key=value")
    for override in overrides:
        key, value = (part.strip() for part in override.split("=", 1))
        if key in SECRET_KEYS:
            secrets.append(value)
            if not value:  # `transport.auth_token=$TOKEN` with $TOKEN unset: never "no auth" silently
                check_token(value, key)
        try:
            dotlist = OmegaConf.from_dotlist([override])
        except yaml.YAMLError as exc:
            raise ConfigError(
                f"override {_shown(override)!r}: value is not valid YAML ({_first_line(exc)}); quote it"
            ) from None
        try:
            cfg = OmegaConf.merge(cfg, _off_is_a_choice(dotlist))
        except TypeError as exc:  # OmegaConf: a list where a mapping belongs, or the reverse
            why = "value not shown" if key in SECRET_KEYS else str(exc)
            raise ConfigError(f"{key}: wrong type ({why}); {_expected(cfg, key)}") from None
        if key == "transport.auth_token":
            _keep_token_text(cfg, yaml.load(value, Loader=yaml.BaseLoader), secrets)
    return cfg


_BAD_VALUE = re.compile(r"(?:Value|Incompatible value) '(?P<value>.*?)'")
_FIELD_KINDS = {float: "a number", int: "an integer", bool: "true or false", str: "a non-empty string"}


def _diagnosed(exc: OmegaConfBaseException, base: Any, path: Any, overrides: Sequence[str]) -> ConfigError:
    """An OmegaConf failure as one `ConfigError` naming the key: a secret's value hidden, every unknown key at
    once (with a close spelling), a bad choice with the allowed ones."""
    bad_key = getattr(exc, "full_key", None) or getattr(exc, "key", None)
    if bad_key in SECRET_KEYS:  # OmegaConf's message quotes the value
        return ConfigError(f"{bad_key} must be one string (quote it in YAML); its value is not shown")
    unknown = _unknown_keys(base, path, overrides)
    if len(unknown) > 1:  # every unknown key at once, not one per attempt
        return ConfigError(f"invalid config keys {', '.join(unknown)}: not fields of the config")
    choice = _BAD_CHOICE.match(_first_line(exc))
    if choice:  # an Enum field: say it the way every other bad value is said
        return ConfigError(f"{bad_key}={choice['value']!r} is not allowed; choose one of: {choice['allowed']}")
    if isinstance(exc, ValidationError) and not isinstance(exc, ConfigKeyError) and bad_key and not unknown:
        return _bad_value(str(bad_key), exc)
    return ConfigError(f"invalid config key {bad_key!r}: {_first_line(exc)}")


def _bad_value(key: str, exc: OmegaConfBaseException) -> ConfigError:
    """A right key with a value of the wrong type: the value, the type the field takes, and an example."""
    got = _BAD_VALUE.search(_first_line(exc))
    default = OmegaConf.select(default_config(), key, default=None)
    kind = _FIELD_KINDS.get(type(default), type(default).__name__) if default is not None else "a value"
    example = f" like {default!r}" if default not in (None, "") else ""
    if got is None or got["value"] == "None":
        return ConfigError(f"{key} is empty (null); expected {kind}{example}")
    return ConfigError(f"{key}={got['value']!r} is not {kind}; expected {kind}{example}")


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """What the YAML parser objects to and where (1-based line and column), on one line."""
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    context = getattr(exc, "context", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem or _first_line(exc)}" + (f" ({context})" if context else "")


def _unknown_keys(base: Any, path: Any, overrides: Sequence[str]) -> list[str]:
    """Every key of `base`, the file at `path` and the overrides that is not a field of the structured
    config (each followed by `(did you mean ...?)` when a field is spelled alike), in the order given."""
    defaults = default_config()
    trees: list[Any] = [base]
    with contextlib.suppress(Exception):  # a file that does not load was reported already
        trees.append(OmegaConf.load(Path(path)) if path is not None else None)
    for override in overrides:
        with contextlib.suppress(Exception):
            trees.append(OmegaConf.from_dotlist([override]))
    found: list[str] = []
    for tree in trees:
        if tree is None:
            continue
        container = OmegaConf.to_container(OmegaConf.create(tree), resolve=False)
        if isinstance(container, dict):
            found += [k for k in _unknown_in(defaults, "", container) if k not in found]
    fields = _walk_keys(defaults)
    out = []
    for key in found:
        section, _, name = key.rpartition(".")
        siblings = [f.rpartition(".")[2] for f in fields if f.rpartition(".")[0] == section]
        alike = difflib.get_close_matches(name, siblings, n=1)
        out.append(f"{key} (did you mean {section + '.' if section else ''}{alike[0]}?)" if alike else key)
    return out


def _unknown_in(cfg: Any, prefix: str, tree: dict[Any, Any]) -> list[str]:
    out: list[str] = []
    for k, value in tree.items():
        key = f"{prefix}{k}"
        try:
            OmegaConf.merge(cfg, _nested(key, {} if isinstance(value, dict) else value))
        except ConfigKeyError:
            out.append(key)
            continue
        except (OmegaConfBaseException, TypeError):
            continue  # a wrong type or value: reported by its own check
        if isinstance(value, dict):
            out += _unknown_in(cfg, key + ".", value)
    return out


def _walk_keys(node: Any, prefix: str = "") -> list[str]:
    """Every dotted key of a config, sections included (a misspelt section is matched too)."""
    out: list[str] = []
    if isinstance(node, DictConfig):
        for k in node:
            out.append(f"{prefix}{k!s}")
            out += _walk_keys(node[k], f"{prefix}{k!s}.")
    return out


SECRET_KEYS = ("transport.auth_token",)


def _raw_token(tree: Any) -> Any:
    transport = tree.get("transport") if isinstance(tree, dict) else None
    return transport.get("auth_token") if isinstance(transport, dict) else None


def _keep_token_text(cfg: Any, raw: Any, secrets: list[str]) -> None:
    """The token exactly as written: YAML would read `0x1F` as the number 31 (and OmegaConf then store
    "31"), while the environment gives `0x1F`; both sides must derive the same keys. `null` stays null."""
    if isinstance(raw, str) and raw not in ("null", "~", "") and OmegaConf.select(cfg, "transport.auth_token"):
        secrets.append(raw)
        cfg.transport.auth_token = raw


def _shown(override: str) -> str:
    """An override as an error message may show it: a secret's value masked."""
    key, sep, _ = override.partition("=")
    return f"{key}=<redacted>" if sep and key.strip() in SECRET_KEYS else override


SCRUB_ANYWHERE_LEN = 8  # a secret this long is hidden wherever it appears; a shorter one only where it is a value


def _scrub(text: str, secrets: list[str]) -> str:
    """`text` with every secret hidden where a message could quote it. A short "secret" (the value of a token
    that is refused for being short) is hidden only as a value (quoted, or after `=`), so the message's own
    words stay readable: `auth_token=short` must not turn "a short token" into "a <redacted> token"."""
    for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
        if len(secret) >= SCRUB_ANYWHERE_LEN:
            text = text.replace(secret, "<redacted>")
            continue
        for shown in (repr(secret), f"'{secret}'", f'"{secret}"'):
            text = text.replace(shown, "'<redacted>'")
        text = re.sub(rf"=\s*{re.escape(secret)}(?![\w-])", "=<redacted>", text)
    return text


def _expected(cfg: Any, key: str) -> str:
    """What the default at `key` looks like, as the fix for a wrong type."""
    current = OmegaConf.select(cfg, key, default=None)
    if isinstance(current, DictConfig):
        return "expected a mapping, e.g. {key: value}"
    if OmegaConf.is_list(current):
        return "expected a list, e.g. [a, b]"
    return f"expected a value like {current!r}"


def _wrong_type_key(cfg: Any, base: Any, path: Any) -> str:
    """The first key of `base` / the file at `path` that does not merge onto `cfg` on its own."""
    sources = [base] + ([OmegaConf.load(Path(path))] if path is not None else [])
    for source in sources:
        if source is None:
            continue
        tree = OmegaConf.to_container(OmegaConf.create(source), resolve=False)
        found = _first_bad(cfg, "", tree) if isinstance(tree, dict) else None
        if found:
            return found
    return "a config value"


def _first_bad(cfg: Any, prefix: str, tree: dict[Any, Any]) -> str | None:
    """Depth first, so the deepest key that fails is named, not its section."""
    for k, value in tree.items():
        key = f"{prefix}{k}"
        if isinstance(value, dict) and (found := _first_bad(cfg, key + ".", value)):
            return found
        try:
            OmegaConf.merge(cfg, _nested(key, value))
        except TypeError:
            return f"{key} ({_expected(cfg, key)})"
        except OmegaConfBaseException:
            pass
    return None


def _nested(key: str, value: Any) -> dict[str, Any]:
    out: Any = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


_BAD_CHOICE = re.compile(r"Invalid value '(?P<value>.*)', expected one of \[(?P<allowed>.*)\]")


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def auth_token(cfg: DictConfig) -> bytes | None:
    """The shared secret: `transport.auth_token`, else `transport.auth_token_file`, else the environment,
    else none (no authentication). Set but empty, or shorter than MIN_TOKEN_LEN, is a `ConfigError`."""
    return transport_token(cfg.transport)


def transport_token(t: TransportConfig | DictConfig) -> bytes | None:
    """`auth_token` of the transport section alone (typed or not): what the sender and the receiver, which
    hold only their own section, ask."""
    if t.auth_token is not None:
        token, source = str(t.auth_token), "transport.auth_token"
    elif t.auth_token_file:
        token, source = _read_token_file(Path(t.auth_token_file)), f"transport.auth_token_file ({t.auth_token_file})"
    elif AUTH_TOKEN_ENV in os.environ:
        token, source = os.environ[AUTH_TOKEN_ENV], f"${AUTH_TOKEN_ENV}"
    else:
        return None
    check_token(token, source)
    return token.encode()


def _read_token_file(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"transport.auth_token_file={str(path)!r} cannot be read ({type(exc).__name__})") from None
    mode = path.stat().st_mode
    if mode & 0o077:
        logger.warning(
            "transport.auth_token_file %s is readable by other users (mode %o); chmod 600 it", path, mode & 0o777
        )
    lines = text.splitlines()
    return lines[0].strip() if lines else ""


def to_yaml(cfg: DictConfig | WeightSyncConfig, *, redact: bool = True, drop_token: bool = False) -> str:
    """The resolved config (loaded, or typed: `settings()`) as YAML; the HMAC secret is masked unless
    `redact=False` (config dumps end up in logs and bug reports), or left out (null) with `drop_token` (a
    launcher's file for its server's workers: the token goes by environment instead, `rollout_engines/launch.py`)."""
    if isinstance(cfg, WeightSyncConfig):
        cfg = cast(DictConfig, OmegaConf.structured(cfg))
    if cfg.transport.auth_token and (redact or drop_token):
        masked = None if drop_token else "<redacted>"
        cfg = cast(DictConfig, OmegaConf.merge(cfg, {"transport": {"auth_token": masked}}))
    return OmegaConf.to_yaml(cfg, resolve=True)
