"""A real WeightReceiver in its own process for the trainer-side end-to-end tests (Lightning,
Accelerate, recipes): receives N versions, then writes what it got to files the test compares."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lightning_weightsync import WeightReceiver, load_config

VERSION_TIMEOUT_S = 150.0


def receiver_main(port: int, expect: int, out_dir: str, timeout_s: float = VERSION_TIMEOUT_S) -> None:
    """Receive `expect` versions (from one or more sender sessions) on `port`; write
    `versions.json` (after each) and `received.safetensors` (the last version, bitwise)."""
    cfg = load_config(
        overrides=[
            f"transport.port={port}",
            "transport.timeout_s=60",
            "transport.heartbeat_interval_s=0.2",
            "rollout.identity=rollout-0",
        ]
    )

    async def main() -> None:
        versions: list[int] = []
        last: dict[str, torch.Tensor] = {}
        async with WeightReceiver(cfg) as receiver:

            async def one() -> dict[str, torch.Tensor]:
                return {n: t.clone() async for n, t in receiver.receive_weights()}

            while len(versions) < expect:
                last = await asyncio.wait_for(one(), timeout_s)
                versions.append(int(receiver.version))  # type: ignore[arg-type]
                Path(out_dir, "versions.json").write_text(json.dumps(versions))
        save_file(last, str(Path(out_dir, "received.safetensors")))

    asyncio.run(main())


def received_versions(out_dir: Path) -> list[int]:
    path = out_dir / "versions.json"
    return json.loads(path.read_text()) if path.exists() else []


def assert_same_weights(received_path: Path, final_path: Path) -> dict[str, torch.Tensor]:
    """The receiver's last version equals the trainer's final weights: names, dtypes, shapes, bits."""
    received, final = load_file(str(received_path)), load_file(str(final_path))
    assert list(received) and sorted(received) == sorted(final)
    for name, t in final.items():
        r = received[name]
        assert r.dtype == t.dtype and r.shape == t.shape, name
        assert torch.equal(r, t), name
    return final
