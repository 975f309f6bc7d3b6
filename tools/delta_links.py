"""Delta over a rate-limited link: where the issue-22 table says delta wins in seconds, does it?

On loopback a delta never wins in seconds (docs/backends.md, "Verify and delta": the codec costs more
than the bytes it saves take to move); the table derives the link speed below which it should. Here the
sender runs in its own network namespace behind a `tc tbf` link of `--rate-mbit`, the receiver in
another (tools/netlab.py; needs root), and the same stream of versions (bf16 tensors, each
version moving `--changed` of the elements to a neighbouring value) is sent with `transport.delta: off`,
`always` and `auto`, each in a fresh pair. The receiver applies each version onto what it holds and
checks it bitwise. Prints seconds and bytes of the steady versions, with ratios to `off` from the same run.

    sudo .venv/bin/python -m tools.delta_links --rate-mbit 200 --mb 64 --changed 0.01 0.1 0.5
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MODULE = "tools.delta_links"  # what the lab's processes import (by name, not __main__)

from tools.netlab import netlab, skip_reason  # noqa: E402
from tools.sharded_links import await_versions, jsonl_lines, limit_uplink  # noqa: E402

PORT = 29713


def versions(mb: float, changed: float, count: int) -> list[dict[str, Any]]:
    import torch

    from lightning_weightsync.bench.delta import changed_weights

    gen = torch.Generator().manual_seed(0)
    n = max(1, round(mb / 4))
    first = {f"layers.{i}.weight": torch.randn(1024, 2048, generator=gen).to(torch.bfloat16) for i in range(n)}
    out = [first]
    for k in range(1, count):
        out.append(changed_weights(out[-1], changed, seed=k))
    return out


def delta_sender(host: str, mode: str, mb: float, changed: float, count: int, out: str) -> None:
    import asyncio

    from lightning_weightsync.config import load_config
    from lightning_weightsync.versions.sender import WeightSender

    cfg = load_config(overrides=[f"transport.host={host}", f"transport.port={PORT}", "transport.timeout_s=300",
                                 "transport.bucket_size_mb=16", f"transport.delta={mode}"])  # fmt: skip
    stream = versions(mb, changed, count)

    async def main() -> None:
        async with WeightSender(cfg) as sender:
            for version, weights in enumerate(stream):
                stats = await sender.send_weights(weights.items(), version=version)
                with open(out, "a") as f:
                    f.write(json.dumps({"version": version, "seconds": stats.seconds, "nbytes": stats.nbytes,
                                        "delta_tensors": stats.delta_tensors}) + "\n")  # fmt: skip

    asyncio.run(main())


def delta_receiver(host: str, mb: float, changed: float, count: int, out: str) -> None:
    import asyncio

    import torch

    from lightning_weightsync.config import load_config
    from lightning_weightsync.versions.receiver import WeightReceiver

    cfg = load_config(overrides=[f"transport.host={host}", f"transport.port={PORT}", "transport.timeout_s=300",
                                 "rollout.identity=rollout-0", "transport.heartbeat_interval_s=0.2"])  # fmt: skip
    stream = versions(mb, changed, count)
    held: dict[str, torch.Tensor] = {}

    def into(meta: Any) -> torch.Tensor | None:
        t = held.get(meta.name)
        return t if t is not None and tuple(t.shape) == meta.shape and t.dtype == meta.dtype else None

    async def main() -> None:
        async with WeightReceiver(cfg) as receiver:
            for _ in range(count):
                receiver.delta_base = receiver.last_complete_version
                async for name, tensor in receiver.receive_weights(into=into, base=into):
                    if held.get(name) is not tensor:
                        held[name] = tensor
                want = stream[int(receiver.version)]  # type: ignore[arg-type]  # set once a version is received
                ok = sorted(held) == sorted(want) and all(torch.equal(held[n], want[n]) for n in want)
                with open(out, "a") as f:
                    f.write(json.dumps({"version": receiver.version, "bitwise": ok}) + "\n")

    asyncio.run(main())


def run_pair(rate_mbit: int, mode: str, mb: float, changed: float, count: int) -> dict[str, Any]:
    with netlab() as lab:
        for name in ("s", "r"):
            lab.add(name)
        limit_uplink(lab, "s", rate_mbit)
        host = lab.nodes["s"].ip
        sent, got = lab.workdir / "sent.jsonl", lab.workdir / "got.jsonl"
        procs = [
            lab.spawn("r", f"from {MODULE} import delta_receiver as f; f({host!r}, {mb}, {changed}, "
                           f"{count}, {str(got)!r})", lab.workdir / "r.log"),
            lab.spawn("s", f"from {MODULE} import delta_sender as f; f({host!r}, {mode!r}, {mb}, "
                           f"{changed}, {count}, {str(sent)!r})", lab.workdir / "s.log"),
        ]  # fmt: skip
        received = await_versions(lab, procs, got, count, "*.log", f"delta={mode}")
        stats = jsonl_lines(sent)
    steady = stats[1:]  # version 0 is whole in every mode (nothing held yet) and forms the group
    return {
        "mode": mode,
        "changed": changed,
        "seconds": sum(s["seconds"] for s in steady) / len(steady),
        "nbytes": sum(s["nbytes"] for s in steady) / len(steady),
        "delta_tensors": sum(s["delta_tensors"] for s in steady),
        "bitwise": all(r["bitwise"] for r in received),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate-mbit", type=int, default=200)
    parser.add_argument("--mb", type=float, default=64.0)
    parser.add_argument("--changed", type=float, nargs="+", default=[0.01, 0.1, 0.5])
    parser.add_argument("--versions", type=int, default=4)
    args = parser.parse_args(argv)
    reason = skip_reason()
    if reason:
        print(f"cannot run: {reason}")
        return 2
    rows = []
    for changed in args.changed:
        for mode in ("off", "always", "auto"):
            rows.append(run_pair(args.rate_mbit, mode, args.mb, changed, args.versions))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\nlink {args.rate_mbit} Mbit/s (tbf), {args.mb:g} MB of bf16 a version, steady versions")
    print("| changed | delta | s a version | vs off | MB on the wire | vs off | tensors as delta | bitwise |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        off = next(o for o in rows if o["changed"] == r["changed"] and o["mode"] == "off")
        print(
            f"| {r['changed']:.0%} | {r['mode']} | {r['seconds']:.2f} | {r['seconds'] / off['seconds']:.2f} | "
            f"{r['nbytes'] / 1e6:.1f} | {r['nbytes'] / off['nbytes']:.2f} | {r['delta_tensors']} | {r['bitwise']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
