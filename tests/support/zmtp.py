"""A hostile peer's tools below ZeroMQ: raw ZMTP 3.0 over a plain TCP socket, and a connection reset.

What a stranger can send without any library: the 64-byte greeting (any mechanism), a NULL handshake
(no token: READY), then frames of any declared size. And what tears a connection down with an RST
instead of a FIN (the hang-up libzmq's epoll loop reacts to even while it has stopped reading).
"""

from __future__ import annotations

import os
import socket
import struct
import time
from typing import Any

import psutil


def greeting(mechanism: bytes) -> bytes:
    """ZMTP 3.0 greeting: signature, version 3.0, the mechanism name padded to 20, as-server 0."""
    return b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 0]) + mechanism.ljust(20, b"\x00") + b"\x00" + b"\x00" * 31


def frame_header(size: int, *, command: bool = False, more: bool = False) -> bytes:
    """A frame's flags and size; the body follows (or is streamed afterwards)."""
    flags = (0x04 if command else 0) | (0x01 if more else 0)
    if size < 256:
        return bytes([flags, size])
    return bytes([flags | 0x02]) + size.to_bytes(8, "big")


def frame(body: bytes, *, command: bool = False, more: bool = False) -> bytes:
    return frame_header(len(body), command=command, more=more) + body


def connect(port: int, mechanism: bytes, timeout_s: float = 30.0) -> socket.socket:
    """A TCP connection that has exchanged greetings (and, for NULL, READY) with the ZeroMQ socket at
    `port`; retried until `timeout_s` while the socket is not bound yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    sock.sendall(greeting(mechanism))
    got = b""
    while len(got) < 64:
        chunk = sock.recv(64 - len(got))
        if not chunk:
            raise ConnectionError("the peer closed during the greeting")
        got += chunk
    if mechanism == b"NULL":
        socket_type = b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
        sock.sendall(frame(b"\x05READY" + socket_type, command=True))
    return sock


def reset(sock: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0), as a peer that vanishes with unread data does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def reset_zmq_connections(zmq_sock: Any, port: int) -> None:
    """Make this process's TCP connections to `port` end with an RST when `zmq_sock` closes them."""
    for conn in psutil.Process().net_connections("tcp"):
        if conn.raddr and conn.raddr.port == port and conn.fd >= 0:
            dup = socket.socket(fileno=os.dup(conn.fd))
            dup.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            dup.close()  # the option is the socket's: libzmq's close below is the last one, and resets
    zmq_sock.close(linger=0)
