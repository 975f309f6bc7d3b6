"""Structured config, split by job: `schema` (every knob, its type and default), `load` (YAML and overrides
merged and every failure diagnosed by key; the shared secret), `validate` (ranges types cannot express),
`settings` (the typed view each part of the code receives its own section of).

Config is loaded and validated once, at the edge, so that a typo fails at start-up with the key's name
instead of hours later in the middle of a training run.
"""

from __future__ import annotations

from .load import OFF_CHOICES, SECRET_KEYS, auth_token, load_config, to_yaml, transport_token
from .schema import (
    AUTH_TOKEN_ENV,
    CAST_DTYPES,
    MAX_BUCKET_SIZE_MB,
    MAX_CONFIG_IDENTITY_LEN,
    MIN_TOKEN_LEN,
    SINKS,
    ApplyMode,
    BackendName,
    CastDtype,
    Choice,
    DeltaMode,
    FailurePolicy,
    LoraApply,
    LoraBase,
    LoraMode,
    NamesConfig,
    OverlapGather,
    OverlapPolicy,
    OverlapStaging,
    PauseMode,
    RollbackMode,
    RolloutConfig,
    RolloutEngineName,
    SendMode,
    SGLangConfig,
    SGLangPauseMode,
    SinkConfig,
    SinkType,
    TrainerConfig,
    TransportConfig,
    VerifyMode,
    VLLMConfig,
    WeightSyncConfig,
    bucket_size_bytes,
    default_config,
    direct_min_bytes,
    mib_to_bytes,
)
from .settings import ReceiverSettings, SenderSettings, settings
from .validate import GENERIC_S, MAX_COUNT, SECONDS_BOUNDS, check_token, validate_config

__all__ = [
    "AUTH_TOKEN_ENV", "CAST_DTYPES", "GENERIC_S", "MAX_BUCKET_SIZE_MB", "MAX_CONFIG_IDENTITY_LEN", "MAX_COUNT",
    "MIN_TOKEN_LEN", "OFF_CHOICES", "SECONDS_BOUNDS", "SECRET_KEYS", "SINKS", "ApplyMode", "BackendName",
    "CastDtype", "Choice", "DeltaMode", "FailurePolicy", "LoraApply", "LoraBase", "LoraMode", "NamesConfig",
    "OverlapGather", "OverlapPolicy", "OverlapStaging", "PauseMode", "ReceiverSettings", "RollbackMode",
    "RolloutConfig", "RolloutEngineName", "SGLangConfig", "SGLangPauseMode", "SendMode", "SenderSettings",
    "SinkConfig", "SinkType", "TrainerConfig", "TransportConfig", "VLLMConfig", "VerifyMode", "WeightSyncConfig",
    "auth_token", "bucket_size_bytes", "check_token", "default_config", "direct_min_bytes", "load_config",
    "mib_to_bytes", "settings", "to_yaml", "transport_token", "validate_config",
]  # fmt: skip
