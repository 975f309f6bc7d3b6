"""Hostile peers against the control plane, in one process over real ZeroMQ sockets (issue 10).

Each test plays one finding of the hostile-peer review: identity takeover, replay, unchecked
outgoing tensors, unbounded config, and the errors that did not name what failed.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio

from lightning_weightsync import ConfigError, ProtocolError, WeightSyncError, load_config
from lightning_weightsync.errors import VersionAborted
from lightning_weightsync.protocol.messages import (
    MAX_NAME_LEN,
    MAX_NDIM,
    Ack,
    BucketMeta,
    Entry,
    Prepare,
    Ready,
    Register,
    Seal,
    check_tensor,
    encode,
    seal,
    unseal,
    validate,
)
from lightning_weightsync.transport.control import ReceiverControl, SenderControl, curve_keys
from lightning_weightsync.versions.sender import BlockingWeightSender, WeightSender
from lightning_weightsync.versions.steps import ReceiverSteps, SenderSteps
from tests.support.control import BUCKET, KEY, prepare, record_sends, registered, started_sender, until
from tests.support.mp import LOAD_SLACK_S, free_port
from tests.support.transfer import engine_cfg, with_timeout

# ----------------------------------------------------------------------------------------------- CURVE keys


def test_curve_keys_come_from_the_token() -> None:
    a, b, other = curve_keys(KEY), curve_keys(KEY), curve_keys(b"another")
    assert a == b  # both sides derive the same pairs
    assert a.server_public != a.client_public and a.server_secret != a.client_secret
    assert other.server_public != a.server_public and other.client_public != a.client_public
    assert zmq.curve_public(a.server_secret) == a.server_public


# ----------------------------------------------------------------------------------------------- finding 1


async def test_unauthenticated_peer_cannot_take_over_an_identity() -> None:
    """Before: a plain DEALER with the receiver's identity took its ROUTER route (handover) and got
    its signed messages; the real receiver was cut off. Now it never completes a handshake."""
    sender = await started_sender()
    receiver = await registered(sender, "rollout-0")
    ctx = zmq.asyncio.Context()
    thief = ctx.socket(zmq.DEALER)
    thief.setsockopt(zmq.IDENTITY, b"rollout-0")
    thief.setsockopt(zmq.LINGER, 0)
    thief.connect(sender.address)
    wrong = ctx.socket(zmq.DEALER)  # CURVE, but keys from another token
    keys = curve_keys(b"guessed")
    wrong.curve_serverkey, wrong.curve_publickey, wrong.curve_secretkey = (
        keys.server_public, keys.client_public, keys.client_secret,
    )  # fmt: skip
    wrong.setsockopt(zmq.LINGER, 0)
    wrong.connect(sender.address)
    try:
        for sock in (thief, wrong):
            await sock.send_multipart(encode(Register("rollout-0", "evil", 1, "cpu"), KEY))
        await until(lambda: sender.rejected_handshakes >= 2, sender)
        assert sender.peers["rollout-0"].instance == receiver.instance  # still the real one
        for version in (1, 2):
            await prepare(sender, receiver, version)  # the real receiver keeps getting its messages
        assert not await thief.poll(500) and not await wrong.poll(100)  # and the thief gets nothing
    finally:
        thief.close(0)
        wrong.close(0)
        ctx.term()
        await receiver.close()
        await sender.close()


@pytest.mark.parametrize("key", [KEY, None], ids=["token", "no-token"])
async def test_duplicate_live_identity_is_refused_not_handed_over(key: bytes | None) -> None:
    sender = await started_sender(key)
    first = await registered(sender, "rollout-0", key)
    second = ReceiverControl("127.0.0.1", sender.port, key, "rollout-0", "cpu")
    await second.start()
    try:
        await until(lambda: sender.refused_registrations >= 1, sender)
        assert sender.peers["rollout-0"].instance == first.instance
        assert await second.recv(2) is None and second.refused is not None
        assert "rollout.identity" in second.refused and "held by a connected receiver" in second.refused
        await prepare(sender, first, 1)  # the first is not cut off
        with pytest.raises(WeightSyncError, match="refuses us"):
            await ReceiverSteps(second, "rollout-0").wait_prepare(0.2, 0.5)
        # once the first is gone (no goodbye: its connection just closes), the identity is free again
        assert first._sock is not None
        first._sock.close(linger=0)
        first._sock = None
        await asyncio.sleep(0.3)
        await second.register()
        await until(lambda: sender.peers["rollout-0"].instance == second.instance, sender)
        await prepare(sender, second, 2)
    finally:
        await first.close()
        await second.close()
        await sender.close()


# ----------------------------------------------------------------------------------------------- finding 3


async def test_replays_from_another_run_and_this_run_are_rejected_and_counted() -> None:
    """Before: an Ack/Ready captured in one run verified in a later run reusing the version."""
    port = free_port()
    first_run = await started_sender(port=port)
    receiver = await registered(first_run, "rollout-0")
    assert receiver._sock is not None
    original_send, captured = record_sends(receiver._sock)
    old_prepare: list[bytes] = []
    try:
        await prepare(first_run, receiver, 1)
        nonce = first_run.peers["rollout-0"].nonce
        session = first_run.session
        old_prepare = seal(Prepare(1, session), KEY, Seal(session, session, 99, False, nonce))
        await receiver.send(Ready("rollout-0", 1))
        await receiver.send(Ack("rollout-0", 1, True))
        got = [await first_run.recv(5), await first_run.recv(5)]
        assert [type(m) for _, m in got] == [Ready, Ack]  # type: ignore[misc]
        old_ready, old_ack = captured[-2], captured[-1]
        await first_run.close()

        second_run = await started_sender(port=port)  # a restarted trainer, same port, new session
        try:
            await receiver.register()
            await until(lambda: "rollout-0" in second_run.peers, second_run)
            await prepare(second_run, receiver, 1)  # version numbering starts over
            for frames in (old_ready, old_ack):
                original_send(frames)  # replayed on the receiver's own (authenticated) connection
            assert await second_run.recv(1) is None  # nothing got through ...
            assert second_run.replayed_messages == 2  # ... and both were counted as replays
            await receiver.send(Ready("rollout-0", 1))
            fresh = captured[-1]
            _, msg = await second_run.recv(5)  # type: ignore[misc]
            assert isinstance(msg, Ready)
            original_send(fresh)  # the same message again within this run: its seq is spent
            assert await second_run.recv(1) is None and second_run.replayed_messages == 3
            # the other direction: the first run's Prepare replayed to the receiver is rejected too
            await second_run.inject(second_run.route_of("rollout-0"), old_prepare)
            assert await receiver.recv(1) is None and receiver.replayed_messages == 1
            # ... and a sender message of this run delivered twice (same seq) is a replay for the receiver
            _, sent = record_sends(second_run._router, "submit")  # every send goes through the socket thread
            await prepare(second_run, receiver, 2)
            await second_run.inject(sent[-1][0], sent[-1][1:])
            assert await receiver.recv(1) is None and receiver.replayed_messages == 2
        finally:
            await second_run.close()
    finally:
        await receiver.close()


def test_sealed_frames_reject_tampering_reflection_and_unsealed() -> None:
    msg = Ack("r", 3, True)
    frames = seal(msg, KEY, Seal("sess", "inst", 5, True))
    got, envelope = unseal(frames, KEY, to_sender=True)
    assert got == msg and envelope.seq == 5 and envelope.session == "sess"
    with pytest.raises(ProtocolError, match="other direction"):
        unseal(frames, KEY, to_sender=False)
    forged = seal(msg, KEY, Seal("other-session", "inst", 6, True))
    with pytest.raises(ProtocolError, match="signature"):  # a seal swapped onto another body
        unseal([frames[0], forged[1], frames[2]], KEY, to_sender=True)
    with pytest.raises(ProtocolError, match="unsealed"):
        unseal(encode(msg, KEY), KEY, to_sender=True)
    with pytest.raises(ProtocolError, match="signature"):
        unseal(seal(msg, b"wrong", Seal("s", "i", 1, True)), KEY, to_sender=True)


# ----------------------------------------------------------------------------------------------- finding 4


@pytest.mark.parametrize(
    "name,shape,match",
    [
        ("x" * (MAX_NAME_LEN + 1), (2,), f"over {MAX_NAME_LEN}"),
        ("", (2,), "empty"),
        ("w", (1,) * (MAX_NDIM + 1), f"MAX_NDIM={MAX_NDIM}"),
    ],
    ids=["long-name", "empty-name", "ndim"],
)
def test_one_tensor_rule_on_both_sides(name: str, shape: tuple[int, ...], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        check_tensor(name, shape, "float32")  # what the sender runs on every tensor
    entry = Entry(name, list(shape), "float32", 0, 4, 0)
    with pytest.raises(ProtocolError, match=match):  # what every receiver runs on the metadata
        validate(BucketMeta(1, 0, True, 4, [entry]))


@pytest.mark.parametrize(
    "name,tensor,match",
    [
        ("x" * (MAX_NAME_LEN + 1), torch.zeros(2), "1024"),
        ("", torch.zeros(2), "empty"),
        ("deep", torch.zeros((1,) * (MAX_NDIM + 1)), "MAX_NDIM"),
    ],
    ids=["long-name", "empty-name", "ndim"],
)
async def test_sender_fails_unsendable_tensor_and_drains(name: str, tensor: torch.Tensor, match: str) -> None:
    """No receiver needed: the version fails before anything waits on a peer (before: every
    receiver dropped the metadata and both sides waited transport.timeout_s)."""
    pulled: list[str] = []

    def weights() -> Any:
        for n, t in [("a", torch.ones(3)), (name, tensor), ("z", torch.ones(3))]:
            pulled.append(n)
            yield n, t

    cfg = engine_cfg(0, trainer__min_receivers=0, transport__timeout_s=60)
    async with WeightSender(cfg) as sender:
        sender._control.peers.clear()
        t0 = time.monotonic()
        stats = await sender.send_weights(weights(), version=1)  # nobody registered: drained, not checked
        assert stats.receivers == 0 and pulled == ["a", name, "z"]
        pulled.clear()
        from lightning_weightsync.versions.source import Drainable as _Drainable

        source = _Drainable(weights())
        with pytest.raises(ProtocolError, match=match) as info:
            async for _ in source:
                pass
        assert "trainer.names" in str(info.value)
        await source.drain()
        assert pulled == ["a", name, "z"]  # the rest of the caller's iterable was still consumed
        assert time.monotonic() - t0 < cfg.transport.timeout_s / 2  # failed at once, never waited on a peer


async def _pull(weights: list[tuple[str, torch.Tensor]]) -> list[str]:
    from lightning_weightsync.versions.source import Drainable as _Drainable

    return [name async for name, _ in _Drainable(weights)]


@pytest.mark.parametrize(
    "weights,match",
    [
        ([("a", torch.ones(2)), ("b", torch.ones(2)), ("a", torch.zeros(2))], r"cannot send 'a' twice"),
        ([("s", torch.eye(3).to_sparse())], r"'s': a torch\.sparse_coo tensor has no dense bytes"),
        ([("m", torch.empty(3, device="meta"))], r"'m': it is on the meta device"),
    ],
    ids=["duplicate-name", "sparse-coo", "meta"],
)
async def test_the_sender_names_a_tensor_it_cannot_send(weights, match: str) -> None:
    """Issue 24 item 6: a name sent twice reached every receiver (each refused the version after waiting);
    sparse and meta tensors failed with torch's error, naming no tensor."""
    with pytest.raises(ProtocolError, match=match) as info:
        await _pull(weights)
    assert "trainer.names" in str(info.value)


