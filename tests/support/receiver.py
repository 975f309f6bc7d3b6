"""A real WeightReceiver in its own process for the trainer-side end-to-end tests (Lightning,
Accelerate, recipes): receives N versions, then writes what it got to files the test compares;
and `ThreadReceiver`, one on its own event loop in a thread of the test's process (the TRL tests)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lightning_weightsync import WeightReceiver, load_config
from tests.support.transfer import engine_cfg

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


class ThreadReceiver:
    """A real `WeightReceiver` on its own event loop in a thread: every version it received, whole and cloned."""

    def __init__(self, port: int, versions: int) -> None:
        self.got: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run(port, versions)), daemon=True)
        self._thread.start()

    async def _run(self, port: int, versions: int) -> None:
        try:
            async with WeightReceiver(engine_cfg(port, bucket_size_mb=1 / 128), identity="thread-rollout") as receiver:
                while len(self.got) < versions:
                    got = {n: t.clone() async for n, t in receiver.receive_weights(wait_s=30)}
                    self.got.append((int(receiver.version or 0), got))
        except BaseException as exc:
            self.error = exc

    def join(self) -> list[tuple[int, dict[str, torch.Tensor]]]:
        self._thread.join(timeout=60)
        assert not self._thread.is_alive() and self.error is None, self.error
        return self.got
