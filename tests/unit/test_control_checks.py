"""One test per check that guards the control plane against a token holder or a stranger (issue 24 item
7), each built so that only that check stands between the forged frame and the application: a fresh seq
where the session is what is wrong, the right session where the identity is, and so on. Every one fails
when its check alone is removed or weakened: tools/plant_check.py plants each.

Real sockets on loopback: a sender, registered receivers, and a token holder's own CURVE connection
(`tests/support/control.py: TokenHolder`) that sends the forged frames.
"""

from __future__ import annotations

import time

import pytest
import zmq
import zmq.asyncio

from lightning_weightsync import ProtocolError
from lightning_weightsync.protocol.messages import Prepare, Ready, Register, Seal, seal, unseal
from lightning_weightsync.transport.control import curve_keys
from lightning_weightsync.transport.control.sender import REFUSE_EVERY_S
from tests.support.control import KEY, TokenHolder, prepare, registered, started_sender, until

FRESH = 1 << 40  # a seq above anything a real peer used: the seq floor never decides these tests


# -- the ZAP handler: only the token's client key completes a handshake ---------------------------------------


async def test_a_client_key_other_than_the_tokens_fails_the_handshake() -> None:
    """The server's public key is no secret (it can leak with a config or a former token holder); what
    admits a client is the client key derived from the token."""
    sender = await started_sender()
    ctx = zmq.asyncio.Context()
    stranger = ctx.socket(zmq.DEALER)
    public, secret = zmq.curve_keypair()
    stranger.curve_serverkey = curve_keys(KEY).server_public  # knows the server's public key ...
    stranger.curve_publickey, stranger.curve_secretkey = public, secret  # ... not the token
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.connect(sender.address)
    try:
        await stranger.send_multipart(
            seal(Register("x", "h", 1, "cpu", instance="i"), b"guess", Seal("", "i", 1, True))
        )
        await until(lambda: sender.rejected_handshakes >= 1, sender, timeout_s=5)
        assert sender.dropped_messages == sender.rejected_handshakes  # no message of it was even read
        assert "x" not in sender.peers
    finally:
        stranger.close(0)
        ctx.term()
        await sender.close()


# -- the sender's checks on what receivers send ---------------------------------------------------------------


async def test_a_register_whose_instance_is_not_its_seal_origin_is_dropped() -> None:
    sender = await started_sender()
    holder = TokenHolder(sender)
    try:
        await holder.send(Register("x", "h", 1, "cpu", instance="claimed"), Seal("", "sealer", 1, True))
        await until(lambda: sender.dropped_messages >= 1, sender)
        assert "x" not in sender.peers
    finally:
        holder.close()
        await sender.close()


async def test_a_message_sealed_for_another_sender_session_is_dropped() -> None:
    """On the receiver's own connection, with its identity and instance and a fresh seq: only the seal's
    session is wrong (a message of another run, or meant for another trainer)."""
    sender = await started_sender()
    receiver = await registered(sender, "r")
    try:
        assert receiver._sock is not None
        receiver._sock.send_multipart(
            seal(Ready("r", 1), KEY, Seal("another-session", receiver.instance, FRESH, True))
        )
        assert await sender.recv(1) is None
        assert sender.replayed_messages == 1
    finally:
        await receiver.close()
        await sender.close()


async def test_a_connection_cannot_register_a_second_identity() -> None:
    sender = await started_sender()
    receiver = await registered(sender, "r")
    try:
        assert receiver._sock is not None
        forged = Register("other", "h", 1, "cpu", instance=receiver.instance)
        receiver._sock.send_multipart(seal(forged, KEY, Seal("", receiver.instance, FRESH, True)))
        await until(lambda: sender.dropped_messages >= 1, sender)
        assert "other" not in sender.peers and sender.peers["r"].route == sender.route_of("r")
    finally:
        await receiver.close()
        await sender.close()


async def test_a_connection_cannot_speak_for_another_identity() -> None:
    sender = await started_sender()
    r, q = await registered(sender, "r"), await registered(sender, "q")
    try:
        assert r._sock is not None
        envelope = Seal(sender.session, r.instance, FRESH, True)
        r._sock.send_multipart(seal(Ready("q", 1), KEY, envelope))  # r's connection, q's name
        assert await sender.recv(1) is None
        assert sender.dropped_messages == 1
    finally:
        await r.close()
        await q.close()
        await sender.close()


async def test_a_message_sealed_by_another_instance_than_the_registered_one_is_dropped() -> None:
    sender = await started_sender()
    receiver = await registered(sender, "r")
    try:
        assert receiver._sock is not None
        receiver._sock.send_multipart(seal(Ready("r", 1), KEY, Seal(sender.session, "not-r", FRESH, True)))
        assert await sender.recv(1) is None
        assert sender.dropped_messages == 1
    finally:
        await receiver.close()
        await sender.close()


async def test_a_token_holder_cannot_take_a_live_receivers_instance_or_lock_it_out() -> None:
    """Issue 24 item 6: a token holder's Register with the victim's identity, instance id and a huge seq
    took the victim's identity (a reconnect of "the same process"), and the huge seq made every later
    message of the victim a replay. Now it is refused (the victim's connection is up) and nothing of it is
    recorded; the same forgery under another identity does not touch the victim's seq either."""
    sender = await started_sender()
    victim = await registered(sender, "victim")
    holder = TokenHolder(sender)
    try:
        huge = (1 << 63) - 2
        await holder.send(
            Register("victim", "h", 1, "cpu", instance=victim.instance), Seal("", victim.instance, huge, True)
        )
        await until(lambda: sender.refused_registrations >= 1, sender)
        await holder.send(
            Register("decoy", "h", 1, "cpu", instance=victim.instance), Seal("", victim.instance, huge, True)
        )
        await until(lambda: "decoy" in sender.peers, sender)
        assert sender.peers["victim"].instance == victim.instance and sender.peers["victim"].route != b""
        await prepare(sender, victim, 1)  # the victim still hears the sender ...
        await victim.send(Ready("victim", 1))
        got = await sender.recv(5)  # ... and is still heard
        assert got is not None and got[0] == "victim" and isinstance(got[1], Ready), (got, sender.replayed_messages)
    finally:
        holder.close()
        await victim.close()
        await sender.close()


