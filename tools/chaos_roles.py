"""The chaos roles: a sender and a receiver that run forever inside a network namespace (`tools/netlab.py`
`Lab.spawn`) and log every version's outcome as JSON lines. Shared by the chaos tests
(tests/integration/test_chaos.py) and the soak benchmark (`tools/soak.py`), so neither imports the other and
the benchmark runs from an installed package."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from lightning_weightsync.bench.inventory import model_stream

TOKEN = "chaos-token-0123456789"
PORT = 29655
TIMEOUT_S = 8.0


def stream(version: int) -> list[tuple[str, Any]]:
    """What version `version` carries (the chaos tests' stream: `tests.support.transfer.stream`'s defaults)."""
    return list(model_stream(version=version, scale=128, max_tensors=40))


def _cfg(host: str, **extra: Any) -> Any:
    from lightning_weightsync.config import load_config

    overrides = [
        f"transport.host={host}", f"transport.port={PORT}", f"transport.timeout_s={TIMEOUT_S}",
        "transport.ready_timeout_s=3", "transport.heartbeat_interval_s=0.2", "transport.bucket_size_mb=0.015625",
        f"transport.auth_token={TOKEN}",
    ]  # fmt: skip
    return load_config(overrides=overrides + [f"{k}={v}" for k, v in extra.items()])


def _log(path: str, **event: Any) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"t": time.time(), **event}) + "\n")


# -- the roles (run inside the namespaces by `Lab.spawn`) ----------------------------------------------


def chaos_receiver(sender_ip: str, identity: str, out: str, slow_s: float) -> None:
    """Receive forever; log every version's start, bitwise check, or failure."""
    import torch

    from lightning_weightsync.errors import WeightSyncError
    from lightning_weightsync.protocol.chunks import as_bytes
    from lightning_weightsync.versions.receiver import WeightReceiver

    async def main() -> None:
        async with WeightReceiver(_cfg(sender_ip), identity=identity) as receiver:
            while True:
                got: dict[str, torch.Tensor] = {}
                try:
                    async for name, tensor in receiver.receive_weights():
                        if not got:
                            _log(out, event="start", version=receiver.version)
                        got[name] = tensor.clone()
                        await asyncio.sleep(slow_s)
                except WeightSyncError as exc:
                    _log(out, event="fail", version=receiver.version, error=f"{type(exc).__name__}: {exc}"[:300])
                    continue
                assert receiver.version is not None  # a version arrived whole
                expected = stream(receiver.version)
                bitwise = list(got) == [n for n, _ in expected] and all(
                    torch.equal(as_bytes(got[n]), as_bytes(t)) for n, t in expected
                )
                _log(out, event="ok", version=receiver.version, bitwise=bitwise)

    asyncio.run(main())


def chaos_sender(my_ip: str, out: str, min_receivers: int, gap_s: float, pace_s: float = 0.05) -> None:
    """Send versions 1, 2, ... forever to whoever is there; log each outcome. The producer yields a
    tensor every `pace_s` (a gather takes time too), so a version is on the wire for a while."""
    from lightning_weightsync.errors import WeightSyncError
    from lightning_weightsync.versions.sender import WeightSender

    async def paced(weights: list[Any]) -> Any:
        for item in weights:
            await asyncio.sleep(pace_s)
            yield item

    async def main() -> None:
        cfg = _cfg(my_ip, **{"trainer.min_receivers": min_receivers})
        async with WeightSender(cfg) as sender:
            version = 0
            while True:
                version += 1
                t0 = time.time()
                try:
                    stats = await sender.send_weights(paced(stream(version)), version=version)
                    _log(out, event="sent", version=version, receivers=stats.receivers, t0=t0)
                except WeightSyncError as exc:
                    _log(out, event="failed", version=version, error=f"{type(exc).__name__}: {exc}"[:500], t0=t0)
                await asyncio.sleep(gap_s)

    asyncio.run(main())


__all__ = ["PORT", "TIMEOUT_S", "TOKEN", "chaos_receiver", "chaos_sender", "stream"]
