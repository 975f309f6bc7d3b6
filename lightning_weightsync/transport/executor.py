"""Blocking work off the event loop, on daemon threads.

Blocking collectives run on a `SerialExecutor`, in order (every rank must issue them in the same
order).
Unlike `ThreadPoolExecutor` / `asyncio.to_thread`, a call stuck in a dead peer's collective or a hung
device cannot keep the process from exiting: the interpreter does not join daemon threads at shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import PeerError

T = TypeVar("T")


Job = tuple[Callable[[], Any], asyncio.AbstractEventLoop, asyncio.Future[Any], bool]


class SerialExecutor:
    """One thread that runs blocking calls in submission order (the data plane's issue order).

    `submit_started(start, ...)` is for calls that only *start* an operation and return a function
    that waits for it (an asynchronous collective): the worker thread issues the next operation at once,
    and a second thread waits for the started ones in order and settles their futures. So several
    transfers are in flight and one's handshake overlaps another's bytes, while the order in which they
    are issued (which every rank must share) stays the submission order.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._started: queue.SimpleQueue[
            tuple[Callable[[], Any], asyncio.AbstractEventLoop, asyncio.Future[Any]] | None
        ]
        self._started = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._waiter = threading.Thread(target=self._wait_started, name=f"{name}-wait", daemon=True)
        self._waiter.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Run `fn(*args)` on the worker thread; the returned future belongs to the running loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._jobs.put((lambda: fn(*args), loop, future, False))
        return future

    def submit_started(self, start: Callable[..., Callable[[], Any] | None], *args: Any) -> asyncio.Future[None]:
        """Run `start(*args)` on the worker thread, in order; the future completes when the function it
        returned (the wait for the started operation) returned, or at once when it returned None."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._jobs.put((lambda: start(*args), loop, future, True))
        return future

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            call, loop, future, started = job
            if not started:
                _call_and_settle(call, loop, future)
                continue
            try:
                wait = call()
            except BaseException as exc:
                _settle_from_thread(loop, future, None, exc)
                continue
            # even an operation complete at once is settled by the waiter, after the ones started before it
            self._started.put((wait if wait is not None else _nothing, loop, future))
            del job, call, wait, loop, future
        self._started.put(None)

    def _wait_started(self) -> None:
        while (item := self._started.get()) is not None:
            wait, loop, future = item
            _call_and_settle(wait, loop, future)
            # the wait holds the collective's Work (and through it the process group): a reference kept
            # in this idle thread's frame would outlive the group and abort the process at exit
            del item, wait, loop, future

    def shutdown(self) -> None:
        """Stop after the job running now. Jobs still queued fail with `PeerError` instead of running:
        after a failure they belong to a group that was given up, and run late on this thread they
        would race the next group's calls on a new thread (a shared socket, a half-built group)."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                _, loop, future, _ = job
                dropped = PeerError("dropped: the data-plane group was given up before this call ran")
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                    loop.call_soon_threadsafe(_settle, future, None, dropped)
        self._jobs.put(None)


def forget(future: asyncio.Future[Any] | None) -> None:
    """Nobody will await `future` (its version was abandoned): consume its outcome when it comes, so
    a failure there is not reported again as "Future exception was never retrieved"."""
    if future is not None:
        future.add_done_callback(lambda f: f.cancelled() or f.exception())


def _call_and_settle(call: Callable[[], Any], loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any]) -> None:
    """Worker-thread side: run `call`, hand its outcome to `future` on its loop (dropped if the loop is gone)."""
    try:
        result, error = call(), None
    except BaseException as exc:
        result, error = None, exc
    _settle_from_thread(loop, future, result, error)


def _settle_from_thread(
    loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], result: Any, error: BaseException | None
) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed (shutting down): nobody waits any more
        loop.call_soon_threadsafe(_settle, future, result, error)


def _nothing() -> None:
    return None


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
