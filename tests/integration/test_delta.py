"""Issue 22, delta: only what changed goes on the wire, bitwise equal after apply, and whole tensors by
themselves where a delta cannot be applied (a new receiver, one that missed a version, a sink that holds no
tensors, a request); a delta that fails leaves the held version intact.

Daemons in-process against a real `WeightSender` over real ZeroMQ sockets and real gloo groups, as in
`test_daemon.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
import torch

from lightning_weightsync import PeerError, WeightSender
from lightning_weightsync.rollout.daemon import RolloutDaemon
from lightning_weightsync.rollout.sinks.module import ModuleSink
from tests.integration.test_daemon import daemon_cfg, running, until
from tests.integration.test_verify import differing, noise_module, sent
from tests.support.corrupt import CorruptingSender
from tests.support.mp import free_port

pytestmark = pytest.mark.timeout(180)


def step(weights: dict[str, torch.Tensor], seed: int, fraction: float = 0.02) -> dict[str, torch.Tensor]:
    """The next version: about `fraction` of the floating-point elements moved by one ulp-ish nudge."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in weights.items():
        new = tensor.clone()
        if new.is_floating_point():
            flat = new.view(-1)
            pick = torch.rand(flat.shape, generator=g) < fraction
            flat[pick] = (flat[pick].float() * 1.01 + 0.001).to(flat.dtype)
        out[name] = new
    return out


def module_daemon(port: int, identity: str, apply: str = "atomic", **extra: Any) -> RolloutDaemon:
    extra.setdefault("transport__verify", "full")
    cfg = daemon_cfg(port, rollout__identity=identity, rollout__apply=apply, transport__delta="auto", **extra)
    return RolloutDaemon(cfg, sink=ModuleSink(cfg, module=noise_module()), handle_signals=False)


@contextlib.asynccontextmanager
async def delta_sender(
    port: int, cls: type[WeightSender] = WeightSender, mode: str = "always", **kw: Any
) -> AsyncIterator[Any]:
    """`always` unless said: which tensors go as deltas is then the codec's call alone, not `auto`'s timing."""
    knobs = {
        "transport__delta": mode,
        "transport__verify": "full",
        "trainer__min_receivers": kw.pop("min_receivers", 1),
    }
    sender = cls(daemon_cfg(port, **knobs), **kw)
    await sender.start()
    try:
        yield sender
    finally:
        await sender.close()


def held(daemon: RolloutDaemon) -> dict[str, torch.Tensor]:
    sink = daemon.sink
    assert isinstance(sink, ModuleSink)
    return sink.state_dict()


@pytest.mark.parametrize("apply", ["atomic", "streaming"])
async def test_deltas_are_small_and_bitwise_and_a_new_receiver_gets_whole_tensors(apply: str) -> None:
    port = free_port()
    first = module_daemon(port, "first", apply)
    weights = sent(0)
    async with running(first), delta_sender(port) as sender:
        full = await sender.send_weights(weights.items(), version=0)
        assert full.delta_tensors == 0 and sender.delta_copy_bytes == full.nbytes
        for version in (1, 2):
            weights = step(weights, version)
            stats = await sender.send_weights(weights.items(), version=version)
            assert stats.delta_tensors > 0 and stats.nbytes < full.nbytes / 2, (stats.delta_tensors, stats.nbytes)
            assert not differing(held(first), weights), "not bitwise equal after the delta"
            assert first.records[-1].verified == first.records[-1].num_tensors, "a delta's result is verified"
        second = module_daemon(port, "second", apply)
        async with running(second):
            # the version waits for the second one to register
            sender.settings = replace(sender.settings, min_receivers=2)
            weights = step(weights, 3)
            stats = await sender.send_weights(weights.items(), version=3)
            assert stats.receivers == 2 and stats.delta_tensors == 0, "a new receiver must get whole tensors"
            assert not differing(held(second), weights) and not differing(held(first), weights)
            weights = step(weights, 4)
            stats = await sender.send_weights(weights.items(), version=4)  # both hold 3: deltas again
            assert stats.delta_tensors > 0
            assert not differing(held(second), weights) and not differing(held(first), weights)
            sender.request_full_sync()
            weights = step(weights, 5)
            stats = await sender.send_weights(weights.items(), version=5)
            assert stats.delta_tensors == 0, "request_full_sync must send whole tensors"
            assert not differing(held(second), weights)


