"""The user-space link between two network namespaces (bench/netem.py) adds latency, cuts and restores.

Benchmarks and fault tests rely on it to stand for a real network, so it is tested like one: a real
TCP connection from one namespace to the other."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from lightning_weightsync.bench.netem import EmulatedLink, unavailable_reason

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}")

ECHO_SERVER = """
import socket, sys, threading
def echo(c):
    while data := c.recv(65536):
        c.sendall(data)
s = socket.create_server((sys.argv[1], 0)); print(s.getsockname()[1], flush=True)
while True:
    threading.Thread(target=echo, args=(s.accept()[0],), daemon=True).start()
"""

ROUND_TRIPS = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
t0 = time.perf_counter()
for _ in range(int(sys.argv[3])):
    c.sendall(b"x"); assert c.recv(1) == b"x"
print((time.perf_counter() - t0) / int(sys.argv[3]))
"""


def _round_trip_s(link: EmulatedLink, port: int, count: int, timeout_s: float = 10) -> float:
    out = subprocess.run(
        [*link.exec_args(1), sys.executable, "-c", ROUND_TRIPS, link.ip[0], str(port), str(count), str(timeout_s)],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    return float(out)


def test_delay_cut_and_restore_over_real_tcp() -> None:
    # 50 ms each way: the delayed round trip (>= 100 ms, a physical bound) stays far above anything a
    # loaded machine adds to the undelayed one, so the comparisons below are not timing-fragile
    with EmulatedLink(delay_us=50_000) as link:
        server = subprocess.Popen(
            [*link.exec_args(0), sys.executable, "-c", ECHO_SERVER, link.ip[0]], stdout=subprocess.PIPE, text=True
        )
        try:
            assert server.stdout is not None
            port = int(server.stdout.readline())
            slow = _round_trip_s(link, port, 5)
            assert slow >= 0.100  # 50 ms each way: a round trip cannot be faster than 100 ms
            link.set(delay_us=0)
            fast = _round_trip_s(link, port, 5)
            assert fast < slow / 2
            link.cut()
            t0 = time.monotonic()
            with pytest.raises(subprocess.CalledProcessError):  # nothing gets through: the connect times out
                _round_trip_s(link, port, 1, timeout_s=1.0)
            assert time.monotonic() - t0 >= 1.0
            link.restore()
            assert _round_trip_s(link, port, 3) < slow
        finally:
            server.kill()
            server.wait(timeout=10)


def test_namespaces_are_removed_on_exit() -> None:
    with EmulatedLink() as link:
        names = link.ns
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert all(n in listed for n in names)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)
