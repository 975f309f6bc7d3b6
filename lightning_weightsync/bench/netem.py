"""A link with real latency, loss and cuts between two network namespaces, emulated in user space.

Kernels without `sch_netem` (this project's CI machines among them: `tc qdisc add ... netem` answers
"Specified qdisc kind is unknown") cannot add latency to a veth pair. Here each namespace gets a TUN
device instead, and one forwarding process carries every IP packet from one TUN to the other after
`delay_us`, dropping a seeded `loss_pct` share, or all of them while the link is cut. Everything
above the TUN devices is the real kernel TCP/IP stack: gloo's pair sockets, ZeroMQ, the TCPStore see a
link with a round-trip time of 2 x `delay_us` (plus the forwarder's own ~50 us per hop) and retransmit
lost segments as on a real network.

    with EmulatedLink(delay_us=100) as link:    # link.ns = (ns_a, ns_b), link.ip = (ip_a, ip_b)
        ... run one process in each namespace (`ip netns exec`), talking to link.ip[...] ...
        link.cut(); link.restore(); link.set(delay_us=50_000, loss_pct=1.0)

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN for `ip netns` and `setns`) and /dev/net/tun.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import heapq
import os
import random
import secrets
import select
import shutil
import struct
import subprocess
import sys
import time
from typing import IO, Any

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
CLONE_NEWNET = 0x40000000
MTU = 9000  # bigger packets: fewer trips through the Python forwarder


class NamespacesUnavailable(RuntimeError):
    """Network namespaces or TUN devices cannot be created here (needs root and /dev/net/tun)."""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def unavailable_reason() -> str | None:
    """None when namespaces and TUN devices work here, else why not (for a skip message)."""
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`)"
    if not os.path.exists("/dev/net/tun"):
        return "needs /dev/net/tun"
    probe = f"lwsprobe{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
        _ip("netns", "exec", probe, "ip", "tuntap", "add", "dev", "probe0", "mode", "tun")
    except (subprocess.CalledProcessError, OSError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        return f"cannot create a network namespace with a TUN device here ({detail.strip()}); run as root"
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("netns", "del", probe)
    return None


class EmulatedLink:
    """Two namespaces joined by a user-space link; deleted on exit, also after a failure."""

    def __init__(self, delay_us: int = 100, loss_pct: float = 0.0, seed: int = 0) -> None:
        tag = secrets.token_hex(3)
        subnet = int(tag[:2], 16) % 250 + 1
        self.ns = (f"lws-a-{tag}", f"lws-b-{tag}")
        self.dev = (f"lwsa{tag}", f"lwsb{tag}")
        self.ip = (f"10.214.{subnet}.1", f"10.214.{subnet}.2")
        self.delay_us, self.loss_pct, self.seed = delay_us, loss_pct, seed
        self._forwarder: subprocess.Popen[str] | None = None
        self._created: list[str] = []

    def __enter__(self) -> EmulatedLink:
        reason = unavailable_reason()
        if reason is not None:
            raise NamespacesUnavailable(reason)
        try:
            for ns, dev, here, there in zip(self.ns, self.dev, self.ip, self.ip[::-1], strict=True):
                _ip("netns", "add", ns)
                self._created.append(ns)
                for cmd in (
                    ["ip", "tuntap", "add", "dev", dev, "mode", "tun"],
                    ["ip", "addr", "add", here, "peer", there, "dev", dev],
                    ["ip", "link", "set", dev, "mtu", str(MTU), "up"],
                    ["ip", "link", "set", "lo", "up"],
                ):
                    _ip("netns", "exec", ns, *cmd)
            self._forwarder = subprocess.Popen(
                [sys.executable, "-m", "lightning_weightsync.bench.netem", *self.ns, *self.dev,
                 str(self.delay_us), str(self.loss_pct), str(self.seed)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
            )  # fmt: skip
            assert self._forwarder.stdout is not None
            if self._forwarder.stdout.readline().strip() != "ready":
                raise NamespacesUnavailable("the user-space link forwarder did not start")
        except BaseException:
            self.__exit__()
            raise
        return self

    def _command(self, line: str) -> None:
        assert self._forwarder is not None and self._forwarder.stdin is not None
        self._forwarder.stdin.write(line + "\n")
        self._forwarder.stdin.flush()

    def cut(self) -> None:
        """Drop every packet from now on (a partition: both directions, connections stay open)."""
        self._command("cut")

    def restore(self) -> None:
        self._command("restore")

    def set(self, *, delay_us: int | None = None, loss_pct: float | None = None) -> None:
        if delay_us is not None:
            self._command(f"delay {delay_us}")
        if loss_pct is not None:
            self._command(f"loss {loss_pct}")

    def exec_args(self, side: int) -> list[str]:
        """Prefix a command with this to run it in namespace `side` (0 or 1)."""
        return ["ip", "netns", "exec", self.ns[side]]

    def __exit__(self, *exc: object) -> None:
        if self._forwarder is not None:
            with contextlib.suppress(ProcessLookupError):
                self._forwarder.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._forwarder.wait(timeout=5)
            self._forwarder = None
        for ns in self._created:
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "del", ns)
        self._created = []


# --- the forwarder process --------------------------------------------------------------------------
def _open_tun(namespace: str, device: str) -> int:
    """Attach to the persistent TUN `device` inside `namespace` (the fd keeps working from here)."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace}")
        fd = os.open("/dev/net/tun", os.O_RDWR)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", device.encode(), IFF_TUN | IFF_NO_PI))
        os.set_blocking(fd, False)
        if libc.setns(home, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns back home")
        return fd
    finally:
        os.close(home)
        os.close(target)


def forward(
    ns: tuple[str, str], dev: tuple[str, str], delay_us: int, loss_pct: float, seed: int, ctrl: IO[str]
) -> None:
    fds = [_open_tun(n, d) for n, d in zip(ns, dev, strict=True)]
    peer = {fds[0]: fds[1], fds[1]: fds[0]}
    ctrl_fd = ctrl.fileno()  # select watches its descriptor; the loop reads lines from `ctrl` itself
    rng = random.Random(seed)
    delay, loss, cut = delay_us / 1e6, loss_pct / 100, False
    pending: list[tuple[float, int, int, bytes]] = []  # (due, seq, destination fd, packet)
    seq = 0
    print("ready", flush=True)
    while True:
        now = time.monotonic()
        timeout = max(0.0, pending[0][0] - now) if pending else 1.0
        readable, _, _ = select.select([*fds, ctrl_fd], [], [], timeout)
        now = time.monotonic()
        for fd in readable:
            if fd == ctrl_fd:
                line = ctrl.readline()
                if not line:
                    return  # the parent went away
                word, _, arg = line.strip().partition(" ")
                cut = {"cut": True, "restore": False}.get(word, cut)
                delay = int(arg) / 1e6 if word == "delay" else delay
                loss = float(arg) / 100 if word == "loss" else loss
                continue
            while True:
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if cut or (loss and rng.random() < loss):
                    continue
                seq += 1
                heapq.heappush(pending, (now + delay, seq, peer[fd], packet))
        while pending and pending[0][0] <= now:
            _, _, dst, packet = heapq.heappop(pending)
            with contextlib.suppress(BlockingIOError, OSError):
                os.write(dst, packet)


def main(argv: list[str] | None = None) -> int:
    a: Any = argv if argv is not None else sys.argv[1:]
    ns_a, ns_b, dev_a, dev_b, delay_us, loss_pct, seed = a
    forward((ns_a, ns_b), (dev_a, dev_b), int(delay_us), float(loss_pct), int(seed), sys.stdin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
