"""The one multi-process test helper: free ports, spawned workers, timeouts, cleanup.

Every multi-process test goes through here so that no test binds a fixed port, waits forever,
or leaves a process behind when it fails.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue as queue_mod
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from lightning_weightsync.transport.process import free_port as free_port  # re-exported for the tests
from lightning_weightsync.transport.process import process_group

DEFAULT_TIMEOUT_S = 120.0
LOAD_SLACK_S = 15.0
"""What a loaded 2-core CI machine may add to any bounded wait (scheduling, imports, GC pauses).
Timing checks here prove *bounded by the configured knob*, never speed: `elapsed < knob_s +
LOAD_SLACK_S` for "fails within the knob", and a knob set far above the slack (e.g. `timeout_s=60`,
checked `< timeout_s / 2`) for "noticed at once, not by waiting for the knob"."""


START_METHOD = os.environ.get("LWS_TEST_START_METHOD", "forkserver")
"""How workers start. `forkserver` (the default): forked from one server process per test session that has
already imported torch and the package (a spawned Python spends 2-3 s, far more on a loaded machine, importing
torch before it runs a line of the test); each worker still gets the test's environment, working directory
and (captured) stdout/stderr, as a spawned one would. `spawn`: a fresh interpreter, for a test whose workers
need something only a new process reads (e.g. a glibc `MALLOC_*` variable): `start_method="spawn"`, or
LWS_TEST_START_METHOD=spawn for a whole run."""
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "zmq", "lightning_weightsync"]


def context(start_method: str | None = None) -> Any:
    """The multiprocessing context workers start from (see START_METHOD)."""
    method = start_method or START_METHOD
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # read when the server starts: once a session
    return ctx


def _attach(out: Any, err: Any, env: dict[str, str]) -> None:
    """In the child: the parent's stdout/stderr (what pytest captures for this test) and environment."""
    for fd, target in ((out.detach(), 1), (err.detach(), 2)):
        if fd != target:  # spawn passes the descriptor itself; the forkserver a copy
            os.dup2(fd, target)
            os.close(fd)
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)


class _ParentSide:
    """Pickled into a worker's arguments; unpickling it there attaches the worker to the parent's current
    stdio and environment (a forkserver child otherwise has the server's, from whenever it started)."""

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing.reduction import DupFd

        sys.stdout.flush()
        sys.stderr.flush()
        return (_attach, (DupFd(1), DupFd(2), dict(os.environ)))


def _child(setup: Any, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    return fn(*args)


def _trampoline(setup: Any, fn: Callable[..., Any], args: tuple[Any, ...], queue: Any, index: int) -> None:
    try:
        result = fn(*args)
        queue.put((index, True, result))
    except BaseException:
        queue.put((index, False, traceback.format_exc()))
        raise SystemExit(1) from None


class WorkerFailed(AssertionError):
    pass


def run_workers(
    fn: Callable[..., Any],
    args_per_worker: Sequence[tuple[Any, ...]],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    doomed: Sequence[int] = (),
    exit_codes: list[int | None] | None = None,
    start_method: str | None = None,
) -> list[Any]:
    """Run `fn(*args)` in one worker process per args tuple (see START_METHOD); return their results in order.

    `fn` must be importable (module level). Any worker exception or a timeout fails the test with
    the worker's traceback, and every worker is killed before returning. Workers listed in
    `doomed` are expected to die (fault-injection tests): nobody waits for their result (None);
    `exit_codes`, if given, receives every worker's exit code.
    """
    ctx = context(start_method)
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_trampoline, args=(_ParentSide(), fn, a, queue, i), daemon=True)
        for i, a in enumerate(args_per_worker)
    ]
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    grace_until: float | None = None  # a dead worker's traceback may still be in the queue
    try:
        for p in procs:
            p.start()
        wanted = len(procs) - len(set(doomed))
        while len([i for i in results if i not in doomed]) < wanted:
            now = time.monotonic()
            if now > deadline:
                raise WorkerFailed(f"workers timed out after {timeout_s}s; finished: {sorted(results)}")
            if grace_until is not None and now > grace_until:
                codes = {i: p.exitcode for i, p in enumerate(procs) if i not in results}
                raise WorkerFailed(f"worker(s) died without a report; exit codes {codes}")
            try:
                index, ok, value = queue.get(timeout=0.5)
            except queue_mod.Empty:
                died = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in doomed]
                if grace_until is None and died:
                    grace_until = time.monotonic() + 3.0
                continue
            if not ok:
                raise WorkerFailed(f"worker {index} failed:\n{value}")
            results[index] = value
        return [results.get(i) for i in range(len(procs))]
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if exit_codes is not None:
            exit_codes[:] = [p.exitcode for p in procs]
        queue.close()


@contextlib.contextmanager
def spawned(fn: Callable[..., Any], *args: Any, start_method: str | None = None) -> Iterator[mp.process.BaseProcess]:
    """A background worker process (see START_METHOD) that is always killed when the block exits."""
    ctx = context(start_method)
    proc = ctx.Process(target=_child, args=(_ParentSide(), fn, args), daemon=True)
    proc.start()
    try:
        yield proc
    finally:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


@contextlib.contextmanager
def popen(cmd: Sequence[str], *, env: dict[str, str] | None = None, **kwargs: Any) -> Iterator[subprocess.Popen[str]]:
    """A subprocess (e.g. the CLI) in its own process group, killed with its children on exit."""
    kwargs.setdefault("stdout", subprocess.PIPE)
    kwargs.setdefault("stderr", subprocess.STDOUT)
    with process_group(cmd, env=env, text=True, **kwargs) as proc:
        yield proc


def output_of(proc: subprocess.Popen[str], timeout_s: float, what: str) -> str:
    """All of `proc`'s output once it exits; if it runs past `timeout_s`, kill it and fail naming `what`
    with the tail of what it printed (the one way every test waits for a subprocess)."""
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except Exception:
        proc.kill()
        out, _ = proc.communicate(timeout=10)
        raise AssertionError(f"{what} did not finish in {timeout_s}s:\n{(out or '')[-4000:]}") from None
    return out or ""


PYTHON = sys.executable
