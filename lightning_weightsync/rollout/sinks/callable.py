"""`rollout.sink.type=callable`: hand each version to your function.

`rollout.sink.target: package.module:function` is called as `function(version, tensors)` where
`tensors` iterates `(name, tensor)` pairs of that version, in stream order.

- `atomic`: the function is called once the version is complete, over tensors already received
  (the version is held in memory for that; it never sees a version that broke).
- `streaming`: the function runs in its own thread while the version arrives and pulls tensors as
  they are merged (one or two in memory). If the version breaks mid-way, the iterator raises
  `VersionAborted` inside the function; if the function raises, the daemon reports it and the
  version is not acknowledged as applied. A function that stops reading (blocked in its own code)
  fails the version after `transport.timeout_s` instead of stalling the daemon; it is then told of
  the abort and, if it still does not read, abandoned (its thread is a daemon thread).

Tensors handed over are the function's to keep: they do not alias any receive buffer.

Tied weights: a tensor the trainer sends once for several names (`begin(version, tied=...)`) is
handed over under each of its names, right after one another, as the same tensor object, so the
function sees every name its model has (`lm_head.weight` and `model.embed_tokens.weight`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ...config import ApplyMode, UserConfig
from ...errors import SinkError, VersionAborted, explain
from ...protocol.chunks import TensorMeta
from .base import Sink, SinkSettings, SinkState, load_callable
from .config import CallableSinkSection, SinkSection

logger = logging.getLogger(__name__)

_END = object()
_POLL_S = 0.1
ABORT_JOIN_TIMEOUT_S = 10.0


class _Abort:
    def __init__(self, reason: str) -> None:
        self.reason = reason


class CallableSink(Sink):
    """Calls `rollout.sink.target(version, iterator of (name, tensor))` once per version."""

    takes_lora = False  # adapter versions are refused (consume.begin_version); merged / full are plain weights

    blocking_io = True

    kind = "callable"

    def __init__(
        self,
        cfg: UserConfig | SinkSettings | SinkSection = None,
        fn: Callable[[int, Iterator[tuple[str, torch.Tensor]]], Any] | None = None,
    ):
        super().__init__(cfg)
        own = self.settings.section
        assert isinstance(own, CallableSinkSection)
        self.target = str(own.target) if fn is None else getattr(fn, "__qualname__", repr(fn))
        self.fn = fn if fn is not None else load_callable(own.target, "rollout.sink.target")
        self._held: list[tuple[str, torch.Tensor]] = []
        self._queue: queue.Queue[object] | None = None
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._consumed_any = False
        self.put_timeout_s = self.settings.timeout_s

    # --- streaming plumbing ---------------------------------------------------------------------
    def _iterate(self) -> Iterator[tuple[str, torch.Tensor]]:
        assert self._queue is not None
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if isinstance(item, _Abort):
                raise VersionAborted(item.reason)
            self._consumed_any = True
            yield item  # type: ignore[misc]

    def _run(self, version: int) -> None:
        try:
            self.fn(version, self._iterate())
        except BaseException as exc:  # reported by commit()/abort(), in the daemon's thread
            self._error = exc
        finally:
            self._done.set()

    def _offer(self, item: object, deadline: float) -> str:
        """Queue `item` for the function: "put", "done" (the function returned or raised: it reads
        nothing more) or "timeout" (still running, but not reading by `deadline`)."""
        assert self._queue is not None
        while not self._done.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return "put"
            except queue.Full:
                if time.monotonic() >= deadline:
                    return "timeout"
        return "done"

    def _put(self, item: object) -> None:
        """Hand the function its next item. Bounded by `transport.timeout_s`: a function that stops
        reading its iterator (stuck in user code) fails the version instead of stalling the daemon
        forever (the sender would time out on us anyway, and the next version must still land)."""
        outcome = self._offer(item, time.monotonic() + self.put_timeout_s)
        if outcome == "done":
            raise self._failure("returned before the version ended")
        if outcome == "timeout":
            raise SinkError(
                f"rollout.sink.target={self.target!r} did not read its next tensor within "
                f"transport.timeout_s={self.put_timeout_s}s (is it blocked?)"
            )

    def _failure(self, what: str) -> SinkError:
        if self._error is not None and not isinstance(self._error, VersionAborted):
            return SinkError(f"rollout.sink.target={self.target!r} raised {type(self._error).__name__}: {self._error}")
        return SinkError(f"rollout.sink.target={self.target!r} {what}")

    # --- Sink -----------------------------------------------------------------------------------
    def _begin(self, version: int) -> None:
        self._held = []
        self._error = None
        self._consumed_any = False
        if self.apply is ApplyMode.streaming:
            self._queue = queue.Queue(maxsize=1)
            self._done = threading.Event()
            self._thread = threading.Thread(target=self._run, args=(version,), name=f"sink-v{version}", daemon=True)
            self._thread.start()

    def _destination(self, meta: TensorMeta) -> torch.Tensor | None:
        return None  # merge allocates a fresh tensor that the function may keep

    def _accept(self, name: str, tensor: torch.Tensor) -> None:
        for each in (name, *self.tied.get(name, ())):
            if self.apply is ApplyMode.streaming:
                self._put((each, tensor))
            else:
                self._held.append((each, tensor))

    def _commit(self, version: int) -> None:
        if self.apply is ApplyMode.streaming:
            self._put(_END)
            assert self._thread is not None
            self._thread.join()
            self._thread = None
            if self._error is not None:
                raise self._failure("failed")
            return
        held, self._held = self._held, []
        try:
            self.fn(version, iter(held))
        except Exception as exc:
            raise SinkError(f"rollout.sink.target={self.target!r} raised {explain(exc)}") from exc

    def _after_failed_commit(self, version: int) -> None:
        self._held = []
        # atomic: the function saw the whole version and failed on its own; streaming: it saw part
        if self.apply is ApplyMode.streaming:
            self.state = SinkState.INCOMPLETE

    def _abort(self, version: int, reason: str) -> bool:
        self._held = []
        if self.apply is not ApplyMode.streaming or self._thread is None:
            return False
        # Tell a function still reading its iterator; one that already returned or raised (often why
        # the version is aborted) reads nothing more, so do not wait on its full queue.
        deadline = time.monotonic() + ABORT_JOIN_TIMEOUT_S
        if self._offer(_Abort(reason), deadline) == "timeout":
            logger.warning("rollout.sink.target=%r does not consume its iterator; abandoning it", self.target)
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self._thread = None
        return self._consumed_any

    def close(self) -> None:
        if self.in_flight is not None:
            self.abort(self.in_flight, "sink closed")
