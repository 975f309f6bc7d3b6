"""Chains (transport.fanout=chain): the trainer rank sends each byte once, each receiver forwards every piece on.

Real gloo groups with point-to-point sends and receives, real ZeroMQ; bitwise at every receiver. Who forwarded what
is read from each side's counters (`relayed_bytes`), so a chain that secretly became a star, or a receiver that
took its bytes but passed nothing on, fails here. Chains also carry what rides on the buckets: fingerprints
(transport.verify), deltas (transport.delta) and a PEFT adapter's versions (sharded mode and lanes of boxes through
chains: test_sharded_delta.py, test_slices.py)."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from lightning_weightsync import ConfigError, WeightReceiver, WeightSender
from lightning_weightsync.protocol.relay import downstream
from tests.support.mp import free_port, run_workers
from tests.support.transfer import assert_bitwise, engine_cfg, receive_once, stream, stream_nbytes, with_timeout

PIECE_MB = 1 / 128  # 8 KiB pieces: a 64 KiB bucket is 8 of them


Weights = Callable[[int], list[tuple[str, torch.Tensor]]]


async def _chain_versions(
    n: int,
    versions: int,
    *,
    into: bool,
    weights: Weights = stream,
    receiving: dict[str, object] | None = None,
    base: bool = False,
    forget: tuple[int, int] | None = None,
    **knobs: object,
) -> tuple[list, list[list]]:
    """A sender and `n` receivers (r0..r{n-1}, chain order) in one loop, `versions` versions of `weights`; (send
    stats, each receiver's [(version, stats, verify report)]), every version checked bitwise. `receiving`: knobs of
    both sides (the receivers' too); `base`: each receiver passes its destinations as the held version
    (transport.delta); `forget` (version, i): receiver i holds nothing before that version (a restarted rollout)."""
    both = dict(receiving or {})
    cfg = engine_cfg(
        0, bucket_size_mb=1 / 16, trainer__min_receivers=n, transport__fanout="chain",
        transport__chain_piece_mb=PIECE_MB, **knobs, **both,
    )  # fmt: skip
    async with WeightSender(cfg) as sender:
        cfg_r = engine_cfg(sender.port, bucket_size_mb=1 / 16, **both)
        receivers = [WeightReceiver(cfg_r, identity=f"r{i}") for i in range(n)]
        for r in receivers:
            await r.start()
        try:
            dest = [{name: torch.empty_like(t.contiguous()) for name, t in weights(0)} for _ in range(n)]

            async def take(i: int, r: WeightReceiver) -> list:
                seen = []
                mine = dest[i]
                held = (lambda meta: mine[meta.name]) if base else None
                for version in range(1, versions + 1):
                    if forget == (version, i):
                        r.delta_base = None
                    if into:
                        names = [x async for x, _ in r.receive_weights(into=lambda m: mine[m.name], base=held)]
                        got = {name: dest[i][name] for name in names}
                    else:
                        got = await receive_once(r)
                    assert_bitwise(got, weights(r.version))
                    seen.append((r.version, r.last_stats, r.last_verify))
                return seen

            async def send() -> list:
                return [await sender.send_weights(weights(v), version=v) for v in range(1, versions + 1)]

            sent, *got = await with_timeout(asyncio.gather(send(), *(take(i, r) for i, r in enumerate(receivers))), 90)
        finally:
            for r in receivers:
                await r.close()
    return sent, got


@pytest.mark.parametrize("into", [False, True], ids=["merged", "into-destinations"])
async def test_one_chain_sends_each_byte_once_and_every_receiver_but_the_tail_forwards_it(into):
    sent, got = await _chain_versions(3, 3, into=into)
    payload = stream_nbytes(stream(1))
    for version, stats in enumerate(sent, start=1):
        assert stats.receivers == 3 and stats.nbytes == payload
        assert stats.relayed_bytes == payload, stats  # the trainer link: one copy, to the head of the chain
        relayed = [got[i][version - 1][1].relayed_bytes for i in range(3)]
        assert relayed == [payload, payload, 0], relayed  # r0 -> r1 -> r2, the tail keeps it
    if into:  # large tensors went straight into their destinations and were forwarded from there
        assert all(stats.direct_buckets > 0 for stats in sent)


async def test_a_chain_length_cap_feeds_several_chains_from_the_trainer():
    sent, got = await _chain_versions(3, 2, into=False, transport__chain_length=2)
    payload = stream_nbytes(stream(1))
    for version, stats in enumerate(sent, start=1):
        # [r0 -> r1] and [r2]: the trainer feeds two heads; r0 forwards, r1 and r2 are tails
        assert stats.relayed_bytes == 2 * payload, stats
        assert [got[i][version - 1][1].relayed_bytes for i in range(3)] == [payload, 0, 0]


async def test_a_lone_receiver_is_sent_whole_buckets():
    sent, got = await _chain_versions(1, 2, into=True)
    assert [s.relayed_bytes for s in sent] == [stream_nbytes(stream(1))] * 2
    assert got[0][1][1].relayed_bytes == 0


# -- chains with the features that ride on the same buckets: verify, delta -----------------------------------------


async def test_a_byte_a_member_forwards_wrong_is_caught_by_the_receiver_behind_it_and_only_there(monkeypatch):
    """transport.verify along a chain: r1 flips a byte of what it forwards to r2 (its own copy is right), so r2's
    fingerprint check fails the version naming the tensor while r0 and r1 keep it, verified; the next version,
    forwarded right, lands verified at all three. Without the tail's own check the flip would land unnoticed."""
    from lightning_weightsync import PeerError, WeightSyncError
    from lightning_weightsync.protocol.relay import tag
    from lightning_weightsync.transport.backends import relay

    forward, flipped = relay._send, []

    def flipping(pg, piece, feeds, piece_tag, sends, counters) -> None:
        if feeds == [3] and piece_tag == tag(0, 0) and not flipped:  # r1 (rank 2) to r2: bucket 0's first piece
            piece = piece.clone()  # the send keeps it alive; r1's own bytes stay right
            piece[7] ^= 0x5A
            flipped.append(piece)
        forward(pg, piece, feeds, piece_tag, sends, counters)

    monkeypatch.setattr(relay, "_send", flipping)
    verify = {"transport__verify": "full"}
    cfg = engine_cfg(
        0, bucket_size_mb=1 / 16, trainer__min_receivers=3, transport__fanout="chain",
        transport__chain_piece_mb=PIECE_MB, **verify,
    )  # fmt: skip
    async with WeightSender(cfg) as sender:
        cfg_r = engine_cfg(sender.port, bucket_size_mb=1 / 16, **verify)
        receivers = [WeightReceiver(cfg_r, identity=f"r{i}") for i in range(3)]
        for r in receivers:
            await r.start()
        try:

            async def take(r: WeightReceiver) -> list:
                out: list = []
                for _ in (1, 2):
                    try:
                        got = await receive_once(r)
                        assert_bitwise(got, stream(r.version))
                        out.append((r.version, r.last_verify.verified, r.last_stats.relayed_bytes))
                    except WeightSyncError as exc:
                        out.append(str(exc))
                return out

            async def send() -> list:
                out: list = []
                for version in (1, 2):
                    try:
                        out.append(await sender.send_weights(stream(version), version=version))
                    except PeerError as exc:
                        out.append(str(exc))
                return out

            sent, *got = await with_timeout(asyncio.gather(send(), *(take(r) for r in receivers)), 90)
        finally:
            for r in receivers:
                await r.close()
    tensors, payload = len(stream(1)), stream_nbytes(stream(1))
    assert flipped and isinstance(sent[0], str) and "r2" in sent[0] and "arrived corrupted" in sent[0], sent
    assert got[0][0] == (1, tensors, payload) and got[1][0] == (1, tensors, payload), got  # ahead of the flip: kept
    assert "arrived corrupted" in got[2][0] and "transport.verify" in got[2][0], got[2]
    assert not isinstance(sent[1], str) and len(sent[1].checksums) == tensors, sent
    assert [g[1] for g in got] == [(2, tensors, payload), (2, tensors, payload), (2, tensors, 0)], got


@functools.cache
def _drifting(version: int) -> list[tuple[str, torch.Tensor]]:
    """Version 0 is `stream(0)` (contiguous); each later one moves about 2 % of the elements of the one before."""
    from tests.integration.test_delta import step

    if version == 0:
        return [(name, t.contiguous()) for name, t in stream(0)]
    return list(step(dict(_drifting(version - 1)), version).items())


async def test_deltas_along_a_chain_land_bitwise_everywhere_and_a_receiver_that_holds_nothing_gets_whole():
    """transport.delta along a chain: version 1 whole, 2 a delta, 3 whole again because r1 (the middle) holds
    nothing any more (a restarted rollout), 4 a delta; every receiver applies each onto its own tensors bitwise
    and verified, and the chain carries exactly the bytes the sender sent, delta or whole."""
    sent, got = await _chain_versions(
        3, 4, into=True, weights=_drifting, base=True, forget=(3, 1), receiving={"transport__verify": "full"},
        transport__delta="always",
    )  # fmt: skip
    tensors, whole = len(_drifting(0)), stream_nbytes(_drifting(0))
    assert [s.delta_tensors > 0 for s in sent] == [False, True, False, True], [s.delta_tensors for s in sent]
    assert sent[0].nbytes == sent[2].nbytes == whole and sent[1].nbytes < whole / 2, [s.nbytes for s in sent]
    for version, stats in enumerate(sent, start=1):
        assert stats.relayed_bytes == stats.nbytes, stats  # the trainer link: one copy of what the version carried
        mine = [got[i][version - 1] for i in range(3)]
        assert [m[1].relayed_bytes for m in mine] == [stats.nbytes, stats.nbytes, 0], (version, mine)
        assert [m[1].delta_tensors for m in mine] == [stats.delta_tensors] * 3, (version, mine)
        assert [m[2].verified for m in mine] == [tensors] * 3, (version, mine)


async def test_peft_lora_adapter_versions_along_a_chain_into_three_module_sinks():
    """trainer.lora=adapter along a chain: a real `SyncDriver` sends a PEFT model's versions (0: the base and the
    adapter, then the adapter alone, its spec in the first bucket) to three rollout daemons whose PEFT models start
    from other seeds; each holds the trainer's whole PEFT model bitwise after every version, every tensor verified,
    and the head and middle forwarded each version's bytes."""
    pytest.importorskip("peft")
    from lightning_weightsync.rollout.daemon import RolloutDaemon
    from lightning_weightsync.rollout.sinks.module import ModuleSink
    from lightning_weightsync.trainer.driver import SyncDriver
    from tests.integration.test_daemon import running, until
    from tests.support.lora import adapter_state, build_peft

    port = free_port()
    knobs = {"bucket_size_mb": 1 / 16, "transport__verify": "full", "rollout__progress": "false"}
    daemons = []
    for i in range(3):
        cfg = engine_cfg(port, rollout__identity=f"r{i}", **knobs)
        daemons.append(RolloutDaemon(cfg, sink=ModuleSink(cfg, module=build_peft(seed=7, lora_seed=8 + i)),
                                     handle_signals=False))  # fmt: skip
    cfg = engine_cfg(
        port, trainer__min_receivers=3, trainer__lora="adapter", transport__fanout="chain",
        transport__chain_piece_mb=PIECE_MB, **knobs,
    )  # fmt: skip
    model, driver = build_peft(), SyncDriver(cfg, rank=0, device=None, prefix=None)
    sent, forwarded = [], []
    trainer = ThreadPoolExecutor(1)  # the driver runs its own loop: on a thread of its own, beside the daemons'

    def on_trainer(fn: Callable, *args: object) -> asyncio.Future:
        return asyncio.get_running_loop().run_in_executor(trainer, fn, *args)

    async with running(daemons[0]), running(daemons[1]), running(daemons[2]):
        await on_trainer(driver.start)
        try:
            for version in range(3):
                assert await on_trainer(driver.sync, model, version), f"version {version} not delivered"
                await until(lambda v=version: all(len(d.records) == v + 1 for d in daemons))
                sent.append(driver.last_stats)
                forwarded.append([d.receiver.last_stats.relayed_bytes for d in daemons])
                for d in daemons:
                    assert d.records[-1].ok and d.records[-1].verified == d.records[-1].num_tensors > 0, d.records
                    held = d.sink.module.state_dict()
                    assert all(torch.equal(held[n], t) for n, t in model.state_dict().items()), (version, d.records)
                with torch.no_grad():  # a training step: the adapter moves, the base does not
                    for param in model.parameters():
                        if param.requires_grad:
                            param.add_(0.01 * (version + 1))
        finally:
            await on_trainer(driver.close)
            trainer.shutdown()
    adapter = stream_nbytes(list(adapter_state(model).items()))
    assert sent[0].nbytes > 2 * adapter and [s.nbytes for s in sent[1:]] == [adapter] * 2, [s.nbytes for s in sent]
    assert [s.relayed_bytes for s in sent] == [s.nbytes for s in sent], sent  # one copy on the trainer link
    assert forwarded == [[s.nbytes, s.nbytes, 0] for s in sent], forwarded


async def test_chain_with_a_backend_that_cannot_relay_fails_at_start():
    cfg = engine_cfg(0, backend="shm", transport__fanout="chain")
    sender = WeightSender(cfg)
    with pytest.raises(ConfigError, match=r"transport\.fanout=chain.*backend shm.*transport\.fanout=broadcast"):
        await sender.start()
    await sender.close()


def test_the_relay_a_receiver_follows_is_the_one_planned():
    """`downstream` is what a rank's backend forwards to: the planned chain, not every rank."""
    from lightning_weightsync.protocol.relay import chains

    upstream = chains(5, 3)
    assert upstream == [-1, 0, 1, 2, 0, 4]
    assert downstream(upstream, 0) == [1, 4] and downstream(upstream, 2) == [3] and downstream(upstream, 3) == []


# -- across processes: a model-shaped stream through a chain of three -------------------------------------------


def _chain_role(role: int, port: int) -> object:
    cfg = engine_cfg(
        port, bucket_size_mb=0.25, trainer__min_receivers=3, transport__fanout="chain", transport__chain_piece_mb=1 / 64
    )
    kw = {"scale": 64, "max_tensors": None}

    async def send() -> list:
        async with WeightSender(cfg) as sender:
            return [(await with_timeout(sender.send_weights(stream(v, **kw), version=v))).relayed_bytes for v in (1, 2)]

    async def take() -> list:
        async with WeightReceiver(cfg, identity=f"r{role}") as receiver:
            out = []
            for _ in range(2):
                got = await with_timeout(receive_once(receiver))
                assert_bitwise(got, stream(receiver.version, **kw))
                out.append(receiver.last_stats.relayed_bytes)
            return out

    return asyncio.run(send() if role == 0 else take())


def test_a_model_stream_through_a_chain_of_three_processes_bitwise():
    port = free_port()
    sender, *receivers = run_workers(_chain_role, [(r, port) for r in range(4)], timeout_s=110)
    payload = stream_nbytes(stream(1, scale=64, max_tensors=None))
    assert sender == [payload, payload]
    assert receivers == [[payload] * 2, [payload] * 2, [0, 0]]


async def test_a_plan_whose_relay_is_a_cycle_is_refused_by_the_receivers_not_followed():
    """A relay from the network that is not a tree rooted at the sender would have each receiver wait for another
    forever: every receiver refuses the plan, names why, and the sender's version fails at once."""
    from lightning_weightsync import WeightSyncError

    cfg = engine_cfg(
        0, bucket_size_mb=1 / 16, trainer__min_receivers=2, transport__fanout="chain", transport__timeout_s=60
    )
    t0 = time.monotonic()
    async with WeightSender(cfg) as sender:
        sender._lanes._relay = lambda receivers, bucket_size: ([-1, 2, 1], 4096)  # r0 <- r1 <- r0: a cycle
        cfg_r = engine_cfg(sender.port, bucket_size_mb=1 / 16)
        async with WeightReceiver(cfg_r, identity="r0") as r0, WeightReceiver(cfg_r, identity="r1") as r1:
            outcomes = await with_timeout(
                asyncio.gather(
                    sender.send_weights(stream(1), version=1), receive_once(r0), receive_once(r1),
                    return_exceptions=True,
                ),
                30,
            )  # fmt: skip
    assert all(isinstance(o, WeightSyncError) for o in outcomes), outcomes
    assert all("never reaches the sender (a cycle)" in str(o) for o in outcomes), outcomes  # the sender names it too
    # the group could never form: the sender gives up on the refusals, not after transport.timeout_s=60
    assert time.monotonic() - t0 < 60 / 2


# -- a member killed mid-version: the chain ahead of it keeps the version, the chain behind it is told at once -----


def _cut_weights(version: int) -> list[tuple[str, torch.Tensor]]:
    """Four tensors of one 64 KiB bucket each: received straight into their destinations, so a receiver posts every
    bucket at once and waits for their bytes with nothing more to read (the case an Abort must still reach)."""
    gen = torch.Generator().manual_seed(version)
    return [(f"w{i}", torch.randn(16384, generator=gen)) for i in range(4)]


def _cut_role(role: int, port: int) -> object:
    """0: the sender (four receivers, then three); 1..4: r0..r3, the chain's order; r1 dies in version 2."""
    import os
    from dataclasses import replace

    from lightning_weightsync import WeightSyncError

    cfg = engine_cfg(
        port, bucket_size_mb=1 / 16, trainer__min_receivers=4, transport__fanout="chain",
        transport__chain_piece_mb=1 / 64, transport__timeout_s=60,
    )  # fmt: skip

    async def send() -> list:
        out: list = []
        async with WeightSender(cfg) as sender:
            for version in (1, 2, 3):
                t0 = time.monotonic()
                try:
                    stats = await sender.send_weights(_cut_weights(version), version=version)
                    out.append(("ok", stats.receivers, time.monotonic() - t0))
                except WeightSyncError as exc:
                    out.append((type(exc).__name__, str(exc), time.monotonic() - t0))
                    sender.settings = replace(sender.settings, min_receivers=3)
        return out

    async def take(identity: str) -> list:
        out: list = []
        if identity == "r1":  # dies (no Bye, no ack) as it posts its receives of version 2's second bucket: r0's
            # forward of that bucket fails, and r2 and r3 never get it, whatever the timing
            from lightning_weightsync.transport.backends import torch_pg

            relay = torch_pg.start_relay

            def dying(pg, data, bucket_index, *rest):
                if bucket_index == 1 and len(out) == 1:
                    os._exit(0)
                return relay(pg, data, bucket_index, *rest)

            torch_pg.start_relay = dying
        dest = {name: torch.empty_like(t) for name, t in _cut_weights(0)}
        async with WeightReceiver(cfg, identity=identity) as receiver:
            for _attempt in (1, 2, 3):
                try:
                    names = [n async for n, _ in receiver.receive_weights(into=lambda meta: dest[meta.name])]
                    assert_bitwise({n: dest[n] for n in names}, _cut_weights(int(receiver.version)))
                    out.append(("ok", receiver.version))
                except WeightSyncError as exc:
                    out.append((type(exc).__name__, str(exc)[:300]))
        return out

    return asyncio.run(send() if role == 0 else take(f"r{role - 1}"))


def test_a_member_killed_mid_version_fails_only_the_chain_behind_it_and_at_once():
    """r1 dies mid-version: r0, ahead of the cut, keeps the version (its failed forward is not a failure of its own
    bytes) unless the sender gave the whole version up first; r2 fails on its broken connection; r3, whose feeder r2
    is alive, is told by the sender at once (nothing else would end its wait before transport.timeout_s)."""
    port = free_port()
    sender, r0, _, r2, r3 = run_workers(_cut_role, [(r, port) for r in range(5)], timeout_s=110, doomed=[2])
    assert sender[0][:2] == ("ok", 4), sender
    kind, message, elapsed = sender[1]
    assert kind == "PeerError" and "r1" in message, sender  # named
    assert elapsed < 60 / 2, sender  # not transport.timeout_s
    assert sender[2][:2] == ("ok", 3), sender  # the next version, chained without it
    for survivor in (r0, r2, r3):  # every other version, bitwise
        assert survivor[0] == ("ok", 1) and survivor[2] == ("ok", 3), survivor
    assert r0[1] == ("ok", 2) or r0[1][0] == "VersionAborted", r0
    assert r2[1][0] != "ok" and r3[1][0] != "ok", (r2, r3)
