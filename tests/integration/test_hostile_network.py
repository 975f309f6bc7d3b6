"""What a peer on the network can do to a running sender (issue 24 items 1 and 4), with real processes,
real ZeroMQ sockets and raw TCP where a stranger would not use ZeroMQ at all.

- A flood of `Register`s for a live receiver's identity, each connection reset afterwards, while the
  trainer is busy with a training step (nothing reads the control socket): before, libzmq aborted the
  trainer (`Assertion failed: !_io_error (src/stream_engine_base.cpp:310)`): the ZMTP heartbeat timer
  wrote on a connection whose reset it had noted while its full pipe had stopped it reading.
- A stranger who declares one huge frame before authenticating: before, the sender buffered whatever
  followed (hundreds of MiB); now libzmq refuses the frame from its header (`ZMQ_MAXMSGSIZE`).
- Whoever reaches a vLLM rollout's HTTP port (dev-mode routes take no credentials): before, it could
  re-point the engine's receiver at its own sender and token (item 2); now only the config file can.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq

from lightning_weightsync import WeightReceiver, WeightSender
from lightning_weightsync.protocol.messages import Prepare, Ready, Register, Seal, encode, seal
from lightning_weightsync.transport.control import ReceiverControl, SenderControl, curve_keys
from lightning_weightsync.transport.control.sender import REFUSE_EVERY_S
from tests.support import zmtp
from tests.support.engine import engine_cfg
from tests.support.mp import free_port, run_workers, spawned
from tests.support.vllm_standin import standin_server_main

TOKEN = "a-token-of-reasonable-length-24"
FLOOD_ROUNDS = 3  # connections, one after the other, each flooded and then reset
FLOOD_MESSAGES = 3000  # per connection: more than the sender's receive pipe holds (RCVHWM 1000)
IDLE_S = 6.0  # the trainer's training step: nothing reads the control socket meanwhile
SERVE_S = 3.0


def _key(token: str | None) -> bytes | None:
    return token.encode() if token else None


def _busy_sender(port: int, token: str | None, ready: Any) -> dict[str, Any]:
    """A sender with one live receiver ("victim"), which then stops reading its socket for IDLE_S, as a
    trainer does between two versions, then serves, then runs a version's first step with the victim."""

    async def main() -> dict[str, Any]:
        sender = SenderControl("127.0.0.1", port, _key(token), 1 << 16)
        await sender.start()
        victim = ReceiverControl("127.0.0.1", port, _key(token), "victim", "cpu")
        await victim.start()
        try:
            deadline = time.monotonic() + 30
            while "victim" not in sender.peers:
                assert time.monotonic() < deadline, "the victim did not register"
                await sender.recv(0.05)
            ready.set()
            time.sleep(IDLE_S)  # on purpose: the loop (and the socket) go unserved, as in a training step
            started = time.monotonic()
            while time.monotonic() - started < SERVE_S:
                await sender.recv(0.05)
            held = sender.peers["victim"].instance == victim.instance
            await sender.send("victim", Prepare(1, sender.session, sender.peers["victim"].nonce))
            prepare = await victim.recv(5)
            await victim.send(Ready("victim", 1))
            answer = await sender.recv(5)
            return {
                "held": held,
                "prepare": isinstance(prepare, Prepare),
                "ready": answer is not None and isinstance(answer[1], Ready) and answer[0] == "victim",
                "refused": sender.refused_registrations,
                "throttled": sender.throttled_registrations,
                "overflowed": sender.overflowed_messages,
                "served_s": SERVE_S,
            }
        finally:
            await victim.close()
            await sender.close()

    return asyncio.run(main())


