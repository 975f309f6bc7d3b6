"""Fan-out over real, rate-limited links: what one trainer's link pays to feed K rollout receivers.

M trainer ranks (`--trainer-ranks`; one sends whole tensors, several send their rows of each, sharded mode)
feed K receivers (`--receivers`) that each take the whole model (S bytes). Every process runs in its own
network namespace behind its own veth link (tools/netlab.py; needs root), limited to `--rate-mbit` both
ways with `tc tbf` (slice_links' `limit_uplink` inside the namespace, `limit_downlink` on the bridge side).

Topologies:
- `tree`: one `WeightSender` a trainer rank, every receiver in its one lane: one gloo group of K + 1 whose
  broadcast is a binomial tree (a trainer link sends ceil(log2(K + 1)) copies of its part).
- `chain`: the same, with `transport.fanout=chain` (one chain, `transport.chain_length=0`, pieces of
  `CHAIN_PIECE_MB`): the trainer rank sends its part once, each receiver forwards every piece to the next.
- `star`: K `WeightSender`s a trainer rank (one port each), receiver k connected to the k-th of every rank,
  sent concurrently: each lane is one receiver, so a trainer link sends its part K times. This is "K lanes of
  one" built from K senders: the library has no knob that splits receivers of one declaration into lanes.

Per row (one per topology, K and M, fresh namespaces each): rank 0's seconds a version (`send_weights`, the
mean of the steady versions: version 1 builds the groups), `seconds x B / S` (1.0 is the floor: every byte
once over one link), each link's bytes a version (eth0's counters, read by each process inside its own
namespace at the start and end of each version; headers and acks included), the trainer link's TX (the
busiest rank's), and whether every receiver holds every version bitwise. MiB = 2**20 bytes, as `--mb`.
`--kill` rows: a receiver dies mid-version; `--late-joiner` rows: a receiver joins after version 2, caught up by a
peer (tools/fanout_late_joiner.py).

    sudo .venv/bin/python -m tools.fanout_links --mb 16 --rate-mbit 100 --receivers 2 4 8 \
        --trainer-ranks 1 2 --json out/fanout.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MODULE = "tools.fanout_links"  # what the lab's processes import (by name, not __main__)

from tools.netlab import Lab, netlab, skip_reason  # noqa: E402
from tools.sharded_links import await_versions, jsonl_lines, limit_uplink, row_shard  # noqa: E402
from tools.slice_links import MIB, limit_downlink, link_bytes, model_bytes, stream  # noqa: E402

TRAINER_PORT, PORT = 29711, 29720  # inside the lab's private namespaces; star sender k listens on PORT + k
TOPOLOGIES = ("star", "tree", "chain")
STEADY_AFTER = 1  # version 1 builds the data-plane groups
SLOW_LINK = "r1"  # --slow-link: this receiver's link runs at a quarter of the rate
KILLED = "r1"  # --kill: this receiver dies mid-version 2 (the second of a chain, an interior node of the tree)
BUCKET_MB = 8
CHAIN_PIECE_MB = 0.25  # transport.chain_piece_mb of the chain rows, and the chunk of the chain model
ROW_KEYS = ("topology", "receivers", "trainer_ranks", "slice_bytes", "trainer_link_bytes", "seconds",
            "seconds_x_rate_over_slice", "predicted_x", "links", "rate_mbit", "steady_versions",
            "bitwise", "slow_link")  # fmt: skip


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be >= 1")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be > 0")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=positive_float, default=16.0, help="MiB a receiver takes a version (S)")
    parser.add_argument("--tensor-mb", type=positive_float, default=4.0)
    parser.add_argument("--rate-mbit", type=positive_int, default=100, help="every link's rate (tbf), each way")
    parser.add_argument("--receivers", type=positive_int, nargs="+", default=[2, 4, 8], help="K values")
    parser.add_argument("--trainer-ranks", type=positive_int, nargs="+", default=[1], help="M values")
    parser.add_argument("--topologies", nargs="+", choices=TOPOLOGIES, default=list(TOPOLOGIES))
    parser.add_argument("--versions", type=positive_int, default=3, help="versions a run (the first is not reported)")
    parser.add_argument("--slow-link", action="store_true",
                        help=f"{SLOW_LINK}'s link at a quarter of --rate-mbit (K >= 2): what one slow receiver costs")
    parser.add_argument("--kill", action="store_true",
                        help=f"rows where {KILLED} dies mid-version 2 (M = 1, K >= 2): seconds to fail and to recover")
    parser.add_argument("--late-joiner", action="store_true",
                        help="rows where a receiver joins after version 2, caught up by a peer (M = 1, K >= 2; "
                        "tools/fanout_late_joiner.py): its time to catch up, the trainer's versions before and after")
    parser.add_argument("--json", type=Path, default=None, help="append one JSON object a row to this file")
    args = parser.parse_args(argv)
    if args.versions <= STEADY_AFTER:
        parser.error(f"--versions {args.versions}: version 1 builds the groups and is not measured; use >= 2")
    if args.tensor_mb > args.mb:
        parser.error(f"--tensor-mb {args.tensor_mb} is larger than --mb {args.mb}: lower --tensor-mb")
    if args.late_joiner:
        late_joiner_checks(parser, args)
    return args


def late_joiner_checks(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`--late-joiner` rows are one trainer rank, a tree or a chain of K >= 2, and nothing else varied."""
    if args.kill or args.slow_link:
        parser.error("--late-joiner with --kill or --slow-link: one kind of row a run; drop one of them")
    if args.trainer_ranks != [1]:
        parser.error(f"--late-joiner rows have one trainer rank: drop --trainer-ranks {args.trainer_ranks}")
    if not any(k >= 2 for k in args.receivers):
        parser.error(f"--late-joiner needs a peer beside the joiner's: --receivers {args.receivers}, give one >= 2")
    if args.topologies == ["star"]:
        parser.error("--late-joiner joins a lane of several receivers: --topologies tree and/or chain, not star")


