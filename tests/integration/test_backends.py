"""Backends that need hardware: what CPU can check (clear errors, handle encoding), and the real
runs, skipped with a reason where the hardware is missing. gloo and shm are covered end to end in
test_transfer.py; nccl / hccl / cuda_ipc share its sender, receiver and group bookkeeping."""

from __future__ import annotations

import asyncio
import importlib.util
import os

import pytest
import torch

from lightning_weightsync import BackendUnavailable, WeightReceiver, WeightSender
from lightning_weightsync.transport.backends import backend_class, build_backend
from lightning_weightsync.transport.backends import shared as shared_backends
from lightning_weightsync.transport.device import resolve_device
from tests.support.mp import free_port, run_workers
from tests.support.transfer import assert_bitwise, engine_cfg, receive_once, stream, with_timeout

HAS_CUDA = torch.cuda.is_available()
HAS_CUPY = importlib.util.find_spec("cupy") is not None
HAS_NPU = importlib.util.find_spec("torch_npu") is not None
# `gpu` / `npu` markers: `pytest -m gpu` on a GPU machine selects exactly these (conftest skips them,
# with the reason, where the hardware is missing); cupy is an extra condition on top
needs_cuda = pytest.mark.gpu
needs_npu = pytest.mark.npu


def needs_cupy(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUPY, reason="needs cupy (extra [nccl])")(fn))


def _kwargs(**extra):
    return {"bucket_size": 1024, "device": torch.device("cpu"), "timeout_s": 5.0, "is_sender": True, **extra}


@pytest.mark.skipif(HAS_CUPY, reason="cupy is installed: the missing-extra message cannot be shown")
def test_nccl_without_cupy_names_the_extra():
    with pytest.raises(BackendUnavailable, match=r"\[nccl\]"):
        build_backend("nccl", **_kwargs())


@pytest.mark.skipif(HAS_NPU, reason="torch_npu is installed: the missing-extra message cannot be shown")
def test_hccl_without_torch_npu_names_the_extra():
    with pytest.raises(BackendUnavailable, match=r"\[npu\]"):
        build_backend("hccl", **_kwargs())
    with pytest.raises(BackendUnavailable, match=r"\[npu\]"):
        resolve_device("hccl", None, backend_class("hccl").natural_device)


@pytest.mark.skipif(HAS_CUDA, reason="a GPU is present")
@pytest.mark.parametrize("backend", ["nccl", "cuda_ipc"])
def test_gpu_backends_on_a_cpu_machine_fail_with_the_fix(backend):
    cfg = engine_cfg(0, backend=backend)
    with pytest.raises(BackendUnavailable, match=r"transport\.backend=gloo"):
        WeightSender(cfg)
    with pytest.raises(BackendUnavailable, match="needs a CUDA GPU"):
        WeightReceiver(cfg)


def test_every_backend_implements_the_same_interface():
    from lightning_weightsync.transport.backends.base import Backend

    for name in ("gloo", "shm", "cuda_ipc", "nccl", "hccl"):
        try:
            cls = backend_class(name)
        except BackendUnavailable:  # pragma: no cover - import-time dependency missing
            continue
        assert issubclass(cls, Backend) and cls.name == name
        assert not getattr(cls, "__abstractmethods__", None), f"{name} leaves abstract methods"


# -- the engine <-> backend interface, on CPU ----------------------------------------------------------


def _group(join, *, backend="gloo", bucket_size=1024, members=("r0",)):
    from lightning_weightsync.protocol.messages import GroupSpec, Member

    return GroupSpec("sess", 1, backend, bucket_size, [Member(m, os.getpid()) for m in members], join)


@pytest.mark.parametrize("name", ["gloo", "shm"])
def test_sender_says_what_the_plan_needs_and_packs_through_the_backend(name):
    """The sender's side of the interface: a typed join spec, `pack` into a slot, `view` of it, and
    members that come in through the group spec."""
    from lightning_weightsync.protocol.joins.shared import SharedJoin
    from lightning_weightsync.protocol.joins.store import StoreJoin
    from lightning_weightsync.protocol.messages import validate_group
    from lightning_weightsync.transport.backends import NUM_SLOTS, next_slot

    backend = build_backend(name, **_kwargs())
    try:
        backend.setup("127.0.0.1", 0)
        spec = backend.join_spec(1)
        assert isinstance(spec, backend.join_type)
        if name == "gloo":
            assert isinstance(spec, StoreJoin) and spec.host == "127.0.0.1" and spec.port > 0
        else:
            assert isinstance(spec, SharedJoin) and len(spec.slots) == NUM_SLOTS
            assert spec.release_addr.startswith("tcp://127.0.0.1:")
        group = _group(spec, backend=name, members=())
        validate_group(group)  # what the sender puts on the wire passes the receivers' validation
        backend.join(group, 0, 1)
        assert backend.members == {} and backend.world_size == 1
        data = torch.arange(100, dtype=torch.uint8)
        for slot in range(NUM_SLOTS):
            backend.pack(slot, 7 * slot, data)
            assert torch.equal(backend.view(slot, 7 * slot + 100)[7 * slot :], data)
        assert [next_slot(s) for s in range(NUM_SLOTS)] == [*range(1, NUM_SLOTS), 0]
    finally:
        backend.close()