async def test_duplicate_registrations_are_answered_at_a_bounded_rate() -> None:
    """Issue 24 item 1: each duplicate Register cost a liveness probe and a Refuse, 50k of them a minute of
    the sender's time. Now one answer per identity and REFUSE_EVERY_S; the rest are dropped and counted."""
    sender = await started_sender()
    victim = await registered(sender, "victim")
    holder = TokenHolder(sender)
    try:
        started = time.monotonic()
        for seq in range(1, 301):
            await holder.send(
                Register("victim", "h", 1, "cpu", instance="dup", nonce=f"n{seq}"), Seal("", "dup", seq, True)
            )
        # the sender's per-connection queue (256 messages) drops the oldest of a flood sent while it does not read
        await until(lambda: sender.refused_registrations + sender.overflowed_messages >= 300, sender)
        answered = sender.refused_registrations - sender.throttled_registrations
        assert 1 <= answered <= (time.monotonic() - started) / REFUSE_EVERY_S + 1, answered
        assert sender.peers["victim"].instance == victim.instance
    finally:
        holder.close()
        await victim.close()
        await sender.close()


# -- the receiver's checks on what the sender sends -----------------------------------------------------------


async def _with_session() -> tuple:
    sender = await started_sender()
    receiver = await registered(sender, "r")
    await prepare(sender, receiver, 1)  # the receiver now follows this session
    return sender, receiver, sender.peers["r"].nonce  # the nonce whose answer admitted it


async def test_a_sender_message_whose_seal_origin_is_not_its_session_is_dropped() -> None:
    sender, receiver, _ = await _with_session()
    try:
        frames = seal(Prepare(2, sender.session), KEY, Seal(sender.session, "not-the-session", FRESH, False))
        await sender.inject(sender.route_of("r"), frames)
        assert await receiver.recv(1) is None and receiver.dropped_messages == 1
    finally:
        await receiver.close()
        await sender.close()


async def test_a_sender_message_naming_another_session_than_its_seal_is_dropped() -> None:
    sender, receiver, _ = await _with_session()
    try:
        frames = seal(Prepare(2, "another-session"), KEY, Seal(sender.session, sender.session, FRESH, False))
        await sender.inject(sender.route_of("r"), frames)
        assert await receiver.recv(1) is None and receiver.dropped_messages == 1
    finally:
        await receiver.close()
        await sender.close()


async def test_a_new_session_must_answer_a_registration_after_the_one_that_admitted_the_current() -> None:
    """The nonce floor: a Prepare of another session whose seal answers the very nonce that admitted the current
    session (a copy of an answer to that registration) must not switch the receiver over."""
    sender, receiver, admitted = await _with_session()
    try:
        other = "another-sender-session"
        frames = seal(Prepare(1, other), KEY, Seal(other, other, 1, False, admitted))
        await sender.inject(sender.route_of("r"), frames)
        assert await receiver.recv(1) is None and receiver.replayed_messages == 1
        assert receiver.sender_session == sender.session
    finally:
        await receiver.close()
        await sender.close()


@pytest.mark.parametrize("answers", ["", "0123456789abcdef"], ids=["no-answer", "a-nonce-never-issued"])
async def test_a_new_session_must_answer_one_of_the_receivers_recent_registrations(answers: str) -> None:
    """`Seal.answers`: a receiver that follows no session yet (its nonce floor at its lowest, so only the
    answer decides) adopts none from a correctly sealed Prepare that answers none of its Registers: a
    recorded message of another run. A real answer afterwards is adopted (the check is not refusing all)."""
    sender = await started_sender()
    receiver = await registered(sender, "r")
    try:
        other = "another-sender-session"
        await sender.inject(sender.route_of("r"), seal(Prepare(1, other), KEY, Seal(other, other, 1, False, answers)))
        assert await receiver.recv(1) is None and receiver.replayed_messages == 1
        assert receiver.sender_session is None
        await prepare(sender, receiver, 1)
        assert receiver.sender_session == sender.session
    finally:
        await receiver.close()
        await sender.close()


# -- the seal itself ------------------------------------------------------------------------------------------


def test_the_seal_mac_frames_the_header_length() -> None:
    """Bytes moved from the body to the header keep header || body the same: only the length prefix in
    the MAC tells the two splits apart."""
    mac, header, body = seal(Ready("r", 1), KEY, Seal("s", "i", 5, True))
    with pytest.raises(ProtocolError, match="signature"):
        unseal([mac, header + body[:1], body[1:]], KEY, to_sender=True)


@pytest.mark.parametrize("seq", [-1, 1 << 63, (1 << 64) - 1], ids=["negative", "2**63", "2**64-1"])
def test_a_seq_outside_0_to_2_63_is_refused(seq: int) -> None:
    with pytest.raises(ProtocolError, match="bad seq"):
        unseal(seal(Ready("r", 1), KEY, Seal("s", "i", seq, True)), KEY, to_sender=True)
    unseal(seal(Ready("r", 1), KEY, Seal("s", "i", (1 << 63) - 1, True)), KEY, to_sender=True)  # the edge is legal