async def test_the_sender_refuses_tied_names_the_receivers_would_drop() -> None:
    cfg = engine_cfg(0, trainer__min_receivers=0, transport__timeout_s=60)
    async with WeightSender(cfg) as sender:
        with pytest.raises(ProtocolError, match="aliased twice"):
            await sender.send_weights([("w", torch.ones(2))], version=1, tied={"w": ["x", "x"]})
        stats = await sender.send_weights([("w", torch.ones(2))], version=2, tied={"w": ["x"]})
        assert stats.receivers == 0


# ----------------------------------------------------------------------------------------------- finding 6


async def test_too_few_ready_receivers_get_an_abort() -> None:
    """Before: a receiver that answered Ready waited transport.timeout_s for a plan that never came."""
    sender = await started_sender(None)
    receiver = await registered(sender, "rollout-0", None)
    try:
        gather = asyncio.ensure_future(
            SenderSteps(sender, session=sender.session, min_receivers=2, timeout_s=1.5, ready_timeout_s=5).gather_ready(
                1
            )
        )
        steps = ReceiverSteps(receiver, "rollout-0")
        prepare = await steps.wait_prepare(0.2, 5)
        await receiver.send(Ready("rollout-0", prepare.version))
        t0 = time.monotonic()
        with pytest.raises(VersionAborted, match="min_receivers=2"):
            await steps.wait_plan(prepare, 30)
        # told within the gather's timeout_s=1.5 (plus load), not after its own 30 s wait for a plan
        assert time.monotonic() - t0 < 1.5 + LOAD_SLACK_S
        with pytest.raises(WeightSyncError, match="min_receivers"):
            await gather
    finally:
        await receiver.close()
        await sender.close()


