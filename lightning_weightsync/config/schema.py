"""The config's schema: every knob, its type and default, as dataclasses and Choice enums.

The sections config owns are here; each plug-in's section is declared by the plug-in, next to its code, and
collected from its table (`plugins.py`): a sink's knobs into `rollout.sink` (`sinks.py`), a rollout engine's
section as the top-level `<engine>` section of `WeightSyncConfig`. Loading and diagnosing a YAML file lives
in `load.py`, the checks that types cannot express in `validate.py`; `settings()` turns a loaded config into
these dataclasses, once, at the edge (CLI, callback, hook), and each part of the code receives only its own
section.
"""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass
from typing import TYPE_CHECKING, Any, cast

from omegaconf import DictConfig, OmegaConf

from ..choice import Choice
from ..plugins import BACKENDS, ROLLOUT_ENGINES
from ..protocol.messages import MAX_IDENTITY_LEN
from .sinks import SinkConfig

# The names are defined once, by the backend table `BACKENDS` (`plugins.py`, one line a backend, no backend
# imported); the config field is an Enum built from it, so OmegaConf rejects any other name at load time.
if TYPE_CHECKING:
    # mypy reads `Choice(name, members)` as str's constructor, not Enum's functional API, and takes no
    # variable for a type: to it each of these is a Choice subclass whose members it does not know (the
    # code looks them up by name, `BackendName["gloo"]`).
    class BackendName(Choice): ...

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


# Like BackendName: the engines are named once, in `ROLLOUT_ENGINES` (plugins.py).
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
    auto = "auto"  # a delta where it is worth it (versions/delta.py AUTO_MAX_PAYLOAD_FRACTION), else whole
    always = "always"  # a delta whenever it is smaller at all


class FanOut(Choice):
    """`transport.fanout`: how a lane's bucket reaches its receivers."""

    broadcast = "broadcast"  # the backend's own collective (gloo: a binomial tree; nccl: a ring)
    chain = "chain"  # the trainer rank sends each byte once, each receiver forwards it to the next (gloo)


CAST_DTYPES = tuple(d.value for d in CastDtype)
MIN_CHAIN_PIECE_MB = 1 / 256  # 4 KiB: below it the calls a piece cost more than its bytes on any link
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
    layout_once: bool = True
    """Send each bucket's layout (names, shapes, dtypes, offsets) once: while a version is cut into the same
    buckets as the last one every receiver holds, its buckets name that layout by digest instead of listing
    their entries again (protocol/layout.py). false: every bucket lists its entries (the wire before this knob)."""
    fanout: FanOut = FanOut.broadcast
    """Sender: how a bucket reaches several receivers. broadcast: the backend's collective (gloo's is a binomial
    tree: a trainer link sends ceil(log2(K + 1)) copies to K receivers; nccl's is already a pipelined ring). chain
    (gloo): the trainer rank sends each byte once and every receiver forwards each piece on as it arrives
    (transport.chain_piece_mb), so a trainer link carries one copy whatever the number of receivers."""
    chain_piece_mb: float = 0.25
    """transport.fanout=chain: the piece a receiver forwards as soon as it has it, in MiB. Smaller fills a long
    chain sooner (a chain of K adds about (K - 1) pieces' time); larger costs fewer calls a bucket."""
    chain_length: int = 16
    """transport.fanout=chain: the most receivers in one chain; more are split into chains of near-equal length,
    each fed by the trainer rank (its link then carries one copy a chain). 0: one chain, however long."""
    slices: bool = True
    """Receiver: declare the box of each tensor this rollout holds (a tensor-parallel rollout's DTensors, learnt
    from the first version received into them), so the sender sends it that slice only (versions/lanes.py).
    false: take whole tensors and keep the box (the wire before this knob). The sender serves either."""


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
    serve_port: int = -1
    """Serve the version this daemon installed to late joiners (`versions/peer_serve.py`) on this TCP port:
    -1 = off; 0 = any free port (logged); needs a sink that keeps its tensors (module)."""
    serve_host: str | None = None
    """Address the serve binds and joiners connect to (this rollout's address as its peers see it); null =
    transport.host (right only where the rollout runs on the trainer's host)."""
    catch_up_from: list[str] = field(default_factory=list)
    """Serve addresses (host:port) of peers this daemon takes the current version from, in order, before it
    first registers with the trainer; [] = none (the trainer's next version is its first)."""
    catch_up_wait_s: float = 30.0
    """How long the catch-up waits for each peer in catch_up_from to start serving a version."""
    recover_from_peers: bool = True
    """With catch_up_from set: a version that failed here for a cause outside this rollout (the sender aborted it,
    its transport failed) is taken from those peers at once, before the trainer's next version
    (`rollout/recover.py`); false = off (the trainer's next version is the next one this rollout holds)."""


@dataclass
class CoreConfig:
    """The sections config owns; `WeightSyncConfig` adds each rollout engine's after them."""

    transport: TransportConfig = field(default_factory=TransportConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


RECIPE_DOC = """A recipe script's own knobs (steps, lr, ...): free-form here, validated by that script's schema at
start-up (`demo/recipe.py`), so one recipe YAML serves the trainer script and the rollout CLI."""


def _engine_sections() -> list[tuple[str, Any, Any]]:
    """Each registered engine's section (its entry's `section=`, `<engine>/config.py`), as a field of that name."""
    return [(name, ROLLOUT_ENGINES.section(name), field(default_factory=ROLLOUT_ENGINES.section(name)))
            for name in ROLLOUT_ENGINES]  # fmt: skip


if TYPE_CHECKING:  # the checker's view of the generated class

    @dataclass
    class WeightSyncConfig(CoreConfig):
        recipe: dict[str, Any] = field(default_factory=dict)

        def __getattr__(self, name: str) -> Any: ...  # a rollout engine's section (`config.vllm`)

else:
    WeightSyncConfig = make_dataclass(
        "WeightSyncConfig",
        [*_engine_sections(), ("recipe", dict[str, Any], field(default_factory=dict))],
        bases=(CoreConfig,),
        namespace={"__module__": __name__},
    )
    WeightSyncConfig.__doc__ = (
        """The whole config: transport, trainer, rollout, one section a rollout engine
(`vllm`, `sglang`: collected from `ROLLOUT_ENGINES`), and `recipe`: """
        + RECIPE_DOC
    )


def default_config() -> DictConfig:
    # OmegaConf types structured() as Any; a dataclass gives a DictConfig
    return cast(DictConfig, OmegaConf.structured(WeightSyncConfig))


def mib_to_bytes(mib: float) -> int:
    """A `*_mb` knob (MiB, float allowed) in bytes: the one place the conversion is written."""
    return int(float(mib) * 1024 * 1024)


def direct_min_bytes(cfg: DictConfig) -> int | None:
    """`transport.direct_min_mb` in bytes; None when 0 (only full-bucket chunks go direct)."""
    return mib_to_bytes(cfg.transport.direct_min_mb) or None


def bucket_size_bytes(cfg: DictConfig) -> int:
    """`transport.bucket_size_mb` (MiB, float) in bytes."""
    return mib_to_bytes(cfg.transport.bucket_size_mb)
