"""verl's checkpoint engine `lightning_weightsync` (lightning_weightsync/integrations/verl.py), without verl.

CI has no verl, so the engine runs on a stand-in of the verl 0.9.1 code it meets (tests/support/verl_standin.py:
the registry, the base class, `import_external_libs` and the manager's steps, each citing verl's file:line),
in real processes (tests/support/verl_workers.py: actor ranks with a gloo default group whose weight generator
is collective, rollout ranks whose server adapter checks every tensor bitwise), over real sockets and gloo.
`./dev verl-contract` runs this file and tests/integration/test_verl_real.py, the same flows on verl's own code.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from tests.support import verl_standin
from tests.support.mp import LOAD_SLACK_S, free_port
from tests.support.verl_workers import BACKEND, BUCKET_MB, MODEL, MODULE, WorkerError, get, verl_workers

pytestmark = pytest.mark.timeout(120)
LIVENESS_S = 2.0
OVERRIDES = [
    "transport.host=127.0.0.1",  # else the node's address as Ray sees it (verl runs under Ray)
    "transport.port=0",
    "transport.timeout_s=30",
    f"transport.liveness_s={LIVENESS_S}",
    "transport.verify=full",  # every tensor's fingerprint checked on arrival too
]


def ckpt(overrides: list[str] = OVERRIDES) -> dict[str, Any]:
    """verl's `actor_rollout_ref.rollout.checkpoint_engine` section, as a user sets it for us."""
    return {
        "backend": BACKEND,
        "custom_backend_module": MODULE,
        "update_weights_bucket_megabytes": BUCKET_MB,
        "engine_kwargs": {BACKEND: {"overrides": list(overrides)}},
    }


def standin() -> Any:
    """The stand-in verl in this process too: the manager imports `custom_backend_module` (base.py:417)."""
    return verl_standin.installed(MODULE)


def standin_manager(actor_wg: Any, replicas: Any) -> verl_standin.StandInManager:
    return verl_standin.StandInManager(SimpleNamespace(**ckpt()), actor_wg, replicas, get)


def check_sync(actor_wg: Any, replicas: Any, step: int, metrics: dict[str, float]) -> None:
    """Every rollout rank holds the actor's version `step`, bitwise; rank 0's metrics say what went."""
    returned = [h.last("update_weights").value for h in actor_wg.handles]
    assert [r != {} for r in returned] == [True] + [False] * (len(returned) - 1)  # rank 0 alone sends
    sent = get([h.call("sent", None) for h in actor_wg.handles])
    assert sent[0] is not None and sent == [sent[0]] * len(sent)  # every rank drained the whole generator
    for replica in replicas:
        got = replica.workers[0].last("update_weights").value
        assert got == {"digest": sent[0], "tensors": len(MODEL)}
    assert metrics[f"{BACKEND}/version"] == step
    assert metrics[f"{BACKEND}/receivers"] == len(replicas)
    assert metrics[f"{BACKEND}/tensors"] == len(MODEL)
    assert metrics[f"{BACKEND}/chunked_tensors"] >= 1  # the embedding is larger than the 1 MiB bucket


def run_syncs(manager: Any, actor_wg: Any, replicas: Any, steps: list[int]) -> None:
    endpoints = set()
    for i, step in enumerate(steps):
        metrics = manager.update_weights(global_steps=step)
        check_sync(actor_wg, replicas, step, metrics)
        endpoints.add(repr(actor_wg.handles[0].last("execute", "prepare").value))
        if i:  # both ends kept their session: the receivers still hold the last version's bucket layout
            assert metrics[f"{BACKEND}/layout_buckets"] >= 1, metrics
    assert len(endpoints) == 1, endpoints  # one sender session across every sync