async def test_dropped_message_warnings_are_rate_limited_with_a_count(caplog: pytest.LogCaptureFixture) -> None:
    sender = await started_sender(None)
    ctx = zmq.asyncio.Context()
    flood = ctx.socket(zmq.DEALER)
    flood.setsockopt(zmq.LINGER, 0)
    flood.connect(sender.address)
    try:
        with caplog.at_level(logging.WARNING, logger="lightning_weightsync.transport.control"):
            for _ in range(250):  # fewer than a connection's queue holds (256): each one is read and decoded
                await flood.send_multipart([b"\x93garbage"])
            await until(lambda: sender.dropped_messages >= 250, sender)
        lines = [r for r in caplog.records if "dropped a control message" in r.getMessage()]
        assert len(lines) == 1, [r.getMessage() for r in lines]
        assert sender.dropped_messages == 250
    finally:
        flood.close(0)
        ctx.term()
        await sender.close()


async def test_port_in_use_and_unresolvable_host_name_their_knobs() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=r"in use; set transport\.port"):
            await SenderControl("127.0.0.1", port, None, BUCKET).start()
    for control in (
        SenderControl("no-such-host.invalid", 0, None, BUCKET),
        ReceiverControl("no-such-host.invalid", 1234, None, "r", "cpu"),
    ):
        with pytest.raises(ConfigError, match=r"transport\.host='no-such-host\.invalid' does not resolve"):
            await control.start()
        await control.close()


