"""verl's actor and rollout workers, as far as its checkpoint engine sees them, in real processes.

Ray runs verl's workers; here each is a spawned process (tests/support/mp.py) serving the calls verl's manager
makes, over a pipe, and `ProcessWorkerGroup` / `get` stand in for `RayWorkerGroup` and `ray.get` in the driver.
What a worker does on each call mirrors verl 0.9.1:

- build (actor): verl/workers/engine_workers.py:679-688: bucket size `update_weights_bucket_megabytes << 20`,
  `engine_kwargs.get(backend, {})`, `import_external_libs(custom_backend_module)`, then
  `CheckpointEngineRegistry.new(backend, is_master=(torch.distributed.get_rank() == 0), bucket_size=...,
  **engine_kwargs)`; the actor ranks form a gloo default process group, as verl's trainer has one;
- build (rollout): verl/checkpoint_engine/base.py:331-339, the same without `is_master`;
- `execute_checkpoint_engine(method, *args, **kwargs)`: `getattr(self.checkpoint_engine, method)(...)`
  (engine_workers.py:830-839, base.py:362-364);
- `update_weights` (actor): engine_workers.py:754-766: `send_weights(per_tensor_param, global_steps=...)` of
  the model's per-tensor generator, its metrics or {} returned; the generator runs one collective per tensor
  over the actor group, as FSDP's `full_tensor()` all-gathers do, so a rank that stops pulling hangs the others;
- `update_weights` (rollout): base.py:353-360: `receive_weights(global_steps=...)` handed to the server
  adapter's `update_weights`, which here consumes it and checks every tensor bitwise against the actor's. With
  the real verl installed, a rollout worker runs verl's own `CheckpointEngineWorker.update_weights` and
  `execute_checkpoint_engine` (the actor's `ActorRolloutRefWorker` needs verl's whole training stack to import:
  its lines are mirrored).

Every worker runs its calls on an asyncio loop, as a Ray async actor does: a wait of the engine that blocked
that loop would block the worker's next call.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from tests.support.mp import spawned

BACKEND = "lightning_weightsync"
MODULE = "lightning_weightsync.integrations.verl"
BUCKET_MB = 1  # verl's knob is whole MiB (update_weights_bucket_megabytes: int)
CALL_TIMEOUT_S = 60.0
# name -> (shape, dtype): a tensor larger than the bucket (chunked), small ones packed together, an empty one
MODEL = {
    "model.embed_tokens.weight": ((1024, 640), torch.bfloat16),  # 1.25 MiB > 1 MiB bucket
    "model.layers.0.self_attn.q_proj.weight": ((256, 256), torch.float32),
    "model.layers.0.input_layernorm.weight": ((256,), torch.float32),
    "model.layers.0.mlp.down_proj.weight": ((128, 512), torch.bfloat16),
    "model.rotary.positions": ((7,), torch.int64),
    "model.empty_buffer": ((0,), torch.float32),
}


def model_weights(step: int) -> dict[str, torch.Tensor]:
    """The actor's weights at `step`: the same on every rank, new every step."""
    gen = torch.Generator().manual_seed(1000 + step)
    out = {}
    for name, (shape, dtype) in MODEL.items():
        if dtype.is_floating_point:
            out[name] = torch.randn(shape, generator=gen).to(dtype)
        else:
            out[name] = torch.randint(-(2**40), 2**40, shape, generator=gen, dtype=dtype)
    return out


