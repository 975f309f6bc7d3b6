"""What the Lightning and Accelerate integrations share: one sync = gather on every rank, send on rank 0.

The integrations decide *when* to sync; `SyncDriver` does one sync the same way for both:

    every rank:   weights = iter_full_parameters(model, ...)      (FSDP all-gathers: collective)
    global rank 0: BlockingWeightSender.send_weights(weights)     (drains `weights` even on failure)
    other ranks:   drain(weights)                                 (join the all-gathers, keep nothing)
    every rank:   agree on the outcome (one tiny all-reduce), then apply `trainer.on_failure`

The agreement is what keeps a failed send from hanging training: without it rank 0 would raise
(or not) on its own while the other ranks walk into the next step's collectives alone. It also
carries a SIGTERM / SIGINT that hit any rank during the sync (`interrupt.py`): the sending rank hears
of it through the process group's store and stops sending at once, every rank drains and agrees, and
only then is the signal handed on, on every rank alike, where no collective is in flight.

How long a lost rollout costs: the sender's waits on receivers are bounded by `transport.liveness_s`
when a receiver is gone (versions/steps.py), so under `trainer.on_failure: warn` a step pays at most
that, and the failure is logged once (then at most every `WARN_AGAIN_S` while it lasts), not per step.

The bookkeeping both integrations report (last synced version, failures, the sending rank's
`SendStats` and the `weightsync/*` metrics they log, the resumable state) lives here once, and the
sending rank is decided here once: the global rank of torch.distributed whenever it is initialised
(an `Accelerator()` that did not see the launcher says process 0 on every rank; torch.distributed
does not lie), the integration's own notion of rank only in a single process.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import FailurePolicy, SenderSettings, SendMode, UserConfig, settings
from ..errors import ConfigError, WeightSyncError
from ..protocol.messages import SenderAddress
from ..versions.options import VersionOptions
from .agree import FATAL, OK, RECOVERABLE, SyncFailed, all_ranks_max, all_ranks_max_each, outcome_code
from .facts import ModelFacts
from .gather import iter_full_parameters
from .interrupt import SyncStopWatch, raise_signal, signal_name
from .lora import LoraSync
from .record import SyncRecord
from .send import Outbound, SendRoute, send_version
from .sharded import MembersRelay, ReplicaDrift, iter_local_shards

if TYPE_CHECKING:
    from ..versions.sender import BlockingWeightSender
    from ..versions.stats import SendStats
    from .fleet import RolloutFleet
    from .overlap import OverlapSync

logger = logging.getLogger(__name__)

SENDER_RANK = 0  # the global rank that owns the sender; every stream is gathered onto it

WARN_AGAIN_S = 60.0  # under on_failure=warn, while syncs keep failing: one WARNING this often, not one a step


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def show_logs() -> None:
    """Make this package's INFO lines (one per version sent) visible when nothing configured logging,
    as Lightning does for its own package: Python's last-resort handler prints WARNING and up only, so a
    new user saw no line per version. A handler the user (or pytest) set anywhere up the tree wins."""
    pkg = logging.getLogger("lightning_weightsync")
    if pkg.hasHandlers():
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    pkg.addHandler(handler)
    pkg.propagate = False  # a root handler added later would print every line twice
    if pkg.level == logging.NOTSET:
        pkg.setLevel(logging.INFO)


def process_rank(fallback: int) -> int:
    """This process's global rank: torch.distributed's when it is initialised, else `fallback`.

    A launcher that started several processes (`WORLD_SIZE` > 1) without torch.distributed being
    initialised would make every process think it is rank 0 and try to bind the sender's port;
    that is a `ConfigError` naming the launch, raised before anything binds.
    """
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1:
        raise ConfigError(
            f"process RANK={os.environ.get('RANK', '?')} of WORLD_SIZE={world}: the launcher started {world} "
            "processes but torch.distributed is not initialised here, so every process would be the sender; "
            "create the Accelerator / Lightning Trainer (or call torch.distributed.init_process_group) first"
        )
    return fallback


class SyncDriver:
    """One sync at a time: gather everywhere, send from global rank 0, agree, apply the policy.

    Args:
        cfg: the weightsync config (`load_config()`, or the `WeightSyncConfig` an integration already
            converted; None = the defaults): converted once, here, to typed sections (`config/settings.py`);
            the driver reads `trainer.*`, its sender `transport.*`, its rollouts the engines' sections.
        rank: the integration's global rank of this process (Lightning's `trainer.global_rank`,
            Accelerate's `process_index`); torch.distributed's rank wins when it is initialised
            (`process_rank`). Global rank 0 creates and owns the `BlockingWeightSender`.
        device: the device for the agreement all-reduce (see `all_ranks_max`).
        prefix: the submodule whose tensors are sent, stripped from names (see `iter_full_parameters`).

        record: the integration's `SyncRecord`, updated by every sync (a new one when None).
    """

    def __init__(
        self,
        cfg: UserConfig,
        *,
        rank: int,
        device: torch.device | None,
        prefix: str | None,
        record: SyncRecord | None = None,
    ) -> None:
        self.config = settings(cfg)  # the one conversion; below this, typed sections only
        self.trainer = tr = self.config.trainer
        self.rank = process_rank(rank)
        self.is_sender = self.rank == SENDER_RANK
        self.device = device
        self.prefix = prefix
        self.on_failure: FailurePolicy = tr.on_failure
        self.sender: BlockingWeightSender | None = None
        self.last_stats: SendStats | None = None
        self.replica_drift = ReplicaDrift()  # sharded mode: replicas that differ, warned once per tensor
        self.record = record if record is not None else SyncRecord()
        self.lora = LoraSync(tr)  # trainer.lora: a PEFT model's versions (trainer/lora.py)
        self.record.on_delivered(self.lora.delivered)  # the base goes until a version with it was delivered
        self._tied_logged = False
        self._facts: dict[int, ModelFacts] = {}  # by id(module): what the model is, derived at its first sync
        self.syncs = 0  # syncs started: the same count on every rank (names a sync in the store)
        self._failing_since: int | None = None  # first version of the current run of failures (warn)
        self._skipped = 0
        self._warned_at = -math.inf
        # how a SIGTERM / SIGINT that stopped a sync is handed on, on every rank (see `interrupt`): by
        # default raised again on this process; the Lightning callback sets Lightning's own flag instead
        self.deliver_signal: Callable[[int], None] = raise_signal
        # vLLM rollouts driven around every send (sending rank): from `vllm.urls` at start(), or set
        # your own before start() (e.g. `RolloutFleet([EngineRolloutClient(llm)])`, rollout_engines/vllm/client.py)
        self.rollouts: RolloutFleet | None = None
        # trainer.send_mode=sharded (trainer/sharded.py): every rank has a sender; their endpoints, by rank
        self.sharded = tr.send_mode is SendMode.sharded and _world_size() > 1
        self.addresses: list[tuple[str, int]] = []
        self._mode_logged = False
        # trainer.overlap: the send of a version runs in the background while training goes on (overlap.py)
        self.overlap: OverlapSync | None = None
        if tr.overlap:
            from .overlap import OverlapSync

            self.overlap = OverlapSync(self)

    # -- life cycle -------------------------------------------------------------------------------
    def _sender_settings(self) -> SenderSettings:
        """Rank 0 binds transport.host:port; in sharded mode every other rank its own sender_host:sender_port."""
        t = self.config.transport
        if not self.is_sender:
            host = os.environ.get("LIGHTNING_WEIGHTSYNC_SENDER_HOST") or t.sender_host or t.host
            t = replace(t, host=host, port=t.sender_port)
        return SenderSettings(t, self.trainer.min_receivers)

    def start(self) -> None:
        """Bind the sender on rank 0 (on every rank in sharded mode); every rank raises if that fails (a bad
        port is never 'warn')."""
        show_logs()
        error: BaseException | None = None
        if (self.is_sender or self.sharded) and self.sender is None:
            from ..versions.sender import BlockingWeightSender

            own = self._sender_settings()
            sender = BlockingWeightSender(own)
            try:
                sender.start()
                self.sender = sender
                logger.info("weight sender listening on %s:%d", own.transport.host, sender.port)
                if self.rollouts is None and self.is_sender:
                    from .fleet import RolloutFleet

                    self.rollouts = RolloutFleet.from_config(self.config)
            except Exception as exc:
                error = exc
                sender.close()
                logger.error(
                    "global rank %d: the weight sender could not start on %s:%s (transport.host / transport.port; "
                    "sender_host / sender_port on ranks but 0 in sharded mode): %s",
                    self.rank, own.transport.host, own.transport.port, exc,
                )  # fmt: skip
        if all_ranks_max(FATAL if error is not None else OK, self.device) != OK:
            if error is not None:
                raise error
            raise SyncFailed(f"global rank {self.rank}: a weight sender failed to start; see the failing rank's log")
        if self.sharded and self.sender is not None:
            from .sharded import exchange_addresses

            self.addresses = exchange_addresses(self._sender_settings().transport.host, self.sender.port, self.device)
        if self.overlap is not None:
            self.overlap.start()

    def finish(self, module: nn.Module, version: int | None) -> bool:
        """At the end of training, on every rank: with `trainer.overlap`, wait for the version in flight
        (and send `version` when the last sync skipped it; None: no final version) and apply
        `trainer.on_failure` to it; True when the last version was delivered. Nothing to do for blocking
        syncs (True)."""
        return self.overlap.finish(module, version) if self.overlap is not None else True

    def close(self) -> None:
        if self.overlap is not None:
            self.overlap.close()  # ends a background send first: it uses the sender and the rollouts
        if self.rollouts is not None:
            self.rollouts.close()
        if self.sender is not None:
            sender, self.sender = self.sender, None
            try:
                sender.close()
            except Exception:
                logger.exception("closing the weight sender failed")

    @property
    def port(self) -> int | None:
        return self.sender.port if self.sender is not None else None

    # -- one sync ---------------------------------------------------------------------------------
    def facts(self, module: nn.Module) -> ModelFacts:
        """What `module` is, derived at its first sync and kept (see `ModelFacts`)."""
        facts = self._facts.get(id(module))
        if facts is None:
            facts = self._facts[id(module)] = ModelFacts.of(module, self.lora, self.trainer, self.prefix)
        return facts

    def weights(
        self, module: nn.Module, *, keep_on_rank: int | None = SENDER_RANK, defer_gather: bool = False
    ) -> Iterator[tuple[str, Any]]:
        """The stream a sync sends (names, dtype, exclusions exactly as configured). `defer_gather`: FSDP2
        tensors come as `PendingGather` on every rank (overlap's background gather; not with LoRA, whose
        merge needs whole tensors: `gathers_in_background`)."""
        tr = self.trainer
        if self.facts(module).lora:
            assert not defer_gather, "LoRA streams are gathered in place"
            return self.lora.weights(
                module, include_buffers=tr.include_buffers, names_cfg=tr.names, dtype=tr.dtype,
                keep_on_rank=keep_on_rank, prefix=self.prefix,
            )  # fmt: skip
        return iter_full_parameters(
            module,
            include_buffers=tr.include_buffers,
            names_cfg=tr.names,
            dtype=tr.dtype,
            keep_on_rank=keep_on_rank,
            prefix=self.prefix,
            defer_gather=defer_gather,
        )

    def tied(self, module: nn.Module) -> dict[str, tuple[str, ...]]:
        """{name sent: other names of the same tensor} under this sync's rules (tied embeddings are
        sent once). Local, no collectives; travels in the version's first `BucketMeta.tied`."""
        tr = self.trainer
        facts = self.facts(module)
        if facts.lora:
            return self.lora.tied(module, include_buffers=tr.include_buffers, names_cfg=tr.names, prefix=self.prefix)
        return facts.tied

    def outbound(self, module: nn.Module, version: int, *, sharded: bool, defer_gather: bool = False) -> Outbound:
        """This rank's part of `version`, from the live model: its own shards (sharded mode) or the gather
        stream (every rank runs the all-gathers; global rank 0 alone gets tensors). A bad layout raises
        `ConfigError` here, on every rank alike, before any rank sends."""
        tr = self.trainer
        if sharded:
            weights = iter_local_shards(
                module, include_buffers=tr.include_buffers, names_cfg=tr.names, dtype=tr.dtype,
                prefix=self.prefix, device=self.device, version=version, drift=self.replica_drift,
            )  # fmt: skip
            options = VersionOptions(tied=self.tied(module))
            return Outbound(version, weights, options, sharded=True, replica_drift=self.replica_drift.last)
        facts = self.facts(module)
        stream = self.weights(module, defer_gather=defer_gather)  # LoRA: decides the version's content
        lora = self.lora.spec if facts.lora else None
        options = VersionOptions(tied=self.tied(module), lora=lora, stable_tensors=facts.stable)
        return Outbound(version, stream, options)

    def route(self, sharded: bool) -> SendRoute:
        """What this rank sends through in a version of this mode (see `send.SendRoute`)."""
        sender = self.sender if (self.is_sender or sharded) else None
        others = tuple(SenderAddress(h, p) for h, p in self.addresses[1:]) if sharded else ()
        return SendRoute(self.rank, sender, self.rollouts if self.is_sender else None, others)

    def sync(self, module: nn.Module, version: int) -> bool:
        """Gather and send `version`; call on every rank. True (on every rank) when it was delivered;
        False when it failed and `on_failure: warn` skipped it. The sending rank's `SendStats` are
        in `self.last_stats`."""
        started = time.perf_counter()
        try:
            if self.overlap is not None:
                return self.overlap.sync(module, version)
            return self._sync(module, version)
        finally:
            self.record.last_stall_seconds = time.perf_counter() - started

    def sends_sharded(self, module: nn.Module) -> bool:
        """Whether this sync sends in sharded mode: configured, started, and an FSDP2-sharded model (others
        fall back to the gather, said once)."""
        facts = self.facts(module)
        if not self.sharded or not self.addresses or facts.lora:
            return False
        if not facts.sharded and not self._mode_logged:
            self._mode_logged = True
            logger.warning(
                "trainer.send_mode=sharded, but the model is not FSDP-sharded: sending in gather mode (global rank %d "
                "sends everything)", SENDER_RANK,
            )  # fmt: skip
        return facts.sharded

    def _sync(self, module: nn.Module, version: int) -> bool:
        self.syncs += 1
        sharded = self.sends_sharded(module)
        route = self.route(sharded)
        sender = route.sender
        if self.is_sender and sender is None:
            raise WeightSyncError("SyncDriver.sync() before start()")
        if sender is not None:
            sender.clear_interrupt()
        watch = SyncStopWatch(rank=self.rank, sync_id=self.syncs, on_stop=sender.interrupt if sender else None)
        with watch:
            error = self._send_blocking(module, version, sharded, route)
            # 3. agree: the outcome, and whether a rank was stopped by a signal (and which)
            agreed, signum, signalled = all_ranks_max_each([outcome_code(error), *watch.seen()], self.device)
        # 4. the signal handlers are back: hand on what stopped the sync, on every rank alike
        for late in watch.late(signum):
            raise_signal(late)  # came after this rank had agreed: handled here alone, as without a sync
        if signum:
            return self.signal_stopped(version, "weight sync", agreed, signum, signalled, self.last_stats)
        return self.settle(version, error, agreed)

    def _send_blocking(self, module: nn.Module, version: int, sharded: bool, route: SendRoute) -> Exception | None:
        """1. every rank gathers (or takes its shards); 2. the ranks that send, send. Returns this rank's
        failure (None: its part went out, or it sends nothing); the stream is exhausted on every rank."""
        self.last_stats = None
        out = self.outbound(module, version, sharded=sharded)
        if route.sender is not None and route.coordinates:
            self._log_tied(out.options.tied)
        try:
            self.last_stats = send_version(out, route, MembersRelay(self.device) if sharded else None)
        except ConfigError:
            raise  # raised by the gather on every rank at the same point: nobody is left waiting
        except Exception as exc:
            return exc
        return None

    def _log_tied(self, tied: Mapping[str, Iterable[str]]) -> None:
        if not self._tied_logged:
            self._tied_logged = True
            for sent, aliases in tied.items():
                logger.info("tied weights: %s is sent once, as %r (the rollout restores the tie)", aliases, sent)

    def signal_stopped(
        self, version: int, what: str, agreed: int, signum: int, signalled: int, stats: SendStats | None
    ) -> bool:
        """A SIGTERM / SIGINT came during the sync of `version`: record it if every rank sent it anyway, say
        what became of it, and hand the signal on (every rank alike)."""
        if agreed == OK:  # it came too late to stop the send: the version is delivered
            self.record.delivered(version, stats)
        logger.warning(
            "%s of version %d %s by %s on global rank %d%s",
            what, version, "completed, then was followed" if agreed == OK else "stopped (not delivered)",
            signal_name(signum), signalled - 1, self.stopped_fate(agreed),
        )  # fmt: skip
        self.deliver_signal(signum)
        return agreed == OK

    def stopped_fate(self, agreed: int) -> str:
        """What became of a version a signal stopped, for its log line ("" when it was delivered anyway)."""
        if agreed == OK:
            return ""
        # the sender aborted it: each rollout dropped what it had of it and serves what it held
        held = self.record.last_synced_version
        kept = "the version they held" if held is None else f"version {held}, the last delivered"
        return f": the rollouts were told to abort it and keep {kept}; none applies part of it"

    def settle(self, version: int, error: Exception | None, agreed: int) -> bool:
        """Apply the agreed outcome of `version` (OK / RECOVERABLE / FATAL over every rank) and
        `trainer.on_failure`, the same for a blocking sync and for a background one (trainer/overlap.py)."""
        if agreed == OK:
            self.record.delivered(version, self.last_stats)
            self._recovered(version)
            return True
        self.record.failures += 1
        if agreed == RECOVERABLE and self.on_failure is FailurePolicy.warn:
            self._skipped_version(version, error)
            return False
        if error is not None:
            raise error
        raise SyncFailed(
            f"global rank {self.rank}: weight sync of version {version} failed on the sending global rank "
            f"{SENDER_RANK} (trainer.on_failure={self.on_failure}); see that rank's log"
        )

    def _skipped_version(self, version: int, error: Exception | None) -> None:
        """`on_failure: warn`: one WARNING when syncs start failing, then one every `WARN_AGAIN_S` while they
        keep failing (a rollout that is gone fails every step), and one line when they recover."""
        self._skipped += 1
        if error is None:  # not the sending rank: it says why
            return
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since, self._warned_at = version, now
            logger.warning(
                "weight sync of version %d failed, skipped (trainer.on_failure=warn): %s; while syncs keep "
                "failing this is repeated at most every %.0fs",
                version, error, WARN_AGAIN_S,
            )  # fmt: skip
        elif now - self._warned_at >= WARN_AGAIN_S:
            self._warned_at = now
            logger.warning(
                "weight sync still failing: %d versions skipped since version %d (trainer.on_failure=warn); "
                "version %d: %s",
                self._skipped, self._failing_since, version, error,
            )  # fmt: skip
        else:
            logger.debug("weight sync of version %d failed, skipped: %s", version, error)

    def _recovered(self, version: int) -> None:
        if self._failing_since is not None and self.is_sender:
            logger.warning(
                "weight sync recovered with version %d, after %d skipped versions since version %d",
                version, self._skipped, self._failing_since,
            )  # fmt: skip
        self._failing_since, self._skipped = None, 0