async def test_api_misuse_raises_at_once() -> None:
    sender = WeightSender(engine_cfg(0))
    with pytest.raises(TypeError, match=r"weights\.items\(\)"):
        await sender.send_weights({"w": torch.zeros(1)}, version=1)
    with pytest.raises(ValueError, match="negative"):
        await sender.send_weights([], version=-1)
    for bad in ("1", 1.0, True):
        with pytest.raises(TypeError, match="version must be an int"):
            await sender.send_weights([], version=bad)  # type: ignore[arg-type]


def test_blocking_sender_after_close_says_so() -> None:
    blocking = BlockingWeightSender(engine_cfg(0, trainer__min_receivers=0))
    blocking.start()
    blocking.close()
    with pytest.raises(WeightSyncError, match="BlockingWeightSender is closed"):
        blocking.send_weights([("w", torch.zeros(1))], version=1)
    blocking.close()  # twice is fine


# ----------------------------------------------------------------------------------------------- finding 5


@pytest.mark.parametrize(
    "override,match",
    [
        ("transport.timeout_s=inf", r"transport\.timeout_s=inf is out of range"),
        ("transport.timeout_s=1e9", r"transport\.timeout_s"),
        ("transport.heartbeat_interval_s=1e-9", r"transport\.heartbeat_interval_s"),
        ("transport.ready_timeout_s=inf", r"transport\.ready_timeout_s"),
        ("trainer.names.rename=[a, b]", r"trainer\.names\.rename: wrong type.*mapping"),
        ("trainer.names.rename={a: [1]}", r"trainer\.names\.rename\.a"),
        ("trainer.names.exclude={a: 1}", r"trainer\.names\.exclude: wrong type.*list"),
        ("trainer.min_receivers=100000000", r"trainer\.min_receivers"),
    ],
)
def test_config_bounds_and_types_are_config_errors(override: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=[override])


def test_config_wrong_type_in_a_file_names_the_key(tmp_path: Any) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text("trainer:\n  names:\n    rename: [a, b]\n")
    with pytest.raises(ConfigError, match=r"trainer\.names\.rename"):
        load_config(path)