def counter_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Bytes a link moved between two reads of its counters; a counter that went back (the link was
    recreated, or the namespace is not the one read before) is an error, not a negative count."""
    out = {}
    for key in ("tx", "rx"):
        if after[key] < before[key]:
            raise ValueError(f"{key}_bytes went back from {before[key]} to {after[key]}: the link was reset")
        out[key] = after[key] - before[key]
    return out


def link_table(lines: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each link's mean tx / rx bytes a version over the steady versions (all, if none is steady)."""
    steady = [e for e in lines if e["version"] > STEADY_AFTER] or lines
    by_link: dict[str, list[dict[str, Any]]] = {}
    for e in steady:
        by_link.setdefault(e["link"], []).append(e)
    return {
        link: {key: sum(e[key] for e in got) / len(got) for key in ("tx", "rx")}
        for link, got in sorted(by_link.items())
    }


def trainer_link_bytes(links: dict[str, dict[str, float]]) -> float:
    """The busiest trainer link's TX a version (trainer links are named t0, t1, ...)."""
    return max(v["tx"] for k, v in links.items() if k.startswith("t"))


def predicted_x(topology: str, receivers: int, ranks: int, slice_bytes: float, chunk_bytes: float) -> float:
    """docs/notes/fanout.md's time x B / S, per-hop overhead L = 0; each trainer rank sends its S / M stripe
    and a receiver's ingress (S) bounds every topology below by 1."""
    if topology == "star":
        return max(receivers / ranks, 1.0)
    if topology == "tree":
        return max(math.ceil(math.log2(receivers + 1)) / ranks, 1.0)
    if topology == "chain":
        return 1.0 + (receivers - 1) * min(chunk_bytes, slice_bytes / ranks) / slice_bytes
    raise ValueError(f"unknown topology {topology!r}: one of star, tree, chain")


def make_row(topology: str, receivers: int, ranks: int, slice_bytes: int, rate_mbit: int, seconds: list[float],
             links: dict[str, dict[str, float]], bitwise: bool, slow_link: str | None = None
             ) -> dict[str, Any]:  # fmt: skip
    mean = sum(seconds) / len(seconds)
    rate_bytes = rate_mbit * 1_000_000 / 8
    return {
        "topology": topology,
        "receivers": receivers,
        "trainer_ranks": ranks,
        "slice_bytes": slice_bytes,
        "trainer_link_bytes": trainer_link_bytes(links),
        "seconds": mean,
        "seconds_x_rate_over_slice": mean * rate_bytes / slice_bytes,
        "predicted_x": predicted_x(topology, receivers, ranks, slice_bytes, CHAIN_PIECE_MB * MIB),
        "links": links,
        "rate_mbit": rate_mbit,
        "steady_versions": len(seconds),
        "bitwise": bitwise,
        "slow_link": slow_link,
    }


