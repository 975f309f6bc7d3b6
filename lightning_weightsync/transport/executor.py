"""A one-thread executor whose thread is a daemon.

Blocking collectives run here, in order (every rank must issue them in the same order). Unlike
`ThreadPoolExecutor`, a call stuck in a dead peer's collective cannot keep the process from
exiting: the interpreter does not join daemon threads at shutdown.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class SerialExecutor:
    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.AbstractEventLoop, asyncio.Future[Any]] | None]
        self._jobs = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Run `fn(*args)` on the worker thread; the returned future belongs to the running loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._jobs.put((lambda: fn(*args), loop, future))
        return future

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            call, loop, future = job
            try:
                result, error = call(), None
            except BaseException as exc:
                result, error = None, exc
            if not loop.is_closed():
                loop.call_soon_threadsafe(_settle, future, result, error)

    def shutdown(self) -> None:
        self._jobs.put(None)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
