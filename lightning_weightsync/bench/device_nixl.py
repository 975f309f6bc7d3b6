"""The device check's `nixl_stream` step: VRAM to VRAM between two processes on one GPU through the nixl
backend, against raw NIXL moving the same bytes between the same two processes.

Two spawned processes, both on cuda:0 (`--dry-run`: host memory, tiny sizes, the same code):
  1. raw NIXL (the floor): the receiver READs the stream's byte count, in bucket-sized pieces, from the
     sender's two registered slots into two of its own, through NIXL agents of our own (UCX only, no progress
     thread: as the backend runs them; `lightning_weightsync.bench.nixl`'s helpers). Best of 3 after a
     warm-up; the receiver's slots are overwritten before each pass and compared byte for byte after the last.
  2. the engine: the same processes then run `WeightSender` / `WeightReceiver` with transport.backend=nixl
     and transport.device=cuda:0 (`device_check`'s stream driver, shared with cuda_ipc_stream and nccl): a
     Qwen3-8B-shaped bf16 stream received `into=` preallocated GPU tensors, bitwise for every version.
The report gives GB/s for both, the engine's ratio to raw NIXL (`ratio_vs_raw_nixl`, the number the nixl
row of docs/backends.md wants) and to a device copy of the same bytes (`ratio_vs_copy`).

NIXL comes to the GPU machine as a cut-down nixl-cu13 wheel (`lightning_weightsync/bench/nixl_wheel.py`, made by
`./dev device-check --prepare`); on the GPU a NIXL that will not import is a failure, not a skip.
"""

from __future__ import annotations

import os
import time
from typing import Any

MiB = 1024**2
RAW_REPEATS = 3
RAW_TAG, RAW_DONE = "raw_nixl", "raw_nixl_done"


def _mem(device: Any) -> tuple[str, int]:
    return ("VRAM", device.index or 0) if device.type == "cuda" else ("DRAM", 0)


def _slot_pattern(index: int, nbytes: int, device: Any) -> Any:
    """The sender's slot contents: seeded random bytes the receiver regenerates to compare."""
    import torch

    from lightning_weightsync.bench.device_check import make_tensor

    return make_tensor(f"raw_nixl_slot_{index}", (nbytes,), torch.uint8, 424_242 + index, device)


def raw_nixl_sender(params: dict[str, Any], to_recv: Any, to_send: Any, device: Any) -> None:
    """Passive side: register two slots, hand their addresses over, drive UCX until the receiver is done."""
    from lightning_weightsync.bench.device_check import cuda_sync, progress
    from lightning_weightsync.bench.nixl import make_agent, progress_until

    bucket = int(params["rounds"][0][0] * MiB)
    mem_type, device_id = _mem(device)
    agent = make_agent(f"dc-raw-sender-{os.getpid()}")
    slots = [_slot_pattern(i, bucket, device) for i in range(2)]
    cuda_sync(device)
    descs = agent.register_memory([(s.data_ptr(), bucket, device_id, "") for s in slots], mem_type)
    to_recv.put((RAW_TAG, bytes(agent.get_agent_metadata()), [(s.data_ptr(), bucket) for s in slots]))
    progress(f"sender: raw NIXL, two {bucket / MiB:g} MiB {mem_type} slots registered")
    progress_until(agent, to_send, timeout_s=float(params["workers_timeout_s"]))  # RAW_DONE
    agent.deregister_memory(descs)


