"""Typed views of a loaded config, made once at the edge (CLI, callback, hook, or an engine constructor
handed the `DictConfig` a user loaded): `settings(cfg)` is the whole config as the schema's dataclasses
(real Enum, float and int values), and each engine part takes only its own section from it, so the
engine never reads a `DictConfig` and nothing below the edge re-parses a knob."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias, cast

from omegaconf import DictConfig, OmegaConf

from .load import load_config
from .schema import TransportConfig, WeightSyncConfig, mib_to_bytes

UserConfig: TypeAlias = "DictConfig | WeightSyncConfig | None"
"""What a public constructor at the edge accepts (the callback, the hook, `SyncDriver`, `RolloutDaemon`, the
sinks): a `load_config()` result, a `WeightSyncConfig` an outer edge already converted, or None (the
defaults). Edges name this alias, so only `config/` imports omegaconf (tests/unit/test_layers.py)."""


def settings(cfg: DictConfig | WeightSyncConfig | None = None) -> WeightSyncConfig:
    """`cfg` (a `load_config()` result; None = the defaults) as typed dataclasses. A DictConfig that is not
    the structured config (`OmegaConf.create({...})`) is loaded and validated first, as `load_config` would;
    a `WeightSyncConfig` (already converted by an outer edge) is returned as it is."""
    if isinstance(cfg, WeightSyncConfig):
        return cfg
    if cfg is None or OmegaConf.get_type(cfg) is not WeightSyncConfig:
        cfg = load_config(base=cfg)
    return cast(WeightSyncConfig, OmegaConf.to_object(cfg))


@dataclass(frozen=True)
class SenderSettings:
    """What a `WeightSender` reads: the transport section and `trainer.min_receivers`. Read per version,
    so a caller may replace it between versions (`dataclasses.replace`), e.g. to lower min_receivers."""

    transport: TransportConfig
    min_receivers: int = 1

    @classmethod
    def of(cls, cfg: DictConfig | WeightSyncConfig | SenderSettings | None) -> SenderSettings:
        if isinstance(cfg, SenderSettings):
            return cfg
        typed = cfg if isinstance(cfg, WeightSyncConfig) else settings(cfg)
        return cls(typed.transport, int(typed.trainer.min_receivers))

    @property
    def bucket_size(self) -> int:
        """`transport.bucket_size_mb` in bytes."""
        return mib_to_bytes(self.transport.bucket_size_mb)

    @property
    def direct_min(self) -> int | None:
        """`transport.direct_min_mb` in bytes; None when 0 (only full-bucket chunks go direct)."""
        return mib_to_bytes(self.transport.direct_min_mb) or None


@dataclass(frozen=True)
class ReceiverSettings:
    """What a `WeightReceiver` reads: the transport section, `rollout.identity` and `rollout.device`."""

    transport: TransportConfig
    identity: str | None = None
    device: str = "cpu"

    @classmethod
    def of(cls, cfg: DictConfig | WeightSyncConfig | ReceiverSettings | None) -> ReceiverSettings:
        if isinstance(cfg, ReceiverSettings):
            return cfg
        typed = cfg if isinstance(cfg, WeightSyncConfig) else settings(cfg)
        return cls(typed.transport, typed.rollout.identity, str(typed.rollout.device))

    @property
    def bucket_size(self) -> int:
        """`transport.bucket_size_mb` in bytes."""
        return mib_to_bytes(self.transport.bucket_size_mb)
