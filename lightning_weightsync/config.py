"""Structured config: every knob, its default, and its validation, in one place.

Config is validated once, at load time, so that a typo fails at start-up with the key's name
instead of hours later in the middle of a training run.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .errors import ConfigError

BACKENDS = ("gloo", "nccl", "hccl", "shm", "cuda_ipc")
APPLY_POLICIES = ("atomic", "streaming")
SINK_TYPES = ("module", "safetensors", "vllm", "callable")
FAILURE_POLICIES = ("raise", "warn")
CAST_DTYPES = ("float32", "float16", "bfloat16", "float64")
MAX_BUCKET_SIZE_MB = 64 * 1024  # 64 GiB: nothing real needs a bigger single bucket
AUTH_TOKEN_ENV = "LIGHTNING_WEIGHTSYNC_AUTH_TOKEN"


@dataclass
class TransportConfig:
    backend: str = "gloo"
    bucket_size_mb: float = 512.0
    host: str = "127.0.0.1"
    port: int = 29600
    timeout_s: float = 600.0
    ready_timeout_s: float = 10.0
    heartbeat_interval_s: float = 2.0
    store_port: int = 0
    rebuild_group: bool = False
    auth_token: str | None = None
    device: str | None = None


@dataclass
class NamesConfig:
    strip_prefixes: list[str] = field(default_factory=list)
    rename: dict[str, str] = field(default_factory=dict)
    exclude: list[str] = field(default_factory=list)


@dataclass
class TrainerConfig:
    every_n_steps: int = 1
    sync_on_fit_start: bool = True
    sync_on_train_end: bool = True
    dtype: str | None = None
    min_receivers: int = 1
    on_failure: str = "raise"
    include_buffers: bool = True
    names: NamesConfig = field(default_factory=NamesConfig)


@dataclass
class SinkConfig:
    type: str = "module"
    factory: str | None = None
    dir: str | None = None
    keep_last: int = 3
    target: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class RolloutConfig:
    apply: str = "atomic"
    sink: SinkConfig = field(default_factory=SinkConfig)
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    identity: str | None = None
    device: str = "cpu"
    progress: bool = True


@dataclass
class WeightSyncConfig:
    transport: TransportConfig = field(default_factory=TransportConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


def default_config() -> DictConfig:
    return OmegaConf.structured(WeightSyncConfig)


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Sequence[str] = (),
    *,
    base: DictConfig | dict[str, Any] | None = None,
) -> DictConfig:
    """Merge defaults <- `base` <- YAML file <- `key=value` overrides, then validate.

    Any OmegaConf failure (unknown key, wrong type) becomes a `ConfigError` naming the key.
    """
    cfg: Any = default_config()  # OmegaConf.merge is typed loosely; it stays a DictConfig
    try:
        if base is not None:
            cfg = OmegaConf.merge(cfg, base)
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"config file not found: {p}")
            try:
                loaded = OmegaConf.load(p)
            except yaml.YAMLError as exc:
                raise ConfigError(f"config file {p} is not valid YAML: {_first_line(exc)}") from None
            if not isinstance(loaded, DictConfig):
                raise ConfigError(f"config file {p} must hold a mapping at top level")
            cfg = OmegaConf.merge(cfg, loaded)
        if overrides:
            bad = [o for o in overrides if "=" not in o]
            if bad:
                raise ConfigError(f"override {bad[0]!r} is not of the form key=value")
            for override in overrides:  # one at a time, so a YAML error names its override
                try:
                    dotlist = OmegaConf.from_dotlist([override])
                except yaml.YAMLError as exc:
                    raise ConfigError(
                        f"override {override!r}: value is not valid YAML ({_first_line(exc)}); quote it"
                    ) from None
                cfg = OmegaConf.merge(cfg, dotlist)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or getattr(exc, "key", None)
        raise ConfigError(f"invalid config key {key!r}: {_first_line(exc)}") from None
    assert isinstance(cfg, DictConfig)
    validate_config(cfg)
    return cfg


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _choice(key: str, value: Any, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not allowed; choose one of: {', '.join(allowed)}")


def _port(key: str, value: int | None, *, allow_zero: bool) -> None:
    low = 0 if allow_zero else 1
    if value is not None and not (low <= value <= 65535):
        raise ConfigError(f"{key}={value} is out of range; use a TCP port in [{low}, 65535]")


def _positive(key: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{key}={value} must be > 0 (seconds)")


def validate_config(cfg: DictConfig) -> None:
    """Check ranges and choices that types alone cannot express."""
    t, tr, ro = cfg.transport, cfg.trainer, cfg.rollout
    _choice("transport.backend", t.backend, BACKENDS)
    mb = t.bucket_size_mb
    if not mb > 0:
        raise ConfigError(f"transport.bucket_size_mb={mb} must be > 0 (MiB; floats like 0.5 are fine)")
    if mb > MAX_BUCKET_SIZE_MB:
        raise ConfigError(
            f"transport.bucket_size_mb={mb} is absurd (> {MAX_BUCKET_SIZE_MB} MiB); "
            "pick a bucket that fits twice in free device memory, e.g. 512"
        )
    if bucket_size_bytes(cfg) < 1:
        raise ConfigError(f"transport.bucket_size_mb={mb} rounds to 0 bytes")
    _port("transport.port", t.port, allow_zero=True)
    _port("transport.store_port", t.store_port, allow_zero=True)
    _port("rollout.metrics_port", ro.metrics_port, allow_zero=True)
    if not ro.metrics_host:
        raise ConfigError(
            "rollout.metrics_host is empty; use 127.0.0.1, or 0.0.0.0 to serve metrics on every interface"
        )
    for key in ("timeout_s", "ready_timeout_s", "heartbeat_interval_s"):
        _positive(f"transport.{key}", t[key])
    if not t.host:
        raise ConfigError("transport.host is empty; set the sender's address, e.g. 127.0.0.1")
    if tr.every_n_steps < 1:
        raise ConfigError(f"trainer.every_n_steps={tr.every_n_steps} must be >= 1")
    if tr.min_receivers < 0:
        raise ConfigError(f"trainer.min_receivers={tr.min_receivers} must be >= 0")
    if tr.dtype is not None:
        _choice("trainer.dtype", tr.dtype, CAST_DTYPES)
    _choice("trainer.on_failure", tr.on_failure, FAILURE_POLICIES)
    _choice("rollout.apply", ro.apply, APPLY_POLICIES)
    _choice("rollout.sink.type", ro.sink.type, SINK_TYPES)
    if ro.sink.keep_last < 1:
        raise ConfigError(f"rollout.sink.keep_last={ro.sink.keep_last} must be >= 1")


def bucket_size_bytes(cfg: DictConfig) -> int:
    """`transport.bucket_size_mb` (MiB, float) in bytes."""
    return int(float(cfg.transport.bucket_size_mb) * 1024 * 1024)


def auth_token(cfg: DictConfig) -> bytes | None:
    """The shared HMAC secret: config first, then the environment, else no signing."""
    token = cfg.transport.auth_token or os.environ.get(AUTH_TOKEN_ENV)
    return token.encode() if token else None


def to_yaml(cfg: DictConfig, *, redact: bool = True) -> str:
    """The resolved config as YAML; the HMAC secret is masked unless `redact=False` (config dumps
    end up in logs and bug reports)."""
    if redact and cfg.transport.auth_token:
        cfg = OmegaConf.merge(cfg, {"transport": {"auth_token": "<redacted>"}})  # type: ignore[assignment]
    return OmegaConf.to_yaml(cfg, resolve=True)
