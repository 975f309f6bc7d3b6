"""The body of the vLLM weight-transfer engine, free of vLLM imports (`engine.py` adds vLLM's base).

vLLM's V1 GPU worker builds one `WeightTransferEngine` per worker when the server runs with
`--weight-transfer-config '{"backend": "lightning_weightsync"}'` (vllm/v1/worker/gpu_worker.py,
`load_model`), and calls it only through these methods, each from the worker's main thread inside
an engine-core `collective_rpc`:

    init_weight_transfer_engine(init_info) -> parse_init_info -> init_transfer_engine
    start_weight_update()                  -> start_weight_update
    update_weights(update_info)            -> parse_update_info -> receive_weights; accelerator sync
    finish_weight_update()                 -> finish_weight_update
    shutdown_weight_transfer_engine()/exit -> shutdown

Between two versions the worker generates; nothing of ours blocks it. Our `WeightReceiver` lives on its
own asyncio loop in a daemon thread (`WorkerReceiver`, `rollout_engines/worker.py`), so it keeps its
ZeroMQ connection and heartbeats alive while the worker is busy, and re-registers between versions;
`receive_weights` runs exactly one version, pulling merged tensors from that loop and handing them to
`model.load_weights` one at a time on the worker's thread (vLLM's own name mapping, fusing and tensor-
parallel sharding apply). On GPU the buckets are on the worker's device (`transport.device` = the
engine's `device`), so nothing makes a host hop. Memory beyond the model: two buckets, taken when the
engine is built (before vLLM sizes its KV cache), plus one merged tensor at a time during a version.
A LoRA adapter version (`trainer.lora=adapter`) is not loaded into the model: worker 0 writes it to
`vllm.lora_dir` as a PEFT adapter directory (`rollout_engines/adapter.py`), which the trainer then has vLLM load.

The trainer drives a version (`trainer/fleet.py`): pause -> start_weight_update ->
update_weights (running while our sender broadcasts) -> finish_weight_update(weight_version)
[-> /v1/load_lora_adapter, adapter versions] -> resume.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ...errors import ConfigError, SinkError, explain
from ...protocol.dtypes import itemsize
from ...quantize import QuantContract
from ...rollout.observability import VersionRecord
from ..adapter import AdapterDirectory, EngineVersionSink
from ..host_copy import HostCopy
from ..worker import CONFIG_ENV, ModelLoadSink, WorkerReceiver, tied_aliases, worker_identity, worker_rank
from .config import RollbackMode
from .reload_checks import (
    BufferWatch,
    ModuleLoad,
    bad_scales,
    incomplete_modules,
    missing_names,
    padding_counts,
    refusal,
)

if TYPE_CHECKING:
    from .slices import CheckpointParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
BACKEND_NAME = "lightning_weightsync"
"""The name registered with vLLM's `WeightTransferEngineFactory` (`--weight-transfer-config`)."""

LORA_DIR_KNOB = "vllm.lora_dir"

LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]


INIT_OVERRIDES = (
    "transport.timeout_s",
    "transport.ready_timeout_s",
    "transport.heartbeat_interval_s",
    "transport.backend",
    "transport.bucket_size_mb",
)
"""The only keys POST /init_weight_transfer_engine may override. vLLM's dev-mode routes take no
credentials: whoever reaches the HTTP port could otherwise point the receiver at their own sender,
with their own token, and the model would serve their weights. Where it connects, whom it trusts,
its token and its identity come from `$LIGHTNING_WEIGHTSYNC_CONFIG` only (re-read on every init)."""


@dataclass
class InitInfo:
    """`init_info` of POST /init_weight_transfer_engine: optional; the engine starts its receiver
    from `$LIGHTNING_WEIGHTSYNC_CONFIG` on its own. An init restarts it, re-reading that file (edit
    it to point at a new trainer); `overrides` (`key=value`) may change only `INIT_OVERRIDES`: waits
    and how bytes move, never the address, token or identity (the request is unauthenticated HTTP)."""

    overrides: list[str] = field(default_factory=list)