def test_a_plan_for_another_backend_is_a_protocol_error():
    from lightning_weightsync import ProtocolError
    from lightning_weightsync.protocol.joins.shared import SharedJoin

    backend = build_backend("gloo", **_kwargs(is_sender=False))
    with pytest.raises(ProtocolError, match="SharedJoin join fields, backend gloo needs StoreJoin"):
        backend.join(_group(SharedJoin(["a", "b"], "tcp://127.0.0.1:1")), 1, 1)


def test_shm_receiver_names_a_missing_segment_and_rejects_bad_plans():
    from lightning_weightsync import PeerError, ProtocolError
    from lightning_weightsync.protocol.joins.shared import SharedJoin

    receiver = build_backend("shm", **_kwargs(is_sender=False, identity="r0"))
    try:
        with pytest.raises(PeerError, match="needs trainer and rollout on one host"):
            receiver.join(
                _group(SharedJoin(["lws_no_such_segment", "lws_nope"], "tcp://127.0.0.1:1"), backend="shm"), 1, 1
            )
        with pytest.raises(ProtocolError, match="1 slot handles, expected 2"):
            receiver.join(_group(SharedJoin(["a"], "tcp://127.0.0.1:1"), backend="shm"), 1, 1)
        with pytest.raises(ProtocolError, match="malformed"):
            receiver.join(_group(SharedJoin(["../etc", "x"], "tcp://127.0.0.1:1"), backend="shm"), 1, 1)
    finally:
        receiver.close()


def test_shm_sender_counts_only_this_versions_releases_by_members():
    """A late release of an earlier version, or one by a non-member, cannot free a slot early; the
    member's release of this version (sent by a real receiver backend) does."""
    import zmq

    from lightning_weightsync import WeightSyncTimeout
    from lightning_weightsync.protocol.messages import BucketDone, encode

    sender = build_backend("shm", **_kwargs(timeout_s=1.0))
    receiver = build_backend("shm", **_kwargs(is_sender=False, identity="r0"))
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.linger = 0
    try:
        sender.setup("127.0.0.1", 0)
        group = _group(sender.join_spec(1), backend="shm", members=("r0",))
        sender.join(group, 0, 5)
        receiver.join(group, 1, 5)
        push.connect(group.join.release_addr)
        push.send_multipart(encode(BucketDone("r0", 4, 0)))  # late, from version 4
        push.send_multipart(encode(BucketDone("intruder", 5, 0)))  # not a member
        with pytest.raises(WeightSyncTimeout, match="released by 0 of 1"):
            sender.broadcast(0, 10, 0)
        receiver.release(0, 0)
        sender.broadcast(0, 10, 0)  # returns: r0 released bucket 0 of version 5
    finally:
        push.close()
        receiver.close()
        sender.close()


@pytest.mark.skipif(not shared_backends.DATAGRAM_RELEASES, reason="datagram releases are Linux's")
def test_shm_releases_come_as_datagrams_and_a_bad_one_is_dropped():
    """On Linux a release is one datagram to the name derived from the plan's release address: the sender's
    wait takes it (and drops a malformed one) without any ZeroMQ message."""
    import socket

    from lightning_weightsync import WeightSyncTimeout
    from lightning_weightsync.protocol.messages import BucketDone, encode

    sender = build_backend("shm", **_kwargs(timeout_s=1.0))
    client = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sender.setup("127.0.0.1", 0)
        group = _group(sender.join_spec(1), backend="shm", members=("r0",))
        sender.join(group, 0, 5)
        name = shared_backends.release_name(group.join.release_addr)
        client.sendto(b"\x07not a release", name)
        with pytest.raises(WeightSyncTimeout, match="released by 0 of 1"):
            sender.broadcast(0, 10, 0)
        client.sendto(shared_backends.to_datagram(encode(BucketDone("r0", 5, 0))), name)
        sender.broadcast(0, 10, 0)  # returns: r0's datagram released bucket 0 of version 5
    finally:
        client.close()
        sender.close()


