"""The control link: endpoints, socket options, CURVE keys from the shared token, the ZAP check, and the
bookkeeping of dropped messages that both socket ends share.

Security, with `transport.auth_token` set (docs/security.md has the threat model):
- CURVE (libsodium, in pyzmq's wheels): both sides derive their key pairs from the token, and the
  sender's ZAP handler admits only the token-derived client key, so a peer without the token never
  completes a handshake: it can neither send a message nor receive one.
- Every message is also signed (HMAC-SHA256) and sealed (`protocol.messages.Seal`): bound to the
  sender session, with a per-origin sequence number; a copy from another run, another session or
  an earlier point of this one is rejected and counted (`replayed_messages`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import socket
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils import z85

from ...errors import ConfigError, ProtocolError
from ...protocol.messages import max_frame_bytes
from ..droplog import DROP_LOG_INTERVAL_S, DropLog
from ..sockets import heartbeats, network_options

logger = logging.getLogger(__name__)

__all__ = ["DROP_LOG_INTERVAL_S", "CurveKeys", "DropLog", "Replay", "TokenHolders", "curve_keys", "endpoint"]


def endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


# -- CURVE keys from the shared token ----------------------------------------------------------------
@dataclass(frozen=True)
class CurveKeys:
    """Z85 key pairs of the two roles, derived from the token (HMAC-SHA256 with a per-role label;
    every 32-byte string is a valid Curve25519 secret). All receivers share the client pair: CURVE
    proves "holds the token"; which receiver is which is the control plane's bookkeeping."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def curve_keys(token: bytes) -> CurveKeys:
    if not zmq.has("curve"):
        raise ConfigError(
            "transport.auth_token is set but this pyzmq/libzmq has no CURVE support; "
            "install the pyzmq wheel (it bundles libsodium) or unset transport.auth_token"
        )

    def pair(label: bytes) -> tuple[bytes, bytes]:
        secret = z85.encode(hmac.new(token, b"lightning-weightsync curve " + label, hashlib.sha256).digest())
        return zmq.curve_public(secret), secret

    sp, ss = pair(b"server")
    cp, cs = pair(b"client")
    return CurveKeys(sp, ss, cp, cs)


class TokenHolders:
    """ZAP credentials provider: admits exactly the token-derived client key."""

    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public
        self.rejected = 0

    def callback(self, domain: str, key: bytes) -> bool:
        ok = hmac.compare_digest(key, self.client_public)
        if not ok:
            self.rejected += 1
        return ok


def link_options(sock: zmq.Socket[Any], host: str, liveness_s: float, *, to_sender: bool) -> None:
    """A control socket's options (`transport/sockets.py` says why each): no linger, frames no larger
    than the largest legal message this end receives, TCP liveness, and the ZMTP heartbeat that makes a
    frozen or vanished peer a disconnection after `liveness_s`, on a socket whose reading never stops."""
    sock.setsockopt(zmq.LINGER, 0)
    network_options(sock, max_frame_bytes=max_frame_bytes(to_sender=to_sender), liveness_s=liveness_s, ipv6=":" in host)
    heartbeats(sock, liveness_s)


def resolve_host(host: str) -> None:
    """Fail with the knob when `transport.host` names nothing (ZeroMQ would only say 'No such device')."""
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(
            f"transport.host={host!r} does not resolve ({exc}); set transport.host to the sender's address or a "
            "name this machine can resolve"
        ) from None


class Replay(ProtocolError):
    """A correctly signed message that is not fresh (another session, or a seq already seen)."""
