"""Our checkpoint engine driven by verl 0.9.1's REAL code, on CPU over gloo (`./dev verl-contract`).

What is verl's own here: `CheckpointEngineConfig` (verl/workers/config/rollout.py:125-141), the manager
`CheckpointEngineManager` (verl/checkpoint_engine/base.py:380-562: `__init__` importing `custom_backend_module`
with `import_external_libs` and asking `CheckpointEngineRegistry.get`, `build_process_group`, `update_weights`
with its steps, order, length checks and metrics merge), the registry and the base class our engine subclasses,
`import_external_libs` and `CheckpointEngineRegistry.new` in every worker, and on the rollout ranks verl's own
`CheckpointEngineWorker.update_weights` / `execute_checkpoint_engine`. What is not: Ray. The manager's two Ray
names, `RayWorkerGroup` and `ray.get`, are replaced by process-backed worker groups (tests/support/verl_workers.py:
spawned processes over pipes), and the replicas are ours (no inference server: their abort / KV-cache calls do
nothing). The actor worker's `update_weights` (engine_workers.py:754-766) is mirrored: `verl.workers.engine_workers`
imports verl's whole training stack (datasets, ...), which this kit does not install.

Skipped where verl is not importable (CI: tests/integration/test_verl.py runs the same flows on a stand-in).
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

verl_base = pytest.importorskip(
    "verl.checkpoint_engine.base",
    reason="verl is not installed: ./dev verl-contract installs verl 0.9.1 in its own venv and runs this file",
)

from verl.workers.config import CheckpointEngineConfig  # noqa: E402

from tests.integration.test_verl import LIVENESS_S, ckpt, run_syncs  # noqa: E402
from tests.support.mp import LOAD_SLACK_S, free_port  # noqa: E402
from tests.support.verl_workers import BACKEND, MODULE, ProcessWorkerGroup, WorkerError, get, verl_workers  # noqa: E402

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def manager_of(monkeypatch: pytest.MonkeyPatch) -> Any:
    """verl's real `CheckpointEngineManager` over our process-backed worker groups instead of Ray's."""
    monkeypatch.setattr(verl_base, "RayWorkerGroup", ProcessWorkerGroup)  # base.py:529
    monkeypatch.setattr(verl_base, "ray", SimpleNamespace(get=get))  # base.py:427, 445, 539, 551

    def make(actor_wg: Any, replicas: Any) -> Any:
        config = CheckpointEngineConfig(**ckpt())
        return verl_base.CheckpointEngineManager(config=config, actor_wg=actor_wg, replicas=replicas)

    return make


def test_verl_registers_our_engine_through_custom_backend_module() -> None:
    """`import_external_libs(custom_backend_module)` (verl/utils/import_utils.py:81-88) imports our module, whose
    decorator registers the engine under its name; it is verl's `CheckpointEngine`, with no abstract method left."""
    from verl.utils.import_utils import import_external_libs

    import_external_libs(MODULE)
    cls = verl_base.CheckpointEngineRegistry.get(BACKEND)
    assert issubclass(cls, verl_base.CheckpointEngine) and not cls.__abstractmethods__
    assert cls.__module__ == MODULE


@pytest.mark.parametrize("actor_ranks", [1, 2])
def test_verls_manager_drives_our_engine(manager_of: Any, actor_ranks: int) -> None:
    """verl's manager, three syncs, 1 or 2 actor ranks, 2 rollout ranks: bitwise, one session across syncs."""
    with verl_workers(actor_ranks, 2, ckpt(), standin=False, dist_port=free_port()) as (actor_wg, replicas):
        run_syncs(manager_of(actor_wg, replicas), actor_wg, replicas, [1, 2, 3])


def test_dead_rollout_fails_verls_sync_within_seconds(manager_of: Any) -> None:
    """A rollout rank dies mid-sync: verl's `update_weights` raises within transport.liveness_s, the actor's
    send naming the failure (PeerError), instead of hanging."""
    with verl_workers(1, 2, ckpt(), standin=False, dist_port=free_port()) as (actor_wg, replicas):
        manager = manager_of(actor_wg, replicas)
        run_syncs(manager, actor_wg, replicas, [1])
        replicas[1].workers[0].inject = {"die_after": 2}
        start = time.monotonic()
        with pytest.raises(WorkerError, match="rollout1: died"):
            manager.update_weights(global_steps=2)
        actor = actor_wg.handles[0].last("update_weights")
        assert not actor.ok and "PeerError" in actor.value, actor.value
        assert time.monotonic() - start < LIVENESS_S + LOAD_SLACK_S


def test_dead_actor_fails_verls_rollout_ranks_within_seconds(manager_of: Any) -> None:
    """The actor dies after init_process_group, before its version starts: verl's own rollout worker method
    (`CheckpointEngineWorker.update_weights`) fails within transport.liveness_s on every rollout rank."""
    with verl_workers(1, 2, ckpt(), standin=False, dist_port=free_port()) as (actor_wg, replicas):
        manager = manager_of(actor_wg, replicas)
        run_syncs(manager, actor_wg, replicas, [1])
        actor_wg.handles[0].inject = {"die_before_send": True}
        with pytest.raises(WorkerError, match="actor0: died"):
            manager.update_weights(global_steps=2)
        for replica in replicas:
            got = replica.workers[0].last("update_weights")
            assert not got.ok and "PeerError" in got.value, got.value
            assert got.seconds < LIVENESS_S + LOAD_SLACK_S, got.seconds


def test_the_ci_standin_mirrors_verl() -> None:
    """tests/support/verl_standin.py, which CI runs the engine on, has verl's signatures (parameter names, kinds,
    defaults) for every method it mirrors, and no abstract method verl lacks."""
    import inspect

    from verl.utils import import_utils

    from tests.support import verl_standin

    def params(fn: Any) -> list[tuple[str, Any, Any]]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    real, ours = verl_base.CheckpointEngine, verl_standin.CheckpointEngine
    assert ours.__abstractmethods__ == real.__abstractmethods__
    for name in real.__abstractmethods__:
        assert params(getattr(ours, name)) == params(getattr(real, name)), name
    for name in ("register", "get", "new"):
        assert params(getattr(verl_standin.CheckpointEngineRegistry, name)) == params(
            getattr(verl_base.CheckpointEngineRegistry, name)
        ), name
    assert params(verl_standin.import_external_libs) == params(import_utils.import_external_libs)
    for name in ("build_process_group", "update_weights"):
        assert params(getattr(verl_standin.StandInManager, name)) == params(
            getattr(verl_base.CheckpointEngineManager, name)
        ), name
