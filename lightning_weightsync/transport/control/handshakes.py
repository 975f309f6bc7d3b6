"""Why a control connection failed its handshake, said on both sides within a moment.

A token that differs between trainer and rollout (or is set on one side only) fails the ZeroMQ handshake
at once, on both ends; without this module neither end says so, and the trainer waits
`transport.timeout_s` to blame a missing rollout while the rollout logs "no trainer connected".

- The sender's side (`HandshakeWatch`): a thread reads the ROUTER's connection events as they come, so
  it can read the peer's address off the accepted socket before libzmq closes it (the event carries
  only the file descriptor; libzmq's peer-address events are draft API, absent from pyzmq's wheels), and
  logs each refused address with the cause and the knob.
- The receiver's side (`HandshakeVerdict`): a handshake the sender refused shows either as an explicit
  mechanism mismatch (a token on one side only) or, with another token, as a connection that the
  sender closes before the handshake ends (CURVE gives the client no other sign); either is the token.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..droplog import DropLog

logger = logging.getLogger(__name__)

HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
FIX = "set the same transport.auth_token (or transport.auth_token_file) on the trainer and every rollout"
MAX_REFUSED_PEERS = 64  # addresses remembered for the trainer's give-up message
WATCH_POLL_MS = 100  # how often the watch thread looks for `stop`
STOP_WAIT_S = 5.0  # how long `stop` waits for it: a poll interval, unless the machine is starved of CPU
UNREAD = "an address that closed before it could be read"
UNREAD_BEFORE_SAYING = 3  # refusals from unread addresses in a row before the log says so without one
CLOSES_BEFORE_HANDSHAKE = 2  # connections the sender closed mid-handshake before the receiver names the token


def specific(event: int, value: int, cause: str) -> tuple[int, str]:
    """(rank, cause): a mechanism, crypto or ZAP failure says more than an errno (`NO_DETAIL`, e.g. EPIPE
    from a write after the other end closed), which one connection may also report."""
    return (0 if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL else 1), cause


def refusal_cause(event: int, value: int, has_token: bool, peer: str, this: str) -> str:
    """What one failed handshake means, said from the end that saw it (`peer`: the other end, `this`: ours)."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"{peer} presented a CURVE key that transport.auth_token does not derive"
    if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        if has_token:
            return f"{peer} has no transport.auth_token, and {this} has one"
        return f"{peer} has a transport.auth_token, and {this} has none"
    if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return f"{peer} uses another transport.auth_token"
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        # an end learns no more when the other cannot open its HELLO or refuses its mechanism: it is cut off
        if has_token:
            return f"{peer} broke off the CURVE handshake: it has another transport.auth_token, or none"
        return f"{peer} broke off the handshake: it likely has a transport.auth_token, and {this} has none"
    return f"{peer} failed the ZeroMQ handshake (libzmq error {value:#x}); is it a lightning-weightsync peer?"


@dataclass(frozen=True)
class ConnectionEvent:
    """One connection's fate, for `SenderControl.poll_connections`' bookkeeping."""

    failed_handshake: bool  # else a disconnection after the handshake
    at: float  # time.monotonic() when it was seen


def peer_address(fd: int) -> str | None:
    """The remote address of the socket behind `fd`, read through a duplicate so that libzmq closing its
    own descriptor meanwhile cannot make us read another connection's."""
    try:
        dup = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        addr = dup.getpeername()
    except OSError:
        return None
    finally:
        dup.close()
    return _host_port(str(addr[0]), int(addr[1])) if isinstance(addr, tuple) and len(addr) >= 2 else None


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


CLOSED_HERE_FIRST = {"04", "05", "06", "0B"}  # FIN_WAIT1, FIN_WAIT2, TIME_WAIT, CLOSING (/proc/net/tcp's hex states)


def closed_by_us(local_port: int) -> set[str]:
    """Remote addresses of the connections to `local_port` that this host closed first in the last minute
    (FIN_WAIT / TIME_WAIT in Linux's /proc/net/tcp*): where a refused handshake ended before its address
    could be read (a token on one side only fails at the greeting, in microseconds), this still names the
    peer, whether or not the peer's own close has arrived yet."""
    found: set[str] = set()
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) < 4 or cols[3] not in CLOSED_HERE_FIRST:
                continue
            local, remote = cols[1].split(":"), cols[2].split(":")
            if int(local[1], 16) != local_port:
                continue
            raw = bytes.fromhex(remote[0])
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # host-order 32-bit words
            ip = socket.inet_ntop(socket.AF_INET if width == 4 else socket.AF_INET6, words)
            if ip.startswith("::ffff:"):
                ip = ip[len("::ffff:") :]
            found.add(_host_port(ip, int(remote[1], 16)))
    return found


