"""`nixl`: one-sided transfers through NVIDIA NIXL (UCX underneath: RDMA, NVLink, CUDA IPC, shared memory
or TCP, whichever UCX finds between two agents), host or device memory, any hosts.

How a bucket moves (receivers pull: READ):
  sender    registers its two slots with its NIXL agent once (at `setup`) and puts the agent's metadata and
            the slots' addresses into the plan (`NixlJoin`, signed like every control message). Bucket k is
            packed into slot k % NUM_SLOTS, its metadata published, and `broadcast` then only waits until
            every member *released* bucket k (nothing is posted by the sender).
  receiver  `broadcast` READs the first nbytes of the sender's slot k % NUM_SLOTS into its own slot, or
            straight into the consumer's destination tensor (`direct_ok`: a bucket that is one chunk), and
            when the READ completed sends a signed `BucketDone` to the sender's release socket (ZeroMQ).
So the sender repacks a slot only when every receiver has finished reading it (never while one still
reads); a receiver's own slots are its own. A receiver's `start_broadcast` only posts the READ and returns
its wait (which sends the release once the READ completed), so the engine's data-plane thread posts bucket
k+1's READ while bucket k's is still moving (both of the sender's slots in flight). Measured with `python -m
lightning_weightsync.bench.nixl --bucket-mb 16` (244 MiB stream, 2-core machine under a load of 5-7), four
interleaved runs each: 0.98-1.58 s/GiB with each READ waited before the next was posted, 0.54-0.81 s/GiB
posted ahead (ratio to raw NIXL READ 0.07-0.14 -> 0.13-0.37; gloo in the same runs 1.3-2.4 s/GiB both times).
Receivers do not move in lockstep: each one reads at its own pace, and a slow one holds the others back by
at most the slots (the sender cannot repack slot k % 2 before the slowest receiver read bucket k).

Why READ and not WRITE (the sender pushing into every receiver's slot): measured, the two are the same
speed (DRAM to DRAM between two processes over UCX, 2-core CI machine, `python -m
lightning_weightsync.bench.nixl`: READ 11.4 GB/s, WRITE 11.3 GB/s in 16 MiB pieces; 4.0 vs 3.1 GB/s with
NIXL's progress thread on), so the design decides: only the sender's metadata has to travel (in the plan),
none comes back from the receivers; with N receivers each drives its own transfer instead of the sender
posting N writes per bucket and waiting for the slowest; a receiver's direct destination is registered by
the receiver and never described to anyone; and a WRITE could only go into a receiver slot the receiver had
released, one more round trip per bucket.

Direct transfers, and registration: the receiver READs a one-chunk bucket straight into the consumer's
tensor; that tensor's storage is registered with NIXL once and cached (keyed by the storage's address and
size, with a weak reference that tells a freed storage from a new one at the same address; bounded LRU),
so destinations that live across versions (a module's parameters) are registered on the first version
only. The sender always packs (`direct_ok` is False on the sender): a receiver could READ a caller's
tensor only if each bucket's metadata carried its address, and a gathered tensor is new memory every
version, so its registration could not be cached. Registration is cheap on host memory without RDMA
NICs (measured 0.1-0.3 ms for 1-256 MiB here: UCX pins nothing); with RDMA NICs or GPU memory it pins
pages, which is why destinations are registered once and cached.

Progress: NIXL's own progress thread busy-polls UCX (a full core per process, for the life of the agent,
measured), so agents run without it: a receiver drives its transfer by checking it, and the sender drives
its UCX worker while it waits for releases (every PROGRESS_POLL_S), which is exactly when receivers READ
its slots. Without the thread, a 64 MiB READ went from 3.0-4.0 to 6.1 GB/s (2-core machine) and an idle
sender costs no CPU.

Failure detection: the release socket (ZeroMQ PULL) is monitored. Every receiver announces itself on it
(a signed `Ready`) when it joins; a receiver whose connection drops (its process died: the kernel closes
the socket; its host went silent: TCP keepalive drops the link) while the sender waits for its release fails
the bucket at once with a `PeerError` naming it, instead of after transport.timeout_s. A receiver whose
sender died sees its READ fail (or time out after transport.timeout_s).

Security: metadata and slot addresses travel only in the plan (signed with transport.auth_token, validated
like every message, bounded sizes); releases are signed too. The data plane itself (UCX) is not
authenticated: like the gloo store without a token, use it on networks you trust.

The dependency is the optional extra `[nixl]` (nixl-cu12; nixl-cu13 for a CUDA-13 torch), imported when a
nixl backend is built.
"""

