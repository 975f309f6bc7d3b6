"""Structured config, split by job: `schema` (every knob, its type and default), `sinks` (`rollout.sink`,
collected from each sink's own section), `load` (YAML and overrides merged and every failure diagnosed by key;
the shared secret), `validate` (ranges types cannot express), `settings` (the typed view each part of the code
receives its own section of). A plug-in's section is its own (next to its code, named by its table in
`plugins.py`): import it from there (`rollout_engines/vllm/config.py`, `rollout/sinks/config.py`).

Config is loaded and validated once, at the edge, so that a typo fails at start-up with the key's name
instead of hours later in the middle of a training run.
"""

from __future__ import annotations

from ..plugins import SINKS
from .load import OFF_CHOICES, SECRET_KEYS, auth_token, load_config, to_yaml, transport_token
from .schema import (
    AUTH_TOKEN_ENV,
    CAST_DTYPES,
    MAX_BUCKET_SIZE_MB,
    MAX_CONFIG_IDENTITY_LEN,
    MIN_TOKEN_LEN,
    ApplyMode,
    BackendName,
    CastDtype,
    Choice,
    CoreConfig,
    DeltaMode,
    FailurePolicy,
    FanOut,
    LoraBase,
    LoraMode,
    NamesConfig,
    OverlapGather,
    OverlapPolicy,
    OverlapStaging,
    RolloutConfig,
    RolloutEngineName,
    SendMode,
    TrainerConfig,
    TransportConfig,
    VerifyMode,
    WeightSyncConfig,
    bucket_size_bytes,
    default_config,
    direct_min_bytes,
    mib_to_bytes,
)
from .settings import ReceiverSettings, SenderSettings, UserConfig, settings
from .sinks import SINK_SECTIONS, SinkConfig, SinkType, sink_section, unread_sink_knobs
from .validate import GENERIC_S, MAX_COUNT, SECONDS_BOUNDS, check_token, host_port, validate_config

__all__ = [
    "AUTH_TOKEN_ENV",
    "CAST_DTYPES",
    "GENERIC_S",
    "MAX_BUCKET_SIZE_MB",
    "MAX_CONFIG_IDENTITY_LEN",
    "MAX_COUNT",
    "MIN_TOKEN_LEN",
    "OFF_CHOICES",
    "SECONDS_BOUNDS",
    "SECRET_KEYS",
    "SINKS",
    "SINK_SECTIONS",
    "ApplyMode",
    "BackendName",
    "CastDtype",
    "Choice",
    "CoreConfig",
    "DeltaMode",
    "FailurePolicy",
    "FanOut",
    "LoraBase",
    "LoraMode",
    "NamesConfig",
    "OverlapGather",
    "OverlapPolicy",
    "OverlapStaging",
    "ReceiverSettings",
    "RolloutConfig",
    "RolloutEngineName",
    "SendMode",
    "SenderSettings",
    "SinkConfig",
    "SinkType",
    "TrainerConfig",
    "TransportConfig",
    "UserConfig",
    "VerifyMode",
    "WeightSyncConfig",
    "auth_token",
    "bucket_size_bytes",
    "check_token",
    "default_config",
    "direct_min_bytes",
    "host_port",
    "load_config",
    "mib_to_bytes",
    "settings",
    "sink_section",
    "to_yaml",
    "transport_token",
    "unread_sink_knobs",
    "validate_config",
]  # fmt: skip
