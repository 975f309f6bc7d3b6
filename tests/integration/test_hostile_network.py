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
import socket
import threading
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
from tests.support.mp import free_port, run_workers, spawned
from tests.support.transfer import assert_bitwise, engine_cfg, receive_once, stream
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
            await sender.send("victim", Prepare(1, sender.session))
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


def _busy_rollout(port: int, registered: Any) -> bool:
    """A receiver whose loop is held up for IDLE_S (a sink that blocks), then reads on."""

    async def main() -> bool:
        receiver = ReceiverControl("127.0.0.1", port, None, "busy-rollout", "cpu")
        await receiver.start()
        try:
            assert registered.wait(60), "the trainer did not see the registration"
            time.sleep(IDLE_S)  # on purpose: nothing reads the DEALER meanwhile
            await receiver.recv(0.5)
            return True
        finally:
            await receiver.close()

    return asyncio.run(main())


def test_a_trainer_that_dies_with_a_backlog_queued_to_a_busy_rollout_does_not_kill_it() -> None:
    """The other end of the same libzmq abort: a receiver's DEALER is read by its event loop only, so a
    trainer that queued more than a pipe holds (RCVHWM) and then died with an RST made libzmq abort the
    rollout. Its DEALER has no RCVHWM, so its engine never stops reading (`transport/sockets.py`)."""
    port, registered = free_port(), mp.get_context("spawn").Event()
    ctx = zmq.Context()
    trainer = ctx.socket(zmq.ROUTER)  # a stand-in for a trainer: it only has to send, then die
    trainer.setsockopt(zmq.SNDHWM, 0)
    trainer.bind(f"tcp://127.0.0.1:{port}")
    exit_codes: list[int | None] = []
    try:
        with spawned(_busy_rollout, port, registered) as rollout:
            assert trainer.poll(60_000), "the rollout did not register"
            route = trainer.recv_multipart()[0]
            registered.set()
            for _ in range(FLOOD_MESSAGES):
                trainer.send_multipart([route, b""])  # empty frames: receivers ignore them
            time.sleep(1.0)  # on the wire: the rollout's pipe fills if it has a high-water mark
            for conn in psutil.Process().net_connections("tcp"):  # close with an RST, as a killed process
                if conn.laddr and conn.laddr.port == port and conn.raddr and conn.fd >= 0:
                    zmtp.reset(socket.socket(fileno=os.dup(conn.fd)))
            trainer.close(linger=0)
            rollout.join(IDLE_S + 30)
            exit_codes.append(rollout.exitcode)
    finally:
        trainer.close(linger=0)
        ctx.term()
    assert exit_codes == [0], f"the rollout did not survive its trainer's death (exit code {exit_codes})"


# -- a token holder's flood while the trainer does not read (item 1: memory after authentication) ----------

STEP_FLOOD_S = 4.0  # the flooder sends for this long (or FLOOD_BYTES) while the trainer is in its training step
FLOOD_BYTES = 256 << 20
JUNK_BYTES = 60_000  # a frame under the sender's MAXMSGSIZE (68,925): authenticated by CURVE, not by the seal
BACKLOG_RSS_BOUND = 24 << 20  # under the inbox's 32 MiB total: one connection that only the total stopped fails it


def _rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) << 10 for line in status if line.startswith("VmRSS:"))


def _stepping_trainer(port: int, phases: dict[str, Any]) -> dict[str, Any]:
    """A WeightSender that sends version 1 to the honest rollout, then spends a training step without
    touching its loop (the control socket is not read by the trainer meanwhile) while a thread samples
    this process's RSS, then sends version 2."""

    async def main() -> dict[str, Any]:
        async with WeightSender(engine_cfg(port, transport__auth_token=TOKEN)) as sender:
            await _until_registered(sender, 60)
            await sender.send_weights(stream(1), version=1)  # the data plane and its buffers exist from here on
            baseline, peak, stepping = _rss(), [0], threading.Event()

            def sample() -> None:
                while not stepping.wait(0.05):
                    peak[0] = max(peak[0], _rss())

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            phases["step"].set()
            time.sleep(STEP_FLOOD_S + 2.0)  # on purpose: the training step (the flood ends 2 s before it)
            stepping.set()
            sampler.join(5)
            stats = await sender.send_weights(stream(2), version=2)
            return {
                "grown": peak[0] - baseline,
                "overflowed": sender.overflowed_messages,
                "lost": sender.lost_messages,  # the one total an alert watches
                "receivers": stats.receivers,
                "failed": stats.failed,
            }

    return asyncio.run(main())