def raw_nixl_receiver(params: dict[str, Any], to_recv: Any, to_send: Any, device: Any, total: int) -> dict[str, Any]:
    """Active side: READ `total` bytes in bucket-sized pieces from the sender's slots, timed, then compare."""
    import torch

    from lightning_weightsync.bench.device_check import cuda_sync, progress, queue_get
    from lightning_weightsync.bench.nixl import make_agent, nixl_pieces

    tag, metadata, remote = queue_get(to_recv, 150, "the sender's raw NIXL slots")
    if tag != RAW_TAG:
        raise RuntimeError(f"expected the sender's raw NIXL slots first, got {tag!r}")
    bucket = int(params["rounds"][0][0] * MiB)
    mem_type, device_id = _mem(device)
    agent = make_agent(f"dc-raw-receiver-{os.getpid()}")
    slots = [torch.empty(bucket, dtype=torch.uint8, device=device) for _ in range(2)]
    descs = agent.register_memory([(s.data_ptr(), bucket, device_id, "") for s in slots], mem_type)
    peer = agent.add_remote_agent(metadata)
    peer = peer.decode() if isinstance(peer, bytes) else str(peer)
    try:
        nixl_pieces(agent, "READ", slots, remote, peer, min(total, 2 * bucket), bucket, mem_type, device_id)  # connect
        times = []
        for _ in range(RAW_REPEATS):
            for s in slots:  # stale bytes must not pass for read ones
                s.fill_(0xA5)
            cuda_sync(device)
            times.append(nixl_pieces(agent, "READ", slots, remote, peer, total, bucket, mem_type, device_id))
        # the last piece read into slot i is the first n bytes of the sender's slot i
        starts = list(range(0, total, bucket))
        wrong = []
        for i in range(min(2, len(starts))):
            last = max(k for k in range(len(starts)) if k % 2 == i)
            n = min(bucket, total - starts[last])
            if not torch.equal(slots[i][:n], _slot_pattern(i, bucket, device)[:n]):
                wrong.append(i)
    finally:
        to_send.put((RAW_DONE,))
        agent.remove_remote_agent(peer)
        agent.deregister_memory(descs)
    read_s = min(times)
    progress(f"receiver: raw NIXL READ {total / read_s / 1e9:.3g} GB/s ({mem_type}, {len(starts)} pieces)")
    return {
        "mem_type": mem_type,
        "bucket_bytes": bucket,
        "pieces": len(starts),
        "read_seconds": [round(t, 6) for t in times],
        "read_s": read_s,
        "read_gbps": total / read_s / 1e9,
        "bitwise": not wrong,
        "mismatched_slots": wrong,
    }


def step_nixl(params: dict[str, Any], dry: bool) -> dict[str, Any]:
    import torch

    from lightning_weightsync.bench.device_check import Skip, check_results, stream_pair
    from lightning_weightsync.errors import BackendUnavailable
    from lightning_weightsync.transport.backends import backend_class

    if not dry and not torch.cuda.is_available():
        raise Skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    try:
        backend_class("nixl").agent_classes()  # type: ignore[attr-defined]  # the nixl backend's own import check
    except BackendUnavailable as exc:
        if dry:
            raise Skip(f"NIXL is not installed here: {exc}") from None
        raise BackendUnavailable(
            f"{exc}; the kit brings a cut-down nixl-cu13 in .device/wheels: run `./dev device-check --prepare` "
            "where PyPI is reachable and carry .device/wheels"
        ) from None
    started = time.perf_counter()
    out = stream_pair({**params, "raw_nixl": True}, timeout_s=params["workers_timeout_s"])
    raw = out["raw_nixl"]
    for rnd in out["rounds"]:
        rnd["ratio_vs_raw_nixl"] = raw["read_s"] / rnd["best_seconds"]
    out["ratio_vs_raw_nixl"] = out["rounds"][0]["ratio_vs_raw_nixl"]
    out["pair_seconds"] = round(time.perf_counter() - started, 2)
    out["note"] = (
        "ratio_vs_raw_nixl = raw NIXL READ of the same bytes in bucket-sized pieces (best of 3) / one end-to-end "
        "engine version (Prepare .. acks); ratio_vs_copy as in cuda_ipc_stream"
    )
    out.update(check_results({"bitwise": out["bitwise"], "raw_nixl_bitwise": raw["bitwise"]}))
    return out
