"""Backends that need hardware: what CPU can check (clear errors, handle encoding), and the real
runs, skipped with a reason where the hardware is missing. gloo and shm are covered end to end in
test_engine.py; nccl / hccl / cuda_ipc share its sender, receiver and group bookkeeping."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch

from lightning_weightsync import BackendUnavailable, WeightReceiver, WeightSender
from lightning_weightsync.transport.backends import backend_class, build_backend
from lightning_weightsync.transport.device import resolve_device
from tests.support.engine import assert_bitwise, engine_cfg, receive_once, stream, with_timeout
from tests.support.mp import free_port, run_workers

HAS_CUDA = torch.cuda.is_available()
HAS_CUPY = importlib.util.find_spec("cupy") is not None
HAS_NPU = importlib.util.find_spec("torch_npu") is not None
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")
needs_cupy = pytest.mark.skipif(not (HAS_CUDA and HAS_CUPY), reason="needs a GPU and cupy (extra [nccl])")
needs_npu = pytest.mark.skipif(not HAS_NPU, reason="needs an Ascend NPU and torch_npu (extra [npu])")


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
        resolve_device("hccl", None)


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


@needs_npu
def test_hccl_two_processes():  # pragma: no cover - no NPU in CI
    port = free_port()
    sender, received = run_workers(_gpu_role, [(0, port, "hccl"), (1, port, "hccl")], timeout_s=120)
    assert sender == 1 and received == len(stream(1))