def digest(weights: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(weights):
        t = weights[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# -- the worker process ---------------------------------------------------------------------------------------
@dataclass
class WorkerSpec:
    role: str  # "actor" | "rollout"
    rank: int
    world_size: int  # of its side
    dist_port: int  # the actor group's default process group (actor ranks only)
    ckpt: dict[str, Any]  # checkpoint_engine config: backend, update_weights_bucket_megabytes, engine_kwargs, module
    standin: bool  # True: install tests/support/verl_standin.py first (verl is not installed)


class _Actor:
    """The actor's model engine: `get_per_tensor_param()` yields full tensors, one collective each."""

    def __init__(self, die_after: int | None = None) -> None:
        self.step = 0
        self.die_after = die_after
        self.sent: dict[str, torch.Tensor] = {}

    def get_per_tensor_param(self) -> tuple[Iterator[tuple[str, torch.Tensor]], None]:
        import torch.distributed as dist

        def gen() -> Iterator[tuple[str, torch.Tensor]]:
            for i, (name, tensor) in enumerate(model_weights(self.step).items()):
                if self.die_after is not None and i == self.die_after:
                    os._exit(17)  # this actor rank dies mid-sync
                mark = torch.tensor([i], dtype=torch.int64)
                dist.all_reduce(mark)  # collective: every rank must pull the same tensor, in order
                assert int(mark) == i * dist.get_world_size(), f"ranks out of step at {name}"
                self.sent[name] = tensor
                yield name, tensor

        return gen(), None


class _ServerAdapter:
    """The rollout's server adapter: `update_weights(weights, global_steps=..., wire_format=...)` consumes the
    engine's generator (as vLLM's / SGLang's adapters do) and keeps what it loaded."""

    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}
        self.die_after: int | None = None
        self.raise_after: int | None = None

    async def update_weights(self, weights: Any, global_steps: int | None = None, wire_format: str = "") -> None:
        assert wire_format == "named_tensors", wire_format
        self.loaded = {}
        async for name, tensor in weights:
            if self.die_after is not None and len(self.loaded) == self.die_after:
                os._exit(17)  # this rollout rank dies mid-sync
            if self.raise_after is not None and len(self.loaded) == self.raise_after:
                raise RuntimeError(f"the server failed to load {name}")  # stops consuming mid-version
            assert name not in self.loaded, f"{name} twice"
            self.loaded[name] = tensor.clone()


def _build(spec: WorkerSpec) -> Any:
    if spec.standin:
        from tests.support import verl_standin

        verl_standin.install()
    from verl.checkpoint_engine.base import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    ckpt = spec.ckpt
    backend = ckpt["backend"]
    bucket_size = ckpt["update_weights_bucket_megabytes"] << 20
    engine_kwargs = ckpt["engine_kwargs"].get(backend, {})
    import_external_libs(ckpt["custom_backend_module"] or None)
    if spec.role == "rollout":  # base.py:337-339
        return CheckpointEngineRegistry.new(backend, bucket_size=bucket_size, **engine_kwargs)
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{spec.dist_port}", rank=spec.rank, world_size=spec.world_size
    )
    return CheckpointEngineRegistry.new(  # engine_workers.py:686-688
        backend, is_master=(torch.distributed.get_rank() == 0), bucket_size=bucket_size, **engine_kwargs
    )


async def _rollout_update_weights(engine: Any, adapter: _ServerAdapter, global_steps: int) -> None:
    """`CheckpointEngineWorker.update_weights` (base.py:353-360), line for line."""
    weights = engine.receive_weights(global_steps=global_steps)
    await adapter.update_weights(
        weights, global_steps=global_steps, wire_format=getattr(engine, "wire_format", "named_tensors")
    )


def _real_rollout_worker(engine: Any, adapter: _ServerAdapter) -> Any:
    """verl's own `CheckpointEngineWorker` methods (`update_weights`, base.py:353-360; `execute_checkpoint_engine`,
    base.py:362-364) bound to this worker's engine and adapter: its `__init__` needs a Ray worker and a rollout
    server, so the attributes those methods read are set here, as base.py:331-349 sets them."""
    from verl.checkpoint_engine.base import CheckpointEngineWorker

    state = SimpleNamespace(checkpoint_engine=engine, server_adapter=adapter)
    return SimpleNamespace(
        update_weights=functools.partial(CheckpointEngineWorker.update_weights, state),
        execute_checkpoint_engine=functools.partial(CheckpointEngineWorker.execute_checkpoint_engine, state),
    )


