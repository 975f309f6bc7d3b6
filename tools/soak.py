"""Soak: a few hundred versions under seeded random faults over real links, then the tally.

One sender and N receivers, each in its own network namespace behind a veth link (tests/support/
tools/netlab.py; needs root), with `transport.auth_token` set. While the sender streams versions back to
back, a seeded RNG injects a fault every few seconds: cut a receiver's link for a while, SIGKILL a
receiver and restart it, or cut the sender's link. Every receiver checks every version it reports
complete bitwise against the expected stream.

Prints: versions attempted, delivered (every receiver acked), failed cleanly (the sender raised;
no receiver applied a partial version), corrupted (a complete version that differs: must be 0),
and the max time from a fault to the sender noticing it (a failed version or one that completed
without the victim).

Not part of the default test run. From a source checkout, as root:
    .venv/bin/python -m tools.soak --versions 300 --seed 1
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.netlab import Lab, netlab, skip_reason  # noqa: E402


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            pass
    return out


ROLES = "tools.chaos_roles"  # the roles the chaos tests run, inside each namespace


def _sender_code(ip: str, out: Path, gap_s: float) -> str:
    return f"from {ROLES} import chaos_sender as f; f({ip!r}, {str(out)!r}, 1, {gap_s}, 0.0)"


def _receiver_code(ip: str, name: str, out: Path) -> str:
    return f"from {ROLES} import chaos_receiver as f; f({ip!r}, {name!r}, {str(out)!r}, 0.0)"


def soak(
    versions: int, seed: int, receivers: int, fault_every_s: float, max_minutes: float, gap_s: float = 0.05
) -> dict[str, Any]:
    rng = random.Random(seed)
    with netlab() as lab:
        names = [f"r{i}" for i in range(1, receivers + 1)]
        for name in ("s", *names):
            lab.add(name)
        s_ip = lab.nodes["s"].ip
        sender_log = lab.workdir / "s.jsonl"
        lab.spawn("s", _sender_code(s_ip, sender_log, gap_s), lab.workdir / "s.log")
        procs: dict[str, Any] = {}
        files = {name: lab.workdir / f"{name}.jsonl" for name in names}
        for name in names:
            procs[name] = lab.spawn(name, _receiver_code(s_ip, name, files[name]), lab.workdir / f"{name}.log")
        faults: list[dict[str, Any]] = []
        started = time.monotonic()
        next_fault = time.monotonic() + 15  # let everyone register first
        healing: list[tuple[float, str, str]] = []  # (when, action, node)
        while len(_events(sender_log)) < versions:
            if time.monotonic() - started > max_minutes * 60:
                print(f"stopping after {max_minutes} min", file=sys.stderr)
                break
            now = time.monotonic()
            for item in [h for h in healing if h[0] <= now]:
                healing.remove(item)
                _, action, node = item
                if action == "heal":
                    lab.heal(node)
                else:  # restart a killed receiver, same identity
                    procs[node] = lab.spawn(node, _receiver_code(s_ip, node, files[node]), lab.workdir / f"{node}.log")
            if now >= next_fault and not healing:
                kind = rng.choice(["cut", "cut", "kill", "cut-sender"])
                node = "s" if kind == "cut-sender" else rng.choice(names)
                if kind == "kill":
                    lab.kill(procs[node])
                    healing.append((now + rng.uniform(1, 4), "restart", node))
                else:
                    lab.cut(node)
                    healing.append((now + rng.uniform(2, 12), "heal", node))
                faults.append({"t": time.time(), "kind": kind, "node": node})
                next_fault = now + fault_every_s * rng.uniform(0.5, 1.5)
            time.sleep(0.1)
        for _, action, node in healing:
            if action == "heal":
                lab.heal(node)
        return _tally(sender_log, files, faults, receivers)


def _tally(sender_log: Path, files: dict[str, Path], faults: list[dict[str, Any]], receivers: int) -> dict[str, Any]:
    sent = _events(sender_log)
    oks = [e for path in files.values() for e in _events(path) if e["event"] == "ok"]
    detect: list[float] = []
    by_kind: dict[str, float] = {}
    for fault in faults:
        noticed = [
            e["t"] - fault["t"]
            for e in sent
            if e["t"] >= fault["t"] and (e["event"] == "failed" or e.get("receivers", receivers) < receivers)
        ]
        if noticed:
            detect.append(min(noticed))
            by_kind[fault["kind"]] = max(by_kind.get(fault["kind"], 0.0), round(min(noticed), 2))
    return {
        "versions attempted": len(sent),
        "delivered": sum(e["event"] == "sent" and e["receivers"] == receivers for e in sent),
        "delivered to fewer (a receiver was down)": sum(
            e["event"] == "sent" and 0 < e["receivers"] < receivers for e in sent
        ),
        "failed cleanly": sum(e["event"] == "failed" for e in sent),
        "receiver-side complete versions": len(oks),
        "corrupted": sum(not e["bitwise"] for e in oks),
        "faults injected": len(faults),
        "faults noticed": len(detect),
        "max time to detect a fault (s)": round(max(detect), 2) if detect else None,
        "max time to detect, by fault (s)": by_kind,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--receivers", type=int, default=2)
    parser.add_argument("--fault-every-s", type=float, default=6.0)
    parser.add_argument("--max-minutes", type=float, default=20.0)
    parser.add_argument("--gap-s", type=float, default=0.05, help="pause between versions (more faults per version)")
    args = parser.parse_args()
    reason = skip_reason()
    if reason:
        print(f"soak needs network namespaces: {reason}", file=sys.stderr)
        return 2
    result = soak(args.versions, args.seed, args.receivers, args.fault_every_s, args.max_minutes, args.gap_s)
    for key, value in result.items():
        print(f"{key}: {value}")
    return 1 if result["corrupted"] else 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["Lab", "soak"]