class HandshakeWatch:
    """Reads a ROUTER's monitor socket on its own thread: each refused handshake is logged at once with
    the peer's address and cause (rate-limited), remembered for the trainer's messages (`refused`), and
    every connection event is queued for `SenderControl.poll_connections`."""

    def __init__(self, monitor: zmq.Socket[Any], address: str, port: int, has_token: bool) -> None:
        self.monitor, self.address, self.port, self.has_token = monitor, address, port, has_token
        self.events: queue.SimpleQueue[ConnectionEvent] = queue.SimpleQueue()
        self.refused: OrderedDict[str, tuple[int, str]] = OrderedDict()  # peer host -> `specific` cause
        self._lock = threading.Lock()
        self._log = DropLog("refused a control connection", log=logger)
        self._peers: dict[int, str | None] = {}  # fd -> address, while the connection is up
        self._causes: list[tuple[int, str]] = []  # (specificity, cause) of the connection that is failing
        self._closed_before: set[str] = set()  # `closed_by_us` at the last refusal
        self._unread = 0  # refusals in a row whose address could not be read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lws-handshakes", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> bool:
        """Stop the thread; True when it ended (then the monitor socket may be closed by the caller)."""
        self._stop.set()
        self._thread.join(timeout=STOP_WAIT_S)
        return not self._thread.is_alive()

    def refused_summary(self) -> str | None:
        """The refused addresses and their causes, for a message that would otherwise blame no rollout."""
        with self._lock:
            if not self.refused:
                return None
            return "; ".join(f"from {host}: {cause}" for host, (_, cause) in self.refused.items())

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.monitor, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(WATCH_POLL_MS):
                    continue
                while True:
                    self._handle(parse_monitor_message(self.monitor.recv_multipart(flags=zmq.NOBLOCK)))
            except zmq.Again:
                continue
            except zmq.ZMQError:
                return  # the socket or its context is closing

    def _handle(self, message: Mapping[str, Any]) -> None:
        event, value = int(message["event"]), int(message["value"])
        if event == zmq.EVENT_ACCEPTED:
            self._peers[value] = peer_address(value)
        elif event & HANDSHAKE_FAILED:
            self._causes.append(
                specific(event, value, refusal_cause(event, value, self.has_token, "it", "this trainer"))
            )
        elif event == zmq.EVENT_DISCONNECTED:
            peer = self._peers.pop(value, None)
            failed = bool(self._causes)
            if failed:  # several events for one connection (a write after the peer closed): the telling one
                cause = max(self._causes)
                self._causes.clear()
                self._refused(peer, peer.rsplit(":", 1)[0] if peer else self._newly_closed(), cause)
            self.events.put(ConnectionEvent(failed, time.monotonic()))

    def _newly_closed(self) -> str | None:
        """The one host among the connections closed since the last refusal, or None where that is not one."""
        closed = closed_by_us(self.port)
        new, self._closed_before = closed - self._closed_before, closed
        hosts = {peer.rsplit(":", 1)[0] for peer in new}
        return hosts.pop() if len(hosts) == 1 else None

    def _refused(self, peer: str | None, host: str | None, ranked: tuple[int, str]) -> None:
        # an address neither read nor found in TIME_WAIT is logged as such, and remembered only while no other
        # is: a message naming "unknown" tells the user little
        with self._lock:
            if host is not None:
                self.refused.pop(UNREAD, None)
                ranked = max(ranked, self.refused.pop(host, ranked))  # an EPIPE never hides a mismatch
                self.refused[host] = ranked
                while len(self.refused) > MAX_REFUSED_PEERS:
                    self.refused.popitem(last=False)
            elif not self.refused:
                self.refused[UNREAD] = ranked
            self._unread = 0 if host is not None else self._unread + 1
            if 0 < self._unread < UNREAD_BEFORE_SAYING:  # a retrying peer's next refusal will likely name it
                logger.debug("refused a control connection from an address it could not read: %s", ranked[1])
                return
        who = peer or (f"{host} (port not read)" if host else "an address it could not read")
        self._log.note(f"{who} at {self.address}", f"{ranked[1]}; {FIX}")


class HandshakeVerdict:
    """The receiver's reading of its link's events: whether the sender refused our handshake, and why."""

    def __init__(self, address: str, has_token: bool) -> None:
        self.address, self.has_token = address, has_token
        self._refused: tuple[int, str] | None = None  # `specific` cause, while the sender refuses us
        self._tcp_up = False
        self._causes: list[tuple[int, str]] = []  # of the connection in its handshake now
        self._closed_mid_handshake = 0
        self._log = DropLog("control handshake refused", log=logger, level=logging.ERROR)

    def seen(self, event: int, value: int) -> None:
        if event == zmq.EVENT_CONNECTED:
            self._tcp_up, self._causes = True, []
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._refused, self._closed_mid_handshake, self._tcp_up = None, 0, False
        elif event & HANDSHAKE_FAILED:
            self._causes.append(
                specific(event, value, refusal_cause(event, value, self.has_token, "the trainer", "this rollout"))
            )
        elif event == zmq.EVENT_DISCONNECTED and self._tcp_up:
            self._tcp_up = False
            self._closed_mid_handshake += 1
            if self._causes:  # one connection may report a mechanism mismatch and an EPIPE: the telling one
                self._refuse(max(self._causes))
            elif self.has_token and self._closed_mid_handshake >= CLOSES_BEFORE_HANDSHAKE:
                closed = f"the trainer closed {self._closed_mid_handshake} connections during the CURVE handshake"
                self._refuse((0, f"{closed}: it has another transport.auth_token, or none"))
            self._causes = []

    @property
    def refused(self) -> str | None:
        """The most telling cause seen since the last handshake that passed, or None."""
        return self._refused[1] if self._refused is not None else None

    def _refuse(self, ranked: tuple[int, str]) -> None:
        self._refused = ranked if self._refused is None else max(self._refused, ranked)
        self._log.note(f"the trainer at {self.address}", f"{self._refused[1]}; {FIX} (still trying)")