async def test_a_failed_delta_leaves_the_held_version_and_the_next_sync_is_whole(tmp_path) -> None:
    """A delta corrupted on the wire: verify fails it, the sink keeps the version it held (atomic), the
    receiver's nack drops the sender's copy, so the next version goes whole and lands."""
    port = free_port()
    daemon = module_daemon(port, "r")
    weights = sent(0)
    async with running(daemon):
        async with delta_sender(port) as sender:
            await sender.send_weights(weights.items(), version=0)
        async with delta_sender(port, CorruptingSender, bucket_index=-1, byte=HEADER_PAST) as bad:
            # a restarted trainer has no copy: version 1 is whole, then 2 is a delta, corrupted on the wire
            await bad.send_weights(weights.items(), version=1)
            held_before = held(daemon)
            bad.bucket_index = 0
            with pytest.raises(PeerError, match=r"arrived corrupted|delta of"):
                await bad.send_weights(step(weights, 2).items(), version=2)
            await until(lambda: len(daemon.records) == 3)
            assert daemon.sink is not None and daemon.sink.version == 1
            assert not differing(held(daemon), held_before), "a failed delta changed the held weights"
            bad.bucket_index = -1  # the wire is fine again
            weights = step(weights, 3)
            stats = await bad.send_weights(weights.items(), version=3)
            assert stats.delta_tensors == 0, "after a failed version the sync must be whole"
            assert not differing(held(daemon), weights)


HEADER_PAST = 20  # a byte past a delta payload's 16-byte header: inside its indices or bitmask


async def test_a_sink_without_tensors_gets_whole_tensors_next_to_one_that_takes_deltas(tmp_path) -> None:
    from safetensors.torch import load_file

    port = free_port()
    module = module_daemon(port, "module")
    files_cfg = daemon_cfg(
        port, rollout__identity="files", rollout__sink__type="safetensors", rollout__sink__dir=str(tmp_path)
    )
    files = RolloutDaemon(files_cfg, handle_signals=False)
    weights = sent(0)
    async with running(module), running(files), delta_sender(port, min_receivers=2) as sender:
        for version in range(3):
            stats = await sender.send_weights(weights.items(), version=version)
            assert stats.receivers == 2 and stats.delta_tensors == 0, "the files sink cannot apply a delta"
            assert not differing(load_file(str(tmp_path / f"step_{version}.safetensors")), weights)
            assert not differing(held(module), weights)
            weights = step(weights, version + 1)


async def test_a_version_that_broke_mid_stream_is_followed_by_a_correct_one() -> None:
    """The trainer's stream fails after a few tensors and the step is sent again: the sender's copy holds
    some tensors of the broken attempt and the rollout still the version before, so a delta against that
    copy would leave those tensors stale (their changes are in the copy, not on the rollout)."""
    port = free_port()
    daemon = module_daemon(port, "r")
    weights = sent(0)

    def breaking(items: dict[str, torch.Tensor], after: int):
        for i, item in enumerate(items.items()):
            if i == after:
                raise RuntimeError("the trainer's gather failed (test)")
            yield item

    async with running(daemon), delta_sender(port) as sender:
        await sender.send_weights(weights.items(), version=0)
        weights = step(weights, 1)
        with pytest.raises(RuntimeError, match="gather failed"):
            await sender.send_weights(breaking(weights, after=4), version=1)
        await sender.send_weights(weights.items(), version=2)  # the same step, again
        wrong = differing(held(daemon), weights)
        assert not wrong, f"stale after the retry: {wrong}"


def test_the_delta_benchmark_runs_small_and_checks_what_it_measures(capsys) -> None:
    """`lightning-weightsync bench --only delta` at a toy size: every delta it times lands bitwise (the
    benchmark asserts it), and 1 % changed costs a few percent of the bytes."""
    from lightning_weightsync.bench import delta

    report = delta.run(scale=64, repeats=1, lm_dim=32)
    one = report["synthetic"]["1%"]
    assert one["always"]["delta_tensors"] > 0 and one["always"]["bytes_ratio"] < 0.1, one  # auto's pick is timing
    half = report["synthetic"]["50%"]["auto"]
    assert half["bytes_ratio"] > 0.9, f"auto must send (nearly every tensor of) 50 % changed whole: {half}"
    assert set(report["tiny_lm"]) == {"1e-06", "1e-05", "0.0001"}
    assert "verify" in capsys.readouterr().out