@pytest.mark.parametrize("actor_ranks", [1, 2])
def test_syncs_in_verls_order(actor_ranks: int) -> None:
    """The manager's order every sync (prepare, build_topology, init_process_group, send + receive, finalize),
    three syncs, 1 or 2 actor ranks (each drains the collective generator; rank 0 sends), 2 rollout ranks."""
    with standin(), verl_workers(actor_ranks, 2, ckpt(), standin=True, dist_port=free_port()) as (actor_wg, replicas):
        run_syncs(standin_manager(actor_wg, replicas), actor_wg, replicas, [1, 2, 3])


def test_dead_rollout_fails_the_sync_within_seconds() -> None:
    """A rollout rank that dies mid-sync: the actor's send fails within transport.liveness_s, naming it,
    instead of a hang, and the manager's call raises; the other rollout rank is never left waiting."""
    with standin(), verl_workers(1, 2, ckpt(), standin=True, dist_port=free_port()) as (actor_wg, replicas):
        manager = standin_manager(actor_wg, replicas)
        run_syncs(manager, actor_wg, replicas, [1])
        replicas[1].workers[0].inject = {"die_after": 2}
        start = time.monotonic()
        with pytest.raises(WorkerError, match="rollout1: died"):
            manager.update_weights(global_steps=2)
        elapsed = time.monotonic() - start
        actor = actor_wg.handles[0].last("update_weights")
        other = replicas[0].workers[0].last("update_weights")
        assert not actor.ok and "PeerError" in actor.value, actor.value
        # the other rank either had the whole version already (checked bitwise by its adapter) or was told
        assert other.ok or "VersionAborted" in other.value or "PeerError" in other.value, other.value
        assert elapsed < LIVENESS_S + LOAD_SLACK_S, elapsed


def test_a_failed_sync_leaves_the_next_one_whole() -> None:
    """A rollout's server adapter fails mid-version (stops consuming our generator): that rank's sync fails with
    the adapter's error, the actor's with the rank's nack, and the next sync over the same sessions is whole."""
    with standin(), verl_workers(1, 2, ckpt(), standin=True, dist_port=free_port()) as (actor_wg, replicas):
        manager = standin_manager(actor_wg, replicas)
        run_syncs(manager, actor_wg, replicas, [1])
        replicas[0].workers[0].inject = {"raise_after": 2}
        with pytest.raises(WorkerError, match="the server failed to load"):
            manager.update_weights(global_steps=2)
        actor = actor_wg.handles[0].last("update_weights")
        assert not actor.ok and "PeerError" in actor.value and "consumer stopped" in actor.value, actor.value
        run_syncs(manager, actor_wg, replicas, [3, 4])


@pytest.mark.parametrize("fault", [{"die_after": 3}, {"die_before_send": True}], ids=["mid-version", "before-it"])
def test_dead_actor_fails_every_rollout_within_seconds(fault: dict[str, Any]) -> None:
    """The actor dies mid-version, or before its version started (rollout ranks wait for it: our engine watches
    the actor's control link then, where the receiver's own wait has no bound but transport.timeout_s): every
    rollout rank's receive fails within transport.liveness_s (PeerError: the sender is gone)."""
    with standin(), verl_workers(1, 2, ckpt(), standin=True, dist_port=free_port()) as (actor_wg, replicas):
        manager = standin_manager(actor_wg, replicas)
        run_syncs(manager, actor_wg, replicas, [1])
        actor_wg.handles[0].inject = dict(fault)
        start = time.monotonic()
        with pytest.raises(WorkerError, match="actor0: died"):
            manager.update_weights(global_steps=2)
        for replica in replicas:
            got = replica.workers[0].last("update_weights")
            assert not got.ok and "PeerError" in got.value, got.value
            assert got.seconds < LIVENESS_S + LOAD_SLACK_S, got.seconds
        assert time.monotonic() - start < LIVENESS_S + LOAD_SLACK_S


# -- the engine's own logic, in this process ----------------------------------------------------------------------
@pytest.fixture
def engine_cls() -> Iterator[Any]:
    """The engine class, on the stand-in base."""
    with standin():
        from lightning_weightsync.integrations.verl import LightningWeightSyncCheckpointEngine

        yield LightningWeightSyncCheckpointEngine