def _honest_rollout(port: int) -> bool:
    async def main() -> bool:
        async with WeightReceiver(engine_cfg(port, transport__auth_token=TOKEN), identity="honest") as receiver:
            assert_bitwise(await receive_once(receiver), stream(1))
            assert_bitwise(await receive_once(receiver), stream(2))
        return True

    return asyncio.run(main())


def _token_holder_flood(port: int, phases: dict[str, Any]) -> int:
    """Sealed `Register`s for its own identity (valid, fresh seqs) among frames just under MAXMSGSIZE,
    as fast as the link takes them, for STEP_FLOOD_S or FLOOD_BYTES; returns the bytes sent."""
    assert phases["step"].wait(120), "the trainer did not reach its training step"
    keys, key, instance = curve_keys(_key(TOKEN)), _key(TOKEN), f"flood-{os.getpid()}"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
        keys.server_public, keys.client_public, keys.client_secret,
    )  # fmt: skip
    sock.connect(f"tcp://127.0.0.1:{port}")
    junk, sent, seq = [b"m" * 32, b"seal", os.urandom(JUNK_BYTES)], 0, 0
    try:
        until = time.monotonic() + STEP_FLOOD_S
        while time.monotonic() < until and sent < FLOOD_BYTES:
            seq += 1
            register = Register("flooder", "flooder", os.getpid(), "cpu", instance=instance, nonce=f"n{seq}")
            frames = seal(register, key, Seal("", instance, seq, True)) if seq % 2 else junk
            sock.send_multipart(frames)
            sent += sum(len(f) for f in frames)
    finally:
        sock.close(linger=0)
        ctx.term()
    return sent


def _backlog_role(role: int, port: int, phases: dict[str, Any]) -> Any:
    if role == 0:
        return _stepping_trainer(port, phases)
    if role == 1:
        return _honest_rollout(port)
    return _token_holder_flood(port, phases)


def test_a_token_holders_flood_during_a_training_step_costs_the_trainer_a_bounded_backlog() -> None:
    """Before: libzmq kept everything a token holder sent while the trainer did not read (its pipe may not
    stop reading, or a reset peer aborts the process): the trainer grew by what was sent. Now a thread reads
    it at once into per-connection queues with a budget and drops the oldest past it, counted."""
    port, manager = free_port(), mp.get_context("spawn").Manager()
    with manager:
        phases = {"step": manager.Event()}
        trainer, honest, sent = run_workers(_backlog_role, [(i, port, phases) for i in range(3)], timeout_s=180)
    assert sent > 4 * BACKLOG_RSS_BOUND or sent >= FLOOD_BYTES, f"the flood sent only {sent >> 20} MiB"
    grown = trainer["grown"]
    assert grown < BACKLOG_RSS_BOUND, f"the trainer grew by {grown >> 20} MiB for {sent >> 20} MiB of flood"
    assert honest and trainer["receivers"] >= 1 and not trainer["failed"], trainer  # version 2 landed, bitwise
    assert trainer["overflowed"], trainer  # the budget dropped the flood's excess, counted
    assert trainer["lost"] >= trainer["overflowed"], trainer  # ... and in the total an operator alerts on


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
    from tests.support.transfer import receive_once, stream, with_timeout

    cfg = engine_cfg(free_port(), backend="shm", bucket_size_mb=1 / 128)
    async with WeightSender(cfg) as sender, WeightReceiver(cfg, identity="r0") as receiver:
        assert sender._lanes.backend is not None
        ctx = zmq.Context()
        flood = ctx.socket(zmq.PUSH)
        flood.connect(sender._lanes.backend.join_spec(0).release_addr)
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
