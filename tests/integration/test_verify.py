"""Issue 22, verify: the rollout holds exactly the trainer's weights, or the version fails naming the tensor.

In the spirit of Mooncake's `check_weight_update_equal`: every rollout starts from noise and the first
sync must restore the trainer's weights bit for bit, for every sink and every backend that runs on a
CPU; then a corrupting peer (`tests/support/corrupt.py`: one byte flipped on the wire, after the sender
fingerprinted the tensors) is caught, nothing of its version applied, and the same corruption passes
unnoticed with `transport.verify=off` (so the check, not luck, is what catches it).

Daemons run in-process against a real `WeightSender` over real ZeroMQ sockets and real gloo / shm
groups, as in `test_daemon.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_weightsync import PeerError, WeightSender
from lightning_weightsync.config import VerifyMode
from lightning_weightsync.protocol.chunks import as_bytes
from lightning_weightsync.rollout.daemon import RolloutDaemon
from lightning_weightsync.rollout.sinks.callable import CallableSink
from lightning_weightsync.rollout.sinks.module import ModuleSink
from tests.integration.test_daemon import _get, daemon_cfg, running, until
from tests.support.corrupt import CorruptingSender
from tests.support.mp import free_port
from tests.unit.test_sinks import build_tiny, version_weights

pytestmark = pytest.mark.timeout(180)

SINKS = ("module", "safetensors", "callable")
CPU_BACKENDS = ("gloo", "shm")


def noise_module() -> torch.nn.Module:
    """A rollout's model before the first sync: every weight noise (nothing like the trainer's)."""
    module = build_tiny()
    g = torch.Generator().manual_seed(12345)
    with torch.no_grad():
        for tensor in module.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=g) * 100)
            else:
                tensor.fill_(-7)
    return module


def differing(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Names whose bytes differ (or that are missing): bit-exact, NaN-safe, unlike torch.equal."""
    return sorted(
        name
        for name, tensor in want.items()
        if name not in got
        or got[name].dtype != tensor.dtype
        or got[name].shape != tensor.shape
        or not torch.equal(as_bytes(got[name]), as_bytes(tensor))
    )


