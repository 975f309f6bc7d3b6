"""The ZeroMQ options of every socket of ours that faces the network: the control plane's ROUTER and
DEALERs, and the shm / nixl release sockets. One place, because each option answers an attack.

libzmq 4.3.5 (the one in pyzmq's wheels) aborts the whole process with
`Assertion failed: !_io_error (src/stream_engine_base.cpp:310)` when:
1. a connection's receive pipe is full (RCVHWM messages the application has not read: a flood, or a
   trainer in a training step, which reads nothing), so the engine stops reading;
2. the peer resets the connection (an RST: it closed with unread data, or SO_LINGER 0) while reading
   is stopped: epoll reports the hang-up, `in_event` removes the fd and sets `_io_error`;
3. before the application drains the pipe, the engine writes: its own heartbeat timer fires
   (`timer_event` -> `out_event`, every HEARTBEAT_IVL, unconditionally), or a PING the peer had sent
   is decoded from the bytes already read (`restart_input` -> `process_heartbeat_message`).
`out_event` asserts `!_io_error`. Step 1 is what we can rule out: a control socket (the sender's ROUTER,
a receiver's DEALER) has no RCVHWM, so its engine never stops reading and `_io_error` is never set,
whatever a peer sends, pings or resets. That lets both ends keep the ZMTP heartbeat, which is what
bounds how long a frozen or vanished peer counts as connected (`liveness_s`: no FIN ever comes from a
SIGSTOPped process or a cut link). The price: what an authenticated peer sends while the application
does not read would wait in libzmq's pipe without bound. So the application must read: the sender's
ROUTER is read all the time by a thread of its own into per-connection queues with a budget
(`control/router.py`, `control/inbox.py`: a trainer reads nothing during a training step); a receiver's
DEALER faces only the sender it chose (docs/security.md: with `transport.auth_token` only a token holder
can send anything; a stranger gets no further than one handshake frame, bounded below). The shm / nixl
release sockets keep their RCVHWM and run no heartbeat instead: no timer, and no PING from our peers.
Every socket also has TCP keepalive and TCP_MAXRT (`TCP_USER_TIMEOUT`) at the same bound, in the
kernel, for the links no ZMTP ping covers.

`ZMQ_MAXMSGSIZE`: the largest legal frame the socket can receive (`protocol.messages.max_frame_bytes`).
libzmq checks a frame's declared size before it allocates, handshake commands included, so a stranger
declaring a frame of gigabytes is disconnected at once instead of being buffered. libzmq 4.3 says nothing
else about it (decoder EMSGSIZE -> protocol error -> only ZMQ_EVENT_DISCONNECTED, the same event as a peer
that exits; checked by experiment with 4.3.5), so the control sockets count every connection lost without a
Bye (`dropped_connections`) and log it, rate-limited, naming the limit among the causes.
"""

from __future__ import annotations

from typing import Any

import zmq

DEFAULT_LIVENESS_S = 5.0  # a peer silent this long is disconnected (`transport.liveness_s`)
LINK_HEARTBEATS_PER_TIMEOUT = 4  # ZMTP pings per liveness bound on a control connection


def network_options(
    sock: zmq.Socket[Any], *, max_frame_bytes: int, liveness_s: float = DEFAULT_LIVENESS_S, ipv6: bool = False
) -> None:
    """Options for a socket that talks TCP to another process; call before bind/connect (LINGER is
    the caller's: a release socket lingers so its last message leaves, the control sockets do not).
    No ZMTP heartbeats (`heartbeats` turns them on where that is safe)."""
    idle_s = max(1, round(liveness_s * 0.4))  # keepalive: probe an idle link after this long ...
    interval_s = max(1, round((liveness_s - idle_s) / 3))  # ... then 3 probes this far apart
    sock.setsockopt(zmq.HEARTBEAT_IVL, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, idle_s)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, interval_s)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
    sock.setsockopt(zmq.TCP_MAXRT, max(1000, int(liveness_s * 1000)))
    if ipv6:
        sock.setsockopt(zmq.IPV6, 1)


def heartbeats(sock: zmq.Socket[Any], liveness_s: float) -> None:
    """ZMTP heartbeats (a peer silent for `liveness_s` is disconnected), on a socket whose reading
    never stops (RCVHWM 0), so libzmq's heartbeat cannot meet a stopped, reset connection."""
    timeout_ms = max(100, int(liveness_s * 1000))
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(25, timeout_ms // LINK_HEARTBEATS_PER_TIMEOUT))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, timeout_ms)