def _flooder(port: int, token: str | None, ready: Any) -> None:
    """FLOOD_ROUNDS connections, each sending FLOOD_MESSAGES Registers for the victim's identity and then
    vanishing with an RST (as a killed process with unread data does). With a token it is a token holder."""
    assert ready.wait(60), "the sender did not come up"
    key = _key(token)
    ctx = zmq.Context()
    try:
        for round_ in range(FLOOD_ROUNDS):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.SNDHWM, 0)
            if key:
                keys = curve_keys(key)
                sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
                    keys.server_public, keys.client_public, keys.client_secret,
                )  # fmt: skip
            sock.connect(f"tcp://127.0.0.1:{port}")
            instance = f"flood-{os.getpid()}-{round_}"
            for i in range(FLOOD_MESSAGES):
                msg = Register("victim", "flooder", os.getpid(), "cpu", instance=instance, nonce=f"n{i}")
                sock.send_multipart(seal(msg, key, Seal("", instance, i + 1, True)) if key else encode(msg))
            time.sleep(1.0)  # on the wire: the sender's pipe for this connection fills, its engine stops reading
            zmtp.reset_zmq_connections(sock, port)
    finally:
        ctx.term()


def _flood_role(role: int, port: int, token: str | None, ready: Any) -> dict[str, Any] | None:
    if role == 0:
        return _busy_sender(port, token, ready)
    _flooder(port, token, ready)
    return None


@pytest.mark.parametrize("token", [TOKEN, None], ids=["token-holder", "no-token"])
def test_a_register_flood_then_reset_neither_kills_nor_stalls_a_busy_sender(token: str | None) -> None:
    port, ready = free_port(), mp.get_context("spawn").Event()
    exit_codes: list[int | None] = []
    try:
        result, _ = run_workers(_flood_role, [(0, port, token, ready), (1, port, token, ready)], timeout_s=120,
                                exit_codes=exit_codes)  # fmt: skip
    except AssertionError as exc:  # before the fix: the sender died of SIGABRT (exit code -6)
        raise AssertionError(f"the sender did not survive the flood (exit codes {exit_codes}): {exc}") from None
    assert result["held"] and result["prepare"] and result["ready"], result  # the victim kept its identity
    # the flood did reach the sender: read in full, past each connection's queue budget the oldest dropped
    assert result["refused"] + result["overflowed"] >= 1000, result
    answered = result["refused"] - result["throttled"]  # each answer costs a probe and a Refuse
    assert answered <= result["served_s"] / REFUSE_EVERY_S + 2, result


# -- a stranger's huge frame before authentication (item 4) -------------------------------------------------

STREAM_BYTES = 256 << 20
RSS_BOUND = 32 << 20


def _listening_sender(port: int, token: str | None, seconds: float) -> None:
    async def main() -> None:
        sender = SenderControl("127.0.0.1", port, _key(token), 1 << 16)
        await sender.start()
        try:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                await sender.recv(0.1)
        finally:
            await sender.close()

    asyncio.run(main())


@pytest.mark.parametrize("token", [TOKEN, None], ids=["token", "no-token"])
def test_a_strangers_huge_frame_is_refused_before_it_is_buffered(token: str | None) -> None:
    """One connection, a greeting, then a frame that declares 1 GiB (with a token: the CURVE HELLO, before
    any authentication) followed by STREAM_BYTES. Before: the sender's RSS grew by what was streamed."""
    port = free_port()
    with spawned(_listening_sender, port, token, 90) as proc:
        sender = psutil.Process(proc.pid)
        raw = zmtp.connect(port, b"CURVE" if token else b"NULL", timeout_s=60)
        try:
            time.sleep(0.5)
            before = sender.memory_info().rss
            chunk, sent = b"\0" * (1 << 20), 0
            try:
                raw.sendall(zmtp.frame_header(1 << 30, command=token is not None))
                while sent < STREAM_BYTES:
                    raw.sendall(chunk)
                    sent += len(chunk)
            except OSError:
                pass  # the sender hung up
            time.sleep(1.0)
            grown = sender.memory_info().rss - before
        finally:
            zmtp.reset(raw)
    assert grown < RSS_BOUND, f"the sender grew by {grown >> 20} MiB for a stranger's frame"
    assert sent < STREAM_BYTES, "the sender took the whole frame instead of hanging up"


# -- vLLM's unauthenticated HTTP cannot re-point the engine (item 2) ----------------------------------------

ATTACKER_TOKEN = "the-attackers-own-token-0123456789"


