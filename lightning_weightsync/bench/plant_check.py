"""Plant known bugs one at a time and check that the tests written for them fail (issue 14).

A test that passes on a broken implementation proves nothing. Each plant below is a small, realistic
bug (a removed check, a reordered durability step, a missing lock, a skipped collective) with the
tests that must catch it. For each one this script edits the source in place, runs those tests,
restores the file (always, also on Ctrl-C), and reports CAUGHT or MISSED. Exit status 1 if any plant
was missed or a file could not be restored.

    .venv/bin/python -m lightning_weightsync.bench.plant_check            # every plant (~4 min on 2 cores)
    .venv/bin/python -m lightning_weightsync.bench.plant_check decoder    # plants whose name contains "decoder"

Not part of the test suite on purpose: it rewrites source files while it runs. Run it on a clean
checkout (it refuses to start when a file it plants into has uncommitted changes).
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PKG = "lightning_weightsync"


@dataclass(frozen=True)
class Plant:
    name: str
    path: str  # relative to the repository
    old: str  # must occur exactly once
    new: str
    tests: tuple[str, ...]  # pytest node ids or files (-k expressions after "::-k ")


MESSAGES = f"{PKG}/protocol/messages.py"
JOINS = f"{PKG}/protocol/joins"  # each join kind validates itself
CONTROL_LINK = f"{PKG}/transport/control/link.py"
CONTROL_SENDER = f"{PKG}/transport/control/sender.py"
CONTROL_RECEIVER = f"{PKG}/transport/control/receiver.py"
CHECKS = "tests/unit/test_control_checks.py"
HOSTILE = "tests/integration/test_hostile_network.py"
FUZZ = ("tests/unit/test_messages.py", "-k", "fuzz")  # only the fuzzers: they must find it on their own
LORA_UNIT = "tests/unit/test_lora.py"
OVERLAP = f"{PKG}/trainer/overlap.py"
OVERLAP_TESTS = "tests/integration/test_overlap.py"

PLANTS = [
    # -- the wire: each validator check removed in turn; only the fuzz tests run
    Plant("decoder: chunk outside its bucket", MESSAGES,
          "if e.offset < 0 or e.offset + e.chunk_size > msg.nbytes:", "if e.offset < 0:", FUZZ),
    Plant("decoder: chunk outside its tensor", MESSAGES,
          "if e.chunk_offset < 0 or e.chunk_size < 0 or e.chunk_offset + e.chunk_size > nbytes:",
          "if e.chunk_offset < 0 or e.chunk_size < 0:", FUZZ),
    Plant("decoder: bucket over the receiver's buffer", MESSAGES,
          "if bucket_size is not None and msg.nbytes > bucket_size:", "if False:", FUZZ),
    Plant("decoder: rank outside the group", MESSAGES,
          "if not (0 <= msg.rank < msg.group.world_size):", "if not (0 <= msg.rank):", FUZZ),
    Plant("decoder: member listed twice", MESSAGES,
          "if len({m.identity for m in group.members}) != len(group.members):", "if False:", FUZZ),
    Plant("decoder: store port range", f"{JOINS}/store.py",
          "if not self.host or not (1 <= self.port <= 65535):", "if not self.host:", FUZZ),
    Plant("decoder: nccl id byte range", f"{JOINS}/nccl.py",
          "any(not (-128 <= b <= 255) for b in self.unique_id)", "False", FUZZ),
    Plant("decoder: slot count", f"{JOINS}/shared.py",
          "if not (1 <= len(self.slots) <= MAX_SLOTS):\n"
          "            raise ProtocolError(f\"plan has {len(self.slots)} slot handles",
          "if False:\n            raise ProtocolError(f\"plan has {len(self.slots)} slot handles", FUZZ),
    Plant("decoder: tied names only on bucket 0", MESSAGES,
          "if msg.bucket_index != 0:\n        raise ProtocolError(f\"bucket {msg.bucket_index} carries",
          "if False:\n        raise ProtocolError(f\"bucket {msg.bucket_index} carries", FUZZ),
    Plant("decoder: ndim limit", MESSAGES,
          "if len(shape) > MAX_NDIM or any(d < 0 for d in shape):", "if any(d < 0 for d in shape):", FUZZ),
    Plant("decoder: a bug (IndexError) in a check", MESSAGES,
          '    _check_nonneg("bucket_index", msg.bucket_index)\n    _check_nonneg("bucket nbytes"',
          '    [][msg.nbytes]\n    _check_nonneg("bucket_index", msg.bucket_index)\n    _check_nonneg("bucket nbytes"',
          FUZZ),
    Plant("control: a sender message replayed within a run", f"{PKG}/transport/control/receiver.py",
          "            if envelope.seq <= self._sender_seq:", "            if envelope.seq < self._sender_seq:",
          ("tests/unit/test_security.py", "-k", "replays")),
    Plant("control: a receiver message replayed within a run", f"{PKG}/transport/control/sender.py",
          "        if envelope.seq <= last:", "        if envelope.seq < last:",
          ("tests/unit/test_security.py", "-k", "replays")),
    Plant("receiver: a failed version counted as complete", f"{PKG}/engine/receiver.py",
          "            await self._send_ack(plan.version, False, explain(exc))",
          "            self._steps.complete(plan.version)\n"
          "            await self._send_ack(plan.version, False, explain(exc))",
          ("tests/integration/test_engine.py", "-k", "destination_that_raises")),
    # -- issue 24: every check against a token holder or a stranger, each caught by its own test
    Plant("zap: any client key admitted", CONTROL_LINK,
          "        ok = hmac.compare_digest(key, self.client_public)",
          "        ok = len(key) == len(self.client_public)",  # any key (pyzmq hands ZAP keys z85-encoded)
          (CHECKS, "-k", "client_key_other")),
    Plant("sender: a Register's instance not checked against its seal", CONTROL_SENDER,
          "            if envelope.origin != msg.instance:", "            if False:",
          (CHECKS, "-k", "instance_is_not_its_seal_origin")),
    Plant("sender: messages sealed for another session accepted", CONTROL_SENDER,
          "        elif envelope.session != self.session:", "        elif False:",
          (CHECKS, "-k", "another_sender_session")),
    Plant("sender: a connection registers a second identity", CONTROL_SENDER,
          "            if bound is not None and bound != msg.identity:", "            if False:",
          (CHECKS, "-k", "second_identity")),
    Plant("sender: a connection speaks for another identity", CONTROL_SENDER,
          "        if claimed != bound:", "        if False:", (CHECKS, "-k", "speak_for_another_identity")),
    Plant("sender: another instance speaks for a registered identity", CONTROL_SENDER,
          "and envelope.origin != self.peers[bound].instance:", "and False:", (CHECKS, "-k", "another_instance_than")),
    Plant("sender: a refused Register's seq recorded", CONTROL_SENDER,
          "        if envelope is not None and admitted:", "        if envelope is not None:",
          (CHECKS, "-k", "lock_it_out")),
    Plant("sender: a live holder's identity handed over", CONTROL_SENDER,
          "            if await self.connected(msg.identity):", "            if False:",
          (CHECKS, "-k", "lock_it_out")),
    Plant("sender: duplicate registrations answered without a bound", CONTROL_SENDER,
          "        if now - self._refused_at.get(identity, -math.inf) < REFUSE_EVERY_S:", "        if False:",
          (CHECKS, "-k", "bounded_rate")),
    Plant("receiver: a sender message sealed by another origin", CONTROL_RECEIVER,
          "        if envelope.origin != envelope.session:", "        if False:",
          (CHECKS, "-k", "seal_origin_is_not_its_session")),
    Plant("receiver: a message naming another session than its seal", CONTROL_RECEIVER,
          '        if getattr(msg, "session", envelope.session) != envelope.session:', "        if False:",
          (CHECKS, "-k", "naming_another_session")),
    Plant("receiver: the nonce floor off by one", CONTROL_RECEIVER,
          "        if index <= self._nonce_floor:", "        if index < self._nonce_floor:",
          (CHECKS, "-k", "new_session_must_answer")),
    Plant("receiver: a new session adopted from a seal answering none of its Registers", CONTROL_RECEIVER,
          "        if index <= self._nonce_floor:", "        if nonce in self._nonces and index <= self._nonce_floor:",
          (CHECKS, "-k", "recent_registrations")),
    Plant("seal: MAC without the header length", MESSAGES,
          '    return sign(_SEAL_CONTEXT + len(header).to_bytes(4, "big") + header + body, key)',
          "    return sign(_SEAL_CONTEXT + header + body, key)", (CHECKS, "-k", "header_length")),
    Plant("seal: no upper bound on seq", MESSAGES,
          "        if not envelope.origin or not (0 <= envelope.seq < 1 << 63):",
          "        if not envelope.origin or not (0 <= envelope.seq):", (CHECKS, "-k", "seq_outside")),
    Plant("seal: MAC not compared", MESSAGES,
          "        if not hmac.compare_digest(mac, _seal_mac(key, header, body)):", "        if False:",
          ("tests/unit/test_security.py", "-k", "sealed_frames")),
    Plant("seal: direction not checked", MESSAGES,
          "        if envelope.to_sender != to_sender:", "        if False:",
          ("tests/unit/test_security.py", "-k", "sealed_frames")),
    Plant("store: a key outside the session's namespace", f"{PKG}/transport/control/store.py",
          "        if not msg.key.startswith(self.namespace):", "        if False:",
          ("tests/unit/test_security.py", "-k", "rendezvous_store_lives")),
    Plant("wire: a bucket of more than MAX_BUCKET_ENTRIES chunks accepted", MESSAGES,
          "    if len(msg.entries) > MAX_BUCKET_ENTRIES:", "    if False:",
          ("tests/unit/test_messages.py", "-k", "more_than_max_bucket_entries")),
    Plant("split: no cap on a bucket's chunks", f"{PKG}/protocol/chunks.py",
          "        if self.filled == self.bucket_size or self.count >= MAX_BUCKET_ENTRIES:",
          "        if self.filled == self.bucket_size:", ("tests/unit/test_chunks.py", "-k", "max_bucket_entries")),
    Plant("sender: no new bucket at MAX_BUCKET_ENTRIES chunks", f"{PKG}/engine/planner.py",
          "meta.offset < self.fill or len(self.entries) >= MAX_BUCKET_ENTRIES", "meta.offset < self.fill",
          ("tests/integration/test_security.py", "-k", "more_empty_tensors")),
    Plant("sockets: no MAXMSGSIZE", f"{PKG}/transport/sockets.py",
          "    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)\n", "",
          (HOSTILE, "-k", "huge_frame and no-token")),
    Plant("sender inbox: no per-connection budget", f"{PKG}/transport/control/inbox.py",
          "while len(queue.messages) > self.messages_per_connection or queue.nbytes > self.bytes_per_connection:",
          "while False:", (HOSTILE, "-k", "backlog")),
    Plant("sender inbox: no total budget", f"{PKG}/transport/control/inbox.py",
          "            if self.nbytes > self.total_bytes:", "            if False:", ("tests/unit/test_inbox.py",)),
    Plant("sender inbox: one connection served until empty", f"{PKG}/transport/control/inbox.py",
          "                self._queues.move_to_end(route)", "                pass", ("tests/unit/test_inbox.py",)),
    Plant("sockets: the control sockets' receive high-water mark back", f"{PKG}/transport/sockets.py",
          "    sock.setsockopt(zmq.RCVHWM, 0)\n", "", (HOSTILE, "-k", "register_flood or dies_with")),
    Plant("shm: a warning line per garbage release frame", f"{PKG}/transport/backends/shared.py",
          '                self._drops.note("a release connection", exc)',
          '                logger.warning("dropped a bad release message: %s", exc)', (HOSTILE, "-k", "shm")),
    Plant("vllm: any init override taken over HTTP", f"{PKG}/rollout_engines/vllm/worker.py",
          "        if key not in INIT_OVERRIDES:", "        if False:",
          ("tests/unit/test_security.py", "-k", "vllm_init")),
    Plant("vllm launcher: the token written into the config file", f"{PKG}/rollout_engines/launch.py",
          "to_yaml(config, redact=False, drop_token=True)", "to_yaml(config, redact=False)",
          ("tests/unit/test_vllm_launch.py", "-k", "no_token")),
    Plant("sender: a name sent twice", f"{PKG}/engine/sender.py",
          "    if name in names:", "    if False:", ("tests/unit/test_security.py", "-k", "cannot_send")),
    Plant("sender: a sparse tensor not named", f"{PKG}/engine/sender.py",
          "    if tensor.layout != torch.strided:", "    if False:",
          ("tests/unit/test_security.py", "-k", "cannot_send")),
    Plant("sender: tied names not checked", f"{PKG}/engine/sender.py",
          "validate_tied(BucketMeta(version, 0, False, 0, [], options.tied))  # what every receiver checks",
          "pass", ("tests/unit/test_security.py", "-k", "tied_names_the_receivers")),
    Plant("config: a short token accepted", f"{PKG}/config/validate.py",
          "    if len(token) < MIN_TOKEN_LEN:", "    if False:", ("tests/unit/test_config.py", "-k", "empty_or_short")),
    Plant("config: an empty token means no auth", f"{PKG}/config/validate.py",
          "    if not token:\n        raise ConfigError(", "    if False:\n        raise ConfigError(",
          ("tests/unit/test_config.py", "-k", "empty_or_short")),
    Plant("config: a number-like token rewritten by YAML", f"{PKG}/config/load.py",
          "        cfg.transport.auth_token = raw\n", "", ("tests/unit/test_config.py", "-k", "number_like")),
    Plant("config: an identity the wire drops accepted", f"{PKG}/config/validate.py",
          "    if identity is not None and len(identity) > MAX_CONFIG_IDENTITY_LEN:", "    if False:",
          ("tests/unit/test_config.py", "-k", "identity_the_wire")),
    Plant("safetensors: rollout.sink.file_mode ignored", f"{PKG}/rollout/sinks/safetensors.py",
          "            os.fchmod(fd, self.file_mode)", "            pass",
          ("tests/unit/test_sinks.py", "-k", "configured_mode")),
    Plant("cli: no warning for a token on the command line", f"{PKG}/cli.py",
          '    _warn_token_on_the_command_line(getattr(args, "overrides", None) or [])\n', "",
          ("tests/unit/test_security.py", "-k", "cli_warns")),
    # -- the receiver's failure paths (issue 18: each passed the whole suite when planted)
    Plant("receiver: a stale Prepare for the version just received answered", f"{PKG}/engine/session.py",
          "self.version is None or prepare.version > self.version",
          "self.version is None or prepare.version >= self.version",
          ("tests/integration/test_session.py", "-k", "stale_prepare")),
    Plant("receiver: the plan's bucket_size not handed to the decoder", f"{PKG}/engine/receiver.py",
          "        self._control.bucket_size = plan.group.bucket_size\n", "",
          ("tests/integration/test_session.py", "-k", "larger_than_the_plan")),
    Plant("receiver: the group kept after a protocol error", f"{PKG}/engine/receiver.py",
          "            pipeline.cancel()\n            self._fail_group()\n"
          "            await self._send_ack(plan.version, False, str(exc))",
          "            pipeline.cancel()\n            await self._send_ack(plan.version, False, str(exc))",
          ("tests/integration/test_session.py", "-k", "rebuilds_its_group")),
    Plant("session: an ack awaited from a receiver that is gone", f"{PKG}/engine/session.py",
          "                    if not await control.connected(identity):", "                    if False:",
          ("tests/integration/test_session.py", "-k", "gone_before")),
    Plant("pipeline: drain() keeps the consumer's destinations", f"{PKG}/engine/pipeline.py",
          "        self.destinations = None  # nothing more lands in the consumer's tensors\n", "",
          ("tests/integration/test_session.py", "-k", "stopped_consumer")),
    Plant("pipeline: a direct destination of the wrong dtype received into", f"{PKG}/engine/pipeline.py",
          "            or dest.dtype != meta.dtype\n", "",
          ("tests/integration/test_session.py", "-k", "wrong_dtype")),
    Plant("split: a tensor of exactly direct_min bytes packed", f"{PKG}/protocol/chunks.py",
          "if self.alone_from is not None and whole >= self.alone_from:",
          "if self.alone_from is not None and whole > self.alone_from:",
          ("tests/integration/test_session.py", "-k", "exactly_direct_min")),
    # -- durability and consistency of the sinks
    Plant("safetensors: no fsync before the rename", f"{PKG}/rollout/sinks/safetensors.py",
          "                f.flush()  # Python's buffer -> the OS, so that the fsync covers every byte\n"
          "                os.fsync(f.fileno())\n",
          "                f.flush()  # Python's buffer -> the OS, so that the fsync covers every byte\n",
          ("tests/unit/test_sink_durability.py",)),
    Plant("safetensors: template files not fsynced", f"{PKG}/rollout/sinks/safetensors.py",
          "                _fsync_file(dst)\n", "", ("tests/unit/test_sink_durability.py",)),
    Plant("safetensors: directory not fsynced after the rename", f"{PKG}/rollout/sinks/safetensors.py",
          "        _fsync_dir(self.dir)  # the new name itself survives a power loss\n", "",
          ("tests/unit/test_sink_durability.py",)),
    Plant("safetensors: keeps one version too many", f"{PKG}/rollout/sinks/safetensors.py",
          "found[: max(0, len(found) - self.keep_last)]", "found[: max(0, len(found) - self.keep_last - 1)]",
          ("tests/unit/test_sinks.py", "-k", "safetensors")),
    Plant("sink: a broken streaming version not marked incomplete", f"{PKG}/rollout/sinks/base.py",
          "        if touched_live:\n            self.state = SinkState.INCOMPLETE",
          "        if False:\n            self.state = SinkState.INCOMPLETE", ("tests/unit/test_sinks.py",)),
    Plant("receive loop: a sink error acked as success", f"{PKG}/rollout/consume.py",
          "                await receiver.ack(ok=False, error=reason[:1000])",
          "                await receiver.ack(ok=isinstance(exc, SinkError), error=reason[:1000])",
          ("tests/integration/test_daemon.py", "tests/unit/test_vllm_engine.py")),
    Plant("receive loop: the rest of a version not drained after a sink error", f"{PKG}/rollout/consume.py",
          '                        v.failed = sink_failure(exc, f"{name!r}", v.version)\n                del tensor',
          '                        v.failed = sink_failure(exc, f"{name!r}", v.version)\n'
          "                        break\n                del tensor",
          ("tests/integration/test_daemon.py", "tests/unit/test_vllm_engine.py")),
    Plant("vllm: min_receivers not checked against the servers' workers", f"{PKG}/rollout_engines/control.py",
          "        if total > self.min_receivers:", "        if total > 10**9:", ("tests/unit/test_vllm_control.py",)),
    Plant("vllm: the prefix cache reset without preempting kept requests", f"{PKG}/rollout_engines/vllm/client.py",
          "        running = self.pause_mode is PauseMode.keep", "        running = False",
          ("tests/unit/test_vllm_control.py",)),
    Plant("engine worker: receiver slots allocated at the first version", f"{PKG}/rollout_engines/worker.py",
          "WeightReceiver(own, preallocate=True)", "WeightReceiver(own)", ("tests/unit/test_vllm_engine.py",)),
    Plant("engine worker: load_weights run on the receiver's loop thread", f"{PKG}/rollout_engines/worker.py",
          "consume_version(self.receiver, sink, call=call, wait_s=wait_s)",
          "consume_version(self.receiver, sink, wait_s=wait_s)",
          ("tests/unit/test_vllm_engine.py", "tests/unit/test_sglang_loader.py")),
    Plant("sink: a failed commit still makes its version current", f"{PKG}/rollout/sinks/base.py",
          "            self._in_flight = None\n            self._after_failed_commit(version)",
          "            self._in_flight = None\n            self.version = version\n"
          "            self._after_failed_commit(version)", ("tests/unit/test_sinks.py",)),
    Plant("module sink: atomic commit without the lock", f"{PKG}/rollout/sinks/module.py",
          "with self.lock, torch.no_grad():", "with torch.no_grad():",
          ("tests/unit/test_sinks.py", "-k", "half_copied")),
    # -- when the trainer syncs, what the sender reports, what every rank gathers
    Plant("lightning: sync on a micro-batch", f"{PKG}/trainer/lightning.py",
          "if stepped and step % self.every_n_steps == 0", "if step % self.every_n_steps == 0",
          ("tests/integration/test_lightning.py", "-k", "per_optimizer_step")),
    Plant("sender: no Abort to receivers when the producer fails", f"{PKG}/engine/session.py",
          "                await self.control.send(peer.identity, Abort(version, reason[:1000]))",
          "                pass",
          ("tests/integration/test_engine.py", "-k", "aborts")),
    Plant("gather: integer tensors cast with trainer.dtype", f"{PKG}/trainer/gather.py",
          "if cast is not None and tensor.is_floating_point() and tensor.dtype != cast:",
          "if cast is not None and tensor.dtype != cast:", ("tests/integration/test_gather.py", "-k", "dtype_cast")),
    Plant("names: trainer.names.exclude ignored", f"{PKG}/trainer/names.py",
          "        if any(fnmatch.fnmatchcase(name, pat) for pat in self.exclude):", "        if False:",
          ("tests/integration/test_gather.py", "-k", "name_mapper")),
    Plant("config: trainer.every_n_steps=0 accepted", f"{PKG}/config/validate.py",
          "    if tr.every_n_steps < 1:", "    if tr.every_n_steps < 0:", ("tests/unit/test_config.py",)),
    Plant("planner: a bucket-filling direct chunk sent ahead of the packed bucket before its packed tail",
          f"{PKG}/engine/planner.py", "return not self.whole or tail_packed", "return not self.whole",
          ("tests/unit/test_planner.py", "-k", "tail_is_packed")),
    Plant("sender: every tensor counted as chunked", f"{PKG}/engine/planner.py",
          "self.counts.chunked_tensors += not meta.is_last", "self.counts.chunked_tensors += 1",
          ("tests/integration/test_engine.py", "-k", "gloo-64MiB")),
    Plant("gather: a rank skips a collective", f"{PKG}/trainer/gather.py",
          "            name = named(raw)\n            if name is None:\n                continue\n",
          "            name = named(raw)\n            if name is None:\n                continue\n"
          "            if not keep and name.endswith('bias') and isinstance(tensor, DTensor):\n"
          "                continue\n",
          ("tests/integration/test_gather.py", "-k", "distributed_gather and fsdp2")),
    # -- the GPU kit's nixl step and the cut-down NIXL wheel it carries (issue 21)
    Plant("nixl wheel: the UCX plug-in left out of the cut", "lightning_weightsync/bench/nixl_wheel.py",
          '        roots += [f"{meson_libs}plugins/libplugin_{p}.so" for p in KEPT_PLUGINS]\n', "",
          ("tests/unit/test_nixl_wheel.py",)),
    Plant("nixl wheel: the libraries a kept one links not followed", "lightning_weightsync/bench/nixl_wheel.py",
          "                    todo += by_basename[needed]", "                    pass",
          ("tests/unit/test_nixl_wheel.py", "-k", "installs_imports")),
    Plant("nixl wheel: the cut's own check removed", "lightning_weightsync/bench/nixl_wheel.py",
          "    if absent:\n        raise WheelStripError", "    if False:\n        raise WheelStripError",
          ("tests/unit/test_nixl_wheel.py", "-k", "refused")),
    Plant("nixl: a bucket released before its READ completed", f"{PKG}/transport/backends/nixl.py",
          "            self._wait_read(read)\n            self._send(done)",
          "            self._send(done)\n            self._wait_read(read)",
          ("tests/integration/test_nixl.py",)),
    Plant("device check: the raw NIXL READs not made", "lightning_weightsync/bench/device_nixl.py",
          'times.append(nixl_pieces(agent, "READ", slots, remote, peer, total, bucket, mem_type, device_id))',
          "times.append(1.0)", ("tests/integration/test_device_check.py", "-k", "complete_report")),
    # -- issue 25 item 8: failure paths that passed the whole suite when planted
    Plant("gather: FSDP1's freed views treated as stable", f"{PKG}/trainer/gather.py",
          "    return not fsdp1_units(module)", "    return True",
          ("tests/integration/test_gather.py", "-k", "distributed_gather and fsdp1")),
    Plant("driver: the gather not joined when the send never started", f"{PKG}/trainer/driver.py",
          "            for _ in weights:  # not sent (a rollout could not pause): still join the other ranks' "
          "gathers\n                pass\n", "            pass\n",
          ("tests/integration/test_driver.py", "-k", "never_started")),
    Plant("driver: every error treated as recoverable", f"{PKG}/trainer/driver.py",
          "RECOVERABLE if isinstance(error, WeightSyncError) else FATAL", "RECOVERABLE",
          ("tests/integration/test_driver.py", "-k", "bug_is_not")),
    Plant("rollout control: sessions left open when another rollout's start failed",
          f"{PKG}/rollout_engines/control.py",
          "                self._finish(started, None)  # close the sessions that did open\n", "",
          ("tests/unit/test_vllm_control.py", "-k", "start_failed")),
    Plant("config: transport.direct_min_mb=0 (documented) rejected", f"{PKG}/config/validate.py",
          "0 <= direct <= MAX_BUCKET_SIZE_MB", "0 < direct <= MAX_BUCKET_SIZE_MB",
          ("tests/unit/test_config.py", "-k", "direct_min_mb_zero")),
    # -- issue 25 items 1-2: a lost rollout costs transport.liveness_s; a signal mid-sync stops every rank
    Plant("session: a rollout that served and vanished waited out timeout_s", f"{PKG}/engine/session.py",
          "        if short and self.missing_since is not None:\n", "        if False:\n",
          ("tests/integration/test_session.py", "-k", "served_then_died")),
    Plant("session: a member gone mid-broadcast not noticed", f"{PKG}/engine/session.py",
          "                if gone is not None:\n", "                if False:\n",
          ("tests/integration/test_session.py", "-k", "frozen")),
    Plant("torch_pg: a broken group destroyed on the event loop", f"{PKG}/transport/backends/torch_pg.py",
          "            thread.start()\n        super().broken()", "            _let_go(box)\n        super().broken()",
          ("tests/integration/test_session.py", "-k", "frozen")),
    Plant("driver: the per-version INFO line left to Python's last-resort handler", f"{PKG}/trainer/driver.py",
          "        show_logs()\n", "", ("tests/integration/test_driver.py", "-k", "shown")),
    Plant("driver: every skipped version logged (on_failure=warn)", f"{PKG}/trainer/driver.py",
          "        if self._failing_since is None:", "        if True:",
          ("tests/integration/test_driver.py", "-k", "warn_with")),
    Plant("shard verify: a sender's range not compared where it landed", f"{PKG}/engine/shard_verify.py",
          "            if got != want:", "            if False:",
          ("tests/integration/test_sharded_verify.py", "-k", "corrupted_shard")),
    Plant("shard verify: a shard fingerprinted as nothing (sharded versions unverified)", f"{PKG}/engine/verify.py",
          "fingerprint(tensor.data if isinstance(tensor, TensorShard) else tensor)",
          "(NO_FINGERPRINT if isinstance(tensor, TensorShard) else fingerprint(tensor))",
          ("tests/integration/test_sharded_verify.py", "-k", "corrupted_shard")),
    Plant("side gather: the mirror reuses the model's own (training) groups", f"{PKG}/trainer/side_gather.py",
          "        groups = [self._groups[(ranks, device_type)] for ranks in _dim_ranks(mesh)]",
          "        groups = [mesh.get_group(d) for d in range(mesh.ndim)]",
          ("tests/integration/test_side_gather.py",)),
    Plant("side gather: a staged shard rebuilt without its global shape (uneven shards)",
          f"{PKG}/trainer/side_gather.py", "run_check=False, shape=self.shape, stride=self.stride",
          "run_check=False", ("tests/integration/test_side_gather.py",)),
    Plant("overlap: a non-sending rank does not take part in the background gather", f"{PKG}/trainer/overlap.py",
          "        if sender is None and not snapshot.gathers:", "        if sender is None:",
          ("tests/integration/test_overlap.py", "-k", "wait_every")),
    Plant("interrupt: the sending rank not told of another rank's signal", f"{PKG}/trainer/interrupt.py",
          "            if self.on_stop is not None and not self._stopped and self._store is not None:",
          "            if False:", ("tests/integration/test_signals.py", "-k", "lightning and fsdp2-r1")),
    Plant("lightning: a signal that stopped a sync sent into Lightning's handler", f"{PKG}/trainer/lightning.py",
          "        connector.received_sigterm = True  # type: ignore[union-attr]\n        return\n", "",
          ("tests/integration/test_signals.py", "-k", "lightning and fsdp2-r0")),
    # -- issue 25 items 1, 3, 4: the daemon's side of a stop, a full disk, a missing trainer
    Plant("consume: a stop cancels the commit under way (abort beside it)", f"{PKG}/rollout/consume.py",
          "                await asyncio.shield(commit)", "                await commit",
          ("tests/integration/test_daemon.py", "-k", "slow_callable_commit")),
    Plant("consume: a sink's OSError (ENOSPC) crashes the daemon", f"{PKG}/rollout/consume.py",
          "                    except (SinkError, OSError) as exc:\n"
          '                        v.failed = sink_failure(exc, f"{name!r}", v.version)',
          "                    except SinkError as exc:\n                        v.failed = exc",
          ("tests/integration/test_daemon.py", "-k", "full_disk")),
    Plant("consume: no nack when the daemon stops mid-version", f"{PKG}/rollout/consume.py",
          "isinstance(exc, (SinkError, asyncio.CancelledError))", "isinstance(exc, SinkError)",
          ("tests/integration/test_daemon.py", "-k", "stop_mid_version")),
    Plant("sharded: an overlap between senders not checked", f"{PKG}/protocol/tiling.py",
          "            if neighbour[0] < end and start < neighbour[1]:", "            if False:",
          ("tests/unit/test_tiling.py",)),
    Plant("sharded: a gap left at the end of the version", f"{PKG}/protocol/tiling.py",
          "        if not self.open:\n            return\n", "        return\n",
          ("tests/unit/test_tiling.py",)),
    Plant("sharded: a bucket's sender not checked against its stream", f"{PKG}/engine/pipeline.py",
          "                if meta.sender != self.sender:", "                if False:",
          ("tests/integration/test_sharded.py", "-k", "claiming")),
    Plant("sharded: a sender gone between buckets waits out timeout_s", f"{PKG}/engine/session.py",
          "                if not linked and since >= self.control.liveness_s:", "                if False:",
          ("tests/integration/test_sharded.py", "-k", "killed")),
    # -- issue 31: the sharded receive, through real sender processes that lie (tests/support/lying.py)
    Plant("sharded: the receiver's tiling loop skips the end-of-version gap check", f"{PKG}/engine/sharded.py",
          "        merger.finish()\n", "", ("tests/integration/test_sharded.py", "-k", "lying")),
    Plant("sharded: senders disagreeing on a tensor's dtype merged", f"{PKG}/protocol/tiling.py",
          "elif meta.shape != tile.meta.shape or meta.dtype != tile.meta.dtype:", "elif meta.shape != tile.meta.shape:",
          ("tests/unit/test_tiling.py", "tests/integration/test_sharded.py", "-k", "disagreeing or lying")),
    Plant("sharded: a secondary sender whose plan lists other senders accepted", f"{PKG}/engine/sharded.py",
          "        if got.version != version or got.senders:", "        if got.version != version:",
          ("tests/integration/test_sharded.py", "-k", "lying")),
    Plant("sharded: a refused sender's group kept (it broadcasts until timeout_s)", f"{PKG}/engine/sharded.py",
          "            sub.give_up_group()  # it joined", "            pass  # it joined",
          ("tests/integration/test_sharded.py", "-k", "lying")),
    # -- issue 34: who sends what, from the placements and the mesh
    Plant("sharded: every copy of a submesh sends (a replica sending too)", f"{PKG}/trainer/sharded.py",
          "self.holders.append((len(these) * held.replicas, copy * held.replicas + held.replica))",
          "self.holders.append((held.replicas, held.replica))",
          ("tests/integration/test_sharded_layouts.py", "-k", "two_rank")),
    Plant("sharded: HSDP's replicate dim not counted (both replicas send)", f"{PKG}/trainer/sharded.py",
          "replicas, replica = replicas * mesh.size(dim), replica * mesh.size(dim) + coordinate[dim]",
          "replicas, replica = replicas, replica", ("tests/integration/test_sharded_layouts.py", "-k", "hsdp")),
    Plant("sharded: whole tensors not compared across ranks", f"{PKG}/trainer/sharded.py",
          "            if None in values or len(set(values)) == 1:", "            if True:",
          ("tests/integration/test_sharded_layouts.py", "-k", "two_rank")),
    Plant("sharded: a Shard(1) strided box sent as one byte range", f"{PKG}/trainer/sharded.py",
          "        if any(size != 1 for size in shape[: placement.dim]):", "        if False:",
          ("tests/integration/test_sharded_layouts.py", "-k", "two_rank")),
    Plant("sharded: a Partial tensor sent as if replicated", f"{PKG}/trainer/sharded.py",
          "        if isinstance(placement, Replicate):\n            continue",
          "        if isinstance(placement, Replicate) or type(placement).__name__ == \"Partial\":\n"
          "            continue",
          ("tests/integration/test_sharded_layouts.py", "-k", "two_rank")),
    Plant("daemon: silent while no trainer connects", f"{PKG}/rollout/daemon.py",
          "            elif not connected and for_s >= warn_at:", "            elif False:",
          ("tests/integration/test_daemon.py", "-k", "without_a_trainer")),
    # -- issue 23: SGLang rollouts on the rollout-engine seam
    Plant("sglang: a dp_size > 1 server driven anyway", f"{PKG}/rollout_engines/sglang/client.py",
          "        if dp != 1:", "        if False:", ("tests/unit/test_sglang_control.py", "-k", "dp_size")),
    Plant("sglang launcher: a dp_size > 1 server started", f"{PKG}/rollout_engines/sglang/launch.py",
          '    if dp is not None and dp.strip() != "1":', "    if False:",
          ("tests/unit/test_sglang_launch.py", "-k", "limits")),
    Plant("sglang: the session left open after a failed update", f"{PKG}/rollout_engines/sglang/client.py",
          "            self._end_quietly()\n", "", ("tests/unit/test_sglang_control.py", "-k", "failed_update")),
    Plant("sglang: a failed version keeps the weight_version SGLang recorded",
          f"{PKG}/rollout_engines/sglang/client.py",
          "            self.http.request(api.SET_VERSION, marked)\n", "",
          ("tests/unit/test_sglang_control.py", "-k", "failed_send")),
    Plant("sglang: the reported weight_version not checked", f"{PKG}/rollout_engines/sglang/client.py",
          "        if held != str(version):", "        if False:",
          ("tests/unit/test_sglang_control.py", "-k", "does_not_report")),
    Plant("sglang loader: a failed version raised into SGLang's scheduler", f"{PKG}/rollout_engines/sglang/loader.py",
          "    except Exception as exc:  # never into SGLang's scheduler loop: the trainer hears it from our nack",
          "    except ConfigError as exc:", ("tests/unit/test_sglang_loader.py", "-k", "failing_load")),
    Plant("rollout control: sessions of a broken version left open", f"{PKG}/rollout_engines/control.py",
          "                self._finish(loaded, None)  # an engine that took a broken version closes its session "
          "unversioned\n", "", ("tests/unit/test_sglang_control.py", "-k", "failed_send")),
    # -- issue 22, verify: each check removed in turn
    Plant("verify: the receiver does not check merged tensors", f"{PKG}/engine/receiver.py",
          "                verifier.check(name, tensor)  # before the consumer sees it", "                pass  #",
          ("tests/integration/test_verify.py", "-k", "flipped_byte_is_caught and module-gloo")),
    Plant("verify: the sender sends no fingerprints", f"{PKG}/engine/sender.py",
          "transforms=(sent.fingerprints.stamp, sent.delta.transform)", "transforms=(sent.delta.transform,)",
          ("tests/integration/test_verify.py", "-k", "flipped_byte_is_caught and callable-shm")),
    Plant("verify: fingerprint rows not weighted by position", f"{PKG}/protocol/fingerprint.py",
          ".mul_(2).add_(1)", ".mul_(0).add_(1)", ("tests/unit/test_fingerprint.py",)),
    Plant("verify: the length not in the fingerprint", f"{PKG}/protocol/fingerprint.py",
          "(total + nbytes * GOLDEN) & MASK", "total & MASK", ("tests/unit/test_fingerprint.py",)),
    Plant("decoder: fingerprints not one per entry", MESSAGES,
          "if len(msg.fingerprints) != len(msg.entries):", "if False:", FUZZ),
    Plant("verify: /weights does not recheck the held tensors", f"{PKG}/rollout/held.py",
          "if snapshot is not None and report.checksums:", "if False:",
          ("tests/integration/test_verify.py", "-k", "daemon_says")),
    # -- issue 22, delta
    Plant("delta: sent to a receiver that does not hold its base", f"{PKG}/engine/sender.py",
          "        usable = usable and all(self._steps.readies[p.identity].delta_base == base.version for p in peers)"
          "\n", "",
          ("tests/integration/test_delta.py", "-k", "new_receiver and atomic")),
    Plant("delta: the sender's copy kept after a version that broke mid-stream", f"{PKG}/engine/sender.py",
          "                self._delta_base.invalidate()  # the copy may be part-updated", "                pass  #",
          ("tests/integration/test_delta.py", "-k", "broke_mid_stream")),
    Plant("delta: auto never falls back to whole versions", f"{PKG}/engine/sender.py",
          "if usable and mode is DeltaMode.auto and base.prefer_whole():", "if False:",
          ("tests/integration/test_delta.py", "-k", "falls_back")),
    Plant("delta: payload indices not range-checked", f"{PKG}/engine/delta.py",
          "if count and (index.max() >= numel or", "if count and (False or",
          ("tests/unit/test_delta.py", "-k", "hostile")),
    Plant("decoder: a delta payload not smaller than its tensor", MESSAGES,
          "if not (0 < size < nbytes) or e.chunk_offset + e.chunk_size > size:",
          "if e.chunk_offset + e.chunk_size > size:", ("tests/unit/test_messages.py", "-k", "delta")),
    # -- rollout engines (issue 20)
    Plant("engine worker: no registration between versions", f"{PKG}/rollout_engines/worker.py",
          "            if self._receiving:\n                continue", "            if True:\n                continue",
          ("tests/unit/test_vllm_engine.py", "-k", "restarted")),
    Plant("vllm http client: the workers' reports not checked", f"{PKG}/rollout_engines/vllm/client.py",
          "problems = [p for report in reports for p in weight_problems(self.name, version, report, None)]",
          "problems: list[str] = []", ("tests/unit/test_vllm_control.py", "-k", "verify")),
    Plant("vllm engine: a server's workers do not agree on a version", f"{PKG}/rollout_engines/vllm/worker.py",
          "        group = self._server_group()\n", "        group = None\n",
          ("tests/integration/test_vllm_server_rollback.py",)),
    Plant("vllm engine: a failed version not rolled back", f"{PKG}/rollout_engines/vllm/worker.py",
          "lost = self._host_copy.restore(self.model)", "lost: list[str] = []",
          ("tests/integration/test_vllm_server_rollback.py",)),
    # -- issue 31: behaviours the suite let through (each with a test written for it)
    Plant("router: a send to a peer that stops reading retried forever", f"{PKG}/transport/control/router.py",
          "self._try(self._blocked[0], give_up=time.monotonic() >= self._blocked[0].deadline)",
          "self._try(self._blocked[0], give_up=False)", ("tests/unit/test_router.py",)),
    Plant("receiver session: the next bucket's wait bounded by timeout_s, not liveness_s", f"{PKG}/engine/session.py",
          "if not linked and since >= self.control.liveness_s:", "if not linked and since >= timeout_s:",
          ("tests/integration/test_session.py", "-k", "killed_between")),
    Plant("host copy: a refused copy leaves the older one to restore", f"{PKG}/rollout_engines/host_copy.py",
          "        self.taken = False\n        live = _live_tensors(model)\n",
          "        live = _live_tensors(model)\n",
          ("tests/unit/test_host_copy.py",)),
    Plant("vllm engine: a worker cut off from the agreement keeps the version", f"{PKG}/rollout_engines/vllm/worker.py",
          "return max(1, int(not ok))", "return int(not ok)",
          ("tests/unit/test_vllm_engine.py", "tests/integration/test_vllm_server_rollback.py")),
    Plant("engine worker: re-registers in the middle of a version", f"{PKG}/rollout_engines/worker.py",
          "            if self._receiving:\n                continue",
          "            if False:\n                continue",
          ("tests/unit/test_vllm_engine.py",)),
    Plant("held layout: a named bucket's size not checked against the held one", f"{PKG}/protocol/layout.py",
          "        if held is None or (held.nbytes, held.is_last) != (meta.nbytes, meta.is_last):",
          "        if held is None:", ("tests/unit/test_layout.py",)),
    Plant("held layout: per-entry fields not validated against the held entries", f"{PKG}/protocol/layout.py",
          "        validate_per_entry(expanded)\n", "", ("tests/unit/test_layout.py",)),
    Plant("held layout: a bucket names a layout and lists entries", MESSAGES,
          "    if msg.layout and msg.entries:", "    if False:", ("tests/unit/test_layout.py",)),
    # -- issue 43: LoRA variants, layout/planner/delta/verify, version rules, the previous round's survivors
    Plant("lora: trainer.lora=merged takes a lora_bias adapter (merged without the bias)", f"{PKG}/trainer/lora.py",
          "mergeable=isinstance(mod, linear) and not variant and not lora_bias,",
          "mergeable=isinstance(mod, linear) and not variant,", (LORA_UNIT, "-k", "lora_bias")),
    Plant("lora: a resumed run's failed base version counted as delivered", f"{PKG}/trainer/lora.py",
          "self._base_pending, self._record_before = True, self.record.last_synced_version",
          "self._base_pending, self._record_before = True, None", (LORA_UNIT, "-k", "resumed")),
    Plant("lora: bf16 factors multiplied in bf16 on a CPU (PEFT: fp32)", f"{PKG}/protocol/lora.py",
          "dtype in (torch.float16, torch.bfloat16)", "dtype == torch.float16", (LORA_UNIT, "-k", "bf16")),
    Plant("lora merge sink: rsLoRA ignored (alpha / r)", f"{PKG}/rollout/sinks/lora.py",
          "lora_scaling(self.spec.lora_alpha, self.spec.r, use_rslora=self.spec.use_rslora)",
          "lora_scaling(self.spec.lora_alpha, self.spec.r)", (LORA_UNIT, "-k", "rslora")),
    Plant("lora merge sink: fan_in_fan_out factors checked against the untransposed weight",
          f"{PKG}/rollout/sinks/lora.py", "out_f, in_f = live.shape[::-1] if self.spec.fan_in_fan_out else live.shape",
          "out_f, in_f = live.shape", (LORA_UNIT, "-k", "fan_in_fan_out")),
    Plant("held layout: a bucket whose is_last changed named by reference", f"{PKG}/protocol/layout.py",
          "self.nbytes == nbytes and self.is_last == is_last and self.entries == entries",
          "self.nbytes == nbytes and self.entries == entries",
          ("tests/unit/test_layout.py", "-k", "no_longer or stops_or_starts")),
    Plant("shard verify: a partly fingerprint-checked tensor reported verified", f"{PKG}/engine/shard_verify.py",
          "        if covered == data.numel():", "        if covered:", ("tests/unit/test_shard_verify.py",)),
    Plant("sharded delta: a payload chunk out of order or repeated stitched", f"{PKG}/engine/sharded.py",
          "        if meta.chunk_offset != got or data.numel() != meta.chunk_size:",
          "        if data.numel() != meta.chunk_size:",
          ("tests/integration/test_sharded_delta.py", "-k", "out_of_order")),
    Plant("delta: a payload with repeated indices accepted", f"{PKG}/engine/delta.py",
          "(np.diff(index) > 0).all()", "(np.diff(index) >= 0).all()",
          ("tests/unit/test_delta.py", "-k", "hostile")),
    Plant("delta: a payload exactly at the limit sent as a delta", f"{PKG}/engine/delta.py",
          "    if size >= max_payload:", "    if size > max_payload:",
          ("tests/unit/test_delta.py", "-k", "at_the_limit")),
    Plant("planner: a packed bucket [tail of X, whole Y] counted as whole tensors", f"{PKG}/engine/planner.py",
          "self.whole = (self.whole or not self.entries) and meta.is_first and meta.is_last",
          "self.whole = meta.is_first and meta.is_last",
          ("tests/unit/test_planner.py", "-k", "goes_out_before_a_direct_chunk")),
    Plant("session: a consumer that keeps nothing advertises its last version as delta base",
          f"{PKG}/engine/session.py",
          "        if self.keeps:\n            self.held = version if ok",
          "        if True:\n            self.held = version if ok",
          ("tests/integration/test_session.py", "-k", "keeps_nothing")),
    Plant("tiling: a chunk at a negative offset accepted", f"{PKG}/protocol/tiling.py",
          "        if start < 0 or end > nbytes:", "        if end > nbytes:", ("tests/unit/test_tiling.py",)),
    Plant("tiling: a trailing one-byte gap not named", f"{PKG}/protocol/tiling.py",
          "        if at < tile.meta.nbytes:", "        if at < tile.meta.nbytes - 1:", ("tests/unit/test_tiling.py",)),
    Plant("sender inbox: a trim frees nothing beyond the cap", f"{PKG}/transport/control/inbox.py",
          "        target = int(self.total_bytes * TRIM_TO)", "        target = self.total_bytes",
          ("tests/unit/test_inbox.py",)),
    Plant("router: a message read by a send on the loop wakes nobody", f"{PKG}/transport/control/router.py",
          "            self._arrived.set()  # a send on the loop read it",
          "            pass  # a send on the loop read it",
          ("tests/unit/test_router.py",)),
    Plant("host copy: a dtype-changed tensor restored with a cast", f"{PKG}/rollout_engines/host_copy.py",
          "if copy is None or copy.shape != tensor.shape or copy.dtype != tensor.dtype:",
          "if copy is None or copy.shape != tensor.shape:", ("tests/unit/test_host_copy.py",)),
    Plant("config: transport.liveness_s unbounded (0.001 s or a week)", f"{PKG}/config/validate.py",
          '    "transport.liveness_s": (0.2, 3600.0),\n', "", ("tests/unit/test_config.py", "-k", "liveness")),
    # -- issue 43: overlap and the side gather, each failure path in real processes (one run, a case each)
    Plant("overlap: each rank skips or settles on its own busy flag, not the agreed one", OVERLAP,
          "        if busy_any:\n            if signum:", "        if busy:\n            if signum:",
          (OVERLAP_TESTS, "-k", "ranks_agree")),
    Plant("overlap: a staging buffer reused after its tensor's shape or dtype changed", OVERLAP,
          "if buf is None or buf.shape != src.shape or buf.dtype != dtype:", "if buf is None:",
          (OVERLAP_TESTS, "-k", "changes_shape_or_dtype")),
    Plant("overlap: a rank whose snapshot copy failed stops consuming the gather stream", OVERLAP,
          "                continue  # still join the other ranks' all-gathers",
          "                break  # still join the other ranks' all-gathers", (OVERLAP_TESTS, "-k", "snapshot_that")),
    Plant("overlap: a failed copy's shard still handed to the mirror exchange (background gather)", OVERLAP,
          "                    local = self.staging.copy(name, item.tensor.to_local(), item.dtype)\n"
          "                    pending.append((len(snap.items), item))\n",
          "                    pending.append((len(snap.items), item))\n"
          "                    local = self.staging.copy(name, item.tensor.to_local(), item.dtype)\n",
          (OVERLAP_TESTS, "-k", "snapshot_that")),
    Plant("overlap: the sending rank stops gathering when its send fails (before the sender drains)", OVERLAP,
          "            drain(stream)  # whatever failed: the other ranks' gathers of the rest need this rank's",
          "            pass", (OVERLAP_TESTS, "-k", "send_failing")),
    Plant("overlap: close() waits for a send in flight instead of interrupting it", OVERLAP,
          '            self._interrupt("the trainer closed (training ended or failed) while',
          "            pass  # (", (OVERLAP_TESTS, "-k", "close_with")),
    Plant("side gather: a rank with no new mesh skips the collective group exchange", f"{PKG}/trainer/side_gather.py",
          "        if not int(flag.item()):", "        if not needed:",
          ("tests/integration/test_side_gather.py", "-k", "new_to_one_rank")),
]  # fmt: skip


def _dirty(paths: set[str]) -> list[str]:
    cmd = ["git", "status", "--porcelain", "--", *sorted(paths)]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if line.strip()]


def run(plant: Plant) -> tuple[bool, str]:
    """(caught, the first failure line) for one plant; the file is restored before returning."""
    target = REPO / plant.path
    original = target.read_text()
    if original.count(plant.old) != 1:
        return False, f"the text to replace occurs {original.count(plant.old)} times in {plant.path} (update the plant)"
    try:
        target.write_text(original.replace(plant.old, plant.new))
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *plant.tests],
            cwd=REPO, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    finally:
        target.write_text(original)
    lines = proc.stdout.splitlines()
    first = next((ln.strip() for ln in lines if ln.startswith("E ")), lines[-1] if lines else "")
    return proc.returncode != 0, first[:200]


def main(argv: list[str]) -> int:
    chosen = [p for p in PLANTS if not argv or any(a in p.name for a in argv)]
    dirty = _dirty({p.path for p in chosen})
    if dirty:
        print("refusing to plant into files with uncommitted changes:\n  " + "\n  ".join(dirty))
        return 2
    missed = 0
    for plant in chosen:
        t0 = time.monotonic()
        caught, detail = run(plant)
        missed += not caught
        verdict = "CAUGHT" if caught else "MISSED"
        print(f"{verdict}  {plant.name:52s} {time.monotonic() - t0:5.1f}s  {detail}", flush=True)
    if _dirty({p.path for p in chosen}):
        print("a planted file was not restored: check `git diff`")
        return 1
    print(f"{len(chosen) - missed} of {len(chosen)} plants caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
