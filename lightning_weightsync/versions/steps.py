"""One version of weights, step by step, on both sides: the policy the transport does not know.

    sender                                              receivers
    1. Prepare(version)  to every registered receiver   wait_prepare: heartbeat (Register) while idle
    2. gather Ready      (min_receivers, ready_timeout)  -> Ready(version, group generation)
    3. Plan(rank, group) to every member                wait_plan (a newer Prepare or an Abort ends it)
       join the data-plane group (serving the rendezvous) join the group
    4. BucketMeta*       ahead of each bucket's bytes    next_bucket, in order (progress when it waits)
    5. collect Ack       (or Abort on failure)           Ack(ok | reason)

The control plane (`transport/control`) moves signed messages and keeps the registry of receivers;
this module decides what a message means for a version: who is in it, what is stale or superseded,
who is behind when a broadcast stalls. Both sides' steps live here, next to each other, so the
protocol can be read in one place and in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import NoReturn, TypeVar

from ..errors import PeerError, ProtocolError, VersionAborted, WeightSyncError, WeightSyncTimeout, explain
from ..protocol.messages import (
    Abort,
    Ack,
    BucketDone,
    BucketMeta,
    GroupSpec,
    Message,
    Plan,
    Prepare,
    Ready,
    SenderAddress,
)
from ..transport.control import Peer, ReceiverControl, SenderControl

logger = logging.getLogger(__name__)

PROGRESS_AFTER_S = 0.05  # a receiver waiting this long for a bucket's metadata tells the sender where it is
WAITING_LOG_EVERY_S = 10.0  # while too few receivers are ready, one line this often naming what is missing
LOOK_AHEAD = 4096  # messages a receiver keeps unread-ahead while its producer waits for a slot (`look_ahead`)
LIVENESS_POLL_S = 0.5  # while a wait depends on receivers, whether they are still connected is asked this often
GONE = "disconnected (its process stopped or the link is down)"
NACK_GRACE_S = 0.1  # once a member is found gone: how long its nack, sent just before it left, may still take

T = TypeVar("T")


class _Round:
    """One version's Prepare -> Ready round on the sender (`SenderSteps.gather_ready`): whom it asked
    (identity -> when), who answered, and its clock."""

    def __init__(
        self,
        version: int,
        asked: dict[str, float],
        only: frozenset[str] | None,
        min_receivers: int,
        session: SenderSteps,
    ) -> None:
        self.version, self.asked, self.only, self.min_receivers = version, asked, only, min_receivers
        self.ready: dict[str, Peer] = {}
        self.started = time.monotonic()
        self.deadline = self.started + session.timeout_s
        self.say_at = self.started + min(session.liveness_s, WAITING_LOG_EVERY_S)


class SenderSteps:
    """The sender's steps of every version, over one control plane.

    Liveness (`liveness_s`, `transport.liveness_s`): every wait that only a receiver can end (its Ready,
    its part of the group's join and broadcasts, its Ack) asks every `LIVENESS_POLL_S` whether that
    receiver is still connected, and one that is gone fails the version at once, named, instead of the
    wait lasting `timeout_s`. Between versions: a receiver that served the last version and is gone makes
    the next version wait at most `liveness_s` for `min_receivers` (a rollout that restarts and registers
    within it is served), and while receivers stay missing every later version fails at once; the first
    version that gathers enough receivers ends that state. A receiver never seen may take `timeout_s`
    to come up (the trainer may start first).
    """

    def __init__(
        self,
        control: SenderControl,
        *,
        session: str,
        min_receivers: int,
        timeout_s: float,
        ready_timeout_s: float,
        liveness_s: float = 5.0,
    ) -> None:
        self.control, self.session = control, session
        self.min_receivers, self.timeout_s, self.ready_timeout_s = min_receivers, timeout_s, ready_timeout_s
        self.liveness_s = liveness_s
        self.members: list[str] = []  # receivers of the version being sent
        self.feeders: dict[str, str | None] = {}  # in a chain: member -> the member it takes bytes from (None: us)
        self.version: int | None = None  # the version being sent
        self.early: dict[str, Ack] = {}  # its acks that came before step 5 (a receiver that failed or stopped)
        # its members' Ready: the group each still holds (`generation`), the version each can apply a delta to
        self.readies: dict[str, Ready] = {}
        self.contract = ""  # the digest of the quantization contract the version is sent by (versions/quantized.py)
        self.served: dict[str, int] = {}  # receivers of the last version that gathered enough -> that version
        self.missing_since: float | None = None  # too few receivers since then (see the class docstring)
        self.missing_why = ""

    # 1-2 -------------------------------------------------------------------------------------
    async def gather_ready(self, version: int, only: frozenset[str] | None = None) -> list[Peer]:
        """Ask every registered receiver to join `version`; return those that answered in time.

        `only` (a sharded version's other senders): exactly these receivers, the ones the coordinating
        sender gathered; others registered here are not asked, and all of these must answer.

        Waits up to `timeout_s` for at least `min_receivers` (up to `liveness_s` when the rollouts it
        served are gone: see the class docstring); a registered receiver that does not answer within
        `ready_timeout_s` is presumed dead and forgotten (it re-registers if alive). If too few answered,
        every receiver asked gets an `Abort`, so none waits for a plan.
        """
        asked: dict[str, float] = {}
        self.version, self.early, self.members, self.readies = version, {}, [], {}
        self.feeders = {}
        try:
            return await self._gather_ready(version, asked, only)
        except asyncio.CancelledError as exc:  # the trainer is stopping: nobody who answered waits for a plan
            for identity in asked:
                with contextlib.suppress(PeerError):
                    await self.control.send(identity, Abort(version, explain(exc)[:1000]))
            raise

    async def _gather_ready(self, version: int, asked: dict[str, float], only: frozenset[str] | None) -> list[Peer]:
        rnd = _Round(version, asked, only, self.min_receivers if only is None else len(only), self)
        while True:
            now = time.monotonic()
            await self._ask(rnd, now)
            waiting = [i for i in self.control.peers if i not in rnd.ready and (only is None or i in only)]
            if len(rnd.ready) >= rnd.min_receivers and not waiting:
                return self._gathered(rnd)
            if only is not None and now - rnd.started > self.ready_timeout_s:
                await self._give_up(rnd, self._unreachable(rnd))
            give_up_at = self._give_up_at(rnd, now, waiting)
            if now >= rnd.say_at and now < give_up_at:  # a long wait says whom it waits for, long before it ends
                rnd.say_at = now + WAITING_LOG_EVERY_S
                logger.warning(
                    "version %d: waiting %.0fs for trainer.min_receivers=%d ready receivers at %s: %d ready, "
                    "registered %s; gives up in %.0fs (transport.timeout_s); %s",
                    version, now - rnd.started, rnd.min_receivers, self.control.address, len(rnd.ready),
                    sorted(self.control.peers), give_up_at - now, self._what_to_check(),
                )  # fmt: skip
            if now >= give_up_at:
                await self._give_up(rnd, self._too_few(rnd, now, give_up_at))
            await self._take_ready(rnd, min(0.05 if waiting else LIVENESS_POLL_S, max(give_up_at - now, 0.001)))

    async def _ask(self, rnd: _Round, now: float) -> None:
        """Prepare to every registered receiver not asked yet; one asked that has not answered within
        `ready_timeout_s` is presumed dead and forgotten (it re-registers if alive)."""
        control = self.control
        for identity in list(control.peers):
            if rnd.only is not None and identity not in rnd.only:
                continue
            if identity not in rnd.asked:
                try:
                    await control.send(identity, Prepare(rnd.version, self.session))
                    rnd.asked[identity] = now
                except PeerError:  # its connection is gone: not "unreachable", just not there any more
                    control.forget(identity)
            elif identity not in rnd.ready and now - rnd.asked[identity] > self.ready_timeout_s:
                logger.warning(
                    "receiver %s did not answer within transport.ready_timeout_s=%ss; dropping it",
                    identity,
                    self.ready_timeout_s,
                )
                control.forget(identity)
                del rnd.asked[identity]

    def _gathered(self, rnd: _Round) -> list[Peer]:
        """Enough receivers ready and none left waiting: they are the version's members."""
        members = sorted(rnd.ready.values(), key=lambda p: p.identity)
        self.members = [p.identity for p in members]
        if self.missing_since is not None and self.served:
            logger.info("version %d: %d receivers ready again (%s)", rnd.version, len(members), self.members)
        self.served = dict.fromkeys(self.members, rnd.version)
        self.missing_since = None
        return members

    def _unreachable(self, rnd: _Round) -> str:
        """A sharded part's reason: the coordinating sender gathered these receivers, so they are alive; one
        that has not reached this rank by now cannot (the address it was given is not this rank's, as the
        rollouts see it)."""
        missing = sorted((rnd.only or frozenset()) - set(rnd.ready))
        return (
            f"version {rnd.version}: receivers {missing} did not reach this sender at {self.control.address} within "
            f"transport.ready_timeout_s={self.ready_timeout_s}s; transport.sender_host (or "
            "LIGHTNING_WEIGHTSYNC_SENDER_HOST) must be this rank's address as the rollouts see it"
        )

    def _give_up_at(self, rnd: _Round, now: float, waiting: list[str]) -> float:
        """`timeout_s` after the start, or `liveness_s` after the receivers served last were found gone (when
        too few are left even if every registered one answers: the rollouts are gone, not worth timeout_s)."""
        gone = sorted(i for i in self.served if i not in self.control.peers)
        short = len(rnd.ready) + len(waiting) < rnd.min_receivers  # even if every registered one answers
        if short and gone and self.missing_since is None:
            self.missing_since = now
            last = max(self.served[i] for i in gone)
            self.missing_why = f"{', '.join(gone)} (served version {last}) {GONE}"
        if short and self.missing_since is not None:
            return min(rnd.deadline, max(self.missing_since + self.liveness_s, rnd.started + LIVENESS_POLL_S))
        return rnd.deadline

    def _too_few(self, rnd: _Round, now: float, give_up_at: float) -> str:
        """Why the version gives up with too few receivers ready (and, after `timeout_s` with none missing
        before, every later version fails at once until enough gather)."""
        control, ready, version = self.control, len(rnd.ready), rnd.version
        if give_up_at < rnd.deadline:
            return (
                f"version {version}: {ready} of trainer.min_receivers={rnd.min_receivers} receivers ready at "
                f"{control.address} (registered: {sorted(control.peers)}): {self.missing_why}; not waiting "
                f"for it longer than transport.liveness_s={self.liveness_s}s (a rollout that registers again "
                "is served from the next version)"
            )
        if self.missing_since is None:  # from now on, a version without receivers fails at once
            self.missing_since = now
            self.missing_why = f"no receivers since version {version} waited transport.timeout_s"
        return (
            f"version {version}: {ready} of trainer.min_receivers={rnd.min_receivers} receivers ready "
            f"within transport.timeout_s={self.timeout_s}s at {control.address} (registered: "
            f"{sorted(control.peers)}); {self._what_to_check()}"
        )

    def _what_to_check(self) -> str:
        """The fix for too few receivers: the token when connections were refused for it, else a rollout."""
        refused = self.control.refused_handshakes()
        if refused:
            return (
                f"handshakes refused {refused}: set the same transport.auth_token on the trainer and every rollout"
            )
        return (
            "start a rollout daemon pointing at this address (with the same transport.auth_token), or lower "
            "trainer.min_receivers"
        )

    async def _give_up(self, rnd: _Round, reason: str) -> NoReturn:
        """Every receiver asked gets an `Abort`, so none waits for a plan; then the version fails."""
        for identity in rnd.asked:
            with contextlib.suppress(PeerError):
                await self.control.send(identity, Abort(rnd.version, reason[:1000]))
        raise WeightSyncTimeout(reason)

    async def _take_ready(self, rnd: _Round, wait_s: float) -> None:
        """One control message (at most `wait_s`): a Ready for this version from a receiver asked."""
        got = await self.control.recv(wait_s)
        if got is None:
            return
        identity, msg = got
        peers = self.control.peers
        if isinstance(msg, Ready) and msg.version == rnd.version and identity in peers and identity in rnd.asked:
            rnd.ready[identity] = peers[identity]
            self.readies[identity] = msg

    async def wait_registered(self, wait_s: float, exclude: frozenset[str] = frozenset()) -> list[str]:
        """Between versions: read control messages (a registration is taken as it is read, and a Bye) until a
        receiver not in `exclude` is registered or `wait_s` passed; the identities registered then, but those.
        Nothing read here belongs to a version."""
        deadline = time.monotonic() + wait_s
        while not (self.control.peers.keys() - exclude) and (left := deadline - time.monotonic()) > 0:
            await self.control.recv(left)
        return sorted(self.control.peers.keys() - exclude)

    # 3 ---------------------------------------------------------------------------------------
    async def send_plans(
        self,
        version: int,
        peers: list[Peer],
        group: GroupSpec,
        others: list[SenderAddress] | None = None,
        boxes: str = "",
        refused: Mapping[str, str] | None = None,
    ) -> None:
        """Every member's rank (1..N, in the order of `peers`), the group to join, (sharded send mode) the other
        senders of the version, the declaration the group's lane serves (versions/lanes.py), and to a receiver
        whose declaration was refused, why."""
        refused = refused or {}
        for rank, peer in enumerate(peers, start=1):
            if group.relay:  # a chain: whom it takes each bucket from (None: the sender)
                feeder = group.relay[rank]
                self.feeders[peer.identity] = peers[feeder - 1].identity if feeder > 0 else None
            why = refused.get(peer.identity, "")[:1000]
            plan = Plan(version, rank, group, others or [], boxes, why, contract=self.contract)
            await self.control.send(peer.identity, plan)

    async def while_connected(
        self, work: asyncio.Future[T], timeout_s: float, what: str, *, joining: bool = False
    ) -> T:
        """`work` (the group's join, or a broadcast, on the data-plane thread: it completes only with
        every member taking part) for at most `timeout_s`, serving the control socket meanwhile. Every
        `LIVENESS_POLL_S` the members are asked of ZeroMQ; one that is gone raises `PeerError` at once,
        naming it, where the wait would otherwise last until `timeout_s` or the backend's own timeout.
        `joining`: a member that nacked the version (it refused the plan) never joins either: `PeerError` naming
        it and its reason. Raises `asyncio.TimeoutError` after `timeout_s` (the caller names the laggards)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise asyncio.TimeoutError
            try:
                return await self.control.serve_until(work, min(left, LIVENESS_POLL_S))  # type: ignore[no-any-return]
            except asyncio.TimeoutError:
                gone = await self.gone(what)
                if gone is not None:
                    raise gone from None
                refused = await self._failed_early() if joining else {}
                if refused:
                    named = "; ".join(f"receiver {i} failed: {why}" for i, why in refused.items())
                    raise PeerError(f"{what}: {named}") from None

    async def gone(self, what: str) -> PeerError | None:
        """The error naming the members whose connection is gone (None: all there). One that said why before
        it went (a rollout stopping or failing mid-version: its nack) is named with its reason."""
        said = await self._failed_early()  # first: once its connection is found gone, its messages are refused
        gone = [i for i in self.members if not self._took_it(i) and not await self.control.connected(i)]
        if not gone:
            return None
        # a rollout that nacks (or acks) and exits at once: its ack and its disconnect arrive together, and the
        # ack may still be on its way into the sender's queues when the probe finds the connection gone
        said = {**said, **await self._failed_early(NACK_GRACE_S)}
        gone = [i for i in gone if not self._took_it(i)]
        if not gone:
            return None
        named = [f"receiver {i} failed: {said[i]}" if i in said else f"receiver {i} {GONE}" for i in gone]
        return PeerError(f"{what}: " + "; ".join(named))

    def _took_it(self, identity: str) -> bool:
        """It acked this version whole: a rollout that took the last version and shut down at once is not a
        failure of that version (its releases of the last slots are in the data plane's queue already)."""
        ack = self.early.get(identity)
        return ack is not None and ack.ok

    async def _failed_early(self, grace_s: float = 0.0) -> dict[str, str]:
        """The members that nacked this version already, with their reasons (read from what the socket kept
        while streaming). Not a reason to stop on its own: a receiver whose consumer failed nacks, then still
        takes part in the version's broadcasts so that the others get it."""
        deadline = time.monotonic() + grace_s
        while (got := await self.control.recv(max(deadline - time.monotonic(), 0.001))) is not None:
            identity, msg = got
            if isinstance(msg, Ack) and msg.version == self.version and identity in self.members:
                self.early[identity] = msg
        return {i: (a.error or "failed")[:300] for i, a in self.early.items() if not a.ok}

    # 4 ---------------------------------------------------------------------------------------
    async def publish(self, peers: list[Peer], meta: BucketMeta) -> None:
        """A bucket's metadata to every member, ahead of its bytes. A member whose connection is gone is
        named (with the reason it gave, if any), not reported as "unreachable"."""
        try:
            await self.control.send_all([p.identity for p in peers], meta)
        except PeerError as exc:
            gone = await self.gone(f"version {meta.version}: bucket {meta.bucket_index}")
            raise (gone or exc) from None

    # 5 ---------------------------------------------------------------------------------------
    async def collect_acks(self, version: int, peers: list[Peer]) -> dict[str, Ack | None]:
        """Acks for `version` from `peers`; a missing one is None after `timeout_s`.

        A receiver whose connection is gone will never ack: every `LIVENESS_POLL_S` the members still
        missing are asked of ZeroMQ, and one that is gone gets a failed ack naming that at once, instead
        of the trainer waiting out `timeout_s` for a rollout that stopped mid-version."""
        control = self.control
        acks: dict[str, Ack | None] = {p.identity: self.early.get(p.identity) for p in peers}
        told: set[str] = set()  # members behind a failed one in a chain, sent an Abort
        deadline = time.monotonic() + self.timeout_s
        check_at = time.monotonic() + LIVENESS_POLL_S
        while any(a is None for a in acks.values()):
            now = time.monotonic()
            if now >= deadline:
                break
            got = await control.recv(min(deadline - now, max(check_at - now, 0.001)))
            if got is not None:
                identity, msg = got
                if isinstance(msg, Ack) and msg.version == version and identity in acks:
                    acks[identity] = msg
            if time.monotonic() >= check_at:
                check_at = time.monotonic() + LIVENESS_POLL_S
                for identity in [i for i, a in acks.items() if a is None]:
                    if not await control.connected(identity):
                        acks[identity] = Ack(
                            identity,
                            version,
                            False,
                            "disconnected before acking (its process stopped or the link is down)",
                        )
            await self._abort_cut_off(version, acks, told)
        return acks

    def cut_off(self, failed: set[str]) -> dict[str, str]:
        """Chain members behind a failed one (transport.fanout=chain), each with the member its chain is cut at:
        their bytes come through it, so they can never complete the version."""
        out: dict[str, str] = {}
        for identity in self.feeders:
            at = self.feeders.get(identity)
            while at is not None and at not in failed:
                at = self.feeders.get(at)
            if at is not None:
                out[identity] = at
        return out

    async def _abort_cut_off(self, version: int, acks: dict[str, Ack | None], told: set[str]) -> None:
        """An `Abort` to every member still waiting behind a member that failed, once: it would wait for bytes that
        never come (its feeder is alive, its group given up) until transport.timeout_s."""
        failed = {i for i, a in acks.items() if a is not None and not a.ok}
        for identity, at in self.cut_off(failed).items():
            if acks.get(identity) is None and identity not in told:
                told.add(identity)
                why = f"its chain is cut at receiver {at}, which failed"
                with contextlib.suppress(PeerError):
                    await self.control.send(identity, Abort(version, why))

    async def abort(self, version: int, peers: list[Peer], reason: str) -> None:
        """Tell every member to drop `version` (each may be gone already)."""
        for peer in peers:
            with contextlib.suppress(PeerError):
                await self.control.send(peer.identity, Abort(version, reason[:1000]))

    async def laggards(self, version: int, wait_s: float = 0.5) -> str:
        """After a broadcast of `version` failed or timed out: which receivers are behind, from what
        they reported (per-bucket progress, failure acks) and which connections dropped."""
        control = self.control
        failed = {i: a.error or "failed" for i, a in self.early.items() if not a.ok and a.version == version}
        deadline = time.monotonic() + wait_s
        with contextlib.suppress(WeightSyncError):
            while (left := deadline - time.monotonic()) > 0:
                got = await control.recv(left)
                if got is None:
                    break
                identity, msg = got
                if isinstance(msg, Ack) and msg.version == version and not msg.ok:
                    failed[identity] = msg.error or "failed"
        members = self.members
        if not members:
            return "no receivers in the group"
        state: dict[str, str] = {}
        done: dict[str, int] = {}
        for identity in members:
            report = control.progress.get(identity)  # the bucket it reached
            done[identity] = report.bucket_index if report is not None and report.version == version else -1
            if identity in failed:
                state[identity] = f"failed: {failed[identity][:200]}"
            elif not await control.connected(identity):
                state[identity] = "disconnected"
            else:
                state[identity] = "connected"
        lowest = min(done.values())
        # A member ahead of the lowest that failed failed *because* the broadcast was given up (its peer
        # closed the connection): it is reported among the others, never blamed for the stall.
        behind = [i for i in members if done[i] == lowest or state[i] == "disconnected"]

        def where(i: str) -> str:
            return f"{i} ({state[i]}, {'no progress reported' if done[i] < 0 else f'reached bucket {done[i]}'})"

        text = ", ".join(where(i) for i in behind)
        ahead = [i for i in members if i not in behind]
        failed_ahead = [where(i) for i in ahead if state[i] != "connected"]
        others = f"; the others ({len(ahead)}) are further" if ahead else ""
        if failed_ahead:
            others += f", of them {', '.join(failed_ahead)}"
        return f"stalled or dead: {text}{others}"


class ReceiverSteps:
    """A receiver's steps of every version, over its control plane, and the receiver's versions as one state
    machine, so that the rules live here and nowhere else:

        idle --Prepare (new)--> joining --Plan--> in flight --ack (once)--> idle
                 a stale Prepare (this sender session, not above the version in flight or last seen): ignored
                 a newer Prepare or an Abort while joining or in flight: that version is superseded / aborted
                 ack ok of a version received whole: it is `last_complete`; and, when its consumer keeps what it
                 received (`keeps`), the version it holds whole (`held`: the base a delta may be applied to);
                 any other ack, or a consumer stopped mid-version with `keeps`: nothing is held

    The control plane knows none of this: it adopts a sender session through its envelope, and is told the
    last version in each registration."""

    def __init__(self, control: ReceiverControl, identity: str) -> None:
        self.control, self.identity = control, identity
        control.ends_join = (Abort, Prepare)  # the sender gave the group up: the rendezvous wait ends
        self.session: str | None = None  # the sender session of the version in flight or last seen
        self.version: int | None = None  # the version in flight, or the last one seen
        self.last_complete: int | None = None  # the last version received whole
        self.held: int | None = None  # the version the consumer holds whole (the delta base); None: none
        self.keeps = False  # the version in flight's consumer keeps what it receives (`receive_weights(base=)`)
        self.acked = True  # the version in flight got its one ack
        self._answer: Ready | None = None  # the last Ready sent, sent again when the same Prepare comes again

    @property
    def in_flight(self) -> int | None:
        """The version taken part in and not acked yet (one ack is owed for it)."""
        return None if self.acked else self.version

    def is_new(self, prepare: Prepare) -> bool:
        """A Prepare starts a version unless it repeats or precedes this sender session's latest one."""
        return prepare.session != self.session or self.version is None or prepare.version > self.version

    def begin(self, plan: Plan) -> None:
        """The version of `plan` is in flight: it gets exactly one ack from here on."""
        self.session, self.version, self.acked = plan.session, plan.version, False

    def complete(self, version: int) -> None:
        """Every tensor of `version` arrived (and was checked); its ack follows."""
        self.last_complete = version

    def torn(self) -> None:
        """The consumer stopped mid-version: whatever landed in the tensors it keeps is no version to build on."""
        if self.keeps:
            self.held = None

    async def register(self) -> None:
        await self.control.register(-1 if self.last_complete is None else self.last_complete)

    # 1-2 -------------------------------------------------------------------------------------
    async def next_prepare(self, heartbeat_interval_s: float, wait_s: float | None) -> Prepare:
        """The next Prepare that starts a version (stale ones are logged and ignored)."""
        while True:
            prepare = await self.wait_prepare(heartbeat_interval_s, wait_s)
            if self.is_new(prepare):
                return prepare
            logger.warning("ignoring stale Prepare for version %d (have %s)", prepare.version, self.version)

    async def wait_prepare(self, heartbeat_interval_s: float, wait_s: float | None) -> Prepare:
        """Block until the sender starts a version; re-register every heartbeat meanwhile."""
        control = self.control
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while True:
            left = heartbeat_interval_s if deadline is None else min(heartbeat_interval_s, deadline - time.monotonic())
            if left <= 0:
                why = f"; the sender refuses us: {control.refused}" if control.refused else ""
                hint = (
                    " (with transport.auth_token set, a different token on either side fails the handshake silently)"
                    if control.key and not control.refused
                    else ""
                )
                raise WeightSyncTimeout(
                    f"no version started by the sender at {control.address} within {wait_s}s{why}{hint}"
                )
            msg = await control.recv(left)
            if msg is None:
                await self.register()
            elif isinstance(msg, Prepare):
                control.refused = None  # the sender took us in
                return msg
            else:
                logger.debug("ignoring %s while idle", type(msg).__name__)

    async def ready(
        self, prepare: Prepare, generation: int, layout: str = "", boxes: str = "", contract: str = ""
    ) -> None:
        """Answer `prepare`: the group this receiver still holds, the version it can apply a delta to, the
        digest of the bucket layout it holds (protocol/layout.py) and of the boxes it declared (declare.py)."""
        held = -1 if self.held is None else self.held
        self._answer = Ready(self.identity, prepare.version, generation, held, layout, boxes, contract)
        await self.control.send(self._answer)

    # 3 ---------------------------------------------------------------------------------------
    async def wait_plan(self, prepare: Prepare, timeout_s: float, heartbeat_interval_s: float = 2.0) -> Plan:
        """After answering `Ready`: the plan for that version (or a newer `Prepare` supersedes it).

        A sender that waited longer than its `ready_timeout_s` for our answer has forgotten us and drops the
        late `Ready` unread, so silence here re-registers every heartbeat (as when idle): the sender then asks
        again with the same `Prepare`, which gets the same answer, not an abort."""
        deadline = time.monotonic() + timeout_s
        awaited = f"version {prepare.version}: the group plan (transport.timeout_s={timeout_s}s)"
        while True:
            left = deadline - time.monotonic()
            msg = await self.control.recv(min(heartbeat_interval_s, left)) if left > 0 else None
            if msg is None:
                if time.monotonic() >= deadline:
                    raise WeightSyncTimeout(f"{awaited} not received from the sender at {self.control.address} in time")
                await self.register()
                continue
            if isinstance(msg, Plan) and msg.version == prepare.version and msg.session == prepare.session:
                return msg
            if isinstance(msg, Prepare) and (msg.version, msg.session) == (prepare.version, prepare.session):
                if self._answer is not None:  # asked again after it forgot us: the same answer
                    await self.control.send(self._answer)
                continue
            if isinstance(msg, Prepare):
                self.control.stash(msg)
                raise VersionAborted(f"version {prepare.version} superseded by {msg.version} before it started")
            if isinstance(msg, Abort) and msg.version == prepare.version:
                raise VersionAborted(f"version {msg.version} aborted by the sender: {msg.reason}")

    # 4 ---------------------------------------------------------------------------------------
    async def next_bucket(self, version: int, bucket_index: int, timeout_s: float) -> BucketMeta:
        # Progress is reported only when this wait lasts (PROGRESS_AFTER_S): while buckets stream,
        # their metadata is already here and a message per bucket would only compete with the data
        # plane for the CPU; when a broadcast stalls, every healthy receiver waits here and reports,
        # and the stalled one, which cannot, is the one the sender names. The usual case (the metadata is here)
        # arms no timer.
        msg = await self.control.recv(0.0)
        if msg is not None:
            meta = self._bucket_of(msg, version, bucket_index)
            if meta is not None:
                return meta
        report = asyncio.get_running_loop().call_later(
            PROGRESS_AFTER_S, self.control.send_soon, BucketDone(self.identity, version, bucket_index)
        )
        try:
            return await self._next_bucket(version, bucket_index, timeout_s)
        finally:
            report.cancel()

    async def look_ahead(self, version: int, wait_s: float) -> None:
        """While the version's producer waits for a slot: read what the sender sent next (at most `wait_s`), keep
        it for `next_bucket` in order, and end the version on an `Abort` of it or a new version's `Prepare`. So a
        sender's abort behind the metadata of buckets still to come is seen while the consumer waits for a
        broadcast the sender gave up (it would otherwise hold this receiver until transport.timeout_s, past the
        next version's Ready). At most `LOOK_AHEAD` messages are kept; beyond them nothing more is read."""
        if self.control.stashed >= LOOK_AHEAD:
            await asyncio.sleep(wait_s)
            return
        msg = await self.control.recv(wait_s, from_stash=False)
        if msg is None:
            return
        if isinstance(msg, Abort) and msg.version == version:
            raise VersionAborted(f"version {version} aborted by the sender: {msg.reason}")
        self.control.stash(msg)  # `next_bucket` (or the next version's wait) reads it in its turn
        if isinstance(msg, Prepare):
            raise VersionAborted(f"version {version} abandoned: the sender started version {msg.version}")

    async def _next_bucket(self, version: int, bucket_index: int, timeout_s: float) -> BucketMeta:
        deadline = time.monotonic() + timeout_s
        awaited = (
            f"version {version}: bucket {bucket_index} metadata (transport.timeout_s={timeout_s}s; "
            "trainer dead or stalled?)"
        )
        while True:
            # in slices, so that a sender whose connection is gone (its process died between two buckets: no
            # broadcast is pending to fail) is noticed within `liveness_s`, not at the deadline
            msg = await self.control.recv(min(LIVENESS_POLL_S, max(deadline - time.monotonic(), 0.0)))
            if msg is None:
                linked, since = self.control.sender_link()
                if not linked and since >= self.control.liveness_s:
                    raise PeerError(
                        f"version {version}: the sender at {self.control.address} is gone (its connection dropped "
                        f"{since:.1f}s ago, transport.liveness_s={self.control.liveness_s}s) while bucket "
                        f"{bucket_index}'s metadata was awaited"
                    )
                if time.monotonic() >= deadline:
                    raise WeightSyncTimeout(f"{awaited} not received from the sender at {self.control.address} in time")
                continue
            meta = self._bucket_of(msg, version, bucket_index)
            if meta is not None:
                return meta

    def _bucket_of(self, msg: Message, version: int, bucket_index: int) -> BucketMeta | None:
        """`msg` as the metadata awaited, or None for a message that is not about this version's buckets; the
        sender's end of the version (an Abort of it, a new version's Prepare) raises."""
        if isinstance(msg, BucketMeta) and msg.version == version:
            if msg.bucket_index != bucket_index:
                raise ProtocolError(
                    f"version {version}: got bucket {msg.bucket_index}, expected {bucket_index} (lost or reordered)"
                )
            return msg
        if isinstance(msg, Abort) and msg.version == version:
            raise VersionAborted(f"version {version} aborted by the sender: {msg.reason}")
        if isinstance(msg, Prepare):
            self.control.stash(msg)
            raise VersionAborted(f"version {version} abandoned: the sender started version {msg.version}")
        return None

    # 5 ---------------------------------------------------------------------------------------
    def settle(self, version: int, ok: bool) -> bool:
        """The version in flight gets its one ack now (False: it had it already; send nothing). A consumer that
        keeps what it receives holds what it acked whole, and nothing it nacked (its tensors may be torn)."""
        if self.acked:
            return False
        self.acked = True
        if self.keeps:
            self.held = version if ok and self.last_complete == version else None
        return True

    async def ack(self, version: int, ok: bool, error: str | None) -> None:
        """Step 5, once `settle` said so."""
        await self.control.send(Ack(self.identity, version, ok, None if error is None else error[:1000]))


__all__ = ["LIVENESS_POLL_S", "PROGRESS_AFTER_S", "WAITING_LOG_EVERY_S", "ReceiverSteps", "SenderSteps"]
