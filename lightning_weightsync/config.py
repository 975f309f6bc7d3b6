"""Structured config: every knob, its default, and its validation, in one place.

Config is validated once, at load time, so that a typo fails at start-up with the key's name
instead of hours later in the middle of a training run.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from .choice import Choice
from .errors import ConfigError
from .protocol.messages import MAX_IDENTITY_LEN
from .registry import Registry
from .rollout_engines import ROLLOUT_ENGINES
from .rollout_engines.sglang.config import SGLangConfig
from .rollout_engines.vllm.config import VLLMConfig
from .transport.backends import BACKENDS

logger = logging.getLogger(__name__)


# The names are defined once, by the backend table `BACKENDS` (`transport/backends/__init__.py`, one line a
# backend, no backend imported); the config field is an Enum built from it, so OmegaConf rejects any other
# name at load time.
if TYPE_CHECKING:
    # mypy reads `Choice(name, members)` as str's constructor, not Enum's functional API, and takes no
    # variable for a type: to it each of these is a Choice subclass whose members it does not know (the
    # code looks them up by name, `BackendName["gloo"]`).
    class BackendName(Choice): ...

    class SinkType(Choice): ...

    class RolloutEngineName(Choice): ...

    class FailurePolicy(Choice):
        warn = "warn"  # and "raise", a keyword

else:
    BackendName = Choice("BackendName", {name: name for name in BACKENDS})
BackendName.__doc__ = """`transport.backend`: the data-plane backends that are registered."""


class ApplyMode(Choice):
    """`rollout.apply`: when a received version becomes visible to the sink."""

    atomic = "atomic"
    streaming = "streaming"


SINKS: Registry[type[Any]] = Registry("rollout.sink.type", "sink")
"""The daemon sinks by their `rollout.sink.type` name (one file each in `rollout/sinks/`, a `Sink`
subclass), imported when the daemon builds one (`rollout.sinks.build_sink`). The table lives here, not
next to the sinks, because config sits below the rollout layer and lists the choices from it."""
SINKS.add("module", "lightning_weightsync.rollout.sinks.module:ModuleSink")
SINKS.add("safetensors", "lightning_weightsync.rollout.sinks.safetensors:SafetensorsSink")
SINKS.add("callable", "lightning_weightsync.rollout.sinks.callable:CallableSink")

if not TYPE_CHECKING:  # the checker's view is the TYPE_CHECKING block at BackendName
    SinkType = Choice("SinkType", {name: name for name in SINKS})
SinkType.__doc__ = """`rollout.sink.type`: where a rollout daemon puts each version (the names in `SINKS`).
A rollout engine that receives by itself (vLLM, SGLang) is `rollout.engine`, not a sink."""


# Like BackendName: the engines are named once, in `ROLLOUT_ENGINES` (rollout_engines/__init__.py).
if not TYPE_CHECKING:  # the checker's view is the TYPE_CHECKING block at BackendName
    RolloutEngineName = Choice("RolloutEngineName", {"none": "none", **{name: name for name in ROLLOUT_ENGINES}})
RolloutEngineName.__doc__ = """`rollout.engine`: none (the daemon and its sink) or a registered rollout engine."""


# `raise` is a keyword, hence the functional form: the member's name must equal its value, because
# OmegaConf writes a member's name back to YAML.
class SendMode(Choice):
    """`trainer.send_mode`: which trainer ranks send (docs/concepts.md, "Send modes")."""

    gather = "gather"
    sharded = "sharded"


class OverlapPolicy(Choice):
    """`trainer.overlap_policy`: what a step boundary does while the previous version still sends."""

    wait = "wait"
    latest = "latest"


class OverlapGather(Choice):
    """`trainer.overlap_gather`: where gather mode's FSDP2 all-gathers run with overlap (trainer/side_gather.py)."""

    background = "background"
    sync = "sync"


class OverlapStaging(Choice):
    """`trainer.overlap_staging`: where the overlap snapshot lives (trainer/overlap.py)."""

    auto = "auto"
    host = "host"
    pinned = "pinned"
    device = "device"


class LoraMode(Choice):
    """`trainer.lora`: what a version of a PEFT LoRA model carries (docs/concepts.md, "LoRA adapters")."""

    auto = "auto"
    adapter = "adapter"
    merged = "merged"
    full = "full"