async def _serve(conn: Any, spec: WorkerSpec) -> None:
    engine = _build(spec)
    actor, adapter = _Actor(), _ServerAdapter()
    rollout_worker = _real_rollout_worker(engine, adapter) if spec.role == "rollout" and not spec.standin else None
    loop = asyncio.get_running_loop()
    conn.send(("ok", type(engine).__module__ + "." + type(engine).__qualname__))
    while True:
        msg = await loop.run_in_executor(None, conn.recv)
        kind, payload = msg
        try:
            if kind == "stop":
                if hasattr(engine, "close"):
                    engine.close()
                conn.send(("ok", None))
                return
            if kind == "execute" and rollout_worker is not None:  # verl's own method (base.py:362-364)
                method, args, kwargs = payload
                result: Any = rollout_worker.execute_checkpoint_engine(method, *args, **kwargs)
            elif kind == "execute":  # engine_workers.py:839, base.py:364
                method, args, kwargs = payload
                result = getattr(engine, method)(*args, **kwargs)
            elif kind == "update_weights" and spec.role == "actor":  # engine_workers.py:754-766
                assert payload["mode"] == BACKEND, payload  # not "naive": the checkpoint engine sends
                actor.step, actor.die_after, actor.sent = payload["global_steps"], payload.get("die_after"), {}
                if payload.get("die_before_send"):
                    os._exit(17)  # this actor rank dies before its version starts (after init_process_group)
                per_tensor_param, _ = actor.get_per_tensor_param()
                metrics = await engine.send_weights(per_tensor_param, global_steps=payload["global_steps"])
                result = metrics or {}
            elif kind == "sent":  # the test asks what this actor rank's generator yielded in the last sync
                result = digest(actor.sent) if len(actor.sent) == len(MODEL) else None
            elif kind == "update_weights":  # base.py:353-360
                adapter.die_after, adapter.raise_after = payload.get("die_after"), payload.get("raise_after")
                if rollout_worker is not None:  # verl's own CheckpointEngineWorker.update_weights
                    await rollout_worker.update_weights(global_steps=payload["global_steps"])
                else:
                    await _rollout_update_weights(engine, adapter, payload["global_steps"])
                expected = model_weights(payload["global_steps"])
                assert sorted(adapter.loaded) == sorted(expected), sorted(adapter.loaded)
                for name, tensor in adapter.loaded.items():
                    want = expected[name]
                    assert tensor.dtype == want.dtype and tensor.shape == want.shape, name
                    assert torch.equal(tensor.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)), name
                    assert tensor.device.type == "cpu", tensor.device
                result = {"digest": digest(adapter.loaded), "tensors": len(adapter.loaded)}
            else:
                raise AssertionError(f"unknown call {kind}")
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
            continue
        conn.send(("ok", result))


def worker_main(conn: Any, spec: WorkerSpec) -> None:
    try:
        asyncio.run(_serve(conn, spec))
    except Exception as exc:
        with contextlib.suppress(Exception):
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise


# -- the driver's side: handles, worker groups, ray.get -----------------------------------------------------------
class WorkerError(AssertionError):
    pass


@dataclass
class Handle:
    """One worker process and its pipe (a Ray actor handle's stand-in)."""

    name: str
    conn: Any
    proc: Any
    pending: Pending | None = None
    inject: dict[str, Any] = field(default_factory=dict)  # merged into the next update_weights call (faults)
    replies: list[tuple[str, Any, Pending]] = field(default_factory=list)  # every call: (kind, payload, reply)

    def call(self, kind: str, payload: Any) -> Pending:
        assert self.pending is None or self.pending.done, f"{self.name}: a call is still outstanding"
        if kind == "update_weights" and self.inject:
            payload, self.inject = {**payload, **self.inject}, {}
        self.conn.send((kind, payload))
        self.pending = Pending(self)
        self.replies.append((kind, payload, self.pending))
        return self.pending

    def last(self, kind: str, method: str | None = None) -> Pending:
        """The reply to the latest `kind` call (of `method`, for execute)."""
        return next(p for k, pl, p in reversed(self.replies) if k == kind and (method is None or pl[0] == method))


