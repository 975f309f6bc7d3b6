"""A tiny network lab for chaos tests: one Linux network namespace per process, joined by veth
pairs to a bridge in the root namespace, so a link can be cut (`ip link set ... down`) or degraded
(`tc netem`) under a real sender or receiver.

Every process runs in its own UTS and mount namespace too, with a hostname that resolves (through a
private /etc/hosts) to its namespace's address: gloo's default device binds the address the
hostname resolves to, which must be the one the other namespaces can reach.

Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN); `skip_reason()` says why not when it is missing.
Names are unique per run and everything is removed on exit, also on failure.
"""

from __future__ import annotations

import contextlib
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=30)


def skip_reason() -> str | None:
    """Why namespaces cannot be used here (None: they can): tried, not guessed."""
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    name = f"lwsprobe{os.getpid() % 100000}"
    probe = _run("ip", "netns", "add", name, check=False)
    if probe.returncode != 0:
        return f"`ip netns add` is not permitted for this user: {probe.stderr.strip()[:200]}"
    _run("ip", "netns", "del", name, check=False)
    return None


def netem_skip_reason() -> str | None:
    probe = _run("tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms", check=False)
    if probe.returncode != 0:
        return f"tc netem is unavailable here ({probe.stderr.strip()[:120]}; the sch_netem kernel module is missing?)"
    _run("tc", "qdisc", "del", "dev", "lo", "root", check=False)
    return None


@dataclass
class Node:
    ns: str
    host_if: str  # the root-namespace end of its veth (cut this to partition the node)
    ip: str
    hostname: str
    hosts_file: Path


@dataclass
class Lab:
    tag: str
    subnet: str  # "10.a.b"
    bridge: str
    workdir: Path
    nodes: dict[str, Node] = field(default_factory=dict)
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def add(self, name: str) -> Node:
        index = len(self.nodes) + 2
        ns, host_if = f"{self.tag}{name}", f"{self.tag}{name}h"[:15]
        ip, hostname = f"{self.subnet}.{index}", f"{self.tag}-{name}"
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "link", "set", host_if, "master", self.bridge)
        _run("ip", "link", "set", host_if, "up")
        _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        hosts = self.workdir / f"hosts-{name}"
        hosts.write_text(f"127.0.0.1 localhost\n{ip} {hostname}\n")
        node = self.nodes[name] = Node(ns, host_if, ip, hostname, hosts)
        return node

    def cut(self, name: str) -> None:
        _run("ip", "link", "set", self.nodes[name].host_if, "down")

    def heal(self, name: str) -> None:
        _run("ip", "link", "set", self.nodes[name].host_if, "up")

    def netem(self, name: str, *args: str) -> None:
        """Degrade both directions of a node's link, e.g. `netem("r1", "delay", "50ms", "loss", "1%")`."""
        node = self.nodes[name]
        _run("tc", "qdisc", "add", "dev", node.host_if, "root", "netem", *args)
        _run("ip", "netns", "exec", node.ns, "tc", "qdisc", "add", "dev", "eth0", "root", "netem", *args)

    def spawn(self, name: str, code: str, log: Path) -> subprocess.Popen[bytes]:
        """Run `python -c code` inside the node (its netns, hostname and /etc/hosts)."""
        node = self.nodes[name]
        inner = (
            f"mount --bind {shlex.quote(str(node.hosts_file))} /etc/hosts && hostname {node.hostname} && "
            f"exec {shlex.quote(sys.executable)} -c {shlex.quote(code)}"
        )
        cmd = ["ip", "netns", "exec", node.ns, "unshare", "--mount", "--uts", "sh", "-c", inner]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
        out = log.open("w")
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self._procs.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        with contextlib.suppress(Exception):
            proc.wait(timeout=10)

    def remove_nodes(self) -> None:
        """Every node's namespace and link gone (the bridge stays): a benchmark's next row adds its own."""
        for node in self.nodes.values():
            _run("ip", "netns", "del", node.ns, check=False)  # takes its veth pair with it
            _run("ip", "link", "del", node.host_if, check=False)
        self.nodes.clear()

    def close(self) -> None:
        for proc in self._procs:
            self.kill(proc)
        self.remove_nodes()
        _run("ip", "link", "del", self.bridge, check=False)
        shutil.rmtree(self.workdir, ignore_errors=True)


@contextlib.contextmanager
def netlab() -> Iterator[Lab]:
    tag = f"lw{os.getpid() % 1000}{random.randrange(100)}"[:7]
    subnet = f"10.{random.randrange(100, 250)}.{random.randrange(1, 250)}"
    lab = Lab(tag, subnet, f"{tag}br", Path(tempfile.mkdtemp(prefix="lws-netlab-")))
    try:
        _run("ip", "link", "add", lab.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{subnet}.1/24", "dev", lab.bridge)
        _run("ip", "link", "set", lab.bridge, "up")
        yield lab
    finally:
        lab.close()