class LoraBase(Choice):
    """`trainer.lora_base`: whether `trainer.lora=adapter|merged` sends the base weights once or never."""

    send_once = "send_once"
    rollout_has = "rollout_has"


class LoraApply(Choice):
    """`rollout.sink.lora`: what the module sink does with adapter versions."""

    keep = "keep"
    merge = "merge"


if not TYPE_CHECKING:  # the checker's view is the TYPE_CHECKING block at BackendName
    FailurePolicy = Choice("FailurePolicy", {"raise": "raise", "warn": "warn"})
FailurePolicy.__doc__ = """`trainer.on_failure`: what a failed sync does to training."""


class CastDtype(Choice):
    """`trainer.dtype`: the dtypes the trainer may cast to before sending."""

    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"
    float64 = "float64"


class VerifyMode(Choice):
    """`transport.verify`: which tensors carry a fingerprint (sender) and are checked once merged (receiver)."""

    off = "off"
    sample = "sample"  # one tensor in VERIFY_SAMPLE_EVERY (8) a version, rotating: each one every 8 versions
    full = "full"


class DeltaMode(Choice):
    """`transport.delta`: send only the elements that changed since the version every receiver holds."""

    off = "off"
    auto = "auto"  # a delta where it is worth it (engine/delta.py AUTO_MAX_PAYLOAD_FRACTION), else whole
    always = "always"  # a delta whenever it is smaller at all


CAST_DTYPES = tuple(d.value for d in CastDtype)
MAX_BUCKET_SIZE_MB = 16 * 1024  # 16 GiB (two a side): far above the largest real weight (~1.2 GiB)
AUTH_TOKEN_ENV = "LIGHTNING_WEIGHTSYNC_AUTH_TOKEN"
MIN_TOKEN_LEN = 16
"""Characters a token has at least: anyone who reaches the control port can try tokens offline against
one CURVE handshake, so a short one is guessed (`secrets.token_urlsafe(32)` gives 43)."""
MAX_CONFIG_IDENTITY_LEN = MAX_IDENTITY_LEN - 16  # room for the "-w<rank>" a vLLM worker appends


@dataclass
class TransportConfig:
    """How bytes and messages move (`configs/default.yaml` has the long form of every field)."""

    backend: BackendName = BackendName["gloo"]
    """Data-plane backend that moves the bucket bytes."""
    bucket_size_mb: float = 512.0
    """One transfer bucket in MiB (float allowed); bounds memory (2 buckets a side), not tensor size."""
    direct_min_mb: float = 1.0
    """Tensors of at least this many MiB go direct: each chunk is broadcast from the caller's tensor and
    received into its destination (no pack or merge copy); smaller ones are packed. 0 = only chunks that
    fill a whole bucket go direct."""
    direct_in_flight: int = 4
    """Direct broadcasts a sender may have queued or running while it produces the next tensor, when the
    producer's tensors are stable (FSDP2 `full_tensor()`, a cast, a plain module): the sender then holds
    up to this many extra tensors (each at most the largest weight). Unstable producers (FSDP1) always 1."""
    host: str = "127.0.0.1"
    """The sender's control endpoint: the sender binds it, receivers connect to it."""
    port: int = 29600
    """TCP port of the control endpoint; 0 = OS-chosen (read `sender.port`)."""
    timeout_s: float = 600.0
    """Seconds: the bound on every wait (registration, group, metadata, broadcast, ack)."""
    ready_timeout_s: float = 10.0
    """Seconds the sender waits for registered receivers to answer Ready for a version."""
    heartbeat_interval_s: float = 2.0
    """Seconds between receiver heartbeats while idle; several missed ones = the peer is gone."""
    liveness_s: float = 5.0
    """Seconds a peer may be unreachable before a wait on it fails: a receiver gone mid-version, or a rollout
    that was served and vanished (not transport.timeout_s); also the control link's heartbeat timeout."""
    store_port: int = 0
    """TCP port of the data-plane rendezvous store (TCPStore) without a token; 0 = OS-chosen. With
    transport.auth_token set the rendezvous goes over the authenticated control plane and no store
    port is opened."""
    rebuild_group: bool = False
    """true: a new data-plane group for every version; false: reuse it while the receivers are unchanged."""
    auth_token: str | None = None
    """Shared secret that signs every control message (>= 16 characters); null = auth_token_file, then
    $LIGHTNING_WEIGHTSYNC_AUTH_TOKEN, else none. On a command line it shows in `ps`: prefer those two."""
    auth_token_file: str | None = None
    """A file holding the shared secret (its first line), readable by this user only: keeps the token out
    of `ps` and of config files. Used when transport.auth_token is null."""
    device: str | None = None
    """Device of the transfer buckets (cpu, cuda:1, npu:0); null = the backend's natural device."""
    sender_host: str | None = None
    """trainer.send_mode=sharded: the address every trainer rank but 0 binds and receivers reach it at
    (this rank's host); null = transport.host. $LIGHTNING_WEIGHTSYNC_SENDER_HOST overrides it per rank."""
    sender_port: int = 0
    """trainer.send_mode=sharded: the control port of every trainer rank but 0; 0 = OS-chosen."""
    verify: VerifyMode = VerifyMode.sample
    """Fingerprint every tensor on the sender and check it once merged on the receiver (full), a rotating one in 8
    (sample: each tensor every 8 versions), or none (off); a mismatch fails the version naming the tensor.
    Measured on CPU (docs/backends.md): full adds about a third to a sync, sample stays within the noise."""
    delta: DeltaMode = DeltaMode.off
    """Send only the elements that changed since the last version every receiver acknowledged (auto: where that
    is worth it, always: whenever smaller); whole tensors to a new receiver, one that missed a version, or a sink
    that holds no tensors. Costs the trainer one host-memory copy of the model, hence off by default."""


