"""The nixl backend against raw NIXL and against gloo, in one run, in the same two processes.

- raw: NIXL agents of our own, no engine: the receiver READs `total` bytes in bucket-sized pieces from
  the sender's two registered slots (the floor the backend can reach), and the sender WRITEs the same
  bytes into the receiver's slots (why the backend READs: see `transport/backends/nixl.py`). Bitwise.
- engine: `send_weights` of a Qwen3-8B-shaped stream (every dimension divided by `scale`), the receiver
  merging `into=` preallocated destinations, with transport.backend=nixl and then gloo; seconds and CPU
  seconds per GiB on both sides (process CPU time: every thread, UCX's progress thread included), best of
  the versions after the first (the first forms the group and registers the destinations). Bitwise.
- registration: seconds to register a tensor of 1 .. 256 MiB with NIXL (what a direct READ into a
  destination costs once; cached afterwards), and the receiver's registrations / cache hits per version.

    python -m lightning_weightsync.bench.nixl [--json] [--scale 8] [--bucket-mb 64] [--versions 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import time
import traceback
from typing import Any

import torch

from ..transport.process import free_port
from .throughput import collect_workers

MiB = 1024 * 1024
GiB = 1024 * MiB
SIZES: dict[str, dict[str, Any]] = {
    "small": {"scale": 32, "versions": 2, "repeats": 1, "registration_mb": (1, 16)},
    "default": {},
}
"""`lightning-weightsync bench --size`: run() keyword arguments (default: the documented figures)."""
ESTIMATE_S = {"small": 6.0, "default": 14.0}
"""Seconds each size took on the 2-core development machine (printed before the run starts)."""


def _stream(scale: int, version: int) -> list[tuple[str, torch.Tensor]]:
    from .inventory import model_stream

    return list(model_stream("qwen3-8b", scale=scale, version=version, extras=False))


def make_agent(name: str) -> Any:
    from ..transport.backends import backend_class

    agent_cls, config_cls = backend_class("nixl").agent_classes()  # type: ignore[attr-defined]
    return agent_cls(name, config_cls(enable_prog_thread=False, backends=["UCX"]))  # as the backend runs it


def progress_until(agent: Any, q_in: Any, timeout_s: float = 300) -> Any:
    """The passive side of a transfer drives its UCX worker until the other side says it is done."""
    import queue

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return q_in.get(timeout=0.001)
        except queue.Empty:
            agent.get_new_notifs()
    raise TimeoutError("the other benchmark worker did not finish")


def _wait(agent: Any, handle: Any) -> None:
    state = agent.transfer(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"NIXL transfer failed ({state})")


def nixl_pieces(agent: Any, op: str, local: list[torch.Tensor], remote: list[tuple[int, int]], peer: str, total: int,
            bucket: int, mem_type: str = "DRAM", device_id: int = 0) -> float:  # fmt: skip
    """Seconds to move `total` bytes in `bucket`-byte pieces, alternating the two slots (one request per piece).
    Both sides' slots are `mem_type` on `device_id` (the GPU kit runs this VRAM to VRAM on one GPU)."""
    t0 = time.perf_counter()
    for i, start in enumerate(range(0, total, bucket)):
        n = min(bucket, total - start)
        here = agent.get_xfer_descs([(local[i % 2].data_ptr(), n, device_id)], mem_type)
        there = agent.get_xfer_descs([(remote[i % 2][0], n, device_id)], mem_type)
        handle = agent.initialize_xfer(op, here, there, peer)
        _wait(agent, handle)
        handle.release()
    return time.perf_counter() - t0


