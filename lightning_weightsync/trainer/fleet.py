"""The trainer drives each version through its rollout engines: pause, start, update, finish, resume.

A rollout engine (vLLM, SGLang: `ROLLOUT_ENGINES` in `plugins.py`) is a server whose workers receive our versions
themselves. The sending rank wraps every send in the rollouts' update window, on every rollout at once:

    every rollout:  pause()                                     (generation stops stepping)
                    start_update()                              (the engine's update window opens)
                    update(v)       <- in a thread each, since it returns only when the workers
                                       received the version, i.e. after...
    this process:   sender.send_weights(...)                    <- ...our broadcast, run meanwhile
    every rollout:  finish_update("v")                          (the engine records the version)
                    load_adapter(v)                             (LoRA adapter versions only: serve the adapter
                                                                 directory the workers wrote under its name)
                    after_update(v), verify(v)                  (cache hygiene; the version is held)
                    resume()                                    (always, also after any failure)

So generation runs between versions and is paused only for the transfer. A failing call is named
with its rollout's URL and fails the version (`PeerError`, i.e. `trainer.on_failure` applies); a
rollout whose update failed is not finished (the engine already closed its session), the others are,
and every paused rollout is resumed. What each step is on the wire is the engine's client
(`rollout_engines/<engine>/client.py`, a `RolloutClient`), loaded by path through the table; the trainer never
imports an engine (tests/unit/test_layers.py: `rollout_engines/` is a layer above the trainer's).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, TypeVar

from ..config import WeightSyncConfig
from ..errors import CannotAsk, ConfigError, PeerError
from ..plugins import ROLLOUT_ENGINES, RolloutClient
from ..protocol.messages import LoraSpec
from ..versions.verify import weight_problems

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class RolloutTimings:
    """Seconds each phase of the last version took (the paused window is `paused_s`)."""

    version: int
    paused_s: float = 0.0
    update_s: float = 0.0
    finish_s: float = 0.0


class RolloutFleet:
    """Runs one version's update window on every rollout around the trainer's send.

    Args:
        clients: the rollouts, of any engines (`<engine>.urls` through the registry, or in-process
            clients such as vLLM's `EngineRolloutClient`).
        timeout_s: bound on each step on all rollouts at once (`<engine>.request_timeout_s`, the largest
            of the engines in use), also the bound on waiting for `update` after the send returned.
        receive_timeout_s: how long a worker waits for the version to start (`update_info.timeout_s`;
            `transport.timeout_s` from config), so a send that never starts cannot hold a worker.
        min_receivers: `trainer.min_receivers`; checked before the first version against the workers the
            servers report, so that a version is never applied by some workers of a server and not others.
    """

    def __init__(
        self,
        clients: Sequence[RolloutClient],
        *,
        timeout_s: float = 600.0,
        receive_timeout_s: float | None = None,
        min_receivers: int | None = None,
    ) -> None:
        self.clients = list(clients)
        self.min_receivers = min_receivers
        self.workers: dict[str, int] | None = None  # per server, once asked
        self.receive_timeout_s = receive_timeout_s
        self.timeout_s = timeout_s
        self.last_timings: RolloutTimings | None = None
        self._unasked: set[str] = set()  # rollouts that cannot say which weights they hold (warned once)
        self._pool = ThreadPoolExecutor(max_workers=max(1, 2 * len(self.clients)), thread_name_prefix="rollout-ctl")

    @classmethod
    def from_config(cls, config: WeightSyncConfig) -> RolloutFleet | None:
        """The clients of every registered engine with servers in its section (`vllm.urls`,
        `sglang.urls`, ...); None when there are none. `config` is typed (`config.settings(cfg)`, done by
        the integration's edge); each engine's client module is handed only its own section."""
        clients: list[RolloutClient] = []
        timeouts: list[float] = []
        for engine in ROLLOUT_ENGINES.values():
            section = engine.section(config)
            made = engine.clients(section)
            if made:
                clients += made
                timeouts.append(section.request_timeout_s)
        if not clients:
            return None
        return cls(
            clients,
            timeout_s=max(timeouts),
            receive_timeout_s=config.transport.timeout_s,
            min_receivers=config.trainer.min_receivers,
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _on_all(
        self, clients: Sequence[RolloutClient], what: str, call: Callable[[RolloutClient], Any]
    ) -> tuple[list[RolloutClient], list[str]]:
        """`call` on every client at once; (the clients it succeeded on, one error line per failure)."""
        futures = [(c, self._pool.submit(call, c)) for c in clients]
        ok: list[RolloutClient] = []
        errors: list[str] = []
        deadline = time.monotonic() + self.timeout_s  # one bound for all: they run at once
        for client, future in futures:
            error = _outcome(future, deadline, self.timeout_s, client, what)
            if error is None:
                ok.append(client)
            else:
                errors.append(error)
        return ok, errors

    def pause(self) -> None:
        """Pause every rollout (for a caller whose framework pauses and resumes apart from the send, as TRL's
        `WeightTransferProtocol` does: then `run_version(..., paused=True)` and `resume()`). Raises `PeerError`
        naming each rollout that could not be paused; those that were stay paused until `resume()`."""
        _, errors = self._on_all(self.clients, "pause", lambda c: c.pause())
        if errors:
            raise PeerError("pause failed: " + "; ".join(errors))

    def resume(self) -> None:
        """Resume every rollout; a failure is logged, never raised (it must not mask the version's outcome)."""
        _, errors = self._on_all(self.clients, "resume", lambda c: c.resume())
        for error in errors:
            logger.error("%s (generation stays paused there until /resume succeeds)", error)

    def run_version(
        self, version: int, send: Callable[[], T], *, lora: LoraSpec | None = None, paused: bool = False
    ) -> T:
        """Pause and open an update on every rollout, run `send()` while they receive, finish with
        `weight_version=str(version)`, resume. Raises `PeerError` naming each failed rollout; `send`
        is not called when a rollout could not be paused or started (the caller drains its stream).
        `lora`: the version's LoRA spec (`trainer.lora`); an adapter version is also loaded by every rollout
        after its finish (`load_adapter`), and refused before anything is paused where it cannot be.
        `paused`: the caller paused every rollout (`pause()`) and resumes them (`resume()`) itself."""
        self._check_receivers()
        adapter = lora is not None and lora.mode == "adapter"
        if adapter:
            self._check_adapters(version, lora)
        timings = RolloutTimings(version)
        self.last_timings = timings
        start = time.perf_counter()
        to_resume: list[RolloutClient] = []  # what `_open` paused: resumed below whatever happens
        try:
            started = self._open(version, paused, to_resume)
            t0 = time.perf_counter()
            result, updated = self._send_while_updating(version, started, send)
            timings.update_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            self._close(version, updated, adapter)
            timings.finish_s = time.perf_counter() - t1
            return result
        finally:
            _, resume_errors = self._on_all(to_resume, "resume", lambda c: c.resume())
            timings.paused_s = time.perf_counter() - start
            for error in resume_errors:  # never masks the version's own error; loud, generation is stuck
                logger.error("%s (generation stays paused there until /resume succeeds)", error)

    def _open(self, version: int, paused: bool, to_resume: list[RolloutClient]) -> list[RolloutClient]:
        """Pause every rollout (unless the caller did; those paused here are added to `to_resume`) and open its
        update: the started ones. Raises `PeerError` when any could not, after closing the updates that did open."""
        errors: list[str] = []
        if paused:
            ready = list(self.clients)
        else:
            ready, errors = self._on_all(self.clients, "pause", lambda c: c.pause())
            to_resume.extend(ready)
        started: list[RolloutClient] = []
        if not errors:
            started, errors = self._on_all(ready, "start_update", lambda c: c.start_update())
        if errors:
            self._finish(started, None)  # close the sessions that did open
            raise PeerError(f"version {version} not sent: " + "; ".join(errors))
        return started

    def _send_while_updating(
        self, version: int, started: list[RolloutClient], send: Callable[[], T]
    ) -> tuple[T, list[RolloutClient]]:
        """Run `send()` while every started rollout's `update` waits for the version (a thread each); the
        rollouts that loaded it whole. Raises `PeerError` naming the others."""
        updates = [(c, self._pool.submit(c.update, version, self.receive_timeout_s)) for c in started]
        try:
            result = send()
        except BaseException:
            # the workers fail their receive too; collect, then raise: one bound for all servers, not
            # request_timeout_s for each in turn
            deadline = time.monotonic() + self.timeout_s
            loaded = [c for c, f in updates if _outcome(f, deadline, self.timeout_s, c, "update") is None]
            self._finish(loaded, None)  # an engine that took a broken version closes its session unversioned
            raise
        updated, errors = [], []
        deadline = time.monotonic() + self.timeout_s
        for client, future in updates:
            error = _outcome(future, deadline, self.timeout_s, client, "update")
            if error is None:
                updated.append(client)
            else:
                errors.append(error)
        errors += self._finish(updated, str(version))  # those that loaded it whole hold `version`
        if errors:
            raise PeerError(f"version {version}: " + "; ".join(errors))
        return result, updated

    def _close(self, version: int, updated: list[RolloutClient], adapter: bool) -> None:
        """After the finish: an adapter version loaded, cache hygiene, the version verified on every rollout."""
        if adapter:  # the model is whole again (session closed); the adapter's directory is written
            _, errors = self._on_all(updated, "load_adapter", lambda c: c.load_adapter(version))
            if errors:
                raise PeerError(f"version {version}: " + "; ".join(errors))
        self._on_all(updated, "after_update", lambda c: c.after_update(version))  # logs, never fails
        _, errors = self._on_all(updated, "verify", lambda c: c.verify(version))
        if errors:
            raise PeerError(f"version {version}: " + "; ".join(errors))

    def check_weights(self, version: int, checksums: dict[str, str]) -> list[str]:
        """After `version`: ask every rollout that can say (`weight_reports`: vLLM in process, or over HTTP with
        our worker extension) what each worker holds and compare it with the trainer's fingerprints
        (`SendStats.checksums`); one line per problem, [] when all match. Rollouts that cannot say (`CannotAsk`,
        the default of `RolloutClient.weight_reports`) are skipped, once with a warning that says why."""
        problems: list[str] = []
        for client in self.clients:
            try:
                reports = client.weight_reports()
            except CannotAsk as exc:
                if client.name not in self._unasked:
                    self._unasked.add(client.name)
                    logger.warning("%s", exc)
                continue
            for report in reports:
                problems += weight_problems(client.name, version, report, checksums)
        return problems

    def _check_receivers(self) -> None:
        """Every worker of every server must be in every version: with fewer than all of them required
        (`trainer.min_receivers`), a late worker is left out and its server serves tensor-parallel shards
        of two versions at once. The servers say how many workers they run; asked once."""
        if self.workers is not None or self.min_receivers is None:
            return
        workers: dict[str, int] = {}
        for client in self.clients:
            try:
                n = client.workers()
            except ConfigError:  # a server this path cannot update (SGLang's dp_size > 1): stop here
                self.workers = None
                raise
            except Exception as exc:  # an older server, or dev routes off: say so, do not guess
                logger.warning(
                    "%s rollout %s: cannot tell how many workers it runs (%s)", client.engine, client.name, exc
                )
                n = None
            if n is not None:
                workers[client.name] = n
        self.workers = workers
        total = sum(workers.values())
        if total > self.min_receivers:
            each = ", ".join(f"{name}: {n}" for name, n in workers.items())
            raise ConfigError(
                f"trainer.min_receivers={self.min_receivers}, but the rollout servers run {total} workers ({each}), "
                f"and every worker receives: a version sent to fewer would leave a server with shards of two "
                f"versions; set trainer.min_receivers={total} (tensor x pipeline x data parallel size, summed "
                f"over the servers, plus any other rollouts)"
            )

    def _check_adapters(self, version: int, lora: LoraSpec | None) -> None:
        """An adapter version goes only where every rollout can serve it: checked before anything is paused, as a
        `PeerError` (the caller drains its stream; `trainer.on_failure` applies) naming what to change."""
        problems: list[str] = []
        if lora is not None and lora.base:
            problems.append(
                "it carries the base weights, which a rollout engine already loaded from its checkpoint and an adapter "
                "directory does not hold: set trainer.lora_base=rollout_has"
            )
        for client in self.clients:
            try:
                client.check_adapter()  # `RolloutClient`'s default: this client cannot load adapters
            except ConfigError as exc:
                problems.append(str(exc))
        if problems:
            raise PeerError(f"adapter version {version} (trainer.lora=adapter) not sent: " + "; ".join(problems))

    def _finish(self, clients: list[RolloutClient], weight_version: str | None) -> list[str]:
        if not clients:
            return []
        return self._on_all(clients, "finish_update", lambda c: c.finish_update(weight_version))[1]


def _outcome(future: Future[Any], deadline: float, limit_s: float, client: RolloutClient, what: str) -> str | None:
    """None when `future` succeeded by `deadline` (monotonic), else one line naming the rollout and the call."""
    try:
        future.result(max(deadline - time.monotonic(), 0.0))
        return None
    except FutureTimeout:
        return f"{client.engine} rollout {client.name}: {what} not done within {client.timeout_knob}={limit_s}s"
    except Exception as exc:
        text = str(exc)
        if client.name in text:  # the HTTP client names its URL already
            return text
        return f"{client.engine} rollout {client.name}: {what} failed: {type(exc).__name__}: {text}"


__all__ = ["RolloutClient", "RolloutFleet", "RolloutTimings"]