@dataclass
class NamesConfig:
    """How trainer-side names become the names the rollout expects."""

    strip_prefixes: list[str] = field(default_factory=list)
    """Prefixes removed from the start of each name (wrapper prefixes are always removed)."""
    rename: dict[str, str] = field(default_factory=dict)
    """Exact renames after stripping: {trainer_name: rollout_name}; only a whole name matches."""
    rename_regex: dict[str, str] = field(default_factory=dict)
    """Regex renames after `rename`: {pattern: replacement}, `re.sub` in order, each on the previous result."""
    exclude: list[str] = field(default_factory=list)
    """fnmatch patterns of names not to send."""


@dataclass
class TrainerConfig:
    """When the trainer syncs and what it sends."""

    every_n_steps: int = 1
    """Sync after every N optimizer steps."""
    sync_on_fit_start: bool = True
    """Also sync once when fit starts (version 0)."""
    sync_on_train_end: bool = True
    """Also sync at the end when the last step was not synced (Lightning callback)."""
    dtype: CastDtype | None = None
    """Cast every tensor to this dtype before sending; null = as is."""
    min_receivers: int = 1
    """Registered receivers a version waits for (up to transport.timeout_s); 0 = whoever is there."""
    on_failure: FailurePolicy = FailurePolicy["raise"]
    """raise: stop training on a failed sync; warn: log it, skip the version, keep training."""
    send_mode: SendMode = SendMode.gather
    """gather: every tensor is all-gathered to global rank 0, which sends it; sharded: every rank sends the
    bytes of the FSDP shards it owns (no all-gather), receivers tile them. Unsharded models always gather."""
    overlap: bool = False
    """true: a sync copies what this rank sends into a staging snapshot and training goes on at once; a
    background thread sends that version while the next step computes (trainer/overlap.py)."""
    overlap_policy: OverlapPolicy = OverlapPolicy.wait
    """overlap only, a step boundary while the previous version still sends: wait: block until it is done
    (rollouts at most one version behind); latest: never block, skip this boundary's version (counted)."""
    overlap_staging: OverlapStaging = OverlapStaging.auto
    """overlap only, where the snapshot lives: auto (device memory on an accelerator, host on CPU) | host |
    pinned (page-locked host memory; accelerators only) | device."""
    overlap_gather: OverlapGather = OverlapGather.background
    """overlap and gather mode only, FSDP2 models: background (the snapshot copies each rank's local shards;
    the background thread all-gathers them on process groups of its own) | sync (the all-gathers run at
    the sync point, on the training group, and rank 0 copies the full tensors)."""
    include_buffers: bool = True
    """Also send persistent buffers."""
    lora: LoraMode = LoraMode.auto
    """A PEFT LoRA model: adapter (only the adapter tensors, PEFT's names), merged (only the tensors LoRA
    changes, merged, base names), full (every tensor, merged, base names); auto = adapter for a PEFT model."""
    lora_base: LoraBase = LoraBase.send_once
    """trainer.lora=adapter|merged: send_once (the base weights go in the first delivered version) or
    rollout_has (never: the rollout loaded the base itself)."""
    names: NamesConfig = field(default_factory=NamesConfig)
    """Name rules, applied in order: strip, rename, rename_regex, exclude."""