def _raw(role: int, q_in: Any, q_out: Any, total: int, bucket: int, repeats: int) -> dict[str, Any]:
    """Raw NIXL between the two workers: READ by role 1 from role 0's slots, then WRITE by role 0."""
    agent = make_agent(f"bench-{role}")
    slots = [torch.full((bucket,), 17 * (i + 1) + role, dtype=torch.uint8) for i in range(2)]
    agent.register_memory(slots)
    q_out.put((agent.get_agent_metadata(), [(s.data_ptr(), bucket) for s in slots]))
    metadata, remote = q_in.get(timeout=120)
    peer = agent.add_remote_agent(metadata)
    peer = peer.decode() if isinstance(peer, bytes) else peer
    out: dict[str, Any] = {}
    if role == 1:
        nixl_pieces(agent, "READ", slots, remote, peer, min(total, 2 * bucket), bucket)  # connection set-up
        out["read_s"] = min(nixl_pieces(agent, "READ", slots, remote, peer, total, bucket) for _ in range(repeats))
        out["read_bitwise"] = all(torch.equal(slots[i], torch.full((bucket,), 17 * (i + 1), dtype=torch.uint8))
                                  for i in range(min(2, -(-total // bucket))))  # fmt: skip
        for slot in slots:
            slot.zero_()
        q_out.put("read done")
        progress_until(agent, q_in)  # the WRITE phase ran
        out["write_bitwise"] = torch.equal(slots[0], torch.full((bucket,), 17, dtype=torch.uint8))
    else:
        progress_until(agent, q_in)  # the READ phase ran
        out["write_s"] = min(nixl_pieces(agent, "WRITE", slots, remote, peer, total, bucket) for _ in range(repeats))
        q_out.put("write done")
    return out


def _registration_seconds(sizes_mb: list[int]) -> dict[str, float]:
    agent = make_agent("bench-registration")
    out = {}
    for size in sizes_mb:
        t = torch.ones(size * MiB, dtype=torch.uint8)  # touched: registration, not page faults, is timed
        t0 = time.perf_counter()
        descs = agent.register_memory([t])
        out[f"{size}MiB"] = time.perf_counter() - t0
        agent.deregister_memory(descs)
    return out


def _engine(role: int, backend: str, port: int, scale: int, bucket_mb: float, versions: int) -> dict[str, Any]:
    from ..config import load_config
    from ..protocol.chunks import as_bytes
    from ..versions.receiver import WeightReceiver
    from ..versions.sender import WeightSender

    cfg = load_config(overrides=[
        f"transport.port={port}", f"transport.backend={backend}", f"transport.bucket_size_mb={bucket_mb}",
        "transport.timeout_s=120", "transport.heartbeat_interval_s=0.2", "trainer.min_receivers=1",
    ])  # fmt: skip

    async def sender() -> dict[str, Any]:
        rows = []
        async with WeightSender(cfg) as s:
            for version in range(1, versions + 1):
                weights = _stream(scale, version)
                cpu0 = time.process_time()
                stats = await s.send_weights(weights, version=version)
                rows.append({"seconds": stats.seconds, "cpu_s": time.process_time() - cpu0, "nbytes": stats.nbytes,
                             "buckets": stats.num_buckets})  # fmt: skip
        return {"versions": rows}

    async def receiver() -> dict[str, Any]:
        rows = []
        dest = {n: torch.empty_like(t) for n, t in _stream(scale, 1)}
        async with WeightReceiver(cfg) as r:
            for _ in range(versions):
                cpu0 = time.process_time()
                async for _name, _t in r.receive_weights(into=lambda meta: dest[meta.name]):
                    pass
                cpu = time.process_time() - cpu0
                assert r.version is not None and r.last_stats is not None  # a version was received
                expected = _stream(scale, r.version)
                bitwise = all(torch.equal(as_bytes(dest[n]), as_bytes(t)) for n, t in expected)
                b = r._lane.backend
                rows.append({"seconds": r.last_stats.seconds, "cpu_s": cpu, "bitwise": bitwise,
                             "direct_buckets": r.last_stats.direct_buckets,
                             "registrations": getattr(b, "registrations", None),
                             "registration_hits": getattr(b, "registration_hits", None),
                             "registration_s": getattr(b, "registration_s", None)})  # fmt: skip
        return {"versions": rows}

    if role == 0:
        return asyncio.run(sender())
    time.sleep(0.3)
    return asyncio.run(receiver())


def _worker(role: int, q_in: Any, q_out: Any, results: Any, case: dict[str, Any]) -> None:
    try:
        torch.set_num_threads(1)
        out: dict[str, Any] = {"raw": _raw(role, q_in, q_out, case["total"], case["bucket"], case["repeats"])}
        if role == 0:
            out["registration_s"] = _registration_seconds(case["registration_mb"])
        for backend, port in case["ports"].items():
            out[backend] = _engine(role, backend, port, case["scale"], case["bucket_mb"], case["versions"])
        results.put((role, True, out))
    except BaseException:
        results.put((role, False, traceback.format_exc()))


def run(
    json_out: bool = False,
    *,
    scale: int = 8,
    bucket_mb: float = 64.0,
    versions: int = 3,
    repeats: int = 3,
    registration_mb: tuple[int, ...] = (1, 16, 64, 256),
    timeout_s: float = 900,
) -> dict[str, Any]:
    total = sum(t.numel() * t.element_size() for _, t in _stream(scale, 1))
    bucket = int(bucket_mb * MiB)
    case = {"total": total, "bucket": bucket, "repeats": repeats, "scale": scale, "bucket_mb": bucket_mb,
            "versions": versions, "registration_mb": list(registration_mb),
            "ports": {"nixl": free_port(), "gloo": free_port()}}  # fmt: skip
    ctx = mp.get_context("spawn")
    q01, q10, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(0, q10, q01, results, case), daemon=True),
        ctx.Process(target=_worker, args=(1, q01, q10, results, case), daemon=True),
    ]
    got = collect_workers(procs, results, timeout_s, "the nixl benchmark", join_s=10)
    report = _report(got[0], got[1], total, bucket_mb)
    if json_out:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return report


def _report(sender: dict[str, Any], receiver: dict[str, Any], total: int, bucket_mb: float) -> dict[str, Any]:
    gib = total / GiB
    read_s, write_s = receiver["raw"]["read_s"], sender["raw"]["write_s"]
    report: dict[str, Any] = {
        "bytes": total,
        "bucket_mb": bucket_mb,
        "raw_nixl": {
            "read_s_per_gib": read_s / gib, "read_gbps": total / read_s / 1e9,
            "write_s_per_gib": write_s / gib, "write_gbps": total / write_s / 1e9,
            "bitwise": receiver["raw"]["read_bitwise"] and receiver["raw"]["write_bitwise"],
        },
        "registration_s": sender["registration_s"],
        "engine": {},
    }  # fmt: skip
    for backend in ("nixl", "gloo"):
        s_rows, r_rows = sender[backend]["versions"], receiver[backend]["versions"]
        steady = range(1, len(s_rows)) if len(s_rows) > 1 else range(len(s_rows))
        best = min(steady, key=lambda i: s_rows[i]["seconds"])
        report["engine"][backend] = {
            "s_per_gib": s_rows[best]["seconds"] / gib,
            "gbps": total / s_rows[best]["seconds"] / 1e9,
            "sender_cpu_s_per_gib": s_rows[best]["cpu_s"] / gib,
            "receiver_cpu_s_per_gib": r_rows[best]["cpu_s"] / gib,
            "ratio_vs_raw_nixl_read": read_s / s_rows[best]["seconds"],
            "first_version_s": s_rows[0]["seconds"],
            "bitwise": all(r["bitwise"] for r in r_rows),
            "buckets": s_rows[best]["buckets"],
            "direct_buckets": r_rows[best]["direct_buckets"],
            "receiver_registrations": [(r["registrations"], r["registration_hits"]) for r in r_rows],
            "receiver_registration_s": r_rows[-1]["registration_s"],
        }
    report["nixl_vs_gloo"] = report["engine"]["gloo"]["s_per_gib"] / report["engine"]["nixl"]["s_per_gib"]
    return report


def _print(report: dict[str, Any]) -> None:
    raw = report["raw_nixl"]
    print(f"{report['bytes'] / MiB:.0f} MiB Qwen3-8B-shaped stream, {report['bucket_mb']:g} MiB buckets, one sender, "
          "one receiver (into= destinations)")  # fmt: skip
    print(f"raw NIXL READ  {raw['read_s_per_gib']:.3f} s/GiB ({raw['read_gbps']:.2f} GB/s)")
    print(f"raw NIXL WRITE {raw['write_s_per_gib']:.3f} s/GiB ({raw['write_gbps']:.2f} GB/s), bitwise {raw['bitwise']}")
    print("| backend | s/GiB | GB/s | vs raw NIXL READ | sender CPU s/GiB | receiver CPU s/GiB | first version s | "
          "direct buckets | bitwise |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name, e in report["engine"].items():
        print(f"| {name} | {e['s_per_gib']:.3f} | {e['gbps']:.2f} | {e['ratio_vs_raw_nixl_read']:.2f} | "
              f"{e['sender_cpu_s_per_gib']:.2f} | {e['receiver_cpu_s_per_gib']:.2f} | {e['first_version_s']:.2f} | "
              f"{e['direct_buckets']} of {e['buckets']} | {e['bitwise']} |")  # fmt: skip
    print(f"nixl is {report['nixl_vs_gloo']:.2f}x gloo's throughput")
    regs = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in report["registration_s"].items())
    print(f"NIXL registration: {regs}")
    e = report["engine"]["nixl"]
    print(
        f"nixl receiver (registrations, cache hits) per version: {e['receiver_registrations']}, "
        f"{e['receiver_registration_s'] * 1e3:.1f} ms registering in all"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--scale", type=int, default=8, help="divide every dimension of Qwen3-8B by this")
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--versions", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    run(args.json, scale=args.scale, bucket_mb=args.bucket_mb, versions=args.versions, repeats=args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
