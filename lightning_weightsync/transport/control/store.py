"""The data-plane rendezvous over the control plane: a `torch.distributed.Store` whose keys live in
the sender and are reached only through the (CURVE-authenticated, signed) ZeroMQ control plane.

A TCPStore listens for anyone: a stranger can list its keys and set the address a rank will connect
to. With this store there is no such listener; the sender keeps a `HashStore` (`StoreServer`), and a
receiver's process group (built on the executor thread) asks the sender for each key through
`StoreRequest` (`ControlPlaneStore`). gloo's rendezvous only needs `set`, `get` and `wait`; `add` and
`check` are there for other process groups.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Protocol

from torch._C._distributed_c10d import HashStore  # its stub home: mypy sees no public torch.distributed.X
from torch.distributed.distributed_c10d import Store

from ...errors import ProtocolError, WeightSyncTimeout
from ...protocol.messages import StoreReply, StoreRequest

MAX_STORE_KEYS = 65536  # rendezvous keys a sender session holds at most
STORE_POLL_S = 0.01


class StoreServer:
    """The sender's side: a `HashStore` that answers `StoreRequest`s inside one session's namespace."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._store: HashStore | None = None

    @property
    def store(self) -> HashStore:
        if self._store is None:
            self._store = HashStore()
        return self._store

    def serve(self, msg: StoreRequest) -> StoreReply:
        """The reply to one request; a request outside the namespace, over the key limit or with a
        non-integer `add` raises `ProtocolError` (dropped and counted by the caller, never answered)."""
        if not msg.key.startswith(self.namespace):
            raise ProtocolError(f"store {msg.op} of {msg.key[:80]!r}, outside this session's namespace")
        store = self.store
        if msg.op == "set":
            if store.num_keys() >= MAX_STORE_KEYS:
                raise ProtocolError(f"store set refused: {MAX_STORE_KEYS} keys already")
            store.set(msg.key, msg.value)  # type: ignore[arg-type]  # torch's stub says str; the binding takes bytes
            return StoreReply(msg.request_id, True, b"")
        if msg.op == "add":  # counters (barriers) of process groups other than gloo
            try:
                amount = int(msg.value.decode("ascii")) if len(msg.value) <= 20 else None
            except (UnicodeDecodeError, ValueError):
                amount = None
            if amount is None:
                raise ProtocolError(f"store add of a non-integer {msg.value[:20]!r}")
            return StoreReply(msg.request_id, True, str(store.add(msg.key, amount)).encode())
        if store.check([msg.key]):
            return StoreReply(msg.request_id, True, store.get(msg.key))
        return StoreReply(msg.request_id, False, b"")


class StoreClient(Protocol):
    """What `ControlPlaneStore` needs of a receiver's control plane (`ReceiverControl`)."""

    async def store_call(self, op: str, key: str, value: bytes, timeout_s: float) -> StoreReply: ...

    async def store_get(self, key: str, timeout_s: float) -> bytes: ...


_HOP_SLACK_S = 5.0  # beyond the store timeout, for the thread -> event loop hop itself


class ControlPlaneStore(Store):
    """Receiver side: every call runs on the control plane's event loop and blocks this (executor)
    thread until the sender answered. Keys are namespaced under `prefix` (PrefixStore cannot wrap a
    Python store in this torch)."""

    def __init__(self, control: StoreClient, loop: asyncio.AbstractEventLoop, prefix: str, timeout_s: float) -> None:
        super().__init__()
        self._control, self._loop, self._prefix, self._timeout_s = control, loop, prefix.rstrip("/") + "/", timeout_s

    def _run(self, coro: Any) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(self._timeout_s + _HOP_SLACK_S)
        except TimeoutError:
            future.cancel()
            raise WeightSyncTimeout(
                f"rendezvous through the control plane did not answer within transport.timeout_s={self._timeout_s}s"
            ) from None

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._run(self._control.store_call("set", self._prefix + key, data, self._timeout_s))

    def get(self, key: str) -> bytes:
        return self._run(self._control.store_get(self._prefix + key, self._timeout_s))  # type: ignore[no-any-return]

    def add(self, key: str, amount: int) -> int:
        reply = self._run(
            self._control.store_call("add", self._prefix + key, str(int(amount)).encode(), self._timeout_s)
        )
        return int(reply.value.decode("ascii"))

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        limit = self._timeout_s if timeout is None else min(self._timeout_s, timeout.total_seconds())
        deadline = time.monotonic() + limit
        for key in keys:
            self._run(self._control.store_get(self._prefix + key, max(deadline - time.monotonic(), 0.001)))

    def check(self, keys: Sequence[str]) -> bool:
        return all(
            self._run(self._control.store_call("get", self._prefix + k, b"", self._timeout_s)).found for k in keys
        )

    def num_keys(self) -> int:
        raise NotImplementedError("the control-plane rendezvous store does not list keys")

    def delete_key(self, key: str) -> bool:
        return False  # keys live as long as the sender session; nothing to clean up per group
