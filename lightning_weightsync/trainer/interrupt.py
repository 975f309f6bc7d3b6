"""A SIGTERM or SIGINT on any trainer rank during a sync ends that sync on every rank within seconds; the
signal is then handled as if it had come right after the sync.

Why not let it through: a signal's handler runs between two bytecodes of the main thread, wherever that
is. Lightning's SIGTERM handler runs a `dist.broadcast`: run mid-sync on rank 0 (inside the sender's
event loop) while rank 1 sits in an FSDP all-gather, the two ranks wait in different collectives for
ever. And a rank blocked inside a collective runs no Python handler at all, so the one rank that could
end the sync, the sender waiting on the network, would never hear of a signal that hit another rank.

What `SyncStopWatch` does around one sync, on every rank (main thread only; elsewhere it does nothing):

1. SIGTERM and SIGINT get a handler that only records the signal, and `signal.set_wakeup_fd` makes the
   C-level handler also write the signal to a socket a watcher thread reads: the signal is seen at once,
   even while this rank's main thread is inside a collective.
2. The watcher publishes it in the default process group's store (every rank already shares it; never
   through the group itself, whose collectives are what may be stuck). The sending rank's watcher polls
   that key and, when any rank (itself included) was signalled, interrupts the send: the version is
   aborted to the receivers and the sender drains its gather, so the other ranks' all-gathers complete
   and every rank reaches the driver's agreement all-reduce.
3. The agreement carries the signal number (`SyncDriver`): every rank knows the sync was stopped and by
   what. The previous handlers are restored, and the driver hands the signal on (`deliver`): by default
   each rank raises it on itself, so it meets the handler it would have met (the default action, the
   `KeyboardInterrupt` of SIGINT, yours), on every rank alike; the Lightning callback instead sets
   Lightning's own SIGTERM flag on every rank, which its loop turns into a clean `SIGTERMException`.
"""

from __future__ import annotations

import contextlib
import logging
import select
import signal
import socket
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch.distributed as dist
from torch.distributed.distributed_c10d import Store

logger = logging.getLogger(__name__)

STOP_SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGINT", None)) if s is not None)
WATCH_POLL_S = 0.1  # how often the sending rank's watcher reads the store for another rank's signal
STORE_KEY = "lightning_weightsync/stop/{sync}"


