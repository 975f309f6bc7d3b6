"""The transfer engine end to end: real processes, real ZeroMQ sockets, real gloo groups / shm."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import replace

import pytest
import torch

from lightning_weightsync import (
    PeerError,
    VersionAborted,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
    WeightSyncTimeout,
)
from tests.support.mp import LOAD_SLACK_S, free_port, run_workers
from tests.support.transfer import (
    NIXL_MISSING,
    assert_bitwise,
    engine_cfg,
    expected_layout,
    largest,
    receive_once,
    stream,
    stream_nbytes,
    with_timeout,
)

# -- multi-process: the model-shaped stream, bitwise, several versions -------------------------------


def _receiver_proc(port: int, backend: str, bucket_mb: float, versions: int, stream_kw: dict, delay_s: float) -> list:
    time.sleep(delay_s)
    cfg = engine_cfg(port, backend=backend, bucket_size_mb=bucket_mb)

    async def main() -> list:
        seen = []
        async with WeightReceiver(cfg) as receiver:
            for _ in range(versions):
                got = await with_timeout(receive_once(receiver))
                assert_bitwise(got, stream(receiver.version, **stream_kw))
                seen.append((receiver.version, receiver.last_stats.num_buckets))
        return seen

    return asyncio.run(main())


def _sender_proc(
    port: int, backend: str, bucket_mb: float, versions: int, stream_kw: dict, rebuild: bool, delay_s: float
) -> dict:
    time.sleep(delay_s)
    cfg = engine_cfg(
        port, backend=backend, bucket_size_mb=bucket_mb, trainer__min_receivers=2, transport__rebuild_group=rebuild
    )

    async def main() -> dict:
        stats = []
        async with WeightSender(cfg) as sender:
            for version in range(1, versions + 1):
                s = await with_timeout(sender.send_weights(stream(version, **stream_kw), version=version))
                stats.append(s)
            generation = sender.generation
        return {"stats": stats, "generation": generation}

    return asyncio.run(main())


def _role(role: int, *args) -> object:
    port, backend, bucket_mb, versions, stream_kw, rebuild, sender_first = args
    if role == 0:
        return _sender_proc(port, backend, bucket_mb, versions, stream_kw, rebuild, 0.0 if sender_first else 0.7)
    return _receiver_proc(port, backend, bucket_mb, versions, stream_kw, 0.7 if sender_first else 0.0)


CASES = [
    # backend, bucket MiB, versions, stream, rebuild_group, sender starts first
    pytest.param("gloo", 1 / 1024, 2, {"scale": 256, "max_tensors": 30}, False, False, id="gloo-1KiB"),
    pytest.param("gloo", 0.0625, 3, {"scale": 64, "max_tensors": 200}, True, True, id="gloo-64KiB-rebuild"),
    pytest.param("gloo", 1.0, 3, {"scale": 64, "max_tensors": None}, False, False, id="gloo-1MiB-qwen3-8b"),
    pytest.param("gloo", 64.0, 2, {"scale": 32, "max_tensors": 120}, False, True, id="gloo-64MiB"),
    pytest.param("shm", 1 / 1024, 2, {"scale": 256, "max_tensors": 30}, False, True, id="shm-1KiB"),
    pytest.param("shm", 0.25, 3, {"scale": 64, "max_tensors": None}, True, False, id="shm-256KiB-qwen3-8b"),
    pytest.param(
        "gloo", 0.25, 2, {"model": "qwen3-30b-a3b", "scale": 64, "max_tensors": None}, False, True, id="gloo-moe-30b"
    ),
]


@pytest.mark.parametrize(("backend", "bucket_mb", "versions", "stream_kw", "rebuild", "sender_first"), CASES)
def test_model_stream_to_two_receivers_bitwise(backend, bucket_mb, versions, stream_kw, rebuild, sender_first):
    port = free_port()
    args = (port, backend, bucket_mb, versions, stream_kw, rebuild, sender_first)
    sender, recv_a, recv_b = run_workers(_role, [(0, *args), (1, *args), (2, *args)], timeout_s=110)
    bucket_size = int(bucket_mb * 1024 * 1024)
    for version, stats in enumerate(sender["stats"], start=1):
        expected = stream(version, **stream_kw)
        assert stats.version == version and stats.receivers == 2
        assert stats.nbytes == stream_nbytes(expected)
        assert stats.num_tensors == len(expected)
        # gloo: tensors >= transport.direct_min_mb get buckets of their own (sent direct), the rest are packed
        # to the last byte; shm cannot send from the caller's tensor, so everything is packed
        alone_from = 1 << 20 if backend == "gloo" else None
        # exact counts both ways (a tensor split when it must not be is as wrong as one that is not)
        buckets, chunked = expected_layout(expected, bucket_size, alone_from)
        assert (stats.num_buckets, stats.num_chunked_tensors) == (buckets, chunked)
        if alone_from is None or largest(expected) < alone_from:
            assert stats.num_buckets == max(1, -(-stats.nbytes // bucket_size))  # packed to the last byte
    assert [v for v, _ in recv_a] == [v for v, _ in recv_b] == list(range(1, versions + 1))
    assert [n for _, n in recv_a] == [s.num_buckets for s in sender["stats"]]
    assert sender["generation"] == (versions if rebuild else 1)


# -- in-process: protocol behaviour and failures (sender and receivers share one event loop) ----------


async def _serve(cfg, versions, *, n_receivers=1, stream_kw=None, consumers=None, may_fail=()):
    """Run a sender and `n_receivers` receivers for `versions`; returns (send results, received),
    `received[i]` a list of `(version, what the consumer returned)` per receiver.

    A failure is a result only for the versions in `may_fail` (a test that provokes it then checks
    it); anywhere else it propagates and fails the test, so a broken version cannot hide in a list.
    """
    stream_kw = stream_kw or {}
    sender = WeightSender(cfg)
    await sender.start()
    cfg_r = engine_cfg(
        sender.port,
        bucket_size_mb=cfg.transport.bucket_size_mb,
        backend=cfg.transport.backend,
        transport__auth_token=cfg.transport.auth_token,
    )
    receivers = [WeightReceiver(cfg_r, identity=f"r{i}") for i in range(n_receivers)]
    for r in receivers:
        await r.start()
    try:

        async def send_all():
            out = []
            for v in versions:
                try:
                    out.append(await sender.send_weights(stream(v, **stream_kw), version=v))
                except WeightSyncError as exc:
                    if v not in may_fail:
                        raise
                    out.append(exc)
            return out

        async def recv_all(i, r):
            got = []
            for v in versions:
                consume = (consumers or {}).get(i, receive_once)
                try:
                    result = await consume(r)  # (r.version is read after the version arrived)
                    got.append((r.version, result))
                except Exception as exc:
                    if v not in may_fail:
                        raise
                    got.append((r.version, exc))
            return got

        return await with_timeout(asyncio.gather(send_all(), *(recv_all(i, r) for i, r in enumerate(receivers))), 90)
    finally:
        for r in receivers:
            await r.close()
        await sender.close()


def _assert_every_version(received: list, versions: list[int], **stream_kw) -> None:
    """Each version a test sent arrived, in order, bitwise (not only the last one)."""
    assert [v for v, _ in received] == versions
    for version, got in received:
        assert_bitwise(got, stream(version, **stream_kw))


async def test_into_destinations_receive_in_place():
    cfg = engine_cfg(0, bucket_size_mb=1 / 256, trainer__min_receivers=1)
    expected = stream(1)
    dest = {n: torch.zeros_like(t.contiguous()) for n, t in expected}

    receive_stats = []

    async def consume(r):
        yielded = {}
        async for name, tensor in r.receive_weights(into=lambda meta: dest[meta.name]):
            assert tensor.data_ptr() == dest[name].data_ptr() or tensor.numel() == 0  # no staging copy
            yielded[name] = tensor
        receive_stats.append(r.last_stats)
        return yielded

    sent, received = await _serve(cfg, [1], consumers={0: consume})
    assert_bitwise(received[0][1], expected)
    assert_bitwise(dest, expected)
    # the embedding spans many buckets: its full-bucket chunks skip the pack copy and the merge copy;
    # a receiver also takes in place any bucket that happens to hold one chunk alone (packed or not)
    assert sent[0].direct_buckets > 0
    assert receive_stats[0].direct_buckets >= sent[0].direct_buckets
    assert receive_stats[0].num_buckets == sent[0].num_buckets


async def test_sender_times_out_without_receivers_and_names_the_knob():
    cfg = engine_cfg(0, transport__timeout_s=0.5, trainer__min_receivers=1)
    async with WeightSender(cfg) as sender:
        t0 = time.monotonic()
        with pytest.raises(WeightSyncTimeout, match="min_receivers"):
            await sender.send_weights(stream(1), version=1)
        elapsed = time.monotonic() - t0
        # it waited for the knob (not an instant give-up) and no longer than the knob allows
        assert cfg.transport.timeout_s <= elapsed < cfg.transport.timeout_s + LOAD_SLACK_S, elapsed


async def test_min_receivers_zero_sends_nothing_but_drains_the_stream():
    cfg = engine_cfg(0, trainer__min_receivers=0)
    pulled = []

    def gen():
        for name, t in stream(1):
            pulled.append(name)
            yield name, t

    async with WeightSender(cfg) as sender:
        stats = await sender.send_weights(gen(), version=1)
    assert stats.receivers == 0 and stats.nbytes == 0
    # the iterable is still consumed: on FSDP the other ranks run the same all-gathers
    assert pulled == [n for n, _ in stream(1)]


async def test_receiver_wait_for_version_times_out():
    cfg = engine_cfg(free_port())
    async with WeightReceiver(cfg) as receiver:
        with pytest.raises(WeightSyncTimeout, match="no version started"):
            await receive_once(receiver, wait_s=0.5)


async def test_versions_must_increase():
    cfg = engine_cfg(0, trainer__min_receivers=0)
    async with WeightSender(cfg) as sender:
        await sender.send_weights([], version=3)
        with pytest.raises(WeightSyncError, match="must increase"):
            await sender.send_weights([], version=3)


async def test_sender_failure_mid_version_aborts_receivers_then_recovers():
    cfg = engine_cfg(0, bucket_size_mb=1 / 256, trainer__min_receivers=2)
    sender = WeightSender(cfg)
    await sender.start()
    cfg_r = engine_cfg(sender.port, bucket_size_mb=1 / 256)
    receivers = [WeightReceiver(cfg_r, identity=f"r{i}") for i in range(2)]
    for r in receivers:
        await r.start()
    pulled = []

    def failing():
        for i, (name, t) in enumerate(stream(1)):
            if i == 10:
                raise RuntimeError("gather exploded")
            pulled.append(name)
            yield name, t

    try:

        async def recv_two(r):
            with pytest.raises(VersionAborted, match="gather exploded"):
                await receive_once(r)
            return await receive_once(r)

        async def send_two():
            with pytest.raises(RuntimeError, match="gather exploded"):
                await sender.send_weights(failing(), version=1)
            return await sender.send_weights(stream(2), version=2)

        stats, got_a, got_b = await with_timeout(asyncio.gather(send_two(), *(recv_two(r) for r in receivers)))
        assert stats.receivers == 2
        assert_bitwise(got_a, stream(2))
        assert_bitwise(got_b, stream(2))
        assert receivers[0].last_complete_version == 2
    finally:
        for r in receivers:
            await r.close()
        await sender.close()


async def test_failing_consumer_does_not_stall_the_others():
    cfg = engine_cfg(0, bucket_size_mb=1 / 256, trainer__min_receivers=2)

    async def broken_sink(r):
        got = {}
        async for name, t in r.receive_weights():
            got[name] = t.clone()
            if len(got) == 5 and r.version == 1:
                raise ValueError("sink rejected tensor")
        return got

    sent, got0, got1 = await _serve(cfg, [1, 2], n_receivers=2, consumers={1: broken_sink}, may_fail={1})
    assert isinstance(sent[0], PeerError) and "r1" in str(sent[0]) and "consumer stopped" in str(sent[0])
    assert sent[1].receivers == 2  # the next version reaches both again
    _assert_every_version(got0, [1, 2])  # the healthy receiver got both versions whole
    assert got1[0][0] == 1 and isinstance(got1[0][1], ValueError)
    _assert_every_version(got1[1:], [2])  # ... and the failed receiver takes the next version whole


async def test_a_destination_that_raises_fails_the_version_not_the_receiver():
    """`into` raising (a sink rejecting a tensor) is a local failure: the version is nacked with the
    reason, is never counted as complete, and the next version lands whole."""
    cfg = engine_cfg(0, bucket_size_mb=1 / 256, trainer__min_receivers=1)
    complete_before: list[int | None] = []  # last_complete_version as each version starts

    def into(meta):
        if meta.name == stream(1)[3][0] and complete_before == [None]:  # version 1 only
            raise KeyError(f"no slot for {meta.name}")
        return None

    async def consume(r):
        complete_before.append(r.last_complete_version)
        return await receive_once(r, into=into)

    sent, got = await _serve(cfg, [1, 2], consumers={0: consume}, may_fail={1})
    assert isinstance(sent[0], PeerError) and "no slot for" in str(sent[0]), sent[0]
    assert got[0][0] == 1 and isinstance(got[0][1], KeyError)
    _assert_every_version(got[1:], [2])
    assert complete_before == [None, None]  # the failed version 1 never counted as complete


async def test_wrong_auth_token_is_dropped_and_counted():
    cfg = engine_cfg(0, transport__timeout_s=1.5, transport__auth_token="right-secret-0123456")
    async with WeightSender(cfg) as sender:
        bad = WeightReceiver(engine_cfg(sender.port, transport__auth_token="wrong-secret-0123456"), identity="intruder")
        await bad.start()
        try:
            with pytest.raises(WeightSyncTimeout):
                await sender.send_weights(stream(1), version=1)
            assert sender.dropped_messages > 0
            assert "intruder" not in sender.registered
        finally:
            await bad.close()


async def test_signed_round_trip():
    cfg = engine_cfg(0, transport__auth_token="s3cret-token-for-tests", bucket_size_mb=1 / 128)
    sent, got = await _serve(cfg, [1, 2, 3])
    assert [(s.version, s.receivers) for s in sent] == [(1, 1), (2, 1), (3, 1)]
    _assert_every_version(got, [1, 2, 3])


async def test_receiver_restart_gets_next_version():
    cfg = engine_cfg(0, bucket_size_mb=1 / 128)
    async with WeightSender(cfg) as sender:
        cfg_r = engine_cfg(sender.port, bucket_size_mb=1 / 128)
        for version in (1, 2):  # a fresh receiver process each time, same identity
            async with WeightReceiver(cfg_r, identity="rollout-0") as r:
                got, stats = await with_timeout(
                    asyncio.gather(receive_once(r), sender.send_weights(stream(version), version=version))
                )
                assert_bitwise(got, stream(version))
                assert stats.receivers == 1


@pytest.mark.parametrize("backend", ["gloo", "shm"])
async def test_restarted_sender_serves_the_same_receiver(backend):
    """A trainer restart = a new sender session on the same port: the receiver re-registers by
    heartbeat and joins a fresh group (for shm: maps the new sender's new segments)."""
    port = free_port()
    cfg = engine_cfg(port, backend=backend, bucket_size_mb=1 / 64)
    async with WeightReceiver(cfg, identity="rollout-0") as receiver:
        for run in range(2):
            async with WeightSender(cfg) as sender:
                versions = [1, 2] if run == 0 else [1]  # a restarted trainer may start its numbering over
                for version in versions:
                    kw = {"scale": 128, "max_tensors": 40 + run}
                    got, stats = await with_timeout(
                        asyncio.gather(
                            receive_once(receiver), sender.send_weights(stream(version, **kw), version=version)
                        )
                    )
                    assert_bitwise(got, stream(version, **kw))
                    assert stats.receivers == 1


# -- a receiver killed mid-version (kill -9 semantics: os._exit, no goodbye) -------------------------


def _dying_receiver(port: int, backend: str) -> None:
    cfg = engine_cfg(port, backend=backend.partition("-")[0], bucket_size_mb=1 / 256)

    async def main() -> None:
        receiver = WeightReceiver(cfg, identity="doomed")
        await receiver.start()
        n = 0
        async for _name, _t in receiver.receive_weights():
            n += 1
            if n == 3:
                os._exit(1)  # no Bye, no ack, sockets torn down by the kernel

    asyncio.run(main())


def _surviving_receiver(port: int, backend: str) -> list:
    cfg = engine_cfg(port, backend=backend.partition("-")[0], bucket_size_mb=1 / 256)

    async def main() -> list:
        outcomes = []
        async with WeightReceiver(cfg, identity="survivor") as receiver:
            while len(outcomes) < 2:
                try:
                    got = await with_timeout(receive_once(receiver), 60)
                    assert_bitwise(got, stream(receiver.version))
                    outcomes.append(("ok", receiver.version))
                except WeightSyncError as exc:
                    outcomes.append((type(exc).__name__, receiver.version))
        return outcomes

    return asyncio.run(main())


def _sender_with_a_dying_receiver(port: int, backend: str) -> list:
    # timeout_s far above LOAD_SLACK_S: a death noticed by waiting for the knob is told apart from one
    # noticed at once, however loaded the machine (the healthy path never waits for it)
    backend, _, fanout = backend.partition("-")  # gloo-chain: the doomed one feeds the survivor (chain order r1, r2)
    cfg = engine_cfg(
        port, backend=backend, bucket_size_mb=1 / 256, trainer__min_receivers=2, transport__timeout_s=60,
        transport__fanout=fanout or "broadcast",
    )  # fmt: skip

    async def main() -> list:
        results = []
        async with WeightSender(cfg) as sender:
            t0 = time.monotonic()
            try:
                await sender.send_weights(stream(1), version=1)
                results.append(("ok", ""))
            except WeightSyncError as exc:
                results.append((type(exc).__name__, str(exc)))
            results.append(time.monotonic() - t0)
            # the dead one is gone; carry on with who is left
            sender.settings = replace(sender.settings, min_receivers=1)
            try:
                stats = await sender.send_weights(stream(2), version=2)
                results.append(stats.receivers)
            except WeightSyncError as exc:  # returned, so that the test shows it with the survivor's side
                results.append(f"{type(exc).__name__}: {exc}")
        return results

    return asyncio.run(main())


def _dying_role(role: int, port: int, backend: str) -> object:
    if role == 0:
        return _sender_with_a_dying_receiver(port, backend)
    if role == 1:
        return _surviving_receiver(port, backend)
    _dying_receiver(port, backend)
    return None


@pytest.mark.parametrize(
    "backend",
    [
        "gloo",
        "gloo-chain",
        "shm",
        pytest.param("nixl", marks=pytest.mark.skipif(NIXL_MISSING is not None, reason=str(NIXL_MISSING))),
    ],
)
def test_receiver_killed_mid_version_fails_the_version_not_the_session(backend):
    port = free_port()
    codes: list[int | None] = []
    args = [(r, port, backend) for r in range(3)]
    sender, survivor, _ = run_workers(_dying_role, args, timeout_s=100, doomed=[2], exit_codes=codes)
    assert codes[2] == 1  # it really died
    # bounded, named, not a hang; and noticed at once, not by waiting out transport.timeout_s=60
    (kind, message), elapsed, receivers_v2 = sender
    assert kind == "PeerError" and "doomed" in message, sender  # named
    assert elapsed < 60 / 2, sender
    assert receivers_v2 == 1, (sender, survivor)  # the next version reached the survivor
    assert survivor[0][0] in ("VersionAborted", "PeerError", "WeightSyncTimeout")
    assert survivor[1] == ("ok", 2)


async def test_producer_may_reuse_its_tensor_once_the_next_is_pulled():
    """The chunk lifetime contract with direct (zero-copy) buckets: a producer that refills one
    buffer for every tensor (as a gather into a reused buffer would) must not corrupt broadcasts
    still in flight from that buffer."""
    bucket = 64 * 1024
    numel = (bucket * 5 // 2) // 4  # 2.5 buckets of float32: full-bucket middle chunks go direct
    buf = torch.empty(numel)

    def reusing_producer():
        for i in range(12):
            buf.fill_(float(i))
            yield f"w{i}", buf

    port = free_port()
    cfg = engine_cfg(port, bucket_size_mb=bucket / 2**20)
    async with WeightSender(cfg) as sender, WeightReceiver(cfg) as receiver:
        got, stats = await with_timeout(
            asyncio.gather(receive_once(receiver), sender.send_weights(reusing_producer(), version=1))
        )
    assert stats.direct_buckets > 0
    for i in range(12):
        assert torch.equal(got[f"w{i}"], torch.full((numel,), float(i))), f"w{i} corrupted"


@pytest.mark.parametrize("token", [None, "s3cret-token-for-tests"])
async def test_hostile_messages_mid_version_are_dropped_and_the_version_still_lands(token):
    """Garbage, a forged bucket with out-of-range offsets, and (with a token) an unsigned or
    wrongly signed but otherwise valid bucket, injected while a version is in flight: each is
    rejected and counted, none is acted upon, and the version arrives bitwise."""
    from lightning_weightsync.protocol.messages import BucketMeta, Entry, encode

    port = free_port()
    cfg = engine_cfg(port, bucket_size_mb=1 / 256, transport__auth_token=token)
    forged_out_of_range = BucketMeta(1, 7, True, 16, [Entry("model.norm.weight", [4], "float32", 0, 16, 4000)])
    forged_valid = BucketMeta(1, 1, True, 4, [Entry("model.norm.weight", [1], "float32", 0, 4, 0)])
    junk = [[b"\x93garbage"], encode(forged_out_of_range, token.encode() if token else None)]
    if token:
        junk += [encode(forged_valid), encode(forged_valid, b"wrong-key")]

    async with WeightSender(cfg) as sender, WeightReceiver(cfg, identity="r0") as receiver:

        async def weights():
            for i, (name, tensor) in enumerate(stream(1)):
                if i == 5:  # the receiver is inside the version now
                    for frames in junk:
                        await sender._control.inject(sender._control.route_of("r0"), frames)
                yield name, tensor

        got, stats = await with_timeout(
            asyncio.gather(receive_once(receiver), sender.send_weights(weights(), version=1))
        )
    assert_bitwise(got, stream(1))
    assert stats.receivers == 1 and not stats.failed
    assert receiver.dropped_messages == len(junk)


def test_stats_as_metrics_are_flat_base_units():
    from lightning_weightsync import ReceiveStats, SendStats

    sent = SendStats(version=3, nbytes=2_000_000_000, seconds=2.0, num_buckets=5, receivers=2, failed={"r1": "x"})
    metrics = sent.as_metrics()
    assert metrics["bytes"] == 2e9 and metrics["seconds"] == 2.0 and metrics["bytes_per_second"] == 1e9
    assert metrics["buckets"] == 5 and metrics["receivers"] == 2 and metrics["failed_receivers"] == 1
    assert all(isinstance(v, (int, float)) for v in metrics.values())
    assert sent.gbps == 1.0  # the old property, still read by trainer/ and rollout/
    received = ReceiveStats(version=3, nbytes=10, seconds=0.0).as_metrics()
    assert received["bytes_per_second"] == 0.0 and "receivers" not in received


class _ScriptedSteps:
    """Bucket metadata from a list, as the receiver's session would hand it over (already validated)."""

    def __init__(self, metas):
        self.metas = metas

    async def next_bucket(self, version, bucket_index, timeout_s):
        if isinstance(self.metas[bucket_index], BaseException):
            raise self.metas[bucket_index]
        return self.metas[bucket_index]


def _loopback_backend(wire):
    """A receiver backend whose "broadcast" copies scripted bytes into the slot (or raises)."""
    from lightning_weightsync.protocol.joins.store import StoreJoin
    from lightning_weightsync.transport.backends import NUM_SLOTS, Backend

    class Loopback(Backend):
        join_type = StoreJoin

        def join_spec(self, generation):
            return StoreJoin("127.0.0.1", 1)

        def _build_group(self, group, rank):
            pass

        def broadcast(self, slot, nbytes, bucket_index, buffer=None):
            data = wire[bucket_index]
            if isinstance(data, threading.Event):  # a broadcast the sender never finishes
                data.wait()
                return
            if isinstance(data, BaseException):
                raise data
            self.buckets[slot][:nbytes].copy_(data)

        def release(self, slot, bucket_index):
            self.released.append((slot, bucket_index))

    backend = Loopback(bucket_size=16, device=torch.device("cpu"), timeout_s=5.0, is_sender=False)
    backend.buckets = [torch.zeros(16, dtype=torch.uint8) for _ in range(NUM_SLOTS)]
    backend.released = []
    return backend


@pytest.mark.parametrize("failure", [None, "timeout", "runtime"])
async def test_bucket_pipeline_runs_on_what_it_is_given(failure):
    """The receive pipeline takes its collaborators as arguments: with a scripted control plane and a
    loopback backend it merges bitwise through `view`, releases each slot once, and a backend's own
    WeightSyncError keeps its type (a bare RuntimeError becomes a PeerError)."""
    from lightning_weightsync import PeerError, ReceiveStats
    from lightning_weightsync.protocol.chunks import as_bytes, merge_weight_chunks
    from lightning_weightsync.protocol.joins.store import StoreJoin
    from lightning_weightsync.protocol.messages import BucketMeta, Entry, GroupSpec, Member, Plan
    from lightning_weightsync.transport.executor import SerialExecutor
    from lightning_weightsync.versions.pipeline import BucketPipeline

    weight = torch.arange(8, dtype=torch.float32)
    raw = as_bytes(weight)
    metas = [
        BucketMeta(1, 0, False, 16, [Entry("w", [8], "float32", 0, 16, 0)]),
        BucketMeta(1, 1, True, 16, [Entry("w", [8], "float32", 16, 16, 0)]),
    ]
    wire: list = [raw[:16].clone(), raw[16:].clone()]
    if failure == "timeout":
        wire[1] = WeightSyncTimeout("the sender went quiet")
    elif failure == "runtime":
        wire[1] = RuntimeError("connection reset")
    backend, executor = _loopback_backend(wire), SerialExecutor("test-pipeline")
    plan = Plan(1, 1, GroupSpec("s", 1, "loopback", 16, [Member("r", 1)], StoreJoin("127.0.0.1", 1)))
    pipeline = BucketPipeline(plan, steps=_ScriptedSteps(metas), backend=backend, executor=executor, timeout_s=5)
    stats = ReceiveStats(version=1)
    try:
        merged = merge_weight_chunks(pipeline.chunks(stats), 16)
        if failure is None:
            got = {name: t.clone() async for name, t in merged}
            assert torch.equal(as_bytes(got["w"]), raw)
            assert backend.released == [(0, 0), (1, 1)] and stats.num_buckets == 2 and stats.nbytes == 32
        else:
            expected = WeightSyncTimeout if failure == "timeout" else PeerError
            with pytest.raises(expected) as info:
                async for _ in merged:
                    pass
            assert type(info.value) is expected
    finally:
        pipeline.cancel()
        executor.shutdown()


async def test_an_abort_ends_the_wait_for_a_broadcast_the_sender_never_finishes():
    """The sender aborts the version while this rank waits for a bucket's broadcast it will never finish (it
    gave its group up): the wait ends with the abort at once, not at transport.timeout_s (past the next
    version's Ready), and the pipeline says a broadcast was left behind, so the receiver gives its group up."""
    from lightning_weightsync import ReceiveStats
    from lightning_weightsync.protocol.joins.store import StoreJoin
    from lightning_weightsync.protocol.messages import BucketMeta, Entry, GroupSpec, Member, Plan
    from lightning_weightsync.transport.executor import SerialExecutor
    from lightning_weightsync.versions.pipeline import BucketPipeline

    never = threading.Event()
    metas = [BucketMeta(1, 0, False, 16, [Entry("w", [8], "float32", 0, 16, 0)]), VersionAborted("aborted: r2 gone")]
    backend, executor = _loopback_backend([never]), SerialExecutor("test-pipeline")
    plan = Plan(1, 1, GroupSpec("s", 1, "loopback", 16, [Member("r", 1)], StoreJoin("127.0.0.1", 1)))
    pipeline = BucketPipeline(plan, steps=_ScriptedSteps(metas), backend=backend, executor=executor, timeout_s=60)
    try:
        with pytest.raises(VersionAborted, match="r2 gone"):
            await with_timeout(anext(pipeline.chunks(ReceiveStats(version=1))), 10)
        pipeline.cancel()
        assert pipeline.abandoned
    finally:
        never.set()
        pipeline.cancel()
        executor.shutdown()


@pytest.mark.parametrize("left_behind", [True, False], ids=["one-left-behind", "all-complete"])
async def test_cancelling_a_receive_with_several_buckets_queued_gives_the_group_up_if_any_was_left_behind(
    left_behind,
):
    """Two buckets posted and queued, the consumer at neither: the first broadcast complete, the second one (left
    behind) never finished by the sender. Cancelling the receive must see the second, not stop at the first: a
    broadcast left posted holds the data-plane thread and the group is out of step (the receiver gives it up);
    with every queued broadcast complete, the group is kept."""
    from lightning_weightsync.protocol.chunks import as_bytes
    from lightning_weightsync.protocol.joins.store import StoreJoin
    from lightning_weightsync.protocol.messages import BucketMeta, Entry, GroupSpec, Member, Plan
    from lightning_weightsync.transport.executor import SerialExecutor
    from lightning_weightsync.versions.pipeline import BucketPipeline

    raw = as_bytes(torch.arange(8, dtype=torch.float32))
    never = threading.Event()
    metas = [
        BucketMeta(1, 0, False, 16, [Entry("w", [8], "float32", 0, 16, 0)]),
        BucketMeta(1, 1, True, 16, [Entry("w", [8], "float32", 16, 16, 0)]),
    ]
    wire = [raw[:16].clone(), never if left_behind else raw[16:].clone()]
    backend, executor = _loopback_backend(wire), SerialExecutor("test-pipeline")
    plan = Plan(1, 1, GroupSpec("s", 1, "loopback", 16, [Member("r", 1)], StoreJoin("127.0.0.1", 1)))
    pipeline = BucketPipeline(plan, steps=_ScriptedSteps(metas), backend=backend, executor=executor, timeout_s=60)
    try:

        async def both_posted() -> None:
            while pipeline.ready.qsize() < 2 or not pipeline.ready._queue[0][3].done():
                await asyncio.sleep(0.01)
            if not left_behind:
                await pipeline.ready._queue[1][3]

        await with_timeout(both_posted(), 10)
        pipeline.cancel()
        assert pipeline.abandoned is left_behind
    finally:
        never.set()
        pipeline.cancel()
        executor.shutdown()


# -- layout once (transport.layout_once, protocol/layout.py) -----------------------------------------------


@pytest.mark.parametrize("layout_once", [True, False], ids=["layout-once", "every-entry"])
async def test_a_held_layout_stands_for_the_entries_and_a_changed_cut_goes_whole(layout_once):
    """Two receivers; versions 2 and 3 are cut like version 1, version 4 has a tensor more at the end (the
    buckets before it are cut as before), and a receiver that joins at version 4 holds no layout."""
    cfg = engine_cfg(0, bucket_size_mb=1 / 64, transport__layout_once=layout_once, trainer__min_receivers=2)
    streams = {v: stream(v, max_tensors=24) for v in (1, 2, 3)}
    streams[4] = [*stream(4, max_tensors=24), ("extra.tail", torch.arange(777, dtype=torch.float32))]
    async with WeightSender(cfg) as sender:
        cfg_r = engine_cfg(sender.port, bucket_size_mb=1 / 64)
        receivers = [WeightReceiver(cfg_r, identity=f"r{i}") for i in range(2)]
        for r in receivers:
            await r.start()
        try:
            for version, weights in streams.items():
                if version == 4:  # r1 restarts: same identity, nothing held
                    await receivers[1].close()
                    receivers[1] = WeightReceiver(cfg_r, identity="r1")
                    await receivers[1].start()
                got = await with_timeout(
                    asyncio.gather(sender.send_weights(weights, version=version), *map(receive_once, receivers))
                )
                stats = got[0]
                for received, r in zip(got[1:], receivers, strict=True):
                    assert_bitwise(received, weights)
                    assert r.last_stats.layout_buckets == stats.layout_buckets, version
                flushes = stats.num_buckets + 1  # and the empty terminator after a direct bucket, if any
                if layout_once and version in (2, 3):  # every bucket named by the held layout's digest
                    assert stats.num_buckets <= stats.layout_buckets <= flushes
                else:  # version 1 and the restarted receiver have none; off: every bucket lists its entries
                    assert stats.layout_buckets == 0, version
            if layout_once:  # version 5 to both (both hold version 4's layout): the tail's buckets are named too
                weights = [*stream(5, max_tensors=24), ("extra.tail", torch.arange(777, dtype=torch.float32) + 1)]
                got = await with_timeout(
                    asyncio.gather(sender.send_weights(weights, version=5), *map(receive_once, receivers))
                )
                assert got[0].num_buckets <= got[0].layout_buckets
                for received in got[1:]:
                    assert_bitwise(received, weights)
        finally:
            for r in receivers:
                await r.close()


async def test_a_version_cut_partly_like_the_held_layout_names_only_the_buckets_before_the_change():
    cfg = engine_cfg(0, bucket_size_mb=1 / 64)
    first = stream(1, max_tensors=24)
    # a tensor in the middle grows: the buckets before it are cut as before, the ones from it on are not
    changed = list(stream(2, max_tensors=24))
    middle = len(changed) // 2
    name, tensor = changed[middle]
    changed[middle] = (name, torch.cat([tensor.reshape(-1), tensor.reshape(-1)[:3]]))
    sender = WeightSender(cfg)
    await sender.start()
    try:
        async with WeightReceiver(engine_cfg(sender.port, bucket_size_mb=1 / 64), identity="r0") as r:
            for version, weights in ((1, first), (2, changed)):
                got, stats = await with_timeout(
                    asyncio.gather(receive_once(r), sender.send_weights(weights, version=version))
                )
                assert_bitwise(got, weights)
            assert 0 < stats.layout_buckets < stats.num_buckets
            assert r.last_stats.layout_buckets == stats.layout_buckets
    finally:
        await sender.close()