@dataclass
class SinkConfig:
    """Where a rollout puts each version."""

    type: SinkType = SinkType["module"]
    """The sink kind."""
    factory: str | None = None
    """`package.module:function` returning the torch module to load into (module sink)."""
    dir: str | None = None
    """Output directory (safetensors sink)."""
    template_dir: str | None = None
    """safetensors sink: a checkpoint directory whose non-weight files (config.json, tokenizer) are copied
    next to each version's model.safetensors, so each version is a directory from_pretrained/vLLM loads."""
    keep_last: int = 3
    """Complete versions the safetensors sink keeps on disk."""
    target: str | None = None
    """`package.module:function` (callable sink) or the model (vllm)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Sink-specific keyword options, passed through."""
    lora: LoraApply = LoraApply.keep
    """Adapter versions (trainer.lora=adapter): keep (the module sink's factory builds a PEFT model, the
    adapter is loaded into it) or merge (a plain module; W + scale * B @ A merged on arrival)."""
    file_mode: int | None = None
    """safetensors sink: permission bits of the files it writes, e.g. 0600 (YAML octal) so only this user
    reads the weights; null = the process umask decides (usually 0644)."""


@dataclass
class RolloutConfig:
    """The rollout daemon."""

    engine: RolloutEngineName = RolloutEngineName["none"]
    """none: the daemon receives into rollout.sink; vllm | sglang: `lightning-weightsync rollout` starts that
    engine's server, whose workers receive by themselves (configured in the engine's section)."""
    apply: ApplyMode = ApplyMode.atomic
    """atomic: visible once whole; streaming: written in place as it arrives (lowest memory)."""
    sink: SinkConfig = field(default_factory=SinkConfig)
    """Where received versions go."""
    metrics_port: int | None = None
    """TCP port for Prometheus metrics and /healthz; null = no server."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics server binds."""
    identity: str | None = None
    """Name this receiver registers under (at most 240 characters); null = <hostname>-<pid>."""
    device: str = "cpu"
    """Device tensors are assembled on when the sink gives no destination."""
    progress: bool = True
    """Show a progress bar on a terminal."""