def test_shm_releases_go_over_zeromq_where_the_datagram_cannot_reach(monkeypatch):
    """A sender that bound no datagram socket (another network namespace, another OS) still hears every
    release: the receiver's datagram is refused and it sends the release over ZeroMQ instead."""
    sender = build_backend("shm", **_kwargs(timeout_s=2.0))
    receiver = build_backend("shm", **_kwargs(is_sender=False, identity="r0"))
    try:
        monkeypatch.setattr(shared_backends, "DATAGRAM_RELEASES", False)
        sender.setup("127.0.0.1", 0)  # ZeroMQ only
        monkeypatch.undo()
        group = _group(sender.join_spec(1), backend="shm", members=("r0",))
        sender.join(group, 0, 5)
        receiver.join(group, 1, 5)
        for index in range(3):  # the first refused datagram switches the receiver to ZeroMQ for good
            receiver.release(index % 2, index)
            sender.broadcast(index % 2, 10, index)
    finally:
        receiver.close()
        sender.close()


def test_sender_store_port_in_use_is_a_config_error():
    from lightning_weightsync import ConfigError

    first = build_backend("gloo", **_kwargs())
    second = build_backend("gloo", **_kwargs())
    try:
        first.setup("127.0.0.1", 0)
        with pytest.raises(ConfigError, match=r"transport\.store_port"):
            second.setup("127.0.0.1", first.join_spec(1).port)
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("handle", ["zz", "bnothex", "i12x", "t1", ""])
def test_cuda_ipc_malformed_handles_are_protocol_errors(handle):
    from lightning_weightsync import ProtocolError
    from lightning_weightsync.transport.backends.cuda_ipc import _decode_ipc

    with pytest.raises(ProtocolError, match="malformed CUDA IPC handle"):
        _decode_ipc(handle, 16, torch.device("cpu"))


# -- real hardware runs (skipped here) ---------------------------------------------------------------


def _gpu_role(role: int, port: int, backend: str) -> object:
    cfg = engine_cfg(port, backend=backend, bucket_size_mb=1 / 64, trainer__min_receivers=1)

    async def main() -> object:
        if role == 0:
            async with WeightSender(cfg) as sender:
                device = "npu" if backend == "hccl" else "cuda"
                weights = [(n, t.to(device)) for n, t in stream(1)]
                return (await sender.send_weights(weights, version=1)).receivers
        async with WeightReceiver(cfg) as receiver:
            got = await with_timeout(receive_once(receiver))
            assert_bitwise({n: t.cpu() for n, t in got.items()}, stream(1))
            return len(got)

    return asyncio.run(main())


@needs_cuda
def test_cuda_ipc_two_processes_one_gpu():
    port = free_port()
    sender, received = run_workers(_gpu_role, [(0, port, "cuda_ipc"), (1, port, "cuda_ipc")], timeout_s=120)
    assert sender == 1 and received == len(stream(1))


@needs_cupy
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: 2 GPUs")
def test_nccl_two_processes_two_gpus():
    port = free_port()
    sender, received = run_workers(_gpu_role, [(0, port, "nccl"), (1, port, "nccl")], timeout_s=120)
    assert sender == 1 and received == len(stream(1))


@needs_cupy
def test_nccl_backend_at_world_size_one_on_one_gpu():
    """What one GPU can show of the cupy NCCL backend (two NCCL ranks need two GPUs): the unique id, a real
    1-rank communicator, a packed slot broadcast on NCCL's own stream after the packing event (fence), and a
    caller's tensor broadcast in place; the bytes come through unchanged and the slots stay reusable."""
    from lightning_weightsync.transport.backends import NO_SLOT, NUM_SLOTS

    backend = build_backend("nccl", **_kwargs(device=torch.device("cuda:0"), bucket_size=1 << 20))
    try:
        backend.setup("127.0.0.1", 0)
        group = _group(backend.join_spec(1), backend="nccl", bucket_size=1 << 20, members=())
        backend.join(group, 0, 1)
        assert backend.world_size == 1
        data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda:0")
        for version in range(3):
            for slot in range(NUM_SLOTS):
                piece = data.roll(version * 7 + slot)
                backend.pack(slot, 0, piece)
                backend.fence(slot)
                backend.broadcast(slot, piece.numel(), version)
                assert torch.equal(backend.view(slot, piece.numel()), piece)
        direct = data.flip(0).contiguous()
        backend.fence(NO_SLOT)
        backend.broadcast(NO_SLOT, direct.numel(), 0, buffer=direct)
        assert torch.equal(direct, data.flip(0))
    finally:
        backend.close()


@needs_npu
def test_hccl_two_processes():  # pragma: no cover - no NPU in CI
    port = free_port()
    sender, received = run_workers(_gpu_role, [(0, port, "hccl"), (1, port, "hccl")], timeout_s=120)
    assert sender == 1 and received == len(stream(1))
