"""The control-plane test helpers: a real sender and receivers on loopback (ZeroMQ, CURVE), and a token
holder's own socket that sends whatever frames a test forges. One copy, for every control-plane test."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import zmq
import zmq.asyncio

from lightning_weightsync.protocol.messages import Message, Prepare, Seal, seal
from lightning_weightsync.transport.control import ReceiverControl, SenderControl, curve_keys

KEY = b"issue-10-token-of-16+"
BUCKET = 1 << 16


async def until(predicate: Any, sender: SenderControl | None = None, timeout_s: float = 10.0) -> None:
    """Pump the sender's socket (registrations are handled inside `recv`) until `predicate()`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        if sender is not None:
            await sender.recv(0.05)
        else:
            await asyncio.sleep(0.05)


async def started_sender(key: bytes | None = KEY, port: int = 0) -> SenderControl:
    sender = SenderControl("127.0.0.1", port, key, BUCKET)
    await sender.start()
    return sender


async def registered(sender: SenderControl, identity: str, key: bytes | None = KEY) -> ReceiverControl:
    receiver = ReceiverControl("127.0.0.1", sender.port, key, identity, "cpu")
    await receiver.start()
    await until(lambda: identity in sender.peers, sender)
    return receiver


async def prepare(sender: SenderControl, receiver: ReceiverControl, version: int) -> Prepare:
    await sender.send(receiver.identity, Prepare(version, sender.session))
    msg = await receiver.recv(5)
    assert isinstance(msg, Prepare) and msg.version == version, msg
    return msg


def record_sends(sock: Any, method: str = "send_multipart") -> tuple[Any, list[list[bytes]]]:
    """Make `sock` keep a copy of every multipart message it sends through `method` (the sender's socket
    thread: "submit"); returns the real method (to replay a copy on the same authenticated connection)
    and the copies."""
    original, sent = getattr(sock, method), []

    def recording_send(frames: list[bytes], *args: Any, **kwargs: Any) -> Any:
        sent.append(list(frames))
        return original(frames, *args, **kwargs)

    setattr(sock, method, recording_send)
    return original, sent


class TokenHolder:
    """A peer that holds the token and speaks for itself: its own CURVE connection to the sender, on
    which it sends sealed frames a test forges (any session, origin, seq or identity)."""

    def __init__(self, sender: SenderControl, key: bytes = KEY) -> None:
        self.key = key
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        keys = curve_keys(key)
        self.sock.curve_serverkey, self.sock.curve_publickey, self.sock.curve_secretkey = (
            keys.server_public, keys.client_public, keys.client_secret,
        )  # fmt: skip
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(sender.address)

    async def send(self, msg: Message, envelope: Seal) -> None:
        await self.sock.send_multipart(seal(msg, self.key, envelope))

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
