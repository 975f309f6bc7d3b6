"""`python -m tools.fanout_links --late-joiner`: what a rollout that joins mid-training costs, served by a peer.

One trainer rank feeds K receivers in one lane (`tree` or `chain`, as tools/fanout_links.py's rows; every process
in its own namespace behind its own link at `--rate-mbit` both ways), every side at `transport.verify=full` (a peer
serves against the trainer's fingerprints). Receiver `PEER` runs a `PeerServer` and holds every version it
installs. After version `JOIN_AFTER` the trainer pauses (a training step that lasts until the joiner has caught
up, bounded by `CATCH_UP_WAIT_S`); the joiner (`JOINER`, a namespace and link of its own at the same rate, its
process started with the others and waiting) takes that version from the peer (`catch_up`), then registers with
the trainer and takes the next versions whole, as a member of the lane (the trainer's `min_receivers` raised to
K + 1).

Why the catch-up runs in the trainer's pause and not beside its next version: the peer's own next version cancels
its serve at that version's Prepare (versions/peer_serve.py), so a catch-up can only complete between two of the
trainer's versions. The others' slowdown is then what the joining costs the trainer's versions: the version the
joiner first takes (its registration read, the group formed again with K + 1) and the ones after, against the
version before it.

Markers between the processes are files in the row's own folder (every namespace shares the filesystem):
`held-<v>` (the peer holds v; its text is the serve address), `sent-2` (the trainer's version 2 is complete on
every receiver: its pause starts), `peer-counting` (the peer read its link counters: the joiner may start) and
`caught-up` (the joiner holds the version and its receiver registered with the trainer: the trainer's next version
may start). So the catch-up lies wholly inside the trainer's pause and the peer's counted window, and the version
before it ran without it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from tools.fanout_links import (
    BUCKET_MB,
    PORT,
    ROW_KEYS,
    STEADY_AFTER,
    add_nodes,
    counter_delta,
    emit_row,
    link_table,
    make_row,
    receiver_overrides,
    sender_overrides,
)
from tools.netlab import Lab, netlab
from tools.sharded_links import await_versions, jsonl_lines
from tools.slice_links import MIB, link_bytes, model_bytes, stream

JOINER_MODULE = "tools.fanout_late_joiner"  # what the lab's processes import (by name, not __main__)
PEER = "r0"  # serves the joiner: the chain's head and an interior node of the tree, whose link forwards too
JOINER = "j"
JOIN_AFTER = 2  # the joiner arrives once the trainer's version 2 is installed (version 1 builds the groups)
PEER_PORT = 29790  # the peer's serve port, inside its own namespace
CATCH_UP_WAIT_S = 120.0  # the most the trainer pauses for the joiner, and the joiner waits for the peer
POLL_S = 0.02
SENT = f"sent-{JOIN_AFTER}"  # the trainer's version JOIN_AFTER is complete on every receiver: its pause starts
COUNTING = "peer-counting"  # the peer read its link counters: the catch-up may start
CAUGHT_UP = "caught-up"
LATE_KEYS = (*ROW_KEYS, "peer", "late_joiner", "caught_up_version", "catch_up_seconds",
             "catch_up_x_rate_over_slice", "catch_up_bytes", "trainer_pause_seconds", "seconds_joined",
             "seconds_after", "trainer_link_bytes_joined", "receivers_joined")  # fmt: skip


def late_receiver_overrides(master: str, index: int) -> list[str]:
    """A receiver of a late-joiner row (and the joiner, `index` -1): checks every tensor (the peer serves against
    the trainer's fingerprints) and buckets of `BUCKET_MB` (the peer's serve sends with its receiver's section)."""
    identity = JOINER if index < 0 else f"r{index}"
    base = [o for o in receiver_overrides(master, PORT, 0) if not o.startswith("rollout.identity=")]
    return [*base, f"rollout.identity={identity}", "transport.verify=full", f"transport.bucket_size_mb={BUCKET_MB}"]


async def wait_for(path: Path, what: str) -> str:
    """The text of marker `path` once it exists; a clear failure after `CATCH_UP_WAIT_S`."""
    import asyncio

    deadline = time.monotonic() + CATCH_UP_WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: no {path.name} after {CATCH_UP_WAIT_S} s")
        await asyncio.sleep(POLL_S)
    return path.read_text()


def write_line(out: str, line: dict[str, Any]) -> None:
    with open(out, "a") as f:
        f.write(json.dumps(line) + "\n")


async def take_version(receiver: Any, dest: dict[str, Any], link: str, mb: float, tensor_mb: float) -> dict[str, Any]:
    """One version into `dest`, checked bitwise against the trainer's, with this link's bytes meanwhile."""
    import torch

    before = link_bytes()
    names = [name async for name, _ in receiver.receive_weights(into=lambda meta: dest[meta.name])]
    moved = counter_delta(before, link_bytes())
    version = int(receiver.version)
    want = stream(version, mb, tensor_mb)
    ok = sorted(names) == sorted(want) and all(torch.equal(dest[n], want[n]) for n in want)
    return {"link": link, "version": version, "bitwise": ok, **moved}


def late_sender(master: str, topology: str, receivers: int, mb: float, tensor_mb: float, versions: int,
                marks: str, out: str) -> None:  # fmt: skip
    """The trainer rank: versions back to back but for the pause after `JOIN_AFTER`, whose link bytes it reads
    (what its link carried while the joiner caught up); from then on it waits for K + 1 receivers."""
    import asyncio
    from dataclasses import replace

    from lightning_weightsync.config import load_config
    from lightning_weightsync.versions.sender import WeightSender

    cfg = load_config(overrides=[*sender_overrides(master, PORT, topology, receivers), "transport.verify=full"])

    async def main() -> None:
        async with WeightSender(cfg) as sender:
            for version in range(1, versions + 1):
                if version == JOIN_AFTER + 1:
                    before, started = link_bytes(), time.perf_counter()
                    (Path(marks) / SENT).write_text("")
                    await wait_for(Path(marks) / CAUGHT_UP, "trainer")
                    pause = {"link": "t0", "phase": "catch_up", "seconds": time.perf_counter() - started}
                    write_line(out, {**pause, **counter_delta(before, link_bytes())})
                    sender.settings = replace(sender.settings, min_receivers=receivers + 1)
                before, started = link_bytes(), time.perf_counter()
                await sender.send_weights(list(stream(version, mb, tensor_mb).items()), version=version)
                line = {"link": "t0", "version": version, "seconds": time.perf_counter() - started,
                        "receivers": len(sender.registered)}  # fmt: skip
                write_line(out, {**line, **counter_delta(before, link_bytes())})

    asyncio.run(main())


def late_receiver(index: int, master: str, ip: str, mb: float, tensor_mb: float, versions: int, marks: str,
                  out: str) -> None:  # fmt: skip
    """Receiver `index`; `PEER` also serves every version it installs (`PeerServer` at `ip:PEER_PORT`) and reads
    its link bytes from the trainer's end of version `JOIN_AFTER` until the joiner caught up (what the serve cost
    it)."""
    import asyncio

    import torch

    from lightning_weightsync.config import load_config
    from lightning_weightsync.versions.peer_serve import PeerServer, serve_settings
    from lightning_weightsync.versions.receiver import WeightReceiver

    link = f"r{index}"
    cfg = load_config(overrides=late_receiver_overrides(master, index))
    dest = {name: torch.empty_like(t) for name, t in stream(0, mb, tensor_mb).items()}

    async def count_serve(server: PeerServer) -> None:
        await wait_for(Path(marks) / SENT, "peer")  # the tree's version done: nothing of it still leaves this link
        before = link_bytes()
        (Path(marks) / COUNTING).write_text("")
        await wait_for(Path(marks) / CAUGHT_UP, "peer")
        line = {"link": link, "phase": "serve", "served": len(server.served), "failed": server.failed}
        write_line(out, {**line, **counter_delta(before, link_bytes())})

    async def main() -> None:
        async with WeightReceiver(cfg) as receiver:
            server = PeerServer(serve_settings(receiver.settings, PEER_PORT, host=ip)) if link == PEER else None
            if server is not None:
                await server.start()
                receiver.on_version_start = server.release
            counting = None
            try:
                for _ in range(versions):
                    line = await take_version(receiver, dest, link, mb, tensor_mb)
                    write_line(out, line)
                    if server is not None and receiver.last_verify is not None:
                        server.hold(line["version"], dest, receiver.last_verify.checksums)
                        (Path(marks) / f"held-{line['version']}").write_text(server.address)
                        if line["version"] == JOIN_AFTER:
                            counting = asyncio.create_task(count_serve(server))
                if counting is not None:
                    await counting
            finally:
                if server is not None:
                    await server.close()

    asyncio.run(main())


def late_joiner(master: str, mb: float, tensor_mb: float, versions: int, marks: str, out: str) -> None:
    """The joiner: waits (started) until the peer holds version `JOIN_AFTER` and the trainer's version is done,
    catches up from the peer, then registers with the trainer (`caught-up` written once it did) and takes every
    later version."""
    import asyncio

    import torch

    from lightning_weightsync.config import ReceiverSettings, load_config
    from lightning_weightsync.versions.peer_serve import catch_up
    from lightning_weightsync.versions.receiver import WeightReceiver

    cfg = load_config(overrides=late_receiver_overrides(master, -1))
    dest = {name: torch.empty_like(t) for name, t in stream(0, mb, tensor_mb).items()}

    async def main() -> None:
        address = await wait_for(Path(marks) / f"held-{JOIN_AFTER}", "joiner")
        await wait_for(Path(marks) / COUNTING, "joiner")  # after the trainer's version: its pause holds the catch-up
        before, started = link_bytes(), time.perf_counter()
        caught = await catch_up(ReceiverSettings.of(cfg), [address], lambda meta: dest[meta.name], identity=JOINER,
                                wait_s=CATCH_UP_WAIT_S)  # fmt: skip
        seconds = time.perf_counter() - started
        moved = counter_delta(before, link_bytes())
        version = caught.version if caught is not None else None
        want = stream(version, mb, tensor_mb) if version is not None else {}
        ok = bool(want) and all(torch.equal(dest[n], want[n]) for n in want)
        write_line(out, {"link": JOINER, "phase": "catch_up", "version": version, "seconds": seconds, "bitwise": ok,
                         "peer": address, **moved})  # fmt: skip
        async with WeightReceiver(cfg) as receiver:
            (Path(marks) / CAUGHT_UP).write_text(str(version))
            for _ in range(versions - JOIN_AFTER):
                write_line(out, await take_version(receiver, dest, JOINER, mb, tensor_mb))

    asyncio.run(main())


def expected_lines(receivers: int, versions: int) -> int:
    """The lines a late-joiner row's receivers write: each receiver's every version, the joiner's catch-up and
    every version after it, and the peer's serve."""
    return receivers * versions + 1 + (versions - JOIN_AFTER) + 1


def run_late_joiner(lab: Lab, topology: str, receivers: int, rate_mbit: int, mb: float, tensor_mb: float,
                    versions: int) -> dict[str, Any]:  # fmt: skip
    """One late-joiner row, fresh namespaces (module docstring)."""
    if receivers < 2 or versions < JOIN_AFTER + 1:
        raise ValueError(f"a late-joiner row needs K >= 2 and versions > {JOIN_AFTER}: got {receivers}, {versions}")
    rollouts = [f"r{index}" for index in range(receivers)]
    tag = f"{topology}-{receivers}-late"
    marks = lab.workdir / f"marks-{tag}"
    marks.mkdir()
    sent, received = lab.workdir / f"senders-{tag}.jsonl", lab.workdir / f"receivers-{tag}.jsonl"
    args = f"{mb}, {tensor_mb}, {versions}, {str(marks)!r}, {str(received)!r}"
    try:
        add_nodes(lab, ("t0", *rollouts, JOINER), rate_mbit)
        master = lab.nodes["t0"].ip
        procs = []
        for index, name in enumerate(rollouts):
            ip = lab.nodes[name].ip
            code = f"from {JOINER_MODULE} import late_receiver as f; f({index}, {master!r}, {ip!r}, {args})"
            procs.append(lab.spawn(name, code, lab.workdir / f"{name}-{tag}.log"))
        code = f"from {JOINER_MODULE} import late_joiner as f; f({master!r}, {args})"
        procs.append(lab.spawn(JOINER, code, lab.workdir / f"{JOINER}-{tag}.log"))
        code = (f"from {JOINER_MODULE} import late_sender as f; f({master!r}, {topology!r}, {receivers}, {mb}, "
                f"{tensor_mb}, {versions}, {str(marks)!r}, {str(sent)!r})")  # fmt: skip
        procs.append(lab.spawn("t0", code, lab.workdir / f"t0-{tag}.log"))
        got = await_versions(lab, procs, received, expected_lines(receivers, versions), f"*-{tag}.log", tag)
        senders = jsonl_lines(sent)
    finally:
        lab.remove_nodes()  # the next run adds its own nodes
    return late_joiner_row(topology, receivers, model_bytes(mb, tensor_mb), rate_mbit, senders, got)


def all_bitwise(receivers: int, versions: int, got: list[dict[str, Any]]) -> bool:
    """Every receiver held every version bitwise, and the joiner the version it caught up with and every later
    one: a version missing counts as not held."""
    want = {(f"r{i}", v) for i in range(receivers) for v in range(1, versions + 1)}
    want |= {(JOINER, v) for v in range(JOIN_AFTER + 1, versions + 1)}
    lines = [e for e in got if "phase" not in e]
    held = {(e["link"], e["version"]) for e in lines if e["bitwise"]}
    caught = [e for e in got if e.get("phase") == "catch_up" and e["link"] == JOINER]
    return want <= held and all(e["bitwise"] for e in lines) and len(caught) == 1 and caught[0]["bitwise"] is True


def late_joiner_row(topology: str, receivers: int, slice_bytes: int, rate_mbit: int, senders: list[dict[str, Any]],
                    got: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """The other rows' keys for the version before the joiner (K receivers: `seconds`, `links`,
    `trainer_link_bytes`), then the catch-up (seconds, each link's bytes meanwhile) and the trainer's versions
    once the joiner is in (the one it joins, the mean of the ones after; None without any)."""
    trainer = {e["version"]: e for e in senders if "phase" not in e}
    versions = max(trainer)
    if JOIN_AFTER not in trainer or JOIN_AFTER + 1 not in trainer:
        raise ValueError(f"the trainer reported versions {sorted(trainer)}: a late-joiner row needs {JOIN_AFTER} "
                         f"and {JOIN_AFTER + 1}")  # fmt: skip
    pause = next(e for e in senders if e.get("phase") == "catch_up")
    caught = next(e for e in got if e.get("phase") == "catch_up" and e["link"] == JOINER)
    serve = next(e for e in got if e.get("phase") == "serve")
    before = [e for e in [*senders, *got] if "phase" not in e and e["version"] == JOIN_AFTER]
    assert JOIN_AFTER > STEADY_AFTER  # the version before the joiner is a steady one
    row = make_row(topology, receivers, 1, slice_bytes, rate_mbit, [trainer[JOIN_AFTER]["seconds"]],
                   link_table(before), all_bitwise(receivers, versions, got))  # fmt: skip
    after = [trainer[v]["seconds"] for v in range(JOIN_AFTER + 2, versions + 1)]
    rate_bytes = rate_mbit * 1_000_000 / 8
    catch_up_bytes = {"joiner_rx": caught["rx"], "peer_tx": serve["tx"], "trainer_tx": pause["tx"],
                      "trainer_rx": pause["rx"]}  # fmt: skip
    row.update(
        {
            "peer": PEER,
            "late_joiner": JOINER,
            "caught_up_version": caught["version"],
            "catch_up_seconds": caught["seconds"],
            "catch_up_x_rate_over_slice": caught["seconds"] * rate_bytes / slice_bytes,
            "catch_up_bytes": catch_up_bytes,
            "trainer_pause_seconds": pause["seconds"],
            "seconds_joined": trainer[JOIN_AFTER + 1]["seconds"],
            "seconds_after": sum(after) / len(after) if after else None,
            "trainer_link_bytes_joined": trainer[JOIN_AFTER + 1]["tx"],
            "receivers_joined": trainer[JOIN_AFTER + 1]["receivers"],
        }
    )
    return row


def late_table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "| topology | K | catch-up s | catch-up x B / S | joiner MiB from the peer | peer link MiB sent "
        "| trainer link MiB sent meanwhile | trainer s a version: before / joined / after | bitwise |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = r["catch_up_bytes"]
        after = "-" if r["seconds_after"] is None else f"{r['seconds_after']:.2f}"
        out.append(
            f"| {r['topology']} | {r['receivers']} | {r['catch_up_seconds']:.2f} | "
            f"{r['catch_up_x_rate_over_slice']:.2f} | {b['joiner_rx'] / MIB:.1f} | {b['peer_tx'] / MIB:.1f} | "
            f"{b['trainer_tx'] / MIB:.2f} | {r['seconds']:.2f} / {r['seconds_joined']:.2f} / {after} | "
            f"{r['bitwise']} |"
        )
    return out


def main_late_joiner(args: argparse.Namespace) -> int:
    """`--late-joiner`: a row per topology (tree, chain) and K >= 2, M = 1 (module docstring)."""
    rows: list[dict[str, Any]] = []
    failed = False
    with netlab() as lab:
        for receivers in [k for k in args.receivers if k >= 2]:
            for topology in [t for t in args.topologies if t != "star"]:  # a star's lanes have one receiver each
                try:
                    row = run_late_joiner(lab, topology, receivers, args.rate_mbit, args.mb, args.tensor_mb,
                                          max(args.versions, JOIN_AFTER + 2))  # fmt: skip
                except RuntimeError as exc:
                    failed = True
                    print(f"{topology} K={receivers} late joiner: failed: {exc}", flush=True)
                    continue
                rows.append(row)
                emit_row(row, args.json)
    print("\n".join(late_table(rows)))
    return 1 if failed else 0


__all__ = ["JOINER", "JOIN_AFTER", "LATE_KEYS", "PEER", "late_joiner_row", "late_table", "run_late_joiner"]