class Rollout:
    """One daemon with one of the CPU sinks, and a way to read back what it holds."""

    def __init__(self, port: int, sink: str, backend: str, tmp: Path, verify: str) -> None:
        self.kind = sink
        self.tmp = tmp
        self.collected: dict[int, dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()
        cfg = daemon_cfg(
            port, transport__backend=backend, transport__verify=verify, rollout__sink__type=sink,
            rollout__sink__dir=str(tmp), rollout__identity=f"{sink}-{backend}", rollout__metrics_port=0,
        )  # fmt: skip
        built: Any = None
        if sink == "module":
            built = ModuleSink(cfg, module=noise_module())
        elif sink == "callable":
            built = CallableSink(cfg, fn=self._collect)
        self.daemon = RolloutDaemon(cfg, sink=built, handle_signals=False)

    def _collect(self, version: int, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        got = {name: tensor.clone() for name, tensor in tensors}
        with self._lock:
            self.collected[version] = got

    def holds(self, version: int) -> dict[str, torch.Tensor]:
        if self.kind == "module":
            sink = self.daemon.sink
            assert isinstance(sink, ModuleSink) and sink.version == version, (sink.version, version)
            return sink.state_dict()
        if self.kind == "safetensors":
            from safetensors.torch import load_file

            return load_file(str(self.tmp / f"step_{version}.safetensors"))
        with self._lock:
            return dict(self.collected[version])


def sent(version: int) -> dict[str, torch.Tensor]:
    """The trainer's version without the tied alias (the safetensors sink writes a tied tensor once)."""
    weights = dict(version_weights(version))
    weights.pop("head.weight")
    return weights


@contextlib.asynccontextmanager
async def sender_of(cls: type[WeightSender], port: int, backend: str, verify: str, **kw: Any) -> AsyncIterator[Any]:
    cfg = daemon_cfg(port, transport__backend=backend, transport__verify=verify)
    sender = cls(cfg, **kw)
    await sender.start()
    try:
        yield sender
    finally:
        await sender.close()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("sink", SINKS)
async def test_noise_is_restored_bit_exactly_and_a_flipped_byte_is_caught(sink: str, backend: str, tmp_path) -> None:
    port = free_port()
    rollout = Rollout(port, sink, backend, tmp_path, verify="full")
    async with running(rollout.daemon):
        async with sender_of(WeightSender, port, backend, "full") as sender:
            stats = await sender.send_weights(sent(0).items(), version=0)
        assert stats.receivers == 1 and len(stats.checksums) == stats.num_tensors
        wrong = differing(rollout.holds(0), sent(0))
        assert not wrong, f"the first sync did not restore the trainer's weights over the noise: {wrong}"
        record = rollout.daemon.records[-1]
        assert record.ok and record.verified == record.num_tensors == stats.num_tensors, record

        # the corrupting peer: bucket 0 (a chunk of the embedding alone in its bucket: the direct path on
        # gloo) and the last bucket (packed small tensors)
        for version, bucket in ((1, 0), (2, stats.num_buckets - 1)):
            async with sender_of(CorruptingSender, port, backend, "full", bucket_index=bucket) as bad:
                with pytest.raises(PeerError, match=r"tensor '[^']+' arrived corrupted") as caught:
                    await bad.send_weights(sent(version).items(), version=version)
            assert "transport.verify" in str(caught.value), caught.value
            await until(lambda n=version: len(rollout.daemon.records) == n + 1)  # the nack comes before the drain
            assert rollout.daemon.sink is not None and rollout.daemon.sink.version == 0
            assert rollout.daemon.records[-1].outcome == "failed", rollout.daemon.records[-1]
            wrong = differing(rollout.holds(0), sent(0))
            assert not wrong, f"a corrupted version touched the held weights: {wrong}"
        assert rollout.daemon.metrics.verify_failures._value.get() == 2


@pytest.mark.parametrize("backend", CPU_BACKENDS)
async def test_with_verify_off_the_same_flipped_byte_lands_unnoticed(backend: str, tmp_path) -> None:
    """The control: the corruption the test above catches is real, and only verify catches it."""
    port = free_port()
    rollout = Rollout(port, "module", backend, tmp_path, verify="off")
    async with running(rollout.daemon), sender_of(CorruptingSender, port, backend, "off", bucket_index=0) as bad:
        stats = await bad.send_weights(sent(3).items(), version=3)
        assert not stats.failed and not stats.checksums
    wrong = differing(rollout.holds(3), sent(3))
    assert len(wrong) == 1, f"expected exactly the corrupted tensor to differ, got {wrong}"


async def test_the_daemon_says_which_version_it_holds_and_whether_its_weights_match(tmp_path) -> None:
    """GET /weights and the metrics: the version, every tensor verified on arrival, and a recheck of what
    the sink holds now (memory corrupted after the sync shows as a mismatch naming the tensor)."""
    port = free_port()
    rollout = Rollout(port, "module", "gloo", tmp_path, verify="full")
    async with running(rollout.daemon):
        await until(lambda: rollout.daemon.metrics_port is not None)
        base = f"http://127.0.0.1:{rollout.daemon.metrics_port}"
        before = json.loads((await asyncio.to_thread(_get, base + "/weights"))[1])
        assert before["version"] is None and before["match"] is None, before
        async with sender_of(WeightSender, port, "gloo", "full") as sender:
            stats = await sender.send_weights(sent(4).items(), version=4)
        code, body = await asyncio.to_thread(_get, base + "/weights")
        answer = json.loads(body)
        assert code == 200 and answer["version"] == 4 and answer["match"] is True, answer
        assert answer["checked"] == "now" and answer["complete"] and answer["verified"] == stats.num_tensors
        assert answer["checksums"] == stats.checksums, "the rollout's checksums are not the trainer's"
        text = (await asyncio.to_thread(_get, base + "/metrics"))[1]
        assert f"weightsync_rollout_verified_tensors {float(stats.num_tensors)}" in text, text
        assert "weightsync_rollout_verify_failures_total 0.0" in text
        sink = rollout.daemon.sink
        assert isinstance(sink, ModuleSink)
        with torch.no_grad():  # a bit flips in the rollout's memory after the sync
            as_bytes(sink.module.proj.weight.data)[3] ^= 1
        answer = json.loads((await asyncio.to_thread(_get, base + "/weights"))[1])
        assert answer["match"] is False and answer["mismatches"] == ["proj.weight"], answer


async def test_sample_checks_a_rotating_subset_and_off_sends_no_fingerprints(engine_pair) -> None:
    sender, receiver = engine_pair
    weights = {f"w{i}": torch.full((3,), float(i)) for i in range(16)}
    seen: dict[str, int] = {}
    for version, mode in enumerate(["sample", "sample", "off"]):
        transport = replace(sender.settings.transport, verify=VerifyMode(mode))
        sender.settings = replace(sender.settings, transport=transport)
        send = asyncio.ensure_future(sender.send_weights(weights.items(), version=version))
        got = {name: t.clone() async for name, t in receiver.receive_weights()}
        stats = await send
        assert not differing(got, weights)
        report = receiver.last_verify
        assert report is not None and report.tensors == 16
        assert report.verified == len(stats.checksums) == (2 if mode == "sample" else 0), (mode, report)
        for name in report.checksums:
            seen[name] = seen.get(name, 0) + 1
    assert len(seen) == 4, f"two sampled versions should check 4 distinct tensors, checked {seen}"


async def test_a_receiver_with_verify_off_does_not_check(engine_pair) -> None:
    sender, receiver = engine_pair
    sender.settings = replace(sender.settings, transport=replace(sender.settings.transport, verify=VerifyMode.full))
    receiver.verify = VerifyMode.off
    weights = {"a": torch.arange(10.0), "b": torch.ones(4, dtype=torch.bfloat16)}
    send = asyncio.ensure_future(sender.send_weights(weights.items(), version=0))
    got = {name: t.clone() async for name, t in receiver.receive_weights()}
    stats = await send
    assert len(stats.checksums) == 2 and not differing(got, weights)
    assert receiver.last_verify is not None and receiver.last_verify.verified == 0