def default_store() -> Store | None:
    """The default process group's store (the rendezvous every rank shares), or None without one."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # pragma: no cover - a torch without it: signals then reach the sender only on rank 0
        return None


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class SyncStopWatch:
    """Within `with SyncStopWatch(...) as watch:` SIGTERM / SIGINT are recorded, not handled (see the
    module docstring); `watch.signum` is the first one this rank received (0: none).

    Args:
        rank: this process's global rank (named in the store and in the messages).
        sync_id: the same on every rank for the same sync (the driver counts its syncs).
        on_stop: on the sending rank, called once, from any thread, with a reason, when any rank was
            signalled (`BlockingWeightSender.interrupt`); None elsewhere.
        escalate: a second signal of a kind already recorded goes on to the handler it would have met, at
            once (for a watch held across training, `trainer/overlap.py`: a step that never ends must not
            hold a user's second Ctrl-C back for ever).
    """

    def __init__(
        self, *, rank: int, sync_id: int | str, on_stop: Callable[[str], None] | None, escalate: bool = False
    ) -> None:
        self.rank, self.on_stop, self.escalate = rank, on_stop, escalate
        self._recorded: dict[int, int] = {}  # how often the Python-level handler ran, per signal
        self.key = STORE_KEY.format(sync=sync_id)
        self.signum = 0  # this rank's first signal
        self.signals: list[int] = []  # every distinct stop signal this rank received, in order
        self.learned: tuple[int, int] | None = None  # (signal, rank) another rank published (sending rank)
        self._stopped = False  # on_stop was called
        self._lock = threading.Lock()
        self._previous: dict[int, Any] = {}
        self._wakeup_old: int | None = None
        self._sockets: tuple[socket.socket, socket.socket] | None = None
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._store: Store | None = None

    # -- life cycle -------------------------------------------------------------------------------------
    def __enter__(self) -> SyncStopWatch:
        if threading.current_thread() is not threading.main_thread() or not STOP_SIGNALS:
            return self  # signals are only ever handled in the main thread: nothing to guard here
        self._store = default_store()
        reader, writer = socket.socketpair()
        reader.setblocking(False)
        writer.setblocking(False)
        self._sockets = (reader, writer)
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._record)
        self._wakeup_old = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name="weightsync-stop-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._sockets is None:
            return
        self._done.set()
        with contextlib.suppress(OSError):  # wake the watcher now: else every sync waits out its select (WATCH_POLL_S)
            self._sockets[1].send(b"\0")  # 0 is no signal: the watcher reads it, sees _done and returns
        if self._thread is not None:
            self._thread.join(timeout=5)
        signal.set_wakeup_fd(self._wakeup_old if self._wakeup_old is not None else -1)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        for sock in self._sockets:
            sock.close()
        self._sockets = None

    # -- seeing a signal ----------------------------------------------------------------------------------
    def _record(self, signum: int, frame: FrameType | None) -> None:
        """The Python-level handler (main thread, between bytecodes): the watcher thread sees the same
        signal through the wakeup socket; whichever comes first notes it."""
        self._recorded[signum] = self._recorded.get(signum, 0) + 1
        if self.escalate and self._recorded[signum] > 1:
            self._hand_on(signum, frame)
            return
        self.note(signum)

    def _hand_on(self, signum: int, frame: FrameType | None) -> None:
        """`signum` to the handler it would have met without this watch, now."""
        previous = self._previous.get(signum)
        logger.warning("global rank %d: %s again: handled now", self.rank, signal_name(signum))
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    def note(self, signum: int) -> None:
        """Record `signum` as this rank's (also: a signal a watch held across training carried into a sync)."""
        with self._lock:
            if signum in self.signals:
                return
            self.signals.append(signum)
            first = not self.signum
            if first:
                self.signum = signum
        if not first:
            return
        logger.warning(
            "global rank %d: %s during a weight sync: ending the sync on every rank first, then handling it",
            self.rank,
            signal_name(signum),
        )
        if self._store is not None:
            with contextlib.suppress(Exception):  # the store is the only way to the sender: best effort
                self._store.set(self.key, f"{self.rank}:{signum}")
        self._stop(f"stopped by {signal_name(signum)} on global rank {self.rank}")

    def _stop(self, reason: str) -> None:
        with self._lock:
            if self._stopped or self.on_stop is None:
                return
            self._stopped = True
        self.on_stop(reason)

    def _watch(self) -> None:
        assert self._sockets is not None
        reader = self._sockets[0]
        while not self._done.is_set():
            readable, _, _ = select.select([reader], [], [], WATCH_POLL_S)
            if readable:
                with contextlib.suppress(BlockingIOError, OSError):
                    for signum in reader.recv(64):
                        if signum in STOP_SIGNALS:
                            self.note(signum)
            if self.on_stop is not None and not self._stopped and self._store is not None:
                self._poll_store()

    def _poll_store(self) -> None:
        """Another rank's signal, as it published it (the sending rank only)."""
        assert self._store is not None
        try:
            if not self._store.check([self.key]):
                return
            who, _, signum = self._store.get(self.key).decode().partition(":")
            learned = (int(signum), int(who))
        except Exception:  # a store that went away, or garbage: the agreement still tells every rank
            return
        with self._lock:
            if self.learned is None:
                self.learned = learned
        self._stop(f"stopped by {signal_name(learned[0])} on global rank {learned[1]}")

    def seen(self) -> tuple[int, int]:
        """(signal, global rank + 1) to contribute to the agreement, (0, 0) for none: this rank's own
        signal, else (sending rank) one another rank published. A rank already waiting in the agreement
        when its signal came contributed none; the sending rank, which ends the sync, contributes it."""
        if self.signum:
            return self.signum, self.rank + 1
        if self.on_stop is not None and self._store is not None:
            self._poll_store()
        with self._lock:
            return (self.learned[0], self.learned[1] + 1) if self.learned is not None else (0, 0)

    # -- after the agreement ----------------------------------------------------------------------------
    def late(self, agreed: int) -> list[int]:
        """Signals this rank received that the agreement (`agreed`: the signal every rank now knows of)
        does not cover: they arrived after this rank had contributed; handled here alone."""
        return [s for s in self.signals if s != agreed]


def raise_signal(signum: int) -> None:
    """Deliver `signum` to this process as if it had just arrived: to whatever handler is installed now."""
    signal.raise_signal(signum)