def check_init_overrides(overrides: list[Any]) -> list[str]:
    """`overrides` from HTTP if every key is in `INIT_OVERRIDES`; else `ConfigError` naming the key
    (never the value: it may be a token)."""
    for item in overrides:
        key, sep, value = item.partition("=") if isinstance(item, str) else ("", "", "")
        key = key.strip()
        if not sep:
            raise ConfigError(f"init_info.overrides: {str(item)[:80]!r} is not key=value")
        if key not in INIT_OVERRIDES:
            raise ConfigError(
                f"init_info.overrides: {key[:80]!r} cannot be set over HTTP: POST /init_weight_transfer_engine "
                "is unauthenticated, so it may not change where this engine connects, whom it trusts, its token or "
                f"its identity; set it in ${CONFIG_ENV} (re-read by every init); allowed here: "
                f"{', '.join(INIT_OVERRIDES)}"
            )
        if "${" in value:  # an interpolation could read the environment (the token) into an error message
            raise ConfigError(f"init_info.overrides: {key}: interpolations (${{...}}) are not allowed over HTTP")
    return [str(item) for item in overrides]


@dataclass
class UpdateInfo:
    """`update_info` of POST /update_weights: which version the trainer is about to send.

    `version`: the version the trainer announces; a different version arriving fails the update
    (a stale or foreign sender). None accepts whatever comes. `timeout_s`: bound on waiting for the
    version to start; None = `transport.timeout_s`.
    """

    version: int | None = None
    timeout_s: float | None = None


