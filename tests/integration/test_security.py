"""Hostile-peer findings of issue 10 against the whole engine: real processes, sockets, gloo groups.

- with `transport.auth_token`, nothing a stranger can reach accepts rendezvous keys (before: the
  TCPStore let anyone list and set them);
- a tensor the receivers would refuse fails the version at once on the sender, naming it, and the
  next version lands bitwise (before: every receiver dropped the metadata, both sides waited
  `transport.timeout_s` for "a receiver died?");
- a stalled receiver is named in the sender's error.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from datetime import timedelta

import psutil
import pytest
import torch
import torch.distributed as dist

from lightning_weightsync import ProtocolError, WeightReceiver, WeightSender, WeightSyncError
from lightning_weightsync.errors import VersionAborted
from lightning_weightsync.protocol.messages import MAX_NAME_LEN, MAX_NDIM
from tests.support.mp import free_port, run_workers
from tests.support.transfer import assert_bitwise, engine_cfg, receive_once, stream, with_timeout


def _listening_ports() -> set[int]:
    return {c.laddr.port for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN}


def _stranger_can_use_store(port: int) -> bool:
    """Whether a TCPStore client with no credentials can set and list keys on `port`."""
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2))
        store.set("lws/stranger", "1")
        return store.num_keys() > 0
    except Exception:
        return False


@pytest.mark.parametrize("token", ["s3cret-token-for-tests", None], ids=["token", "no-token"])
async def test_rendezvous_is_closed_to_strangers_when_auth_is_on(token: str | None) -> None:
    store_port = free_port()
    cfg = engine_cfg(0, bucket_size_mb=1 / 128, transport__auth_token=token, transport__store_port=store_port)
    async with WeightSender(cfg) as sender:
        cfg_r = engine_cfg(sender.port, bucket_size_mb=1 / 128, transport__auth_token=token)
        async with WeightReceiver(cfg_r, identity="r0") as receiver:
            for version in (1, 2):  # the second reuses the group
                got, stats = await with_timeout(
                    asyncio.gather(receive_once(receiver), sender.send_weights(stream(version), version=version))
                )
                assert_bitwise(got, stream(version))
                assert stats.receivers == 1
            listening = _listening_ports()
            # the two addresses a plan can name: the control endpoint and transport.store_port
            strangers = {p: await asyncio.to_thread(_stranger_can_use_store, p) for p in (sender.port, store_port)}
    if token:
        assert store_port not in listening  # nothing listens for the rendezvous at all
        assert not any(strangers.values()), strangers
    else:  # without a token the TCPStore is still there (docs/security.md says so)
        assert store_port in listening and strangers[store_port]


def _with_bad_tensor(version: int, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    weights = stream(version)
    return [*weights[:5], (name, tensor), *weights[5:]]


@pytest.mark.parametrize(
    "name,tensor,match",
    [
        ("n" * (MAX_NAME_LEN + 1), torch.ones(4), f"over {MAX_NAME_LEN} characters"),
        ("", torch.ones(4), "empty"),
        ("model.deep", torch.ones((1,) * (MAX_NDIM + 1)), f"MAX_NDIM={MAX_NDIM}"),
        ("model.sparse", torch.eye(4).to_sparse(), "no dense bytes"),
        ("model.on_meta", torch.empty(4, device="meta"), "meta device"),
    ],
    ids=["long-name", "empty-name", "17-dims", "sparse", "meta"],
)
async def test_unsendable_tensor_fails_the_version_at_once_and_the_next_lands(name, tensor, match) -> None:
    port = free_port()
    cfg = engine_cfg(port, bucket_size_mb=1 / 128, transport__timeout_s=60)
    async with WeightSender(cfg) as sender, WeightReceiver(cfg, identity="r0") as receiver:
        pulled = []

        def weights():
            for item in _with_bad_tensor(1, name, tensor):
                pulled.append(item[0])
                yield item

        t0 = time.monotonic()
        got, sent = await with_timeout(
            asyncio.gather(receive_once(receiver), sender.send_weights(weights(), version=1), return_exceptions=True),
            50,
        )
        elapsed = time.monotonic() - t0
        assert isinstance(sent, ProtocolError) and match in str(sent), sent
        assert repr(name[:40])[:-1] in str(sent) and "trainer.names" in str(sent)  # names the tensor and the fix
        assert isinstance(got, VersionAborted), got  # the receiver was told, nothing applied
        # failed at once, not after waiting out transport.timeout_s=60
        assert elapsed < cfg.transport.timeout_s / 2, f"took {elapsed:.1f}s"
        assert len(pulled) == len(stream(1)) + 1  # the caller's iterable was drained (FSDP ranks stay in step)
        got2, stats = await with_timeout(
            asyncio.gather(receive_once(receiver), sender.send_weights(stream(2), version=2))
        )
        assert_bitwise(got2, stream(2))
        assert stats.receivers == 1


# -- a stalled receiver (SIGSTOP: alive, connected, not reading) is named ---------------------------------


def _receiver_process(port: int, identity: str, stop_after: int | None) -> None:
    cfg = engine_cfg(port, bucket_size_mb=1, transport__timeout_s=60)

    async def main() -> None:
        async with WeightReceiver(cfg, identity=identity) as receiver:
            n = 0
            while True:
                try:
                    async for _name, _tensor in receiver.receive_weights():
                        n += 1
                        if stop_after is not None and n == stop_after:
                            os.kill(os.getpid(), signal.SIGSTOP)
                except WeightSyncError:
                    pass

    asyncio.run(main())


def _sender_process(port: int) -> str:
    cfg = engine_cfg(port, bucket_size_mb=1, transport__timeout_s=5, trainer__min_receivers=2)
    weights = [(f"layer{i}.weight", torch.full((1 << 18,), float(i))) for i in range(64)]  # 64 MiB: fills any buffer

    async def main() -> str:
        async with WeightSender(cfg) as sender:
            deadline = time.monotonic() + 60  # both registered (spawning imports torch: slow on 2 cores)
            while len(sender._control.peers) < 2 and time.monotonic() < deadline:
                await sender._control.recv(0.1)
            try:
                await sender.send_weights(weights, version=1)
            except WeightSyncError as exc:
                return str(exc)
            return "no error"

    return asyncio.run(main())


def _stall_role(role: int, port: int) -> object:
    if role == 0:
        return _sender_process(port)
    _receiver_process(port, "healthy" if role == 1 else "stuck", None if role == 1 else 2)
    return None


@pytest.mark.slow
def test_stalled_receiver_is_named_in_the_senders_error() -> None:
    port = free_port()
    text, _, _ = run_workers(_stall_role, [(r, port) for r in range(3)], timeout_s=150, doomed=[1, 2])
    assert "stalled or dead: " in text and "stuck (" in text, text
    named = text.split("stalled or dead: ", 1)[1].split("; the others", 1)[0]
    assert "healthy (" not in named, text  # the one that kept up is not blamed


async def test_a_stream_of_more_empty_tensors_than_a_bucket_may_list_lands() -> None:
    """Issue 24 item 4: a bucket's metadata is bounded (MAX_BUCKET_ENTRIES chunks, so MAXMSGSIZE can be
    derived). Empty tensors do not move the bucket offset, so the sender must start a new bucket by count
    as well, or its metadata grows past what every receiver accepts."""
    from lightning_weightsync.protocol.chunks import MAX_BUCKET_ENTRIES

    weights = [(f"empty.{i}", torch.empty(0, 3)) for i in range(2 * MAX_BUCKET_ENTRIES + 5)]
    weights.insert(MAX_BUCKET_ENTRIES // 2, ("w", torch.arange(16, dtype=torch.float32)))
    port = free_port()
    cfg = engine_cfg(port, bucket_size_mb=1 / 128, transport__timeout_s=30)
    async with WeightSender(cfg) as sender, WeightReceiver(cfg, identity="r0") as receiver:
        got, stats = await with_timeout(
            asyncio.gather(receive_once(receiver), sender.send_weights(weights, version=1)), 120
        )
    assert_bitwise(got, weights)
    assert stats.num_buckets >= 3