async def test_auto_falls_back_to_whole_versions_by_itself_where_deltas_measure_slower() -> None:
    """On a link where whole versions are cheap (here: one measured as if the link were infinitely fast), a
    delta version measures slower, and `auto` sends the next versions whole, then tries a delta again."""
    from lightning_weightsync.bench.delta import _Pair, changed_weights
    from lightning_weightsync.versions.delta import PROBE_EVERY

    weights = {f"w{i}": torch.randn(4096).to(torch.bfloat16) for i in range(4)}
    async with _Pair(delta="auto") as pair:
        await pair.sync(weights)  # forms the group: not measured
        weights = changed_weights(weights, 0.01, seed=1)
        assert (await pair.sync(weights))[2] == 4, "a delta first, while nothing says it loses"
        weights = changed_weights(weights, 0.01, seed=0)
        assert (await pair.sync(weights))[2] == 0, "then one whole version, to measure that too"
        pair.sender._delta_base.whole_s_per_byte = 1e-15  # whole versions measured as (nearly) free
        weights = changed_weights(weights, 0.01, seed=2)
        assert (await pair.sync(weights))[2] == 4  # measured slower than that: auto decides to go whole
        deltas = []
        for seed in range(3, 3 + PROBE_EVERY + 1):
            weights = changed_weights(weights, 0.01, seed=seed)
            pair.sender._delta_base.whole_s_per_byte = 1e-15
            deltas.append((await pair.sync(weights))[2])
            assert not differing(pair.held, weights)
    assert deltas == [0] * PROBE_EVERY + [4], deltas


async def test_a_low_level_receiver_that_passes_base_takes_deltas_without_bookkeeping(caplog) -> None:
    """`receive_weights(into=..., base=...)`: the receiver counts each version it acked whole as held, so the
    next one comes as a delta without the caller setting `delta_base`; a version the consumer stopped half-way
    clears it (its tensors may be torn) and the next one comes whole."""
    from lightning_weightsync import WeightReceiver

    caplog.set_level("INFO", logger="lightning_weightsync.versions.sender")
    port = free_port()
    weights = sent(0)
    mine = {name: torch.empty_like(t) for name, t in weights.items()}  # the consumer's own tensors

    async def receive_into_mine(stop_after: int | None = None) -> Any:
        n = 0
        async for _name, _ in receiver.receive_weights(into=lambda m: mine[m.name], base=lambda m: mine[m.name]):
            n += 1
            if n == stop_after:
                break
        return receiver.last_stats

    receiver = WeightReceiver(daemon_cfg(port, transport__verify="full"), identity="low-level")
    async with delta_sender(port) as sender:
        await receiver.start()
        try:
            deltas = []
            for version in range(3):
                got, _ = await asyncio.gather(
                    receive_into_mine(), sender.send_weights(weights.items(), version=version)
                )
                assert not differing(mine, weights), version
                assert receiver.delta_base == version
                deltas.append(got.delta_tensors)
                weights = step(weights, version + 1)
            assert deltas[0] == 0 and deltas[1] > 0 and deltas[2] > 0, deltas
            lines = [r.getMessage() for r in caplog.records if " sent: " in r.getMessage()]  # the per-version line
            assert lines[0].startswith("version 0 sent: ") and lines[0].endswith(" buckets; whole"), lines
            assert lines[1].startswith("version 1 sent: ") and "buckets; delta of version 0: " in lines[1], lines
            with contextlib.suppress(Exception):  # the consumer stops after one tensor: the version fails
                await asyncio.gather(receive_into_mine(stop_after=1), sender.send_weights(weights.items(), version=3))
            assert receiver.delta_base is None
            got, _ = await asyncio.gather(receive_into_mine(), sender.send_weights(weights.items(), version=4))
            assert got.delta_tensors == 0 and not differing(mine, weights)  # whole, onto torn tensors: correct
        finally:
            await receiver.close()