def sender_overrides(host: str, port: int, topology: str, receivers: int) -> list[str]:
    """One trainer rank's sender: `receivers` on its lane, chained (one chain) or the backend's broadcast."""
    return [f"transport.host={host}", f"transport.port={port}", "transport.timeout_s=300",
            "transport.ready_timeout_s=120", f"transport.bucket_size_mb={BUCKET_MB}",
            f"trainer.min_receivers={receivers}", "transport.slices=false",
            f"transport.fanout={'chain' if topology == 'chain' else 'broadcast'}",
            f"transport.chain_piece_mb={CHAIN_PIECE_MB}", "transport.chain_length=0"]  # fmt: skip


def receiver_overrides(master: str, port: int, index: int) -> list[str]:
    """Receiver `index` of a row, connected to the sender at `master:port`."""
    return [f"transport.host={master}", f"transport.port={port}", "transport.timeout_s=300",
            "transport.ready_timeout_s=120", f"rollout.identity=r{index}", "transport.heartbeat_interval_s=0.2",
            "transport.slices=false"]  # fmt: skip


def add_nodes(lab: Lab, names: tuple[str, ...], rate_mbit: int, slow: str | None = None) -> None:
    """A namespace a process, its link limited to `rate_mbit` both ways (`slow`'s to a quarter of it)."""
    for name in names:
        lab.add(name)
        rate = max(rate_mbit // 4, 1) if name == slow else rate_mbit
        limit_uplink(lab, name, rate)
        limit_downlink(lab, name, rate)


def fan_sender(rank: int, world: int, master: str, host: str, topology: str, receivers: int, mb: float,
               tensor_mb: float, versions: int, out: str) -> None:  # fmt: skip
    """One trainer rank: one sender (`tree`) or one a receiver (`star`), all sending each version at once."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor
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
    lanes = receivers if topology == "star" else 1
    groups = [dist.new_group(backend="gloo") for _ in range(lanes)] if world > 1 else [None] * lanes

    def config(lane: int) -> Any:
        return load_config(overrides=sender_overrides(host, PORT + lane, topology, receivers // lanes))

    async def send(sender: WeightSender, addresses: list[tuple[str, int]], relay: Any, members: list[str] | None,
                   tensors: list[tuple[str, torch.Tensor]], version: int) -> None:  # fmt: skip
        if world == 1:
            await sender.send_weights(tensors, version=version)
            return
        mine = [(n, s) for n, t in tensors if (s := row_shard(t, rank, world))]
        if rank == 0:
            others = tuple(SenderAddress(h, p) for h, p in addresses[1:])
            try:
                await sender.send_weights(mine, version=version, sharding=Sharding(0, others=others, on_members=relay))
            finally:
                relay.finish()
        else:
            await sender.send_weights(mine, version=version, sharding=Sharding(rank, members=tuple(members or ())))

    async def main() -> None:
        senders = [WeightSender(config(lane)) for lane in range(lanes)]
        pool = ThreadPoolExecutor(max_workers=lanes, thread_name_prefix="members")
        for sender in senders:
            await sender.start()
        try:
            addresses = [exchange_addresses(host, s.port, torch.device("cpu")) for s in senders]
            for version in range(1, versions + 1):
                tensors = list(stream(version, mb, tensor_mb).items())
                relays = [MembersRelay(torch.device("cpu"), group) for group in groups]
                members: list[list[str] | None] = [None] * lanes
                if world > 1:
                    dist.barrier()
                if world > 1 and rank > 0:  # each lane's members on its own group, all at once: one thread a
                    # lane (the default pool has cores + 4; rank 0 blocks its loop in lane k's broadcast, so a
                    # lane without a thread here would hang every lane)
                    loop = asyncio.get_running_loop()
                    got = await asyncio.gather(*(loop.run_in_executor(pool, r.receive) for r in relays))
                    members = list(got)
                before = link_bytes()
                started = time.perf_counter()
                await asyncio.gather(*(send(senders[i], addresses[i], relays[i], members[i], tensors, version)
                                       for i in range(lanes)))  # fmt: skip
                seconds = time.perf_counter() - started
                moved = counter_delta(before, link_bytes())
                with open(out, "a") as f:
                    f.write(json.dumps({"link": f"t{rank}", "version": version, "seconds": seconds, **moved}) + "\n")
        finally:
            for sender in senders:
                await sender.close()
            pool.shutdown(wait=False)

    asyncio.run(main())
    dist.destroy_process_group()


def fan_receiver(index: int, topology: str, master: str, mb: float, tensor_mb: float, versions: int,
                 out: str) -> None:  # fmt: skip
    """Receiver `index`: into preallocated tensors, each version checked bitwise against the trainer's."""
    import asyncio

    import torch

    from lightning_weightsync.config import load_config
    from lightning_weightsync.versions.receiver import WeightReceiver

    lane = index if topology == "star" else 0
    cfg = load_config(overrides=receiver_overrides(master, PORT + lane, index))
    dest = {name: torch.empty_like(t) for name, t in stream(0, mb, tensor_mb).items()}

    async def main() -> None:
        async with WeightReceiver(cfg) as receiver:
            for _ in range(versions):
                before = link_bytes()
                names = [name async for name, _ in receiver.receive_weights(into=lambda meta: dest[meta.name])]
                moved = counter_delta(before, link_bytes())
                version = int(receiver.version)  # type: ignore[arg-type]  # set once a version is received
                want = stream(version, mb, tensor_mb)
                ok = sorted(names) == sorted(want) and all(torch.equal(dest[n], want[n]) for n in want)
                with open(out, "a") as f:
                    f.write(json.dumps({"link": f"r{index}", "version": version, "bitwise": ok, **moved}) + "\n")

    asyncio.run(main())


def run(lab: Lab, topology: str, receivers: int, ranks: int, rate_mbit: int, mb: float, tensor_mb: float,
        versions: int, slow: bool = False) -> dict[str, Any]:  # fmt: skip
    """One row; `slow`: receiver r1 (the second in a chain, an interior node of the tree) behind a link at a quarter
    of `rate_mbit`, both ways."""
    trainers = [f"t{rank}" for rank in range(ranks)]
    rollouts = [f"r{index}" for index in range(receivers)]
    tag = f"{topology}-{receivers}x{ranks}{'-slow' if slow else ''}"
    try:
        add_nodes(lab, (*trainers, *rollouts), rate_mbit, SLOW_LINK if slow else None)
        master = lab.nodes["t0"].ip
        sent, received = lab.workdir / f"senders-{tag}.jsonl", lab.workdir / f"receivers-{tag}.jsonl"
        procs = []
        for index, name in enumerate(rollouts):
            code = (f"from {MODULE} import fan_receiver as f; f({index}, {topology!r}, {master!r}, {mb}, "
                    f"{tensor_mb}, {versions}, {str(received)!r})")  # fmt: skip
            procs.append(lab.spawn(name, code, lab.workdir / f"{name}-{tag}.log"))
        for rank, name in enumerate(trainers):
            code = (f"from {MODULE} import fan_sender as f; f({rank}, {ranks}, {master!r}, {lab.nodes[name].ip!r}, "
                    f"{topology!r}, {receivers}, {mb}, {tensor_mb}, {versions}, {str(sent)!r})")  # fmt: skip
            procs.append(lab.spawn(name, code, lab.workdir / f"{name}-{tag}.log"))
        got = await_versions(lab, procs, received, versions * receivers, f"*-{tag}.log", tag)
        senders = jsonl_lines(sent)
    finally:
        lab.remove_nodes()  # the next run adds its own nodes
    rank0 = [e for e in senders if e["link"] == "t0" and e["version"] > STEADY_AFTER]
    if not rank0:
        raise RuntimeError(f"{tag}: trainer rank 0 reported no steady version")
    links = link_table(senders + got)
    return make_row(topology, receivers, ranks, model_bytes(mb, tensor_mb), rate_mbit, [e["seconds"] for e in rank0],
                    links, all(e["bitwise"] for e in got), SLOW_LINK if slow and receivers > 1 else None)  # fmt: skip


def kill_sender(master: str, topology: str, receivers: int, mb: float, tensor_mb: float, versions: int,
                out: str) -> None:  # fmt: skip
    """`--kill`: one trainer rank, one lane; version 2 loses a receiver mid-stream (it fails, named), then the rank
    carries on with who is left (`trainer.min_receivers` lowered), as a trainer whose `on_failure` warns would."""
    import asyncio
    from dataclasses import replace

    from lightning_weightsync.config import load_config
    from lightning_weightsync.errors import WeightSyncError
    from lightning_weightsync.versions.sender import WeightSender

    cfg = load_config(overrides=sender_overrides(master, PORT, topology, receivers))

    async def main() -> None:
        async with WeightSender(cfg) as sender:
            for version in range(1, versions + 1):
                started, error = time.perf_counter(), None
                try:
                    await sender.send_weights(list(stream(version, mb, tensor_mb).items()), version=version)
                except WeightSyncError as exc:
                    error = f"{type(exc).__name__}: {exc}"[:300]
                    sender.settings = replace(sender.settings, min_receivers=receivers - 1)
                line = {"link": "t0", "version": version, "seconds": time.perf_counter() - started, "error": error}
                with open(out, "a") as f:
                    f.write(json.dumps(line) + "\n")

    asyncio.run(main())


def kill_receiver(index: int, master: str, mb: float, tensor_mb: float, versions: int, out: str) -> None:
    """`--kill`: receiver `KILLED` exits without a word after its first tensor of version 2; the others take every
    version they can, each checked bitwise, and write a line for the failed one too."""
    import asyncio
    import os

    import torch

    from lightning_weightsync.config import load_config
    from lightning_weightsync.errors import WeightSyncError
    from lightning_weightsync.versions.receiver import WeightReceiver

    cfg = load_config(overrides=receiver_overrides(master, PORT, index))
    dest = {name: torch.empty_like(t) for name, t in stream(0, mb, tensor_mb).items()}

    async def main() -> None:
        async with WeightReceiver(cfg) as receiver:
            for attempt in range(1, versions + 1):
                line: dict[str, Any] = {"link": f"r{index}", "attempt": attempt}
                try:
                    names = []
                    async for name, _ in receiver.receive_weights(into=lambda meta: dest[meta.name]):
                        if f"r{index}" == KILLED and attempt == 2:
                            os._exit(0)  # no Bye, no ack: the kernel closes its sockets
                        names.append(name)
                    want = stream(int(receiver.version), mb, tensor_mb)  # type: ignore[arg-type]
                    line["bitwise"] = sorted(names) == sorted(want) and all(torch.equal(dest[n], want[n]) for n in want)
                    line["version"] = receiver.version
                except WeightSyncError as exc:
                    line["error"] = f"{type(exc).__name__}: {exc}"[:300]
                with open(out, "a") as f:
                    f.write(json.dumps(line) + "\n")

    asyncio.run(main())


def run_killed(lab: Lab, topology: str, receivers: int, rate_mbit: int, mb: float, tensor_mb: float,
               versions: int) -> dict[str, Any]:  # fmt: skip
    """A `--kill` row: receiver `KILLED` dies mid-version 2. The seconds until version 2 fails on the trainer, the
    next version's (the group formed again without it), and whether every survivor held every other version."""
    rollouts = [f"r{index}" for index in range(receivers)]
    tag = f"{topology}-{receivers}-killed"
    try:
        add_nodes(lab, ("t0", *rollouts), rate_mbit)
        master = lab.nodes["t0"].ip
        sent, received = lab.workdir / f"senders-{tag}.jsonl", lab.workdir / f"receivers-{tag}.jsonl"
        procs = []
        for index, name in enumerate(rollouts):
            code = (f"from {MODULE} import kill_receiver as f; f({index}, {master!r}, {mb}, {tensor_mb}, "
                    f"{versions}, {str(received)!r})")  # fmt: skip
            procs.append(lab.spawn(name, code, lab.workdir / f"{name}-{tag}.log"))
        code = (f"from {MODULE} import kill_sender as f; f({master!r}, {topology!r}, {receivers}, {mb}, {tensor_mb}, "
                f"{versions}, {str(sent)!r})")  # fmt: skip
        procs.append(lab.spawn("t0", code, lab.workdir / f"t0-{tag}.log"))
        got = await_versions(lab, procs, received, (receivers - 1) * versions + 1, f"*-{tag}.log", tag)
        senders = jsonl_lines(sent)
    finally:
        lab.remove_nodes()  # the next run adds its own nodes
    return killed_row(topology, receivers, senders, got)


def killed_row(topology: str, receivers: int, senders: list[dict[str, Any]], got: list[dict[str, Any]]
               ) -> dict[str, Any]:  # fmt: skip
    """The trainer's view of the kill (`seconds` a version, which failed and why) and the survivors' outcome."""
    by_version = {e["version"]: e for e in senders}
    survivors = [e for e in got if e["link"] != KILLED]
    return {
        "topology": topology,
        "receivers": receivers,
        "killed": KILLED,
        "seconds_to_fail": by_version[2]["seconds"],
        "failed_with": by_version[2]["error"],
        "seconds_next_version": by_version[3]["seconds"] if 3 in by_version else None,
        "later_versions_failed": sum(1 for v, e in by_version.items() if v > 2 and e["error"]),
        "survivors_failed_version_2": sum(1 for e in survivors if e["attempt"] == 2 and "error" in e),
        "bitwise": all(e.get("bitwise", True) for e in survivors) and all(
            "error" not in e for e in survivors if e["attempt"] != 2
        ),
    }


def table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "| topology | K | M | slow link | s a version | s x B / S | model: star / tree / chain "
        "| trainer link MiB sent | max receiver MiB received / sent | bitwise |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        k, m, s = r["receivers"], r["trainer_ranks"], r["slice_bytes"]
        model = " / ".join(f"{predicted_x(t, k, m, s, CHAIN_PIECE_MB * MIB):.2f}" for t in ("star", "tree", "chain"))
        rx = max(v["rx"] for n, v in r["links"].items() if n.startswith("r")) / MIB
        tx = max(v["tx"] for n, v in r["links"].items() if n.startswith("r")) / MIB
        out.append(
            f"| {r['topology']} | {k} | {m} | {r['slow_link'] or '-'} | {r['seconds']:.2f} | "
            f"{r['seconds_x_rate_over_slice']:.2f} | {model} | {r['trainer_link_bytes'] / MIB:.1f} | "
            f"{rx:.1f} / {tx:.1f} | {r['bitwise']} |"
        )
    return out


def emit_row(row: dict[str, Any], json_path: Path | None) -> None:
    """One row as it is measured: printed, and appended to `--json` (one object a line) where given."""
    print(json.dumps(row), flush=True)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        with json_path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = skip_reason()
    if reason:
        print(f"cannot run: {reason}")
        return 2
    if args.kill:
        return main_killed(args)
    if args.late_joiner:
        from tools.fanout_late_joiner import main_late_joiner  # it builds on this module

        return main_late_joiner(args)
    rows: list[dict[str, Any]] = []
    failed = False
    with netlab() as lab:
        for ranks in args.trainer_ranks:
            for receivers in args.receivers:
                for topology in args.topologies:
                    try:
                        row = run(lab, topology, receivers, ranks, args.rate_mbit, args.mb, args.tensor_mb,
                                  args.versions, args.slow_link)  # fmt: skip
                    except RuntimeError as exc:
                        failed = True
                        print(f"{topology} K={receivers} M={ranks}: failed: {exc}", flush=True)
                        continue
                    rows.append(row)
                    emit_row(row, args.json)
    print(f"\nevery link {args.rate_mbit} Mbit/s each way, S = {args.mb} MiB a receiver (tensors of "
          f"{args.tensor_mb} MiB), buckets {BUCKET_MB} MiB, chain pieces (and model chunk) {CHAIN_PIECE_MB} MiB, "
          f"versions {STEADY_AFTER + 1}..{args.versions}")  # fmt: skip
    print("\n".join(table(rows)))
    return 1 if failed else 0


def main_killed(args: argparse.Namespace) -> int:
    """`--kill`: a row per topology and K (M = 1), receiver `KILLED` dying mid-version 2."""
    failed = False
    with netlab() as lab:
        for receivers in [k for k in args.receivers if k >= 2]:
            for topology in [t for t in args.topologies if t != "star"]:  # a star's lanes do not share a fate
                try:
                    row = run_killed(lab, topology, receivers, args.rate_mbit, args.mb, args.tensor_mb,
                                     max(args.versions, 3))  # fmt: skip
                except RuntimeError as exc:
                    failed = True
                    print(f"{topology} K={receivers} killed: failed: {exc}", flush=True)
                    continue
                emit_row(row, args.json)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