def _post(url: str, body: dict[str, Any]) -> tuple[int, str]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def _until_registered(sender: WeightSender, timeout_s: float, exclude: frozenset[str] = frozenset()) -> str:
    deadline = time.monotonic() + timeout_s
    while not set(sender.registered) - exclude:
        assert time.monotonic() < deadline, "the engine did not register with the trainer"
        await sender._control.recv(0.1)
    return sorted(set(sender.registered) - exclude)[0]


async def test_vllm_http_cannot_point_the_engine_at_another_sender_or_token(tmp_path: Path) -> None:
    """Before: POST /init_weight_transfer_engine with `transport.port` and `transport.auth_token` of the
    caller's choosing restarted the receiver at the caller's sender (then /update_weights: their weights)."""
    http, port = free_port(), free_port()
    config = tmp_path / "rollout.yaml"
    config.write_text(f"transport:\n  port: {port}\n  auth_token: {TOKEN}\n  heartbeat_interval_s: 0.2\n")
    config.chmod(0o600)
    trainer = WeightSender(engine_cfg(port, transport__auth_token=TOKEN))
    attacker = WeightSender(engine_cfg(0, transport__auth_token=ATTACKER_TOKEN))
    await trainer.start()
    await attacker.start()
    try:
        with spawned(standin_server_main, http, str(config), str(tmp_path), 120.0):
            await _until_registered(trainer, 90)
            url = f"http://127.0.0.1:{http}/init_weight_transfer_engine"
            hostile = [f"transport.port={attacker.port}", f"transport.auth_token={ATTACKER_TOKEN}"]
            code, text = await asyncio.to_thread(_post, url, {"init_info": {"overrides": hostile}})
            assert code != 200 and "transport.port" in text and "cannot be set over HTTP" in text, (code, text)
            assert ATTACKER_TOKEN not in text  # a value from the request is never echoed
            deadline = time.monotonic() + 3.0  # the engine kept its receiver: nothing reaches the attacker
            while time.monotonic() < deadline:
                await attacker._control.recv(0.1)
                await trainer._control.recv(0.01)
            assert attacker.registered == [], attacker.registered
            # an allowed override restarts the receiver, from the file: still at the trainer, with its token
            before = trainer._control.peers[trainer.registered[0]].instance
            code, text = await asyncio.to_thread(_post, url, {"init_info": {"overrides": ["transport.timeout_s=30"]}})
            assert code == 200, text
            deadline = time.monotonic() + 30
            while not any(p.instance != before for p in trainer._control.peers.values()):
                assert time.monotonic() < deadline, "the restarted receiver did not register with the trainer"
                await trainer._control.recv(0.1)
            assert attacker.registered == []
    finally:
        await attacker.close()
        await trainer.close()


# -- every log line an outsider can cause is rate-limited (item 6) ------------------------------------------


async def test_garbage_on_the_shm_release_socket_costs_one_warning_line(caplog: pytest.LogCaptureFixture) -> None:
    """Before: one WARNING line per garbage frame (20,000 frames, 20,000 lines in 8 s)."""
    from tests.support.engine import receive_once, stream, with_timeout

    cfg = engine_cfg(free_port(), backend="shm", bucket_size_mb=1 / 128)
    async with WeightSender(cfg) as sender, WeightReceiver(cfg, identity="r0") as receiver:
        assert sender._backend is not None
        ctx = zmq.Context()
        flood = ctx.socket(zmq.PUSH)
        flood.connect(sender._backend.join_spec(0).release_addr)
        try:
            for _ in range(2000):
                flood.send(b"\x93garbage")
            with caplog.at_level("WARNING", logger="lightning_weightsync.transport.backends"):
                for version in (1, 2, 3):
                    await with_timeout(
                        asyncio.gather(receive_once(receiver), sender.send_weights(stream(version), version=version))
                    )
        finally:
            flood.close(linger=0)
            ctx.term()
    lines = [rec.getMessage() for rec in caplog.records if "bad release message" in rec.getMessage()]
    assert len(lines) == 1, f"{len(lines)} warning lines: {lines[:3]}"