@dataclass
class Pending:
    """One call's reply (an ObjectRef's stand-in): `get` waits for it, once."""

    handle: Handle
    done: bool = False
    ok: bool = False
    value: Any = None
    seconds: float = 0.0
    started: float = field(default_factory=time.monotonic)

    def wait(self, deadline: float) -> Pending:
        if self.done:
            return self
        try:
            if not self.handle.conn.poll(max(0.0, deadline - time.monotonic())):
                raise WorkerError(f"{self.handle.name}: no reply within {CALL_TIMEOUT_S}s (a hang)")
            status, self.value = self.handle.conn.recv()
            self.ok = status == "ok"
        except (EOFError, ConnectionError):
            self.handle.proc.join(5)
            self.ok, self.value = False, f"died (exit code {self.handle.proc.exitcode})"
        self.done, self.seconds = True, time.monotonic() - self.started
        return self


def get(refs: list[Pending], timeout_s: float = CALL_TIMEOUT_S) -> list[Any]:
    """`ray.get(refs)`: every result in order; the first failure raised once all are in (no stale replies)."""
    deadline = time.monotonic() + timeout_s
    done = [r.wait(deadline) for r in refs]
    failed = [f"{r.handle.name}: {r.value}" for r in done if not r.ok]
    if failed:
        raise WorkerError("; ".join(failed))
    return [r.value for r in done]


class ProcessWorkerGroup:
    """`RayWorkerGroup` as verl's manager uses it: `world_size`, `execute_checkpoint_engine` dispatched
    DP_COMPUTE (one list element per worker, verl/single_controller/base/decorator.py:148-156) and
    `update_weights` ONE_TO_ALL (decorator.py:120-123), both non-blocking (a list of pending replies)."""

    def __init__(self, worker_handles: list[Handle], ray_cls_with_init: Any = None) -> None:
        self.handles = list(worker_handles)
        self.workers = self.handles
        self.world_size = len(self.handles)

    def execute_checkpoint_engine(self, method: list[str], *args: list[Any], **kwargs: list[Any]) -> list[Pending]:
        for v in [method, *args, *kwargs.values()]:
            assert isinstance(v, tuple | list) and len(v) == self.world_size
        return [
            h.call("execute", (method[i], [a[i] for a in args], {k: v[i] for k, v in kwargs.items()}))
            for i, h in enumerate(self.handles)
        ]

    def update_weights(self, **kwargs: Any) -> list[Pending]:
        return [h.call("update_weights", dict(kwargs)) for h in self.handles]


@dataclass
class Replica:
    """A rollout replica as the manager sees it (base.py:525-528: `replica.workers`), and the async calls
    around a sync (abort, release / resume KV cache, resume generation): no inference server, nothing to do."""

    workers: list[Handle]

    async def abort_all_requests(self, reject_request: bool = False) -> None: ...

    async def release_kv_cache(self) -> None: ...

    async def resume_kv_cache(self) -> None: ...

    async def resume_generation(self) -> None: ...


@contextlib.contextmanager
def verl_workers(
    actor_ranks: int, rollout_ranks: int, ckpt: dict[str, Any], *, standin: bool, dist_port: int
) -> Iterator[tuple[ProcessWorkerGroup, list[Replica]]]:
    """Spawn the actor ranks and the rollout ranks (one replica per rank), each with its engine built as verl
    builds it; yield the actor group and the replicas; stop (or kill) every process on exit."""
    ctx = mp.get_context("spawn")
    specs = [WorkerSpec("actor", r, actor_ranks, dist_port, ckpt, standin) for r in range(actor_ranks)]
    specs += [WorkerSpec("rollout", r, rollout_ranks, 0, ckpt, standin) for r in range(rollout_ranks)]
    with contextlib.ExitStack() as stack:
        handles = []
        for spec in specs:
            parent, child = ctx.Pipe()
            proc = stack.enter_context(spawned(worker_main, child, spec))
            child.close()  # the worker's end lives in the worker: its death is an EOF here
            handles.append(Handle(f"{spec.role}{spec.rank}", parent, proc))
        built = get([Pending(h) for h in handles])
        assert all(b.endswith("LightningWeightSyncCheckpointEngine") for b in built), built
        try:
            yield ProcessWorkerGroup(handles[:actor_ranks]), [Replica([h]) for h in handles[actor_ranks:]]
        finally:
            for h in handles:
                if h.proc.is_alive() and (h.pending is None or h.pending.done):
                    with contextlib.suppress(Exception):
                        h.call("stop", None).wait(time.monotonic() + 30)
