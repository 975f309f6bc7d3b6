"""A version that failed at a rollout for a cause outside it, taken from a peer that installed it
(`rollout/recover.py`, `rollout.recover_from_peers` with `rollout.catch_up_from`).

The chain: three real `lightning-weightsync rollout` processes chained by the trainer (transport.fanout=chain); the
middle one dies mid-version 2; the tail, cut off, takes version 2 from the head (which kept it and serves it), then
the trainer's version 3 reaches head and tail. The rules (only the failed version, abandoned at the trainer's next
Prepare): an in-process daemon against a real `PeerServer`, both over real sockets and gloo.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_weightsync import PeerError, WeightSender
from lightning_weightsync.protocol.fingerprint import checksum_hex, fingerprint
from lightning_weightsync.rollout.daemon import RolloutDaemon
from lightning_weightsync.rollout.sinks.module import ModuleSink
from lightning_weightsync.versions.peer_serve import PeerServer, serve_settings
from tests.integration.test_cli import ENV, REPO, TINY, read_stats, rollout, transport, wait_for
from tests.integration.test_daemon import daemon_cfg, running, sender_on, until
from tests.integration.test_daemon_late_joiner import log_of, serve_address, stop
from tests.support.mp import free_port, popen
from tests.unit.test_sinks import assert_same, version_weights

pytestmark = pytest.mark.timeout(180)

CHAIN = ("transport.fanout=chain", f"transport.bucket_size_mb={8 / 1024}")  # 8 KiB: a version is 2 buckets
RECOVERED = re.compile(r"recovered version 2 from the peer at (\S+) in ([0-9.]+) s")


@contextlib.contextmanager
def dying_rollout(tmp_path: Path, port: int, *overrides: str) -> Iterator[subprocess.Popen[str]]:
    """`tests/support/dying_rollout.py`: a rollout daemon that dies as it forwards version 2's second bucket."""
    log = tmp_path / "b.log"
    cmd = [sys.executable, "-m", "tests.support.dying_rollout", "rollout", *transport(port), "rollout.progress=false",
           *overrides]  # fmt: skip
    with open(log, "w") as out, popen(cmd, env=ENV, cwd=REPO, stdout=out, stderr=subprocess.STDOUT) as proc:
        proc.log = log  # type: ignore[attr-defined]
        yield proc


async def test_a_chain_member_killed_mid_version_the_tail_recovers_it_from_the_head(tmp_path: Path) -> None:
    port, dump, out, stats = free_port(), tmp_path / "a.safetensors", tmp_path / "c", tmp_path / "c.jsonl"
    tiny = f"rollout.sink.factory={TINY}:build_tiny"
    peer = f"127.0.0.1:{free_port()}"  # a's serve address, so c starts with a and b (catching up version 1 from a)
    head = (*CHAIN, tiny, f"rollout.serve_port={peer.split(':')[1]}", "rollout.identity=a")
    tail = (*CHAIN, "rollout.sink.type=safetensors", f"rollout.sink.dir={out}", "rollout.identity=c",
            f"rollout.catch_up_from=[{peer}]", "rollout.catch_up_wait_s=30")  # fmt: skip
    async with WeightSender(load_config_chain(port)) as sender:
        sender.settings = replace(sender.settings, min_receivers=2)
        with rollout(tmp_path, port, *head, name="a", args=("--dump-on-exit", str(dump))) as a, dying_rollout(
            tmp_path, port, *CHAIN, tiny, "rollout.identity=b"
        ) as b, rollout(tmp_path, port, *tail, name="c", args=("--stats-jsonl", str(stats))) as c:  # fmt: skip
            stats1 = await sender.send_weights(version_weights(1).items(), version=1)
            assert stats1.receivers == 2 and stats1.num_buckets == 2, stats1  # b dies at the second of two
            assert await asyncio.to_thread(serve_address, a) == peer
            await asyncio.to_thread(wait_for, lambda: "rollout daemon ready" in log_of(c), 60, "c's start", c)
            sender.settings = replace(sender.settings, min_receivers=3)
            with pytest.raises(PeerError) as failed:  # the chain a -> b -> c is cut at b
                await sender.send_weights(version_weights(2).items(), version=2)
            assert "'b'" in str(failed.value), failed.value  # the dead one named
            await asyncio.to_thread(b.wait, 30)
            await asyncio.to_thread(wait_for, lambda: RECOVERED.search(log_of(c)) is not None, 60, "recovery", c)
            assert_same(load_file(str(out / "step_2.safetensors")), version_weights(2))  # from the head, bitwise
            sender.settings = replace(sender.settings, min_receivers=2)
            stats3 = await sender.send_weights(version_weights(3).items(), version=3)  # re-linked: a -> c
            assert stats3.receivers == 2 and sender.registered == ["a", "c"], (stats3, sender.registered)
            assert await asyncio.to_thread(stop, c) == 0, log_of(c)
            assert await asyncio.to_thread(stop, a) == 0, log_of(a)
    found = RECOVERED.search(log_of(c))
    assert found is not None and found.group(1) == peer, log_of(c)
    print(f"c recovered version 2 from the head in {found.group(2)} s")
    records = [(r["version"], r["outcome"]) for r in read_stats(stats)]
    assert records[0][0] == 2 and records[0][1] in ("aborted", "failed", "timeout"), records  # it failed here first
    assert records[1:] == [(2, "recovered"), (3, "applied")], records
    assert_same(load_file(str(out / "step_3.safetensors")), version_weights(3))
    assert_same(load_file(str(dump)), version_weights(3))
    assert "peer served version 2 to 1 joiners" in log_of(a), log_of(a)
    assert "Traceback" not in log_of(a) + log_of(c)