def test_cli_wrong_type_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_weightsync.cli import main

    assert main(["config", "show", "trainer.names.rename=[a]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    assert "trainer.names.rename" in err[0] and any("fix" in line for line in err[1:])


# ----------------------------------------------------------------------------------------------- finding 2


async def test_rendezvous_store_lives_behind_the_control_plane() -> None:
    """A gloo group forms through the sender's store reached over the authenticated control plane
    (no TCPStore); keys outside the sender session's namespace are refused."""
    from datetime import timedelta

    import torch.distributed as dist

    sender = await started_sender()
    receiver = await registered(sender, "rollout-0")
    try:
        await prepare(sender, receiver, 1)  # the receiver now seals for this sender session
        namespace = f"lws/{sender.session}/1"
        local, remote = sender.rendezvous_store(namespace, 10), receiver.rendezvous_store(namespace, 10)
        tensors = [torch.arange(64, dtype=torch.float32), torch.zeros(64)]

        def rank(r: int, store: dist.Store) -> None:
            group = dist.ProcessGroupGloo(store, r, 2, timedelta(seconds=10))
            group.broadcast(tensors[r], 0).wait()

        both = asyncio.gather(asyncio.to_thread(rank, 0, local), asyncio.to_thread(rank, 1, remote))
        await with_timeout(sender.serve_until(asyncio.ensure_future(both), 30), 35)
        assert torch.equal(tensors[1], tensors[0])

        async def served(fn: Any) -> Any:
            return await sender.serve_until(asyncio.ensure_future(asyncio.to_thread(fn)), 30)

        assert await served(lambda: remote.add("counter", 2)) == 2
        assert await served(lambda: remote.add("counter", 3)) == 5
        assert await served(lambda: remote.check(["counter"])) and not await served(lambda: remote.check(["nope"]))
        dropped = sender.dropped_messages
        stranger_ns = receiver.rendezvous_store("lws/another-session/1", 1)
        with pytest.raises(WeightSyncError):
            await served(lambda: stranger_ns.set("0", b"10.0.0.66:1234"))
        assert sender.dropped_messages == dropped + 1
    finally:
        await receiver.close()
        await sender.close()


# ------------------------------------------------------------------------ issue 24 item 5: no shadowing


def test_the_console_script_never_lets_the_working_directory_shadow_the_standard_library(tmp_path, monkeypatch) -> None:
    """A `secrets.py` left in the working directory ran inside the daemon and forced constant nonces:
    the directory was put first on sys.path. It goes last: `./my_models.py` is still found, the
    standard library's `secrets` (and every installed package) wins over a file of the same name."""
    import importlib.machinery

    from lightning_weightsync import cli

    (tmp_path / "secrets.py").write_text("raise RuntimeError('shadowed the standard library')\n")
    (tmp_path / "my_models.py").write_text("def build():\n    return None\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    cli._import_from_cwd()
    found = importlib.machinery.PathFinder.find_spec("secrets", sys.path)
    assert found is not None and found.origin is not None and Path(found.origin).parent != tmp_path
    mine = importlib.machinery.PathFinder.find_spec("my_models", sys.path)
    assert mine is not None and Path(mine.origin).parent == tmp_path


# ------------------------------------------------------------ issue 24 item 2: vLLM's HTTP takes no trust


@pytest.mark.parametrize(
    "override",
    [
        "transport.port=1234",
        "transport.host=10.6.6.6",
        "transport.auth_token=the-callers-own-token",
        "transport.auth_token_file=/tmp/mine",
        "transport.store_port=9",
        "rollout.identity=someone-else",
        " transport.port =1",  # spaces around the key change nothing
        "transport={port: 1}",  # a whole section is not an allowed key either
    ],
)
def test_vllm_init_overrides_cannot_change_where_whom_or_the_token(override: str) -> None:
    from lightning_weightsync.rollout_engines.vllm.worker import check_init_overrides

    with pytest.raises(ConfigError, match="cannot be set over HTTP") as info:
        check_init_overrides(["transport.timeout_s=5", override])
    assert override.split("=", 1)[0].strip() in str(info.value)
    assert "the-callers-own-token" not in str(info.value)


def test_vllm_init_overrides_allow_waits_and_refuse_interpolations() -> None:
    from lightning_weightsync.rollout_engines.vllm.worker import INIT_OVERRIDES, check_init_overrides

    allowed = [f"{key}=1" for key in INIT_OVERRIDES if key != "transport.backend"] + ["transport.backend=gloo"]
    assert check_init_overrides(allowed) == allowed
    for bad in ("transport.timeout_s=${oc.env:LIGHTNING_WEIGHTSYNC_AUTH_TOKEN}", "no-equals-sign", 42):
        with pytest.raises(ConfigError, match=r"init_info\.overrides"):
            check_init_overrides([bad])


def test_the_cli_warns_that_a_token_on_the_command_line_shows_in_ps(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_weightsync.cli import main

    assert main(["config", "show", "transport.auth_token=visible-in-ps-0123"]) == 0
    captured = capsys.readouterr()
    assert "visible to every user" in captured.err and "auth_token_file" in captured.err
    assert "visible-in-ps-0123" not in captured.err and "visible-in-ps-0123" not in captured.out  # masked
    assert main(["config", "show", "transport.port=1234"]) == 0
    assert "visible to every user" not in capsys.readouterr().err