class WeightSyncEngineBody:
    """Everything the `lightning_weightsync` vLLM engine does; `engine.py` mixes it in front of
    vLLM's `WeightTransferEngine`, whose `__init__` sets `config`, `vllm_config`, `device`,
    `model` and `model_config`, and whose `update_weights` calls `receive_weights`.

    `receive_weights` loads into `self.model`, which the worker may retarget (draft models are
    refused: `supports_draft_weight_update = False`).
    """

    init_info_cls: type[Any] = InitInfo
    update_info_cls: type[Any] = UpdateInfo
    supports_draft_weight_update = False  # one sender stream per version: the target model's
    defers_processing = False

    device: torch.device
    model: torch.nn.Module
    model_config: Any
    vllm_config: Any

    def _weightsync_setup(self, *, rank: int | None = None, config_path: str | None = None) -> None:
        """Called from `__init__`: start the receiver if `$LIGHTNING_WEIGHTSYNC_CONFIG` is set."""
        self.rank = worker_rank() if rank is None else rank
        self.version: int | None = None  # the version the model holds, when whole
        self.incomplete = False  # a version broke after it touched the model
        self.last_report: dict[str, Any] = {}
        self._worker_receiver: WorkerReceiver | None = None
        self._host_copy: HostCopy | None = None  # vllm.rollback=host: the model as it was before this version
        self._reload_active = False
        self.identity: str | None = None
        # tensor-parallel slices: the tensors (whole shape, dtype) the last version sent, and those the boxes
        # declared to the running receiver were derived for
        self._checkpoint: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._sliced_for: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
        # what the reload may leave short after a whole version (vocabulary padding): learnt from the last accepted
        # version (reload_checks.incomplete_modules); and what vLLM buffered during the version in flight
        self._padding: dict[str, int] | None = None
        self._previous_version: int | None = None  # what a rollback at finish goes back to
        self._commit_loads: list[ModuleLoad] = []
        self._watch = BufferWatch()
        # trainer.lora=adapter: worker 0 writes each version to vllm.lora_dir (rollout_engines/adapter.py)
        self._adapters = AdapterDirectory(None, LORA_DIR_KNOB, writes=self.rank == 0)
        self._config_path = config_path if config_path is not None else os.environ.get(CONFIG_ENV)
        # the parameters the model ties to others (a tied LM head), found now: inside vLLM's layerwise reload the
        # parameters are on the meta device and the tie is undone (ModelLoadSink skips these names)
        self._aliases = tied_aliases(self.model)
        self._check_model_supported()
        if self._config_path:
            self._start_receiver([])
        else:
            logger.warning(
                "lightning_weightsync engine: $%s is not set; the receiver starts with the defaults (no token, "
                "127.0.0.1:29600) on POST /init_weight_transfer_engine or at the first update",
                CONFIG_ENV,
            )

    # -- what vLLM calls ---------------------------------------------------------------------------
    def init_transfer_engine(self, init_info: Any) -> None:
        """(Re)start the receiver from `$LIGHTNING_WEIGHTSYNC_CONFIG`, with `init_info.overrides` (only
        `INIT_OVERRIDES`: checked before the running receiver is stopped)."""
        overrides = check_init_overrides(list(getattr(init_info, "overrides", []) or []))
        self._stop_receiver()
        # a new trainer may send another set of tensors: forget the last one's (the next version arrives whole and
        # is checked as a first version)
        self._checkpoint, self._padding = {}, None
        self._start_receiver(overrides)

    def start_weight_update(self) -> None:
        """Check that the model can take weights now; begin vLLM's layerwise reload (every model, as
        vLLM's own engines: layers that derive weights after loading are re-processed)."""
        self._check_awake()
        if self._worker_receiver is None:
            self._start_receiver([])
        if self._host_copy is not None:
            self._host_copy.take(self.model)
        self._declare_slices()  # before the reload: the trace runs on the model as it serves
        if self._needs_layerwise_reload():
            self._begin_layerwise_reload()
            self._reload_active = True

    def receive_weights(self, update_info: Any) -> None:
        """Receive one version from the trainer and load it tensor by tensor into `self.model`; every worker
        of the server keeps it, or none does.

        The rollouts' shared receive loop (`rollout/consume.py`) runs on the receiver's loop thread
        and hands each tensor back to this thread (vLLM's worker thread owns the model). A
        `load_weights` failure does not stop the receive: the rest of the version is drained so the
        sender and the other receivers stay in step, the version is nacked with the reason, and the
        error is raised here (vLLM turns it into a failed `update_weights` RPC). The sender sees the
        same reason in its ack, so the trainer's error names it too.

        Then the server's workers agree (`_failed_workers`: one small all-reduce, on every worker, whatever
        happened): with tensor parallelism a version that one worker lacks is no version at all. If any
        failed, every worker undoes it (`vllm.rollback=host`: its host copy goes back in place, and the server
        resumes on the version it held, whole), and raises, naming how many failed.
        """
        worker = self._worker_receiver
        if worker is None:
            raise SinkError("lightning_weightsync engine has no receiver; set $LIGHTNING_WEIGHTSYNC_CONFIG")
        receiver = worker.receiver
        self._watch = BufferWatch()
        self._commit_loads = []
        sink = EngineVersionSink(
            self.model, getattr(update_info, "version", None), self._adapters, self._aliases,
            after_load=self._sample_buffers, check=self._check_version,
        )  # fmt: skip
        wait_s = getattr(update_info, "timeout_s", None)
        failure: BaseException | None = None
        try:
            with self._load_context():
                record = worker.receive(sink, wait_s)
        except BaseException as exc:
            failure = exc
        failed = self._failed_workers(failure is None)
        if failure is None and not failed:
            self._previous_version = self.version
            if not sink.is_adapter:
                self._checkpoint = dict(sink.model_sink.shapes)
                if self._reload_active:
                    self._padding = padding_counts(self._commit_loads)
            self._loaded(record)
            return
        version = receiver.version
        self._abandon_layerwise_reload()
        undone = self._undo(version, touched=sink.touched or failure is None, whole=failure is None)
        if failure is None:
            failure = SinkError(
                f"{failed} of this server's workers failed version {version} (their errors name why); this worker "
                f"had it whole and {undone}"
            )
        elif isinstance(failure, SinkError):
            failure = SinkError(f"{failure}; {undone}")
        self.last_report = {"ok": False, "version": version, "error": str(failure), "touched": sink.touched}
        if isinstance(failure, SinkError):
            raise SinkError(f"{self.identity}: version {version}: {failure}") from None
        logger.error("%s: version %s failed (%s); %s", self.identity, version, explain(failure), undone)
        raise failure

    def _sample_buffers(self) -> None:
        """After each `load_weights` call of a version: what vLLM's reload holds buffered now."""
        if self._reload_active:
            self._watch.sample(self._module_loads())

    def _check_version(self, arrived: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Refuse (SinkError, before the ack) a version that leaves a parameter unwritten or part-written, or whose
        re-quantization produced a NaN, infinite or zero scale (`reload_checks`); the engine then rolls back."""
        problems: list[str] = []
        missing = missing_names(self._checkpoint, arrived)
        if missing:
            problems.append(refusal(missing, f"{len(missing)} tensors the last version sent did not arrive"))
        if self._reload_active:
            self._commit_loads = self._module_loads()
            incomplete = incomplete_modules(self._commit_loads, self._padding, self._aliases)
            if incomplete:
                problems.append(refusal(incomplete, f"{len(incomplete)} parameters left unwritten or part-written"))
        scales, weights = self._quantized_tensors()
        broken = bad_scales(scales, weights)
        if broken:
            problems.append(refusal(broken, f"{len(broken)} quantized tensors broken"))
        if problems:
            raise SinkError("refused: " + " | ".join(problems))

    def _declare_slices(self) -> None:
        """With tensor parallelism and `transport.slices`: once per checkpoint layout (the names and shapes the
        last version sent), derive the box of each tensor this worker's parameters read (`slices.py`, by
        tracing vLLM's own loaders) and declare them, so that the next versions send this worker only its
        boxes. A failure here only costs the slices: logged, and the tensors keep coming whole."""
        worker = self._worker_receiver
        if worker is None or not self._checkpoint or self._checkpoint == self._sliced_for:
            return
        if not worker.receiver.settings.transport.slices or self._tp_size() < 2:
            return
        from .slices import derive_boxes

        layout = dict(self._checkpoint)
        self._sliced_for = layout
        try:
            shapes = {name: shape for name, (shape, _) in layout.items()}
            slices = derive_boxes(self.model, shapes, checkpoint_params=self._checkpoint_params())
        except Exception as exc:
            logger.warning("%s: deriving tensor-parallel slices failed (%s); tensors keep coming whole",
                           self.identity, explain(exc))  # fmt: skip
            return

        async def declare() -> None:
            worker.receiver.declare_boxes(slices.boxes)

        worker.loop.call(declare(), timeout_s=30)
        whole = sum(math.prod(shape) * itemsize(dtype) for shape, dtype in layout.values())
        sliced = slices.nbytes(
            {name: shape for name, (shape, _) in layout.items()},
            lambda name: itemsize(layout[name][1]),
        )
        logger.info(
            "%s: declared the boxes of %d of %d tensors (tensor-parallel slices): %.1f of %.1f MB a version",
            self.identity, len(slices.boxes), len(layout), sliced / 1e6, whole / 1e6,
        )  # fmt: skip

    def _tp_size(self) -> int:
        """This worker's tensor-parallel world size (1 outside vLLM; `weight_transfer.py` asks vLLM)."""
        return 1

    def _loaded(self, record: VersionRecord) -> None:
        assert record.version is not None
        self.version, self.incomplete = record.version, False
        self.last_report = {
            "ok": True,
            "version": record.version,
            "nbytes": record.nbytes,
            "num_tensors": record.num_tensors,
            "verified": record.verified,
            "seconds": record.seconds,
            # what vLLM's layerwise reload held buffered at most (modules at once, bytes of the tensors handed to
            # their loaders), against its own budget unit: the largest module in checkpoint format
            "buffered_modules_peak": self._watch.modules_peak,
            "buffered_bytes_peak": self._watch.bytes_peak,
            "largest_module_bytes": self._largest_module_bytes(),
        }
        short = len(self._padding or {})  # modules a whole version leaves short (padding): held until the finish
        if self._watch.modules_peak > 1 + short:
            logger.warning(
                "%s: version %d: vLLM's reload held %d modules buffered at once (%s): the tensors did not arrive in "
                "parent-module order, so it holds several modules' tensors at once (send each module's tensors back "
                "to back, as a Hugging Face state dict lists them)", self.identity, record.version,
                self._watch.modules_peak, ", ".join(self._watch.names_at_peak[:4]),
            )  # fmt: skip
        logger.info(
            "%s: version %d loaded (%d tensors, %.1f MB, %.2fs; vLLM's reload held at most %d modules, %.1f MB, "
            "against its largest module's %.1f MB)",
            self.identity,
            record.version,
            record.num_tensors,
            record.nbytes / 1e6,
            record.seconds,
            self._watch.modules_peak,
            self._watch.bytes_peak / 1e6,
            self.last_report["largest_module_bytes"] / 1e6,
        )

    def _undo(self, version: int | None, *, touched: bool, whole: bool) -> str:
        """After a version this server does not keep: put the model back as it was; says what was done."""
        if not touched:
            return f"this worker's model was not touched (it holds version {self.version})"
        if self._host_copy is None:
            if whole:  # this worker's part is whole; the server is not
                self.version, self.incomplete = version, False
                return "this worker keeps it (vllm.rollback=none): the server is torn until the next version lands"
            self.incomplete = True
            return "this worker's model holds part of it until the next version lands (vllm.rollback=none)"
        lost = self._host_copy.restore(self.model)
        if lost:
            self.incomplete = True
            logger.error("%s: rolling back version %s left %d tensors as they were: %s", self.identity, version,
                         len(lost), lost[:5])  # fmt: skip
            return f"the rollback could not restore {len(lost)} tensors (first: {lost[0]}); this worker is torn"
        self._after_restore()
        return f"this worker rolled back to version {self.version}"

    def _failed_workers(self, ok: bool) -> int:
        """How many workers of this server failed this version (this one included): every worker calls it once
        per update, whatever happened, so the server's workers agree. A server whose workers cannot be asked
        counts as failed: better the old version on all than two versions in one model."""
        group = self._server_group()
        if group is None:
            return 0 if ok else 1
        import torch.distributed as dist

        flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
        try:
            dist.all_reduce(flag, group=group)
        except Exception as exc:
            logger.error("%s: cannot learn whether the other workers took the version (%s)", self.identity, exc)
            return max(1, int(not ok))
        return int(flag.item())

    def weight_report(self) -> dict[str, Any]:
        """Which version this worker's model holds and what was verified of it (`transport.verify`):
        `{"identity", "version", "incomplete", "verify", "tensors", "verified", "complete", "checksums"}`.

        `checksums` are keyed by the trainer's names, as they arrived (each matched the trainer's fingerprint,
        or the version failed); vLLM's POST /weight_checker digests the model's own parameters after its
        fusing and sharding (vllm 0.33.0 entrypoints/rl/online/api_router.py:232-266), which no trainer can
        compute. `versions.verify.compare_checksums(report["checksums"], stats.checksums)` answers as its
        `compare` action does."""
        worker = self._worker_receiver
        report = worker.receiver.last_verify if worker is not None else None
        answer: dict[str, Any] = {"identity": self.identity, "version": self.version, "incomplete": self.incomplete}
        if report is None or report.version != self.version or self.incomplete:
            return {**answer, "verify": None, "tensors": 0, "verified": 0, "complete": False, "checksums": {}}
        return {**report.as_dict(), **answer}

    def kernel_digest(self) -> dict[str, Any]:
        """`{"identity", "version", "incomplete", "digest"}`: one digest (`versions.verify.tensors_digest`) of every
        parameter and buffer the model serves now, fingerprinted where they are. For an online-quantized model these
        are the FP8 bytes and scales the reload produced, which no trainer can compute: compare with what a worker of
        a server cold-started from the same bf16 checkpoint answers (same vLLM, same TP rank). On request only (it
        reads every tensor once; `rollout_engines.vllm.client.worker_kernel_digest` through `collective_rpc`)."""
        from ...versions.verify import tensors_digest
        from ..host_copy import live_tensors

        return {
            "identity": self.identity,
            "version": self.version,
            "incomplete": self.incomplete,
            "digest": tensors_digest(live_tensors(self.model)),
        }

    def finish_weight_update(self) -> None:
        """Finish vLLM's layerwise reload (re-runs `process_weights_after_loading`), if begun. The modules vLLM
        processes only now (one a whole version leaves short, as a MoE layer whose sizes block FP8 rounds up to 128)
        get their scales checked here, after the ack: the server's workers agree (`_failed_workers`), and a broken
        scale on any of them rolls every one back (`vllm.rollback=host`) and fails the call, naming the tensor."""
        if not self._reload_active:
            return
        self._reload_active = False
        self._finish_layerwise_reload()
        processed_now = {load.name for load in self._commit_loads}  # what was still waiting when the version committed
        broken: list[str] = []
        if processed_now:
            scales, weights = self._quantized_tensors(processed_now)
            broken = bad_scales(scales, weights)
        # every worker of the server asks, whatever it found (one that found nothing to check too): it is a
        # collective, and a version one worker undoes is undone on all
        failed = self._failed_workers(not broken)
        if not failed:
            return
        version = self.version
        self.version = self._previous_version
        undone = self._undo(version, touched=True, whole=False)
        found = refusal(broken, f"{len(broken)} quantized tensors broken") if broken else "nothing broken here"
        self.last_report = {"ok": False, "version": version, "error": found}
        raise SinkError(
            f"{self.identity}: version {version}: {failed} of this server's workers found quantized tensors broken "
            f"when the update finished (after the version was acknowledged); this worker: {found}; {undone}"
        )

    def shutdown(self) -> None:
        """Close the receiver (cancelling a receive in flight); the worker itself lives on."""
        self._stop_receiver()

    # -- receiver life cycle ----------------------------------------------------------------------
    def _start_receiver(self, overrides: list[str]) -> None:
        from ...config import ReceiverSettings, load_config, settings

        if not self._config_path and not overrides:
            raise ConfigError(
                f"lightning_weightsync engine: no config; set ${CONFIG_ENV} to the weightsync YAML in the "
                "environment of `vllm serve` (`lightning-weightsync rollout rollout.engine=vllm` does it)"
            )
        cfg = load_config(self._config_path or None, overrides)
        self.identity = worker_identity(cfg.rollout.identity, self.rank)
        device = torch.device(self.device)
        # the edge: this process read the YAML; typed from here on
        config = settings(
            load_config(
                base=cfg,
                overrides=[
                    f"transport.device={device}",
                    f"rollout.device={device}",
                    f"rollout.identity={self.identity}",
                ],
            )
        )
        # its slots before vLLM sizes its KV cache
        worker = self._worker_receiver = WorkerReceiver(ReceiverSettings.of(config), device)
        contract = self._quant_contract()  # a model this library cannot feed refuses here, at start-up
        worker.receiver.declare_contract(contract)  # before the receiver's first Ready (it reads it there)
        if contract is not None:
            logger.info("lightning_weightsync engine: worker %d declares its model's quantization contract %s (%d "
                        "rules, %d kept patterns): the trainer sends it FP8 bytes and scales", self.rank,
                        contract.digest()[:12], len(contract.rules), len(contract.keep))  # fmt: skip
        self._adapters = AdapterDirectory(config.vllm.lora_dir, LORA_DIR_KNOB, writes=self.rank == 0)
        if config.vllm.rollback is RollbackMode.host and self._host_copy is None:
            self._host_copy = HostCopy(self.model)  # taken now, before the first version, never during one
            logger.info(
                "lightning_weightsync engine: worker %d keeps a host copy of its model for rollback (%.0f MiB of host "
                "memory; vllm.rollback=none saves it, and a failed version then leaves the server torn)",
                self.rank,
                self._host_copy.nbytes / 2**20,
            )
        logger.info(
            "lightning_weightsync engine: worker %d receives as %s from %s:%d on %s (%.0f MiB of slots taken "
            "now; a version adds one merged tensor at a time)",
            self.rank,
            self.identity,
            config.transport.host,
            config.transport.port,
            device,
            worker.receiver.preallocated_bytes / 2**20,
        )

    def _stop_receiver(self) -> None:
        worker, self._worker_receiver = self._worker_receiver, None
        self._sliced_for = None  # a new receiver declares again
        if worker is not None:
            worker.close()

    # -- vLLM model hooks (overridden in engine.py with the real vLLM calls) -----------------------
    def _check_model_supported(self) -> None:
        """Refuse what this engine cannot update correctly, at start-up, with the reason."""

    def _check_awake(self) -> None:
        """Refuse an update while the weights are asleep (sleep mode offloaded or discarded them)."""

    def _needs_layerwise_reload(self) -> bool:
        return False

    def _begin_layerwise_reload(self) -> None:
        raise NotImplementedError

    def _finish_layerwise_reload(self) -> None:
        raise NotImplementedError

    def _abandon_layerwise_reload(self) -> None:
        """After a failed version: put the kept kernel tensors back (vLLM's fallback for layers that
        got nothing) so the model is never left on the meta device; the worker then ends the session."""
        if self._reload_active:
            self._reload_active = False
            try:
                self._finish_layerwise_reload()
            except Exception:
                logger.exception("finishing the layerwise reload after a failed version failed")

    def _load_context(self) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def _server_group(self) -> Any:
        """The CPU process group of this server's workers (None: this worker is the only one). Outside vLLM, the
        default group when it is gloo (tests run workers that way); `engine.py` uses vLLM's world group."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        return dist.group.WORLD if dist.get_backend() == "gloo" else None

    def _quant_contract(self) -> QuantContract | None:
        """What the model loads quantized (a serialized FP8 checkpoint's model: `quant_contract.py`), for the trainer
        to quantize to; None where the model takes tensors as the trainer holds them (bf16, or the engine quantizes
        online). None outside vLLM."""
        return None

    def _checkpoint_params(self) -> CheckpointParams | None:
        """The checkpoint-format parameters the slices are traced on where a module serves others (a quantized
        model's: `slices.py`); None outside vLLM."""
        return None

    def _module_loads(self) -> list[ModuleLoad]:
        """Each module's progress in the engine's reload ([] outside vLLM)."""
        return []

    def _quantized_tensors(
        self, modules: Collection[str] | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The model's scales and FP8 weights (of `modules` only, if given), by name (none outside vLLM)."""
        return {}, {}

    def _largest_module_bytes(self) -> int:
        """The engine's reload budget unit: its largest module in checkpoint format (0 outside vLLM)."""
        return 0

    def _after_restore(self) -> None:
        """Re-derive what lives outside the model's parameters and buffers after `HostCopy.restore`."""


__all__ = [
    "BACKEND_NAME",
    "CONFIG_ENV",
    "INIT_OVERRIDES",
    "InitInfo",
    "ModelLoadSink",
    "UpdateInfo",
    "WeightSyncEngineBody",
    "check_init_overrides",
    "worker_identity",
]