@dataclass
class WeightSyncConfig:
    transport: TransportConfig = field(default_factory=TransportConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    recipe: dict[str, Any] = field(default_factory=dict)
    """A recipe script's own knobs (steps, lr, ...): free-form here, validated by that script's schema at
    start-up (`examples/recipe.py`), so one recipe YAML serves the trainer script and the rollout CLI."""


def default_config() -> DictConfig:
    # OmegaConf types structured() as Any; a dataclass gives a DictConfig
    return cast(DictConfig, OmegaConf.structured(WeightSyncConfig))


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
    cfg: Any = default_config()  # OmegaConf.merge is typed loosely; it stays a DictConfig
    try:
        if base is not None:
            cfg = OmegaConf.merge(cfg, base)
        if path is not None:
            p = Path(path)
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
        if overrides:
            bad = [o for o in overrides if "=" not in o]
            if bad:
                raise ConfigError(f"override {_shown(bad[0])!r} is not of the form key=value")
            for override in overrides:  # one at a time, so a YAML error names its override
                key, value = (part.strip() for part in override.split("=", 1))
                if key in SECRET_KEYS:
                    secrets.append(value)
                    if not value:  # `transport.auth_token=$TOKEN` with $TOKEN unset: never "no auth" silently
                        _check_token(value, key)
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
    except TypeError as exc:  # from a base or a file: name the first key whose type is wrong
        raise ConfigError(f"{_wrong_type_key(cfg, base, path)}: wrong type ({exc})") from None
    except OmegaConfBaseException as exc:
        bad_key = getattr(exc, "full_key", None) or getattr(exc, "key", None)
        if bad_key in SECRET_KEYS:  # OmegaConf's message quotes the value
            raise ConfigError(f"{bad_key} must be one string (quote it in YAML); its value is not shown") from None
        unknown = _unknown_keys(base, path, overrides)
        if len(unknown) > 1:  # every unknown key at once, not one per attempt
            raise ConfigError(f"invalid config keys {', '.join(unknown)}: not fields of the config") from None
        choice = _BAD_CHOICE.match(_first_line(exc))
        if choice:  # an Enum field: say it the way every other bad value is said
            raise ConfigError(
                f"{bad_key}={choice['value']!r} is not allowed; choose one of: {choice['allowed']}"
            ) from None
        raise ConfigError(f"invalid config key {bad_key!r}: {_first_line(exc)}") from None
    assert isinstance(cfg, DictConfig)
    return cfg


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


def _scrub(text: str, secrets: list[str]) -> str:
    for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
        text = text.replace(secret, "<redacted>")
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
    if cfg.rollout.sink.keep_last > MAX_COUNT:
        raise ConfigError(f"rollout.sink.keep_last={cfg.rollout.sink.keep_last} is out of range (at most {MAX_COUNT})")
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
    mode = ro.sink.file_mode
    if mode is not None and not (0 <= mode <= 0o777 and mode & 0o600 == 0o600):
        raise ConfigError(
            f"rollout.sink.file_mode={mode:o} (octal) must be permission bits the owner can read and write, e.g. "
            "0600 or 0640; null = the umask decides"
        )
    if ro.sink.keep_last < 1:
        raise ConfigError(f"rollout.sink.keep_last={ro.sink.keep_last} must be >= 1")
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


def _check_identity(identity: str | None) -> None:
    """An identity the wire would refuse (every sender drops its Register) fails here, naming the knob."""
    if identity is not None and len(identity) > MAX_CONFIG_IDENTITY_LEN:
        raise ConfigError(
            f"rollout.identity is {len(identity)} characters long (at most {MAX_CONFIG_IDENTITY_LEN}); "
            "shorten it, or null = <hostname>-<pid>"
        )


def _check_token_knobs(t: Any) -> None:
    if t.auth_token is not None:
        _check_token(t.auth_token, "transport.auth_token")
    if t.auth_token is not None and t.auth_token_file:
        raise ConfigError("transport.auth_token and transport.auth_token_file are both set; keep one")
    if t.auth_token_file is not None and not t.auth_token_file:
        raise ConfigError("transport.auth_token_file is empty; set a path, or null")


def _check_token(token: str, source: str) -> None:
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


def direct_min_bytes(cfg: DictConfig) -> int | None:
    """`transport.direct_min_mb` in bytes; None when 0 (only full-bucket chunks go direct)."""
    nbytes = int(float(cfg.transport.direct_min_mb) * 1024 * 1024)
    return nbytes if nbytes > 0 else None


def bucket_size_bytes(cfg: DictConfig) -> int:
    """`transport.bucket_size_mb` (MiB, float) in bytes."""
    return int(float(cfg.transport.bucket_size_mb) * 1024 * 1024)


def auth_token(cfg: DictConfig) -> bytes | None:
    """The shared secret: `transport.auth_token`, else `transport.auth_token_file`, else the environment,
    else none (no authentication). Set but empty, or shorter than MIN_TOKEN_LEN, is a `ConfigError`."""
    t = cfg.transport
    if t.auth_token is not None:
        token, source = str(t.auth_token), "transport.auth_token"
    elif t.auth_token_file:
        token, source = _read_token_file(Path(t.auth_token_file)), f"transport.auth_token_file ({t.auth_token_file})"
    elif AUTH_TOKEN_ENV in os.environ:
        token, source = os.environ[AUTH_TOKEN_ENV], f"${AUTH_TOKEN_ENV}"
    else:
        return None
    _check_token(token, source)
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


def to_yaml(cfg: DictConfig, *, redact: bool = True) -> str:
    """The resolved config as YAML; the HMAC secret is masked unless `redact=False` (config dumps
    end up in logs and bug reports)."""
    if redact and cfg.transport.auth_token:
        cfg = OmegaConf.merge(cfg, {"transport": {"auth_token": "<redacted>"}})  # type: ignore[assignment]
    return OmegaConf.to_yaml(cfg, resolve=True)