from __future__ import annotations

import collections
import logging
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from ...errors import BackendUnavailable, ConfigError, PeerError, ProtocolError, WeightSyncError, WeightSyncTimeout
from ...protocol.joins.nixl import NixlJoin, NixlRegion
from ...protocol.messages import (
    MAX_FRAME_TO_RECEIVER,
    MAX_FRAME_TO_SENDER,
    BucketDone,
    GroupSpec,
    Ready,
    decode,
    encode,
)
from ..droplog import DropLog
from ..sockets import network_options
from .base import NUM_SLOTS, Backend

logger = logging.getLogger(__name__)

MAX_CACHED_REGISTRATIONS = 4096  # destination storages kept registered (LRU beyond)
PROGRESS_POLL_S = 0.001  # a sender waiting for releases drives its UCX worker this often (see below)


def import_nixl() -> tuple[Any, Any]:
    """`(nixl_agent, nixl_agent_config)` from the installed NIXL: the `nixl` meta package when present
    (it picks the CUDA variant), else the variant matching torch's CUDA, else any variant."""
    cuda_major = (torch.version.cuda or "").split(".")[0]
    candidates = ["nixl._api", f"nixl_cu{cuda_major}._api", "nixl_cu13._api", "nixl_cu12._api"]
    errors = []
    for name in dict.fromkeys(c for c in candidates if c != "nixl_cu._api"):
        try:
            module = __import__(name, fromlist=["nixl_agent"])
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        if not os.environ.get("NIXL_LOG_LEVEL"):  # NIXL logs every agent at INFO to stdout
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return module.nixl_agent, module.nixl_agent_config
    raise BackendUnavailable(
        "transport.backend=nixl needs NIXL: pip install 'lightning-weightsync[nixl]' (nixl-cu12, for CPU torch or "
        "CUDA 12; for a CUDA-13 torch install nixl-cu13 instead) (" + "; ".join(errors) + ")"
    )


def _mem_type(device: torch.device) -> str:
    if device.type == "cpu":
        return "DRAM"
    if device.type == "cuda":
        return "VRAM"
    raise ConfigError(f"transport.backend=nixl moves cpu or cuda memory, not {device} (transport.device)")


def _device_id(device: torch.device) -> int:
    return (device.index or 0) if device.type == "cuda" else 0  # NIXL wants 0 for host memory


@dataclass
class _Read:
    """A posted READ: what its wait needs to see it through."""

    agent: Any
    handle: Any  # nixl_xfer_handle
    state: str  # as `transfer` returned it: "PROC" or "DONE"
    epoch: int  # the group's; a dropped group abandons the wait
    deadline: float  # time.monotonic()
    bucket_index: int


@dataclass
class _Registration:
    storage: weakref.ref[Any]
    descs: Any  # nixlRegDList, for deregister_memory


