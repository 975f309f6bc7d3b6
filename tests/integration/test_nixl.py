"""transport.backend=nixl end to end on CPU: DRAM to DRAM over UCX between real processes, bitwise.

The same engine as every backend (WeightSender / WeightReceiver), with what is nixl's own: receivers READ
the sender's registered slots, release them over a monitored socket, READ one-chunk buckets straight into
the consumer's tensors (registrations cached), and a receiver that dies mid-version fails the version at
once, naming it. Skipped where NIXL is not installed (`./dev setup` installs the `[nixl]` extra)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import replace

import pytest
import torch

from lightning_weightsync import PeerError, WeightReceiver, WeightSender, WeightSyncError, WeightSyncTimeout
from lightning_weightsync.transport.backends import NUM_SLOTS, build_backend
from tests.support.mp import LOAD_SLACK_S, free_port, run_workers
from tests.support.transfer import (
    NIXL_MISSING,
    assert_bitwise,
    engine_cfg,
    largest,
    receive_once,
    stream,
    stream_nbytes,
    with_timeout,
)

pytestmark = pytest.mark.skipif(NIXL_MISSING is not None, reason=str(NIXL_MISSING))

# -- multi-process: model-shaped streams to 1 and 3 receivers, bitwise, several versions ------------------


def _receiver(port: int, bucket_mb: float, versions: int, stream_kw: dict, into: bool) -> dict:
    cfg = engine_cfg(port, backend="nixl", bucket_size_mb=bucket_mb)

    async def main() -> dict:
        seen, direct, regs = [], [], []
        dest = {n: torch.zeros_like(t.contiguous()) for n, t in stream(1, **stream_kw)} if into else None
        async with WeightReceiver(cfg) as receiver:
            for _ in range(versions):
                if dest is None:
                    got = await with_timeout(receive_once(receiver))
                else:
                    got = await with_timeout(receive_once(receiver, into=lambda meta: dest[meta.name]))
                    assert_bitwise(dest, stream(receiver.version, **stream_kw))
                assert_bitwise(got, stream(receiver.version, **stream_kw))
                seen.append(receiver.version)
                direct.append(receiver.last_stats.direct_buckets)
                backend = receiver._lane.backend
                regs.append((backend.registrations, backend.registration_hits))
        return {"versions": seen, "direct": direct, "registrations": regs}

    return asyncio.run(main())


def _sender(port: int, bucket_mb: float, versions: int, stream_kw: dict, receivers: int) -> list:
    cfg = engine_cfg(port, backend="nixl", bucket_size_mb=bucket_mb, trainer__min_receivers=receivers)

    async def main() -> list:
        async with WeightSender(cfg) as sender:
            return [
                await with_timeout(sender.send_weights(stream(v, **stream_kw), version=v))
                for v in range(1, versions + 1)
            ]

    return asyncio.run(main())


def _role(role: int, port: int, bucket_mb: float, versions: int, stream_kw: dict, receivers: int) -> object:
    if role == 0:
        return _sender(port, bucket_mb, versions, stream_kw, receivers)
    return _receiver(port, bucket_mb, versions, stream_kw, into=role == 1)


@pytest.mark.parametrize(
    ("receivers", "bucket_mb", "stream_kw"),
    [
        pytest.param(1, 1 / 64, {"scale": 128, "max_tensors": 40}, id="1-receiver-16KiB"),
        pytest.param(3, 0.0625, {"scale": 64, "max_tensors": 120}, id="3-receivers-64KiB"),
    ],
)
def test_model_stream_bitwise_to_receivers(receivers, bucket_mb, stream_kw):
    port, versions = free_port(), 2
    args = [(role, port, bucket_mb, versions, stream_kw, receivers) for role in range(receivers + 1)]
    sent, *received = run_workers(_role, args, timeout_s=110)
    bucket_size = int(bucket_mb * 2**20)
    for version, stats in enumerate(sent, start=1):
        expected = stream(version, **stream_kw)
        assert largest(expected) > bucket_size  # tensors larger than a bucket are split across buckets
        assert stats.receivers == receivers and stats.nbytes == stream_nbytes(expected)
        assert stats.direct_buckets == 0  # the sender always packs: receivers read slot k % NUM_SLOTS
        assert stats.num_buckets == max(1, -(-stats.nbytes // bucket_size))  # packed to the last byte
    for r in received:
        assert r["versions"] == list(range(1, versions + 1))
    # the receiver with destinations READ the full-bucket chunks straight into them ...
    assert all(d > 0 for d in received[0]["direct"]), received[0]
    # ... registering each destination storage once: version 2 only hit the cache
    (regs_1, hits_1), (regs_2, hits_2) = received[0]["registrations"]
    assert regs_1 > NUM_SLOTS and regs_2 == regs_1 and hits_2 > hits_1
    for r in received[1:]:
        assert r["direct"] == [0] * versions and r["registrations"][-1][0] == NUM_SLOTS  # only its slots


# -- in-process: a late receiver, a signed round trip -------------------------------------------------


async def test_late_receiver_joins_the_next_version_and_both_get_it_bitwise():
    cfg = engine_cfg(0, backend="nixl", bucket_size_mb=1 / 128, trainer__min_receivers=1)
    async with WeightSender(cfg) as sender:
        cfg_r = engine_cfg(sender.port, backend="nixl", bucket_size_mb=1 / 128)
        async with WeightReceiver(cfg_r, identity="early") as early:
            got, stats = await with_timeout(
                asyncio.gather(receive_once(early), sender.send_weights(stream(1), version=1))
            )
            assert_bitwise(got, stream(1))
            assert stats.receivers == 1
            sender.settings = replace(sender.settings, min_receivers=2)  # version 2 waits for the late one to register
            async with WeightReceiver(cfg_r, identity="late") as late:
                got_early, got_late, stats = await with_timeout(
                    asyncio.gather(receive_once(early), receive_once(late), sender.send_weights(stream(2), version=2))
                )
            assert_bitwise(got_early, stream(2))
            assert_bitwise(got_late, stream(2))
            assert stats.receivers == 2 and late.version == 2


async def test_signed_round_trip():
    """With transport.auth_token the plan (agent metadata, slot addresses) and every release are signed."""
    token = "s3cret-0123456789"
    cfg = engine_cfg(0, backend="nixl", bucket_size_mb=1 / 128, transport__auth_token=token)
    async with WeightSender(cfg) as sender:
        cfg_r = engine_cfg(sender.port, backend="nixl", bucket_size_mb=1 / 128, transport__auth_token=token)
        async with WeightReceiver(cfg_r) as receiver:
            for version in (1, 2):
                got, stats = await with_timeout(
                    asyncio.gather(receive_once(receiver), sender.send_weights(stream(version), version=version))
                )
                assert_bitwise(got, stream(version))
                assert stats.receivers == 1 and not stats.failed


# -- a receiver killed mid-version: tests/integration/test_transfer.py, parametrized over the backends, nixl too


# -- the backend interface directly: slot reuse is safe -------------------------------------------------------


def _kwargs(**extra):
    return {"bucket_size": 4096, "device": torch.device("cpu"), "timeout_s": 5.0, "is_sender": True, **extra}


def _group(join, members=("r0",), generation=1):
    from lightning_weightsync.protocol.messages import GroupSpec, Member

    return GroupSpec("sess", generation, "nixl", 4096, [Member(m, os.getpid()) for m in members], join)


@pytest.fixture
def pair():
    sender = build_backend("nixl", **_kwargs())
    receiver = build_backend("nixl", **_kwargs(is_sender=False, identity="r0", session="sess"))
    sender.setup("127.0.0.1", 0)
    yield sender, receiver
    receiver.close()
    sender.close()


def test_the_sender_reuses_a_slot_only_after_every_member_read_it(pair):
    """`broadcast` on the sender returns only once the member released the bucket, which a receiver
    does only after its READ completed: a slot can be repacked then, never while a receiver reads it.
    A late release of an earlier version, or one by a non-member, frees nothing."""
    import zmq

    from lightning_weightsync.protocol.messages import BucketDone, encode

    sender, receiver = pair
    group = _group(sender.join_spec(1))
    sender.join(group, 0, 5)
    receiver.join(group, 1, 5)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.linger = 0
    try:
        push.connect(group.join.release_addr)
        push.send_multipart(encode(BucketDone("r0", 4, 0)))  # late, from version 4
        push.send_multipart(encode(BucketDone("intruder", 5, 0)))  # not a member
        sender.timeout_s = 1.0
        with pytest.raises(WeightSyncTimeout, match="released by 0 of 1"):
            sender.broadcast(0, 100, 0)
        sender.timeout_s = 5.0
        data = torch.arange(100, dtype=torch.uint8)
        sender.pack(0, 0, data)
        done = threading.Event()
        waiter = threading.Thread(target=lambda: (sender.broadcast(0, 100, 0), done.set()))
        waiter.start()
        assert not done.wait(0.3)  # nobody read bucket 0 yet: the slot stays taken
        receiver.broadcast(0, 100, 0)  # READ, then release
        waiter.join(5)
        assert done.is_set()
        assert torch.equal(receiver.view(0, 100), data)
        # bucket k comes from slot k % NUM_SLOTS, and the sender refuses anything else
        with pytest.raises(WeightSyncError, match="must come from slot 1"):
            sender.broadcast(0, 100, 1)
    finally:
        push.close()


def test_a_direct_read_lands_in_the_callers_tensor_and_its_registration_is_cached(pair):
    sender, receiver = pair
    group = _group(sender.join_spec(1))
    sender.join(group, 0, 1)
    receiver.join(group, 1, 1)
    dest = torch.zeros(3000, dtype=torch.uint8)
    for k, value in enumerate((7, 9, 11)):
        sender.pack(k % NUM_SLOTS, 0, torch.full((1000,), value, dtype=torch.uint8))
        waiter = threading.Thread(target=sender.broadcast, args=(k % NUM_SLOTS, 1000, k))
        waiter.start()
        receiver.broadcast(-1, 1000, k, dest[k * 1000 : (k + 1) * 1000])
        waiter.join(5)
    assert torch.equal(dest, torch.tensor([7, 9, 11], dtype=torch.uint8).repeat_interleave(1000))
    assert receiver.registrations == NUM_SLOTS + 1  # the slots, then dest's storage once
    assert receiver.registration_hits == 2
    # freed storage: a new tensor (maybe at the same address) is registered afresh, never trusted stale
    del dest
    other = torch.zeros(1000, dtype=torch.uint8)
    sender.pack(1, 0, torch.full((1000,), 3, dtype=torch.uint8))
    waiter = threading.Thread(target=sender.broadcast, args=(1, 1000, 3))
    waiter.start()
    receiver.broadcast(-1, 1000, 3, other)
    waiter.join(5)
    assert torch.equal(other, torch.full((1000,), 3, dtype=torch.uint8))
    assert receiver.registrations == NUM_SLOTS + 2


def test_receiver_rejects_plans_it_cannot_use(pair):
    from lightning_weightsync import ProtocolError
    from lightning_weightsync.protocol.joins.nixl import NixlJoin

    sender, receiver = pair
    spec = sender.join_spec(1)
    with pytest.raises(ProtocolError, match="expected 2 of at least bucket_size"):
        receiver.join(_group(NixlJoin(spec.agent, spec.metadata, "DRAM", spec.slots[:1], spec.release_addr)), 1, 1)
    with pytest.raises(ProtocolError, match="its metadata is"):
        receiver.join(_group(NixlJoin("someone-else", spec.metadata, "DRAM", spec.slots, spec.release_addr)), 1, 1)
    with pytest.raises(PeerError, match="cannot load the sender's agent metadata"):
        receiver.join(_group(NixlJoin(spec.agent, b"\x00garbage", "DRAM", spec.slots, spec.release_addr)), 1, 1)


def test_a_dead_sender_fails_a_read_within_the_timeout():
    """The sender's agent is gone (closed): a receiver's READ of its slot fails or times out, bounded."""
    sender = build_backend("nixl", **_kwargs())
    receiver = build_backend("nixl", **_kwargs(is_sender=False, identity="r0", session="sess", timeout_s=2.0))
    try:
        sender.setup("127.0.0.1", 0)
        group = _group(sender.join_spec(1))
        receiver.join(group, 1, 1)
        sender.close()
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError):
            receiver.broadcast(0, 100, 0)
        assert time.monotonic() - t0 < 2.0 + LOAD_SLACK_S
    finally:
        receiver.close()
        sender.close()
