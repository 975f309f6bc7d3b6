"""One version from the receiver into a sink: the receive loop every rollout runs, written once.

    begin(version, tied) -> (destination(meta), accept(name, tensor))* -> commit(version) -> ack(ok)

- A sink that cannot take a tensor (`SinkError` from begin, destination, accept or commit) does not
  stop the receive: the rest of the version is received and dropped so the sender and the other
  receivers stay in step, then the version is aborted, nacked with the reason (the trainer's error
  names it) and the `SinkError` raised.
- A receive that fails (timeout, abort, a dead or bad peer: `WeightSyncError`) aborts the sink's
  version and propagates; the receiver has nacked it already.
- A sink's environmental failure (an `OSError`: ENOSPC, EACCES, EIO, ...) is a `SinkError` like any
  other: the version fails, the trainer is told why, the rollout keeps serving and the next version
  retries (a full disk must not end the daemon with a traceback).
- Cancellation (a daemon stopping) before the commit aborts the version, nacks it with the reason (so
  the trainer hears it from the rollout, not from a broken connection) and propagates. A commit that has
  started is never cancelled: it finishes (a renamed file, a copied module cannot be taken back half-way),
  the version is acked and its record returned as applied, and the caller, which asked to stop, stops.
  Commit and abort therefore never run at once, and what the log says is what the sink holds.

The rollout daemon runs it with its `Sink` (`daemon.py`), vLLM's engine with a sink that loads into
the model on vLLM's worker thread (`vllm/worker.py`). Where a sink method runs is the caller's
`call`: inline, in a thread for blocking sinks, or handed to the thread that owns the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import torch

from ..errors import SinkError, WeightSyncError, explain
from ..protocol.chunks import TensorMeta
from ..protocol.messages import LoraSpec
from ..versions.receiver import WeightReceiver
from .observability import VersionRecord
from .sinks.base import VersionSink

logger = logging.getLogger(__name__)

Call = Callable[..., Awaitable[Any]]
"""`await call(fn, *args)` runs the sink method `fn(*args)` where it must run and returns its result."""


async def call_inline(fn: Callable[..., Any], *args: Any) -> Any:
    """The `call` for sinks whose methods are quick and may run on the event loop."""
    return fn(*args)


class _Version:
    """The version in flight into `sink`: begun at its first tensor (or its end), and the `SinkError` that
    failed it, if any (the rest is then received and dropped, so the group stays in step)."""

    def __init__(self, receiver: WeightReceiver, sink: VersionSink) -> None:
        self.receiver, self.sink = receiver, sink
        self.version: int | None = None
        self.began = False
        self.failed: SinkError | None = None
        self.num_chunked_tensors = 0

    def begin(self) -> None:
        if self.began:
            return
        assert self.receiver.version is not None  # the stream set it (wait_version) before a tensor or its end
        self.version = int(self.receiver.version)
        self.began = True
        try:  # bucket 0 (tied names, LoRA spec) is here
            begin_version(self.sink, self.version, self.receiver.tied, self.receiver.lora)
        except (SinkError, OSError) as exc:
            self.failed = sink_failure(exc, "begin", self.version)

    def destination(self, meta: TensorMeta) -> torch.Tensor | None:
        """Where the receiver merges `meta`'s bytes (`into=`): the sink's say, or None once the version failed."""
        self.begin()
        if meta.chunk_size < meta.nbytes:
            self.num_chunked_tensors += 1
        if self.failed is not None:
            return None  # keep receiving, drop it: the group must stay in step
        try:
            return self.sink.destination(meta)
        except (SinkError, OSError) as exc:
            self.failed = sink_failure(exc, f"a destination for {meta.name!r}", self.version)
            return None


async def consume_version(
    receiver: WeightReceiver,
    sink: VersionSink,
    *,
    call: Call = call_inline,
    wait_s: float | None = None,
    claim_base: bool = True,
) -> VersionRecord:
    """Receive the next version into `sink` and ack it; returns its record (raises on failure).

    `wait_s` bounds the wait for the version to start (None: `transport.timeout_s`). `claim_base` False: claim no
    delta base, so the version comes whole (the sink holds a version it did not take from this sender).
    """
    v = _Version(receiver, sink)
    # a sink that holds its tensors (module) takes deltas onto the version it holds; others get whole tensors
    deltas = sink.holds_tensors and claim_base
    receiver.delta_base = sink.delta_version if deltas else None
    base = sink.held if deltas else None
    stream = receiver.receive_weights(into=v.destination, auto_ack=False, wait_s=wait_s, base=base)
    try:
        await _receive_into(stream, v, call)
        v.begin()  # a version with no tensors still begins and commits
        if v.failed is not None:
            raise v.failed
        commit_s = await _commit(v, call)
    except BaseException as exc:
        await _fail(v, exc)
        raise
    await receiver.ack(ok=True)  # applied: acked and returned even when cancelled meanwhile (the caller stops)
    return _record(v, commit_s)


async def _receive_into(stream: AsyncGenerator[tuple[str, torch.Tensor], None], v: _Version, call: Call) -> None:
    """Every tensor of the version to the sink's `accept` (dropped once the version failed): a receive that
    fails propagates as it is; a bug in the consumer drains the stream first (the group stays in step)."""
    try:
        async for name, tensor in stream:
            if v.failed is None:
                try:
                    await call(v.sink.accept, name, tensor)
                except (SinkError, OSError) as exc:
                    v.failed = sink_failure(exc, f"{name!r}", v.version)
            del tensor  # the consumer's reference: memory is bounded by what the receiver holds
    except (WeightSyncError, asyncio.CancelledError):
        raise
    except BaseException:
        await stream.aclose()  # a bug in the consumer: take part in the rest, then propagate
        raise


async def _commit(v: _Version, call: Call) -> float:
    """Commit the version; seconds it took. The point of no return: a stop (cancellation) waits for a commit
    under way, and the version is then acked as applied (see the module docstring)."""
    assert v.version is not None
    start = time.perf_counter()
    commit = asyncio.ensure_future(call(v.sink.commit, v.version))
    stopping = False
    while not commit.done():
        try:
            await asyncio.shield(commit)
        except asyncio.CancelledError:
            if not stopping:
                logger.info("version %d: stopping once its commit, already under way, is done", v.version)
            stopping = True
    try:
        commit.result()
    except OSError as exc:
        raise sink_failure(exc, "commit", v.version) from exc
    return time.perf_counter() - start


async def _fail(v: _Version, exc: BaseException) -> None:
    """The version failed with `exc`: the sink drops it, and a sink failure or a stop is nacked with its reason
    (the trainer hears it from the rollout), once, while the version is still in flight."""
    if v.began and v.version is not None:
        v.sink.abort(v.version, explain(exc))
    if v.receiver.version is not None and isinstance(exc, (SinkError, asyncio.CancelledError)):
        reason = f"SinkError: {exc}" if isinstance(exc, SinkError) else f"rollout stopped mid-version: {exc}"
        with contextlib.suppress(WeightSyncError):
            await v.receiver.ack(ok=False, error=reason[:1000])


def _record(v: _Version, commit_s: float) -> VersionRecord:
    stats = v.receiver.last_stats
    assert stats is not None and v.version is not None  # set by the complete receive
    seconds = float(stats.seconds) + commit_s
    nbytes = int(stats.nbytes)
    return VersionRecord(
        version=v.version,
        ok=True,
        nbytes=nbytes,
        num_tensors=int(stats.num_tensors),
        num_buckets=int(stats.num_buckets),
        num_chunked_tensors=v.num_chunked_tensors,
        seconds=seconds,
        bytes_per_second=nbytes / seconds if seconds > 0 else 0.0,
        verified=int(stats.verified),
    )


def begin_version(sink: VersionSink, version: int, tied: Mapping[str, Sequence[str]], lora: LoraSpec | None) -> None:
    """`sink.begin`, with the version's LoRA spec for a sink that takes one (`takes_lora`). An adapter version
    (`trainer.lora=adapter`) into a sink that does not is refused here, before anything is applied; merged and
    full versions are plain weights under the base model's names, which every sink takes."""
    if lora is not None and sink.takes_lora:
        sink.begin(version, tied=tied, lora=lora)
        return
    if lora is not None and lora.mode == "adapter":
        raise SinkError(
            f"version {version} is a LoRA adapter (trainer.lora=adapter), which {type(sink).__name__} cannot load; "
            "set trainer.lora=merged (or full) on the trainer, or use the module or safetensors sink"
        )
    sink.begin(version, tied=tied)


def sink_failure(exc: SinkError | OSError, what: str, version: int | None) -> SinkError:
    """`exc` as the `SinkError` that fails this version: an `OSError` (a full disk, a permission, an I/O
    error) is the environment's, not a bug; it names the errno, the file and what was being done."""
    if isinstance(exc, SinkError):
        return exc
    code = errno.errorcode.get(exc.errno or 0, "OSError")
    where = f" ({exc.filename})" if exc.filename else ""
    failure = SinkError(
        f"{code}: {exc.strerror or exc}{where} while the sink took {what} of version {version}; the version is "
        "dropped and the next one retries (free space / fix permissions on the sink's target)"
    )
    failure.__cause__ = exc
    return failure


__all__ = ["Call", "VersionSink", "begin_version", "call_inline", "consume_version", "sink_failure"]
