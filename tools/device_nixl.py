"""Raw NIXL for the device check's `nixl_stream` step (`device_check.step_nixl`): VRAM to VRAM between two
processes on one GPU through the nixl backend, against raw NIXL moving the same bytes between the same two
processes. This module is the raw half, run inside the step's two stream processes before the engine's rounds.

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

NIXL comes to the GPU machine as a cut-down nixl-cu13 wheel (`tools/nixl_wheel.py`, made by
`./dev device-check --prepare`); on the GPU a NIXL that will not import is a failure, not a skip.
"""

from __future__ import annotations

import os
from typing import Any

MiB = 1024**2
RAW_REPEATS = 3
RAW_TAG, RAW_DONE = "raw_nixl", "raw_nixl_done"


def _mem(device: Any) -> tuple[str, int]:
    return ("VRAM", device.index or 0) if device.type == "cuda" else ("DRAM", 0)


def _slot_pattern(index: int, nbytes: int, device: Any) -> Any:
    """The sender's slot contents: seeded random bytes the receiver regenerates to compare."""
    import torch

    from tools.device_common import make_tensor

    return make_tensor(f"raw_nixl_slot_{index}", (nbytes,), torch.uint8, 424_242 + index, device)


def raw_nixl_sender(params: dict[str, Any], to_recv: Any, to_send: Any, device: Any) -> None:
    """Passive side: register two slots, hand their addresses over, drive UCX until the receiver is done."""
    from lightning_weightsync.bench.nixl import make_agent, progress_until
    from tools.device_common import cuda_sync, progress

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

    from lightning_weightsync.bench.nixl import make_agent, nixl_pieces
    from tools.device_common import cuda_sync, progress, queue_get

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