class NixlBackend(Backend):
    """One-sided READs of the sender's registered slots through NIXL (see the module docstring)."""

    name = "nixl"
    natural_device = "cpu"
    join_type = NixlJoin
    agent_classes = staticmethod(import_nixl)  # for code that drives NIXL agents itself (bench/nixl.py)

    def __init__(self, **kwargs: Any) -> None:
        self._nixl_agent_cls, self._nixl_config_cls = import_nixl()
        super().__init__(**kwargs)
        self.mem_type = _mem_type(self.device)
        # Receivers READ one-chunk buckets straight into the consumer's tensors; the sender always packs.
        self.direct_ok = not self.is_sender
        self._lock = threading.RLock()  # the agent is not thread-safe
        # A sender's release wait still running on an executor thread given up after a failure may overlap
        # the next group's wait on the new thread (or close()): a ZeroMQ socket must not be used by both.
        self._socket_lock = threading.Lock()
        self._agent: Any = None
        self._agent_name = ""
        self._slot_regs: Any = None
        self._metadata = b""
        self._remote_agent = ""  # receiver: the sender's agent, loaded from the plan
        self._remote_metadata = b""
        self._remote_slots: list[NixlRegion] = []
        self._remote_mem_type = "DRAM"
        self._registrations: collections.OrderedDict[tuple[int, int], _Registration] = collections.OrderedDict()
        self._ctx: zmq.Context[Any] | None = None
        self._socket: zmq.Socket[Any] | None = None
        self._monitor: zmq.Socket[Any] | None = None
        self._release_addr = ""
        self._released: dict[tuple[int, int], set[str]] = {}  # (version, bucket index) -> who released it
        self._fd_of: dict[str, int] = {}  # sender: member identity -> the fd its releases arrive on
        self._gone: set[str] = set()  # sender: members whose release connection dropped
        self._epoch = 0  # bumped by broken()/close(): waits of an abandoned group give up
        self._drops = DropLog("nixl: dropped a bad release message", log=logger)
        # measured, read by the benchmark: registrations made, their seconds, cache hits
        self.registrations = 0
        self.registration_s = 0.0
        self.registration_hits = 0

    # -- the agent ----------------------------------------------------------------------------
    def _ensure_agent(self) -> Any:
        if self._agent is None:
            role = "sender" if self.is_sender else f"receiver-{self.identity[:64]}"
            self._agent_name = f"lws-{role}-{os.getpid()}-{secrets.token_hex(4)}"
            try:
                config = self._nixl_config_cls(enable_prog_thread=False, backends=["UCX"])
                self._agent = self._nixl_agent_cls(self._agent_name, config)
            except Exception as exc:  # RuntimeError (no plugins), nixlBind errors
                raise BackendUnavailable(f"nixl: could not create a NIXL agent with the UCX backend: {exc}") from exc
            if "UCX" not in self._agent.backends:
                raise BackendUnavailable("nixl: this NIXL has no UCX plug-in (nixl-cu12 / nixl-cu13 wheels ship it)")
        return self._agent

    def _register(self, tensors: list[torch.Tensor]) -> Any:
        start = time.perf_counter()
        regions = [(t.data_ptr(), t.numel() * t.element_size(), _device_id(t.device), "") for t in tensors]
        descs = self._ensure_agent().register_memory(regions, self.mem_type)
        self.registrations += len(tensors)
        self.registration_s += time.perf_counter() - start
        return descs

    # -- set-up -------------------------------------------------------------------------------
    def setup(self, host: str, store_port: int) -> None:
        super().setup(host, store_port)  # the two slots
        with self._lock:
            self._slot_regs = self._register(self.buckets)
            self._metadata = bytes(self._agent.get_agent_metadata())
        self._ctx = zmq.Context.instance()
        socket = self._ctx.socket(zmq.PULL)
        socket.linger = 0
        network_options(socket, max_frame_bytes=MAX_FRAME_TO_SENDER)  # TCP liveness, no ZMTP heartbeats
        try:
            if store_port:
                socket.bind(f"tcp://{host}:{store_port}")
                port = store_port
            else:
                port = socket.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            socket.close(linger=0)
            raise ConfigError(
                f"nixl: cannot listen on {host}:{store_port} for bucket releases ({exc}); "
                "set transport.store_port to a free port (0: any) or transport.host to a local address"
            ) from exc
        self._socket = socket
        self._monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._release_addr = f"tcp://{host}:{port}"
        logger.debug("nixl agent %s: slots registered, releases on %s", self._agent_name, self._release_addr)

    def join_spec(self, generation: int) -> NixlJoin:
        if self._socket is None or not self._metadata:
            raise WeightSyncError("nixl: join_spec() before setup() (the sender sets up at start())")
        slots = [NixlRegion(b.data_ptr(), b.numel(), _device_id(b.device)) for b in self.buckets]
        return NixlJoin(self._agent_name, self._metadata, self.mem_type, slots, self._release_addr)

    def _receiver_buckets(self, group: GroupSpec) -> list[torch.Tensor]:
        buckets = super()._receiver_buckets(group)
        with self._lock:
            self._ensure_agent()
            if self._slot_regs is not None:
                self._agent.deregister_memory(self._slot_regs)
            self._slot_regs = self._register(buckets)
        return buckets

    def _build_group(self, group: GroupSpec, rank: int) -> None:
        if self.is_sender:
            return
        join = group.join
        assert isinstance(join, NixlJoin)  # checked by Backend.join
        if len(join.slots) != NUM_SLOTS or any(s.nbytes < group.bucket_size for s in join.slots):
            raise ProtocolError(
                f"plan for backend nixl has {len(join.slots)} slots of {[s.nbytes for s in join.slots]} bytes, "
                f"expected {NUM_SLOTS} of at least bucket_size={group.bucket_size}"
            )
        with self._lock:
            if (join.agent, join.metadata) != (self._remote_agent, self._remote_metadata):
                if self._remote_agent:
                    self._agent.remove_remote_agent(self._remote_agent)
                    self._remote_agent, self._remote_metadata = "", b""
                try:
                    loaded = self._agent.add_remote_agent(join.metadata)
                except Exception as exc:  # nixlBind errors: metadata NIXL cannot parse or use
                    raise PeerError(f"nixl: cannot load the sender's agent metadata ({exc})") from exc
                loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
                if loaded != join.agent:
                    self._agent.remove_remote_agent(loaded)
                    raise ProtocolError(f"nixl plan names agent {join.agent[:64]!r}, its metadata is {loaded[:64]!r}")
                self._remote_agent, self._remote_metadata = join.agent, join.metadata
            self._remote_slots, self._remote_mem_type = list(join.slots), join.mem_type
        if self._release_addr != join.release_addr or self._socket is None:
            self._close_sockets()
            self._ctx = zmq.Context.instance()
            socket = self._ctx.socket(zmq.PUSH)
            socket.linger = 1000
            socket.sndtimeo = int(self.timeout_s * 1000)  # a gone sender cannot block us forever
            network_options(socket, max_frame_bytes=MAX_FRAME_TO_RECEIVER)
            try:
                socket.connect(join.release_addr)
            except zmq.ZMQError as exc:
                socket.close(linger=0)
                raise ProtocolError(f"plan release_addr {join.release_addr!r} is unusable: {exc}") from exc
            self._socket, self._release_addr = socket, join.release_addr

    def join(self, group: GroupSpec, rank: int, version: int) -> None:
        super().join(group, rank, version)
        if not self.is_sender:  # announce this connection: the sender then knows whose it is if it drops
            self._send(Ready(self.identity, version, group.generation))

    # -- data path ----------------------------------------------------------------------------
    def fence(self, slot: int) -> None:
        """Sender: a slot's metadata goes out right after this, and receivers READ it at once: the
        packing copies must be complete now, not only queued (no-op on CPU: copies there are synchronous)."""
        if self.is_sender and self.device.type != "cpu":
            torch.cuda.synchronize(self.device)
        elif 0 <= slot < NUM_SLOTS:
            super().fence(slot)

    def broadcast(self, slot: int, nbytes: int, bucket_index: int, buffer: torch.Tensor | None = None) -> None:
        wait = self.start_broadcast(slot, nbytes, bucket_index, buffer)
        if wait is not None:
            wait()

    def start_broadcast(
        self, slot: int, nbytes: int, bucket_index: int, buffer: torch.Tensor | None = None
    ) -> Callable[[], None] | None:
        """Receiver: post the READ and return its wait (which sends the release once the bytes are here), so
        the receiver posts the next bucket's READ while this one moves. Sender: the release wait itself."""
        if nbytes == 0:
            return None  # both sides know: nothing is read, nothing released
        if self.is_sender:
            if buffer is not None or slot != bucket_index % NUM_SLOTS:
                raise WeightSyncError(
                    f"nixl: bucket {bucket_index} must come from slot {bucket_index % NUM_SLOTS} (got slot {slot}"
                    f"{', a direct buffer' if buffer is not None else ''}): receivers read slot k % {NUM_SLOTS}"
                )
            self._await_releases(bucket_index)
            return None
        if 0 <= slot < NUM_SLOTS:
            self.wait_fence(slot)  # our copies out of this slot (previous bucket) are done
        target = self.buckets[slot][:nbytes] if buffer is None else buffer
        if target.device != self.device or target.numel() * target.element_size() != nbytes:
            raise WeightSyncError(f"nixl: READ of {nbytes} bytes into a {target.nbytes}-byte {target.device} tensor")
        if not target.is_contiguous():
            raise WeightSyncError("nixl: READ into a non-contiguous tensor")
        if buffer is not None:
            self._ensure_registered(buffer)
        read = self._post_read(target, nbytes, bucket_index)
        done = BucketDone(self.identity, self.version, bucket_index)

        def wait() -> None:
            self._wait_read(read)
            self._send(done)

        return wait

    def _post_read(self, target: torch.Tensor, nbytes: int, bucket_index: int) -> _Read:
        """Post the READ of [0, nbytes) of the sender's slot for `bucket_index` into `target`."""
        remote = self._remote_slots[bucket_index % NUM_SLOTS]
        if nbytes > remote.nbytes:
            raise ProtocolError(f"nixl: bucket {bucket_index} of {nbytes} bytes > the sender's slot ({remote.nbytes})")
        epoch, deadline = self._epoch, time.monotonic() + self.timeout_s
        with self._lock:
            agent = self._agent
            local = agent.get_xfer_descs([(target.data_ptr(), nbytes, _device_id(target.device))], self.mem_type)
            far = agent.get_xfer_descs([(remote.addr, nbytes, remote.device_id)], self._remote_mem_type)
            try:
                handle = agent.initialize_xfer("READ", local, far, self._remote_agent)
                state = agent.transfer(handle)
            except Exception as exc:  # nixlBind errors: the remote agent is gone or the descriptors unusable
                raise PeerError(f"nixl: READ of bucket {bucket_index} from {self._remote_agent} failed: {exc}") from exc
        return _Read(agent, handle, state, epoch, deadline, bucket_index)

    def _wait_read(self, read: _Read) -> None:
        """Drive a posted READ until it is complete (checking it drives UCX); free its handle."""
        state, spins, index = read.state, 0, read.bucket_index
        try:
            while state == "PROC":
                if self._epoch != read.epoch:
                    raise PeerError(f"nixl: READ of bucket {index} abandoned (the group was dropped)")
                if time.monotonic() > read.deadline:
                    raise WeightSyncTimeout(
                        f"nixl: READ of bucket {index} from the sender's agent {self._remote_agent} not "
                        f"complete within transport.timeout_s={self.timeout_s}s"
                    )
                spins += 1
                time.sleep(0 if spins < 64 else min(5e-4, 1e-5 * (spins - 63)))  # checking drives UCX
                with self._lock:
                    state = read.agent.check_xfer_state(read.handle)
            if state != "DONE":
                raise PeerError(
                    f"nixl: READ of bucket {index} from the sender's agent {self._remote_agent} failed "
                    "(the sender is gone?)"
                )
        finally:
            with self._lock:
                try:
                    read.handle.release()
                except Exception:  # still in flight (abandoned): NIXL keeps it and frees it with the agent
                    logger.debug("nixl: transfer handle of bucket %d not released", index, exc_info=True)

    def _ensure_registered(self, tensor: torch.Tensor) -> None:
        """Register `tensor`'s whole storage with NIXL unless a registration of it is cached."""
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        with self._lock:
            entry = self._registrations.get(key)
            if entry is not None and entry.storage() is storage:
                self._registrations.move_to_end(key)
                self.registration_hits += 1
                return
            if entry is not None:  # the storage it was made for is gone; this is new memory at that address
                self._deregister(self._registrations.pop(key))
            whole = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
            self._registrations[key] = _Registration(weakref.ref(storage), self._register([whole]))
            while len(self._registrations) > MAX_CACHED_REGISTRATIONS:
                self._deregister(self._registrations.popitem(last=False)[1])

    def _deregister(self, entry: _Registration) -> None:
        try:
            self._agent.deregister_memory(entry.descs)
        except Exception:  # best effort: the agent frees everything when it goes
            logger.debug("nixl: deregistration failed", exc_info=True)

    def _sweep_registrations(self) -> None:
        """Drop cached registrations of storages that were freed."""
        with self._lock:
            for key in [k for k, e in self._registrations.items() if e.storage() is None]:
                self._deregister(self._registrations.pop(key))

    def _send(self, msg: Ready | BucketDone) -> None:
        try:
            with self._socket_lock:
                if self._socket is None:
                    raise WeightSyncError("nixl backend used before join() or after close()")
                self._socket.send_multipart(encode(msg, self.auth_key))
        except zmq.Again:
            raise WeightSyncTimeout(
                f"nixl: could not send {type(msg).__name__} to the sender at {self._release_addr} within "
                f"transport.timeout_s={self.timeout_s}s (the sender is gone?)"
            ) from None

    # -- the sender's release wait --------------------------------------------------------------
    def _await_releases(self, bucket_index: int) -> None:
        """Block until every member released `bucket_index` of this version. Only members count, and
        only releases of this version (a stray or late release cannot free a slot early); a member
        whose release connection dropped fails the wait at once."""
        socket, monitor = self._socket, self._monitor
        if socket is None or monitor is None:
            raise WeightSyncError("nixl backend used before setup() or after close()")
        epoch, version, members = self._epoch, self.version, set(self.members)
        deadline = time.monotonic() + self.timeout_s
        for key in [k for k in list(self._released) if k[0] < version]:  # left by an abandoned version
            self._released.pop(key, None)
        done = self._released.setdefault((version, bucket_index), set())
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while members - done:
            dead = sorted((members - done) & self._gone)
            if dead:
                raise PeerError(f"nixl: receiver(s) {dead} disconnected before releasing bucket {bucket_index}")
            if self._epoch != epoch:
                raise PeerError(f"nixl: wait for releases of bucket {bucket_index} abandoned (the group was dropped)")
            left = deadline - time.monotonic()
            if left <= 0:
                raise WeightSyncTimeout(
                    f"nixl: bucket {bucket_index} released by {len(members & done)} of {len(members)} receivers "
                    f"within transport.timeout_s={self.timeout_s}s (waiting for: {sorted(members - done)})"
                )
            with self._lock:  # progress: receivers' READs of our slots (and their connection set-up)
                if self._agent is not None:
                    self._agent.get_new_notifs()
            with self._socket_lock:
                if self._socket is not socket:
                    raise PeerError(f"nixl: closed while waiting for releases of bucket {bucket_index}")
                ready = dict(poller.poll(max(1, int(min(left, PROGRESS_POLL_S) * 1000))))
                if monitor in ready:
                    self._on_monitor_event(monitor)
                if socket in ready:
                    self._on_release_message(socket, version)
        self._released.pop((version, bucket_index), None)

    def _on_monitor_event(self, monitor: zmq.Socket[Any]) -> None:
        from zmq.utils.monitor import recv_monitor_message

        event = recv_monitor_message(monitor)
        if event["event"] == zmq.EVENT_DISCONNECTED:
            fd = int(event["value"])
            for identity in [i for i, f in self._fd_of.items() if f == fd]:
                del self._fd_of[identity]
                self._gone.add(identity)
                logger.info("nixl: release connection of receiver %s dropped", identity)

    def _on_release_message(self, socket: zmq.Socket[Any], version: int) -> None:
        frames = socket.recv_multipart(copy=False)
        try:
            msg = decode([f.bytes for f in frames], self.auth_key)
        except ProtocolError as exc:
            self._drops.note("a release connection", exc)
            return
        if not isinstance(msg, (Ready, BucketDone)):
            self._drops.note("a release connection", f"a {type(msg).__name__} is not a release")
            return
        try:
            fd = int(frames[-1].get(zmq.SRCFD))
        except (zmq.ZMQError, AttributeError, ValueError):  # pragma: no cover - libzmq without SRCFD
            fd = -1
        if fd >= 0:
            self._fd_of[msg.identity] = fd
            self._gone.discard(msg.identity)
        # Recorded for whichever wait needs it: a wait of an abandoned version still running on an old
        # executor thread may read the next version's releases off the socket.
        if isinstance(msg, BucketDone) and msg.version >= version:
            self._released.setdefault((msg.version, msg.bucket_index), set()).add(msg.identity)

    # -- life cycle ---------------------------------------------------------------------------
    def _drop_group(self) -> None:
        self._epoch += 1
        self._released.clear()
        if not self.is_sender:
            self._sweep_registrations()

    def close(self) -> None:
        self._epoch += 1
        with self._lock:
            agent, self._agent = self._agent, None
            if agent is not None:
                regs = [e.descs for e in self._registrations.values()]
                if self._slot_regs is not None:
                    regs.append(self._slot_regs)
                for descs in regs:
                    try:
                        agent.deregister_memory(descs)
                    except Exception:  # best effort: the agent frees everything when it goes
                        logger.debug("nixl: deregistration failed", exc_info=True)
                if self._remote_agent:
                    try:
                        agent.remove_remote_agent(self._remote_agent)
                    except Exception:
                        logger.debug("nixl: removing the remote agent failed", exc_info=True)
            self._registrations.clear()
            self._slot_regs, self._remote_agent, self._remote_metadata = None, "", b""
            super().close()
        self._close_sockets()

    def _close_sockets(self) -> None:
        with self._socket_lock:  # a release wait still polling finishes its poll first (<= PROGRESS_POLL_S)
            if self._monitor is not None and self._socket is not None:
                self._socket.disable_monitor()
            for sock in (self._monitor, self._socket):
                if sock is not None:
                    sock.close(linger=0)
            self._monitor = self._socket = None
            self._release_addr = ""