def load_config_chain(port: int):  # the trainer's side of CHAIN
    from lightning_weightsync import load_config

    return load_config(overrides=[*transport(port, 30), *CHAIN])


# -- the rules, with an in-process daemon ---------------------------------------------------------------------------


def dying(version: int, after: int = 4) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's source of `version` breaks mid-way: the sender aborts the version at every receiver."""
    for i, item in enumerate(version_weights(version).items()):
        if i == after:
            raise RuntimeError("trainer crashed mid-gather (test)")
        yield item


def hold(server: PeerServer, version: int) -> None:
    weights = version_weights(version)
    server.hold(version, weights, {n: checksum_hex(fingerprint(t)) for n, t in weights.items()})


async def test_a_recovery_takes_only_the_failed_version_and_is_abandoned_when_the_next_one_starts() -> None:
    """Phase 1: the peer serves version 0 while the daemon, holding 1, failed 2: refused before its bytes reach the
    sink, which keeps 1. Phase 2: the peer serves nothing while the daemon, failed 3, waits for it: the trainer's
    version 4 starts, the recovery is abandoned (cancelled, its connection to the peer closed) and 4 is installed."""
    port = free_port()
    async with sender_on(port) as sender:
        server = PeerServer(serve_settings(sender_settings_of(port), 0))
        await server.start()
        try:
            hold(server, 0)
            cfg = daemon_cfg(port, rollout__catch_up_from=[server.address], rollout__catch_up_wait_s=30,
                             rollout__identity="d")  # fmt: skip
            daemon = RolloutDaemon(cfg, handle_signals=False)
            async with running(daemon):
                await until(lambda: daemon.peers is not None and daemon.peers.caught_up is not None)
                hold(server, 0)  # again: d, served 0 at start-up, would be left out of this hold's serves
                await sender.send_weights(version_weights(1).items(), version=1)
                with pytest.raises(RuntimeError, match="crashed mid-gather"):
                    await sender.send_weights(dying(2), version=2)
                await until(lambda: (r := _recovery(daemon)) is not None and r.version == 2 and r.finished)
                await until(lambda: len(server.failed) == 1)  # d refused it: the serve failed on its nack
                assert "version 0" in server.failed[0] and "'d'" in server.failed[0], server.failed
                sink = daemon.sink
                assert isinstance(sink, ModuleSink) and sink.version == 1 and sink.in_flight is None
                assert_same(sink.state_dict(), version_weights(1))

                server.release()  # phase 2: nothing served
                with pytest.raises(RuntimeError, match="crashed mid-gather"):
                    await sender.send_weights(dying(3), version=3)
                await until(lambda: (r := _recovery(daemon)) is not None and r.version == 3)
                await until(lambda: "d" in server.sender.registered)  # waiting at the peer for version 3
                stats4 = await sender.send_weights(version_weights(4).items(), version=4)
                assert stats4.receivers == 1
                recovery = _recovery(daemon)
                assert recovery is not None and recovery.version == 3
                await until(lambda: recovery.finished)  # abandoned: it stopped waiting at the peer
                assert recovery.task is not None and recovery.task.cancelled() and recovery.guard.abandoned is not None
                assert "the trainer's version 4 started" in recovery.guard.abandoned
                assert sink.version == 4 and sink.in_flight is None
                assert_same(sink.state_dict(), version_weights(4))
        finally:
            await server.close()
    outcomes = [(r.version, r.outcome) for r in daemon.records]
    assert outcomes[0] == (1, "applied") and outcomes[-1] == (4, "applied"), outcomes
    assert [o for _, o in outcomes].count("recovered") == 0 and len(outcomes) == 4, outcomes


def sender_settings_of(port: int):
    from lightning_weightsync.config import ReceiverSettings

    return ReceiverSettings.of(daemon_cfg(port))


def _recovery(daemon: RolloutDaemon):  # the daemon's last recovery, if any
    return daemon.peers.recovery if daemon.peers is not None else None
