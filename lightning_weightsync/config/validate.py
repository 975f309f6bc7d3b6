"""The checks that types cannot express: ranges, bounds, tokens; run once by `load_config`."""

from __future__ import annotations

import math
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ..errors import ConfigError
from ..plugins import ROLLOUT_ENGINES
from .schema import MAX_BUCKET_SIZE_MB, MAX_CONFIG_IDENTITY_LEN, MIN_CHAIN_PIECE_MB, MIN_TOKEN_LEN, bucket_size_bytes
from .sinks import check_sink_sections


def _port(key: str, value: int | None, *, allow_zero: bool) -> None:
    low = 0 if allow_zero else 1
    if value is not None and not (low <= value <= 65535):
        raise ConfigError(f"{key}={value} is out of range; use a TCP port in [{low}, 65535]")


def _positive(key: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{key}={value} must be > 0 (seconds)")


# Seconds: finite, and within what any deployment can mean. A timeout of `inf` disables the bound
# on every wait; a heartbeat of 1e-9 s is a busy loop. Keys not listed get GENERIC_S.
SECONDS_BOUNDS: dict[str, tuple[float, float]] = {
    "transport.timeout_s": (0.1, 7 * 86400.0),
    "transport.ready_timeout_s": (0.05, 86400.0),
    "transport.heartbeat_interval_s": (0.01, 3600.0),
    "transport.liveness_s": (0.2, 3600.0),
}
GENERIC_S = (0.0, 7 * 86400.0)
MAX_COUNT = 1_000_000  # receivers, steps between syncs, versions kept: beyond this it is a typo


def _seconds(key: str, value: Any, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}={value!r} must be a number of seconds")
    if not (math.isfinite(value) and low <= value <= high):
        raise ConfigError(f"{key}={value} is out of range; use a finite number of seconds in [{low:g}, {high:g}]")


def _walk(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Every leaf of a config section as (dotted key, value)."""
    if isinstance(node, DictConfig):
        out: list[tuple[str, Any]] = []
        for k in node:
            out += _walk(node[k], f"{prefix}{k!s}.")
        return out
    return [(prefix[:-1], node)]


def _check_bounds(cfg: DictConfig) -> None:
    """Every time knob (`*_s`) finite and in range, every count sane, name rules of the right types."""
    for key, value in _walk(cfg):
        if key.endswith("_s") and value is not None:
            _seconds(key, value, *SECONDS_BOUNDS.get(key, GENERIC_S))
    tr = cfg.trainer
    for key, value in (("trainer.min_receivers", tr.min_receivers), ("trainer.every_n_steps", tr.every_n_steps)):
        if value > MAX_COUNT:
            raise ConfigError(f"{key}={value} is out of range (at most {MAX_COUNT})")
    rename = OmegaConf.to_container(tr.names.rename)
    for old, new in (rename or {}).items():  # type: ignore[union-attr]
        if not isinstance(new, str) or not new:
            raise ConfigError(
                f"trainer.names.rename.{old!s}={new!r} must be a non-empty string (the rollout's name for {old!r})"
            )


def validate_config(cfg: DictConfig) -> None:
    """Check ranges that types alone cannot express (choices are Enum fields: OmegaConf checks them)."""
    t, tr, ro = cfg.transport, cfg.trainer, cfg.rollout
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
    direct = t.direct_min_mb
    if not (math.isfinite(direct) and 0 <= direct <= MAX_BUCKET_SIZE_MB):
        raise ConfigError(
            f"transport.direct_min_mb={direct} must be in [0, {MAX_BUCKET_SIZE_MB}] MiB (0: only full-bucket chunks "
            "go direct)"
        )
    if not 1 <= t.direct_in_flight <= 1024:
        raise ConfigError(
            f"transport.direct_in_flight={t.direct_in_flight} must be in [1, 1024] (tensors the sender may hold "
            "while their broadcasts run)"
        )
    piece = t.chain_piece_mb
    if not (math.isfinite(piece) and MIN_CHAIN_PIECE_MB <= piece <= MAX_BUCKET_SIZE_MB):
        raise ConfigError(
            f"transport.chain_piece_mb={piece} must be in [{MIN_CHAIN_PIECE_MB}, {MAX_BUCKET_SIZE_MB}] MiB (the piece "
            "a chained receiver forwards as soon as it has it)"
        )
    if not 0 <= t.chain_length <= MAX_COUNT:
        raise ConfigError(f"transport.chain_length={t.chain_length} must be in [0, {MAX_COUNT}] (0: one chain)")
    _port("transport.port", t.port, allow_zero=True)
    _port("transport.store_port", t.store_port, allow_zero=True)
    _port("transport.sender_port", t.sender_port, allow_zero=True)
    if t.sender_host is not None and not t.sender_host:
        raise ConfigError("transport.sender_host is empty; set this rank's address, or null for transport.host")
    _port("rollout.metrics_port", ro.metrics_port, allow_zero=True)
    if not ro.metrics_host:
        raise ConfigError(
            "rollout.metrics_host is empty; use 127.0.0.1, or 0.0.0.0 to serve metrics on every interface"
        )
    for key in ("timeout_s", "ready_timeout_s", "heartbeat_interval_s", "liveness_s"):
        _positive(f"transport.{key}", t[key])
    if not t.host:
        raise ConfigError("transport.host is empty; set the sender's address, e.g. 127.0.0.1")
    if tr.every_n_steps < 1:
        raise ConfigError(f"trainer.every_n_steps={tr.every_n_steps} must be >= 1")
    if tr.min_receivers < 0:
        raise ConfigError(f"trainer.min_receivers={tr.min_receivers} must be >= 0")
    _check_peer_knobs(ro)
    check_sink_sections(ro.sink)
    _check_identity(ro.identity)
    _check_token_knobs(t)
    for name in ROLLOUT_ENGINES:
        _check_engine_section(name, cfg[name])
    _check_bounds(cfg)


def _check_engine_section(name: str, section: Any) -> None:
    """The knobs every rollout engine's section has: its servers' URLs and the bound on one request."""
    _positive(f"{name}.request_timeout_s", section.request_timeout_s)
    for url in section.urls:
        if not str(url).startswith(("http://", "https://")):
            raise ConfigError(f"{name}.urls: {url!r} is not an http(s) URL; use a server's base URL: http://host:8000")


def host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of `host:port` (an IPv6 host in brackets: `[::1]:29700`); None when it is not one."""
    host, _, port = str(address).rpartition(":")
    if not host.strip("[]") or not port.isdigit() or not 0 < int(port) <= 65535:
        return None
    return host.strip("[]"), int(port)


def _check_peer_knobs(ro: Any) -> None:
    """Peer serving (`rollout.serve_*`) and catching up (`rollout.catch_up_*`): ports in range, addresses whole."""
    if not -1 <= ro.serve_port <= 65535:
        raise ConfigError(
            f"rollout.serve_port={ro.serve_port} is out of range; -1 = off, 0 = any free port, or a TCP port in "
            "[1, 65535]"
        )
    if ro.serve_host is not None and not ro.serve_host:
        raise ConfigError("rollout.serve_host is empty; set this rollout's address as its peers see it, or null")
    for address in ro.catch_up_from:
        if host_port(address) is None:
            raise ConfigError(
                f"rollout.catch_up_from: {address!r} is not host:port with a port in [1, 65535]; list the serve "
                "addresses of peers (their rollout.serve_host:rollout.serve_port), e.g. ['10.0.0.7:29700']"
            )
    _positive("rollout.catch_up_wait_s", ro.catch_up_wait_s)


def _check_identity(identity: str | None) -> None:
    """An identity the wire would refuse (every sender drops its Register) fails here, naming the knob."""
    if identity is not None and len(identity) > MAX_CONFIG_IDENTITY_LEN:
        raise ConfigError(
            f"rollout.identity is {len(identity)} characters long (at most {MAX_CONFIG_IDENTITY_LEN}); "
            "shorten it, or null = <hostname>-<pid>"
        )


def _check_token_knobs(t: Any) -> None:
    if t.auth_token is not None:
        check_token(t.auth_token, "transport.auth_token")
    if t.auth_token is not None and t.auth_token_file:
        raise ConfigError("transport.auth_token and transport.auth_token_file are both set; keep one")
    if t.auth_token_file is not None and not t.auth_token_file:
        raise ConfigError("transport.auth_token_file is empty; set a path, or null")


def check_token(token: str, source: str) -> None:
    """Never echoes the token: only where it came from and its length."""
    if not token:
        raise ConfigError(
            f"{source} is set but empty, which would mean no authentication; set the shared secret, or leave it "
            "unset (null) to run without a token on purpose"
        )
    if len(token) < MIN_TOKEN_LEN:
        raise ConfigError(
            f"{source} is {len(token)} characters long (at least {MIN_TOKEN_LEN}): a short token is guessed "
            'offline from one handshake; generate one with python -c "import secrets; '
            'print(secrets.token_urlsafe(32))"'
        )
