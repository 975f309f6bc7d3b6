"""WeightReceiver: one version per `receive_weights()` call, bucket by bucket, merged into tensors.

    wait for Prepare (heartbeating) -> Ready -> Plan -> join the group (receiver_lane.py: this receiver's lane)
    `BucketPipeline` (pipeline.py): the version's buckets, one ahead of the consumer
    chunks of each bucket -> merge_weight_chunks(into=...) -> yield (name, tensor)   (arrivals.py)
    ack

So bucket k + 1 is on the wire while bucket k is merged. If the consumer stops early or fails,
the receiver keeps taking part in the version's remaining broadcasts (discarding them) so the
sender and the other receivers are not stalled, then reports the failure in its ack.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import replace

import torch

from ..config import ReceiverSettings, UserConfig, VerifyMode, transport_token
from ..errors import VersionAborted, WeightSyncError
from ..protocol.boxes import Box
from ..protocol.declare import Declaration
from ..protocol.layout import LayoutRecorder
from ..protocol.messages import BucketMeta, LoraSpec, Plan
from ..quantize import QuantContract
from ..transport.backends import backend_class
from ..transport.control import ReceiverControl, default_identity
from ..transport.device import resolve_device
from .arrivals import Arrivals
from .delta import HeldVersion
from .endpoint import Endpoint
from .pipeline import BucketPipeline, Destinations, FingerprintNotes, Into
from .quantized import ContractDeclaration
from .receiver_lane import Acks, ReceiverLane
from .sharded import OtherSenders
from .stats import ReceiveStats
from .steps import ReceiverSteps
from .verify import VerifyReport

logger = logging.getLogger(__name__)


class WeightReceiver(Endpoint):
    """Receives versions from one `WeightSender`.

    Args:
        cfg: the weightsync config (None = the defaults), converted once here into its `ReceiverSettings`
            (`transport.*`, `rollout.identity`, and `rollout.device`: where merged tensors are allocated when no
            `into` destination is given), or those settings themselves.
    """

    _control: ReceiverControl

    def __init__(
        self,
        cfg: UserConfig | ReceiverSettings = None,
        *,
        identity: str | None = None,
        preallocate: bool = False,
    ) -> None:
        self.settings = ReceiverSettings.of(cfg)
        t = self.settings.transport
        self.identity = identity or self.settings.identity or default_identity()
        self.timeout_s = float(t.timeout_s)
        self.device = resolve_device(t.backend, t.device, backend_class(t.backend).natural_device)
        self.output_device = torch.device(self.settings.device)
        self._key = transport_token(t)
        self._control = ReceiverControl(
            t.host, int(t.port), self._key, self.identity, str(self.device), liveness_s=float(t.liveness_s)
        )
        self._steps = ReceiverSteps(self._control, self.identity)
        lane_backend = functools.partial(self._new_backend, is_sender=False, identity=self.identity)
        self._lane = ReceiverLane(self._control, self.identity, lane_backend)
        self.last_stats: ReceiveStats | None = None
        self.on_bucket: Callable[[BucketMeta], None] | None = None  # progress hook (daemon)
        # a version starts (its Prepare, before this receiver answers it): a peer serving the tensors it installed
        # stops now (versions/peer_serve.py), before any byte of the new version can land in them
        self.on_version_start: Callable[[int], None] | None = None
        self.preallocate = preallocate
        self.preallocated_bytes = 0
        # sharded versions: a receiver of each other sender
        self._others: OtherSenders[WeightReceiver] = OtherSenders(
            self.address, self._other_sender, float(t.ready_timeout_s)
        )
        self._acks = Acks(self._steps, self._others)
        self.verify = VerifyMode(t.verify)
        self.last_verify: VerifyReport | None = None  # what was checked of the last complete version
        self._contract = ContractDeclaration()  # the quantization contract declared (`declare_contract`)

    # -- life cycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        slots = (str(self.settings.transport.backend), self.settings.bucket_size) if self.preallocate else None
        self.preallocated_bytes = self._lane.start(slots) or self.preallocated_bytes
        await self._control.start()

    def _close_lanes(self) -> None:
        self._lane.close()

    @property
    def tied(self) -> dict[str, list[str]]:
        """The version in flight's tied names, {name sent: other names of that tensor} (tied
        embeddings are sent once); known once its first bucket's metadata arrived, before any
        destination is asked for."""
        return dict(self._lane.current.tied) if self._lane.current is not None else {}

    @property
    def lora(self) -> LoraSpec | None:
        """The version in flight's LoRA spec (`trainer.lora`: mode, base included, adapter config), known with
        its first bucket like `tied`; None for a version that is not of a PEFT LoRA model."""
        return self._lane.current.lora if self._lane.current is not None else None

    @property
    def dropped_messages(self) -> int:
        return self._control.dropped_messages

    @property
    def dropped_connections(self) -> int:
        """Links to the sender lost after their handshake (trainer gone, link silent, or a frame over the
        size limit: ZMQ_MAXMSGSIZE drops the connection); each logged, rate-limited, with the causes."""
        self._control.sender_link()
        return self._control.dropped_connections

    @property
    def in_flight(self) -> int | None:
        """The version this receiver took part in and has not acked yet (it owes the sender one ack)."""
        return self._steps.in_flight

    @property
    def version(self) -> int | None:
        """The version in flight, or the last one seen."""
        return self._steps.version

    @property
    def last_complete_version(self) -> int | None:
        return self._steps.last_complete

    @property
    def delta_base(self) -> int | None:
        """The version the consumer holds whole and can apply a delta to, said in every Ready; None: it cannot
        (no held version, or a sink that holds no tensors) and gets whole tensors. `receive_weights(base=...)`
        keeps it for the caller; a sink that tracks its own held version sets it."""
        return self._steps.held

    @delta_base.setter
    def delta_base(self, version: int | None) -> None:
        self._steps.held = version

    @property
    def address(self) -> str:
        """The sender's control address this receiver talks to."""
        return self._control.address

    async def register(self) -> None:
        """Announce this receiver to the sender now; `wait_version` does it every heartbeat while it
        waits, an engine worker between versions too (`rollout_engines/worker.py WorkerReceiver`)."""
        if self._lane.executor is None:
            raise WeightSyncError("WeightReceiver.register() before start()")
        await self._steps.register()

    def sender_link(self) -> tuple[bool, float]:
        """(a trainer connected, seconds since that last changed): `ReceiverControl.sender_link`."""
        return self._control.sender_link()

    @property
    def handshake_refused(self) -> str | None:
        """Why the trainer refuses this receiver's handshake (the token), or None: `sender_link` reads it."""
        return self._control.handshake_refused

    @property
    def declared(self) -> Declaration | None:
        """The boxes this receiver declares to its sender (protocol/declare.py)."""
        return self._lane.declared

    @declared.setter
    def declared(self, declared: Declaration | None) -> None:
        self._lane.declared = declared

    def declare_boxes(self, boxes: dict[str, Box] | None) -> None:
        """Declare the box of each tensor this receiver holds ({name: Box}; a name not in it: whole); None or
        {}: whole tensors. Sent to the sender with the next version's Ready; from the version its plan says it
        took them (`Plan.boxes`), each tensor named arrives as that box alone. A receiver whose `into` returns
        DTensors declares their boxes itself after its first version (transport.slices)."""
        self._lane.declare_boxes(boxes)

    def _other_sender(self, host: str, port: int) -> WeightReceiver:
        """This receiver, for another sender of a sharded version (same identity, same token)."""
        own = self.settings
        at = replace(own, transport=replace(own.transport, host=host, port=port))
        other = WeightReceiver(at, identity=self.identity)
        other.declare_contract(self.declared_contract)  # every sender of a sharded version quantizes its shards
        return other

    @property
    def declared_contract(self) -> QuantContract | None:
        """The quantization contract this receiver declared (`declare_contract`), or None."""
        return self._contract.declared.contract if self._contract.declared is not None else None

    def declare_contract(self, contract: QuantContract | None) -> None:
        """What this receiver's model loads quantized, and how (quantize/contract.py; a vLLM worker learns it from
        its model): the sender quantizes every version to it (versions/quantized.py). None: tensors as the trainer
        holds them. Raises `QuantizeError` for a contract too large to send (name tensors by patterns)."""
        self._contract.declare(contract)
        for other in self._others.subs.values():  # the other senders of a sharded version hear it too
            other.declare_contract(contract)

    def give_up_group(self) -> None:
        """Another part of the version failed: leave the group now, so its sender's broadcast ends at once."""
        self._lane.fail()

    def pipeline(
        self,
        plan: Plan,
        destinations: Destinations | None,
        *,
        on_bucket: Callable[[BucketMeta], None] | None = None,
        sender: int = 0,
        verifier: FingerprintNotes | None = None,
        recorder: LayoutRecorder | None = None,
    ) -> BucketPipeline:
        """The buckets of `plan` (joined by `wait_version`) over this receiver's lane, steps and thread."""
        return self._lane.pipeline(
            plan, self._steps, self.timeout_s, destinations, on_bucket=on_bucket, sender=sender, verifier=verifier,
            recorder=recorder,
        )  # fmt: skip

    # -- one version ------------------------------------------------------------------------------
    async def wait_version(self, wait_s: float | None = None) -> Plan:
        """Block until the sender starts a version, join its group, and return the plan."""
        if self._lane.executor is None:
            raise WeightSyncError("WeightReceiver.receive_weights() / wait_version() before start()")
        await self._lane.finish_abandoned(self._acks)
        t = self.settings.transport
        while True:
            prepare = await self._steps.next_prepare(float(t.heartbeat_interval_s), wait_s)  # 1
            if self.on_version_start is not None:
                self.on_version_start(prepare.version)
            boxes = await self._lane.send_boxes(prepare)
            layout = self._lane.layout.digest if self._lane.layout is not None else ""
            contract = await self._contract.send(self._control, self.identity)
            await self._steps.ready(prepare, self._lane.generation, layout, boxes, contract)  # 2
            try:
                plan = await self._steps.wait_plan(prepare, self.timeout_s, float(t.heartbeat_interval_s))  # 3
            except VersionAborted as exc:
                logger.info("%s", exc)
                continue
            break
        self._lane.note_boxes(plan)
        self._contract.check(plan, self.address)
        self._steps.begin(plan)  # this version gets exactly one ack from here on; the failures below send theirs
        await self._lane.join(plan, self.timeout_s, self._acks)  # 3: its group
        return plan

    async def receive_weights(
        self,
        *,
        into: Into | None = None,
        auto_ack: bool = True,
        wait_s: float | None = None,
        base: Into | None = None,
    ) -> AsyncGenerator[tuple[str, torch.Tensor]]:
        """Yield every `(name, tensor)` of the next version, then (by default) ack it.

        `base(meta)`: the tensor of version `self.delta_base` the consumer holds under that name, onto which
        a delta (`transport.delta`) is applied; the result lands in `into(meta)` (which may be that same
        tensor, updated in place) or a new tensor. Without it, or with `delta_base` None, a delta fails.
        Passing `base` declares that the consumer keeps what it receives (`base` answers with this version's
        tensors next time): once the version is acked ok, `delta_base` becomes its number, so the next one
        may be a delta with no bookkeeping by the caller; a version that fails or is nacked clears it (its
        tensors may be torn), and the next version comes whole.

        Raises `VersionAborted` when the sender drops the version mid-way, `WeightSyncTimeout`
        when a wait expires; in both cases nothing of the version may be applied.
        """
        plan = await self.wait_version(wait_s)  # 1-3
        self._steps.keeps = base is not None
        t, held = self.settings.transport, HeldVersion(base, lambda: self.delta_base)
        destinations = Destinations(into) if into is not None else None
        arrivals = Arrivals(plan, self._lane, self._acks, t, self.output_device, self.verify, held, self.on_bucket,
                            destinations)  # fmt: skip
        # 4: the buckets, merged into tensors: from one sender, or (sharded) from several at once, tiled
        parts = arrivals.sharded(self, self._others, self.declared) if plan.senders else arrivals.whole(self)
        try:
            async for item in parts:
                yield item
            self.last_stats, self.last_verify = arrivals.complete()
            if auto_ack:
                await self._acks.send(plan.version, True, None)  # 5 (else the caller acks)
        except BaseException:
            self._steps.torn()
            await parts.aclose()  # the part's own GeneratorExit handling (drain, ack) runs when the consumer stops
            raise

    async def ack(self, ok: bool = True, error: str | None = None) -> None:
        """Acknowledge the version just received (with `receive_weights(auto_ack=False)`)."""
        if self.version is None:
            raise WeightSyncError("ack() before any version was received")
        await self._acks.send(self.version, ok, error)

    async def close(self) -> None:
        await self._others.close()
        await super().close()


__all__ = ["ReceiveStats", "WeightReceiver"]
