"""Sharded send mode over real, rate-limited links: does N senders' bandwidth add up? (issue 19)

Every trainer rank runs in its own network namespace behind its own veth link, rate-limited with
`tc qdisc ... tbf` (this kernel has no netem; tbf works), the receiver in another (unlimited) one, all
joined by a bridge (tools/netlab.py; needs root). The ranks form a gloo trainer group over the
lab network and send one synthetic stream per version (tensors of `--tensor-mb`, row-sharded over the
ranks as FSDP2 cuts them) in sharded mode; the receiver tiles and checks every version bitwise.

For 1, 2 and 4 senders at the same per-link rate it prints the aggregate throughput (bytes of a version
over rank 0's time for it: Prepare to the last ack) and its ratio to N x the single-sender figure from
the same run; the trainer's stall per sync is each rank's time in `send_weights` (the slowest rank's).

    sudo .venv/bin/python -m tools.sharded_links --rate-mbit 100 --mb 48 --versions 3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MODULE = "tools.sharded_links"  # what the lab's processes import (by name, not __main__)

from tools.netlab import Lab, netlab, skip_reason  # noqa: E402

if TYPE_CHECKING:
    import torch

    from lightning_weightsync.protocol.chunks import TensorShard

TRAINER_PORT, PORT = 29711, 29712  # inside the lab's private namespaces: nothing else binds there


def row_shard(tensor: torch.Tensor, rank: int, world: int) -> TensorShard | None:
    """Rank `rank`'s rows of `tensor` split `world` ways as FSDP2's `Shard(0)` cuts them (`torch.chunk`), as a
    byte range of the whole; None where the rank owns no rows (more ranks than rows). What this benchmark and
    the sharded tests (tests/support/sharded_senders.py) send by hand, without FSDP."""
    import torch

    from lightning_weightsync.protocol.chunks import TensorShard

    parts = torch.chunk(tensor, world, dim=0)
    if rank >= len(parts) or parts[rank].numel() == 0:
        return None
    first = sum(p.shape[0] for p in parts[:rank])
    row_bytes = tensor[0].numel() * tensor.element_size()
    return TensorShard(tuple(tensor.shape), tensor.dtype, first * row_bytes, parts[rank].contiguous())


def stream(version: int, mb: float, tensor_mb: float) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(version)
    rows = 1024
    cols = max(1, int(tensor_mb * 2**20 / 4 / rows))
    count = max(1, round(mb / tensor_mb))
    return {f"layers.{i}.weight": torch.randn(rows, cols, generator=gen) for i in range(count)}


def hsdp_part(version: int, mb: float, tensor_mb: float, world: int) -> list[Any]:
    """This rank's part of the stream placed as HSDP places it (a 2 x world/2 replicate x shard mesh,
    `(Replicate(), Shard(0))`), chosen by the sharded send path itself (`iter_local_shards`: each shard's
    two replicas send half of it each). Each rank cuts its local shard from the stream it generates."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from lightning_weightsync.trainer.sharded import iter_local_shards

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    placements = (Replicate(), Shard(0))
    root, layers = torch.nn.Module(), torch.nn.ModuleList()
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "every sender rank is in the mesh"
    for _, tensor in stream(version, mb, tensor_mb).items():
        local = torch.chunk(tensor, world // 2, dim=0)[coordinate[1]].clone()
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(DTensor.from_local(local, mesh, placements, run_check=False),
                                          requires_grad=False)  # fmt: skip
        layers.append(layer)
    root.layers = layers
    return list(iter_local_shards(root, device=torch.device("cpu"), version=version))


def bench_sender(rank: int, world: int, master: str, host: str, mb: float, tensor_mb: float, versions: int,
                 out: str, layout: str = "rows") -> None:  # fmt: skip
    import asyncio
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from lightning_weightsync.config import load_config
    from lightning_weightsync.protocol.messages import SenderAddress
    from lightning_weightsync.trainer.sharded import MembersRelay, exchange_addresses
    from lightning_weightsync.versions.options import Sharding
    from lightning_weightsync.versions.sender import WeightSender

    store = dist.TCPStore(master, TRAINER_PORT, world, is_master=rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    cfg = load_config(
        overrides=[f"transport.host={host}", f"transport.port={PORT}", "transport.timeout_s=300",
                   "transport.bucket_size_mb=8", "trainer.min_receivers=1"]
    )  # fmt: skip

    async def main() -> None:
        async with WeightSender(cfg) as sender:
            addresses = exchange_addresses(host, sender.port, torch.device("cpu"))
            for version in range(1, versions + 1):
                if layout == "hsdp":
                    mine = hsdp_part(version, mb, tensor_mb, world)
                else:
                    tensors = stream(version, mb, tensor_mb).items()
                    mine = [(n, s) for n, t in tensors if (s := row_shard(t, rank, world))]
                relay = MembersRelay(torch.device("cpu"))
                dist.barrier()
                started = time.perf_counter()
                if rank == 0:
                    others = tuple(SenderAddress(h, p) for h, p in addresses[1:])
                    try:
                        stats = await sender.send_weights(
                            mine, version=version, sharding=Sharding(0, others=others, on_members=relay)
                        )
                    finally:
                        relay.finish()
                else:
                    sharding = Sharding(rank, members=tuple(relay.receive()))
                    stats = await sender.send_weights(mine, version=version, sharding=sharding)
                seconds = time.perf_counter() - started
                with open(out, "a") as f:
                    f.write(json.dumps({"rank": rank, "version": version, "seconds": seconds,
                                        "nbytes": stats.nbytes}) + "\n")  # fmt: skip

    asyncio.run(main())
    dist.destroy_process_group()


def bench_receiver(master: str, mb: float, tensor_mb: float, versions: int, out: str) -> None:
    import asyncio

    import torch

    from lightning_weightsync.config import load_config
    from lightning_weightsync.versions.receiver import WeightReceiver

    cfg = load_config(
        overrides=[f"transport.host={master}", f"transport.port={PORT}", "transport.timeout_s=300",
                   "rollout.identity=rollout-0", "transport.heartbeat_interval_s=0.2"]
    )  # fmt: skip

    async def main() -> None:
        async with WeightReceiver(cfg) as receiver:
            for _ in range(versions):
                got = {n: t.clone() async for n, t in receiver.receive_weights()}
                want = stream(int(receiver.version), mb, tensor_mb)  # type: ignore[arg-type]  # set once a version is received
                ok = sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
                with open(out, "a") as f:
                    f.write(json.dumps({"version": receiver.version, "bitwise": ok}) + "\n")

    asyncio.run(main())


def jsonl_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run(
    lab: Lab, world: int, rate_mbit: int, mb: float, tensor_mb: float, versions: int, layout: str = "rows"
) -> dict[str, Any]:
    names = [f"t{rank}" for rank in range(world)]
    for name in (*names, "r"):
        lab.add(name)
    for name in names:
        limit_uplink(lab, name, rate_mbit)
    master = lab.nodes["t0"].ip
    out = lab.workdir / f"senders-{world}-{layout}.jsonl"
    received = lab.workdir / f"receiver-{world}-{layout}.jsonl"
    code = (f"from {MODULE} import bench_receiver as f; f({master!r}, {mb}, {tensor_mb}, {versions}, "
            f"{str(received)!r})")  # fmt: skip
    procs = [lab.spawn("r", code, lab.workdir / f"r-{world}.log")]
    for rank, name in enumerate(names):
        code = (f"from {MODULE} import bench_sender as f; f({rank}, {world}, {master!r}, "
                f"{lab.nodes[name].ip!r}, {mb}, {tensor_mb}, {versions}, {str(out)!r}, {layout!r})")  # fmt: skip
        procs.append(lab.spawn(name, code, lab.workdir / f"{name}-{world}.log"))
    got = await_versions(lab, procs, received, versions, f"*-{world}.log", f"{world} senders")
    sent = jsonl_lines(out)
    steady = [e for e in sent if e["version"] > 1] or sent  # version 1 builds the groups
    rank0 = [e for e in steady if e["rank"] == 0]
    per_version: dict[int, float] = {}
    for e in steady:
        per_version[e["version"]] = max(per_version.get(e["version"], 0.0), e["seconds"])
    total = sum(e["nbytes"] for e in steady) / len(rank0)
    seconds = sum(e["seconds"] for e in rank0) / len(rank0)
    lab.remove_nodes()  # the next run adds its own nodes
    return {
        "senders": world,
        "layout": "HSDP 2x2" if layout == "hsdp" else "rows",
        "bitwise": all(e["bitwise"] for e in got),
        "MB/s": total / seconds / 1e6,
        "seconds": seconds,
        "stall_s": sum(per_version.values()) / len(per_version),
    }


def limit_uplink(lab: Lab, name: str, rate_mbit: int) -> None:
    """`tc tbf` on a node's egress inside its namespace: what it sends leaves at `rate_mbit`."""
    burst = max(64 * 1024, rate_mbit * 1_000_000 // 8 // 100)  # ~10 ms of traffic
    lab_run("ip", "netns", "exec", lab.nodes[name].ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate",
            f"{rate_mbit}mbit", "burst", str(burst), "latency", "50ms")  # fmt: skip


def await_versions(lab: Lab, procs: list[Any], received: Path, count: int, logs: str, what: str) -> list[Any]:
    """The receiver's `count` lines (a process that fails ends the wait), every process reaped; raises
    with the tails of the `logs` files when fewer arrived."""
    deadline = time.monotonic() + 600
    while len(jsonl_lines(received)) < count and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.2)
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except Exception:
            lab.kill(proc)
    got = jsonl_lines(received)
    if len(got) < count:
        tails = "\n".join(p.read_text()[-2000:] for p in sorted(lab.workdir.glob(logs)))
        raise RuntimeError(f"{what}: {len(got)} of {count} versions received\n{tails}")
    return got


def lab_run(*cmd: str, check: bool = True) -> None:
    import subprocess

    subprocess.run(cmd, check=check, capture_output=True, text=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate-mbit", type=int, default=100, help="each trainer rank's link rate (tbf)")
    parser.add_argument("--mb", type=float, default=48.0, help="MB per version")
    parser.add_argument("--tensor-mb", type=float, default=4.0)
    parser.add_argument("--versions", type=int, default=3)
    parser.add_argument("--senders", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--hsdp",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run HSDP on 4 ranks (2 x 2 replicate x shard: each shard from its two replicas)",
    )
    args = parser.parse_args(argv)
    reason = skip_reason()
    if reason:
        print(f"cannot run: {reason}")
        return 2
    rows = []
    with netlab() as lab:
        for world in args.senders:
            rows.append(run(lab, world, args.rate_mbit, args.mb, args.tensor_mb, args.versions))
            print(json.dumps(rows[-1]), flush=True)
        if args.hsdp:
            rows.append(run(lab, 4, args.rate_mbit, args.mb, args.tensor_mb, args.versions, "hsdp"))
            print(json.dumps(rows[-1]), flush=True)
    base = next((r["MB/s"] for r in rows if r["senders"] == 1), None)
    print(f"\nper-link rate {args.rate_mbit} Mbit/s ({args.rate_mbit / 8:.1f} MB/s), {args.mb} MB a version")
    print("| senders | layout | aggregate MB/s | vs N x 1 sender | s a version | stall a sync (slowest rank) "
          "| bitwise |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['MB/s'] / (r['senders'] * base):.2f}" if base else "-"
        print(f"| {r['senders']} | {r['layout']} | {r['MB/s']:.1f} | {ratio} | {r['seconds']:.2f} | "
              f"{r['stall_s']:.2f} s | {r['bitwise']} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