def test_build_topology_lists_one_entry_per_worker(engine_cls: Any) -> None:
    from lightning_weightsync.integrations.verl import Role, SenderEndpoint, WorkerMetadata

    at = SenderEndpoint("127.0.0.1", 5)
    actor, rollout = engine_cls.build_topology(
        3, 2, [WorkerMetadata(at), WorkerMetadata(), WorkerMetadata()] + [WorkerMetadata()] * 2
    )
    assert actor == {"role": [Role.actor] * 3, "sender": [at] * 3, "receivers": [2] * 3}
    assert rollout == {"role": [Role.rollout] * 2, "sender": [at] * 2, "receivers": [2] * 2}
    with pytest.raises(Exception, match="exactly one actor rank with is_master"):
        engine_cls.build_topology(2, 1, [WorkerMetadata()] * 3)
    with pytest.raises(Exception, match="exactly one actor rank with is_master"):
        engine_cls.build_topology(2, 1, [WorkerMetadata(at), WorkerMetadata(at), WorkerMetadata()])
    with pytest.raises(Exception, match="3 workers' metadata for 1 actor"):
        engine_cls.build_topology(1, 1, [WorkerMetadata(at)] + [WorkerMetadata()] * 2)


def test_versions_follow_global_steps_and_always_increase(engine_cls: Any) -> None:
    engine = engine_cls(bucket_size=1 << 20, overrides=["transport.host=127.0.0.1"])
    assert [engine._next_version(s) for s in (5, 5, None, 9, 3)] == [5, 6, 7, 9, 10]
    assert engine.config.transport.bucket_size_mb == 1.0  # verl's bucket size, in our knob
    assert engine.config.rollout.device == "cpu"  # no GPU here: the worker's device
    assert not engine.is_master and engine.role is None  # a rollout rank and an actor rank > 0 look alike until init


def test_a_rollout_rank_told_of_a_new_actor_endpoint_drops_its_receiver_and_joins_the_new_one(engine_cls: Any) -> None:
    """A restarted actor reports another endpoint: the rollout rank's next `init_process_group` closes the receiver
    of the old one (it leaves that sender's registry) and receives the next version from the new one, bitwise."""
    import asyncio

    import torch

    from lightning_weightsync import WeightSender, load_config
    from lightning_weightsync.integrations.verl import Role, SenderEndpoint

    overrides = ["transport.host=127.0.0.1", "transport.port=0", "transport.timeout_s=20",
                 "transport.heartbeat_interval_s=0.2"]  # fmt: skip
    engine = engine_cls(bucket_size=1 << 20, overrides=overrides)
    weights = [("w", torch.randn(8, 4, generator=torch.Generator().manual_seed(0)))]

    async def received() -> dict[str, torch.Tensor]:
        return {n: t.clone() async for n, t in engine.receive_weights()}

    async def main() -> list[str]:
        old = WeightSender(load_config(overrides=overrides))
        new = WeightSender(load_config(overrides=overrides))
        await old.start()
        await new.start()
        try:
            for sender, version in ((old, 1), (new, 2)):  # the actor, then the actor restarted elsewhere
                endpoint = SenderEndpoint("127.0.0.1", sender.port)
                await asyncio.to_thread(engine.init_process_group, Role.rollout, endpoint, 1)
                sent = sender.send_weights(weights, version=version)
                got, _ = await asyncio.wait_for(asyncio.gather(received(), sent), 60)
                assert list(got) == ["w"] and torch.equal(got["w"], weights[0][1]), version
            deadline = time.monotonic() + 10
            while old.registered and time.monotonic() < deadline:  # its Bye reaches the old sender's registry
                await old._control.recv(0.1)  # the registry is kept by reading the socket
            return old.registered
        finally:
            await new.close()
            await old.close()

    try:
        still = asyncio.run(main())
    finally:
        engine.close()
    assert still == [], still  # the old actor's sender no longer counts this rank
