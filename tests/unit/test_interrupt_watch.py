"""`SyncStopWatch` leaves at once: every sync of the Lightning and Accelerate integrations enters and
leaves one, so a watcher thread that is only noticed at its next poll made each sync block the training
loop for up to `WATCH_POLL_S` (100 ms a step in the GRPO recipe, three times the send itself)."""

from __future__ import annotations

import time

import pytest

from lightning_weightsync.trainer import interrupt
from lightning_weightsync.trainer.interrupt import SyncStopWatch


def test_leaving_the_watch_does_not_wait_for_the_watchers_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(interrupt, "WATCH_POLL_S", 3.0)  # a poll so long that waiting it out is unmistakable
    with SyncStopWatch(rank=0, sync_id=0, on_stop=None) as watch:
        time.sleep(0.05)  # the watcher is in its select by now
        thread = watch._thread
        started = time.perf_counter()
    left_after_s = time.perf_counter() - started  # __exit__ joins the watcher thread
    assert thread is not None and not thread.is_alive()
    assert left_after_s < 1.0, f"leaving the watch took {left_after_s:.2f}s: it waited for the watcher's next poll"
    assert watch.signum == 0


def test_a_watch_held_across_training_records_the_first_signal_and_hands_on_the_second() -> None:
    """`trainer.overlap` holds a watch from a hand-off to the next sync (`OverlapSync._arm_flight`): the
    first SIGTERM is recorded (and stops the background send), not handled mid-step; a second one goes to
    the handler it would have met at once, so a step that never ends cannot hold it back for ever."""
    import os
    import signal

    handled: list[int] = []
    stopped: list[str] = []

    def ours(signum: int, frame: object) -> None:
        handled.append(signum)

    previous = signal.signal(signal.SIGTERM, ours)
    try:
        with SyncStopWatch(rank=0, sync_id="flight-test", on_stop=stopped.append, escalate=True) as watch:
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 5
            while not stopped and time.monotonic() < deadline:
                time.sleep(0.01)
            assert watch.signals == [signal.SIGTERM] and handled == [], (watch.signals, handled)
            assert stopped and "SIGTERM" in stopped[0]  # the background send is told at once
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 5
            while not handled and time.monotonic() < deadline:
                time.sleep(0.01)
            assert handled == [signal.SIGTERM], "the second SIGTERM was held back too"
        assert signal.getsignal(signal.SIGTERM) is ours  # the handler is restored on leaving
    finally:
        signal.signal(signal.SIGTERM, previous)
