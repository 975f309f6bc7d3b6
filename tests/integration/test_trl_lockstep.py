"""TRL's `send_weights` iterator is collective on FSDP2 (`full_tensor()` per parameter, trl 1.16.0
async_grpo_trainer.py:1723-1731): rank 0 hands it to `WeightSyncTransfer.send_weights` while the other ranks
walk it themselves (:1780-1785). Two gloo ranks with a `fully_shard`ed model, under `Lockstep` (every rank's
collectives compared before they run): a delivered version is the full tensors, bitwise, and a version whose
send fails (its rollout left) still runs every all-gather on rank 0, so both ranks meet at the next barrier."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.support.mp import LOAD_SLACK_S, free_port, run_workers

pytestmark = pytest.mark.slow  # two spawned ranks

WORLD = 2
SEND_TIMEOUT_S = 2.0


def _rank(rank: int, store_port: int, sync_port: int) -> dict[str, Any]:
    import faulthandler

    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from lightning_weightsync import WeightSyncError
    from lightning_weightsync.integrations.trl import WeightSyncTransfer
    from tests.support.collectives import Lockstep
    from tests.support.receiver import ThreadReceiver
    from tests.support.transfer import engine_cfg

    faulthandler.dump_traceback_later(40, exit=True)  # a hung rank shows where
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store_port))
    store = dist.TCPStore("127.0.0.1", store_port, WORLD, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 64), nn.Linear(64, 4))
    for layer in net:
        fully_shard(layer)
    fully_shard(net)

    def streaming_iter() -> Any:  # TRL's _streaming_iter
        for name, param in net.named_parameters():
            yield name, (param.full_tensor() if isinstance(param, DTensor) else param.detach())

    out: dict[str, Any] = {}
    sync = WeightSyncTransfer(engine_cfg(sync_port, bucket_size_mb=1 / 128, transport__timeout_s=SEND_TIMEOUT_S))
    with Lockstep(store, rank, WORLD, "trl-sync"):
        for version in (1, 2):
            receiver = None
            if rank == 0:
                if version == 1:
                    sync.init_weight_transfer()
                    receiver = ThreadReceiver(sync_port, versions=1)
                sync.pause()
                started = time.monotonic()
                try:
                    sync.send_weights(streaming_iter())
                except WeightSyncError as exc:
                    out["error"], out["error_after_s"] = str(exc), time.monotonic() - started
                sync.resume()
                if receiver is not None:
                    (_, out["received"]), *_ = receiver.join()
            else:
                for _ in streaming_iter():
                    pass
            dist.barrier()
            full = {name: tensor.clone() for name, tensor in streaming_iter()}  # every rank: collective
            if rank == 0 and version == 1:
                out["full"] = full
    if rank == 0:
        sync.destroy()
        received, full = out.pop("received"), out.pop("full")  # tensors do not cross the result queue
        out["names"] = [list(received), list(full)]
        out["bitwise"] = {name: torch.equal(received[name], tensor) for name, tensor in full.items()}
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_fsdp2_ranks_stay_in_lockstep_through_a_delivered_and_a_failed_version() -> None:
    first, second = run_workers(_rank, _args(), timeout_s=120)
    assert second == {}
    names = ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"]
    assert first["names"] == [names, names]
    assert first["bitwise"] == dict.fromkeys(names, True)
    assert "min_receivers" in first["error"], first["error"]
    assert first["error_after_s"] < SEND_TIMEOUT_S + LOAD_SLACK_S


def _args() -> list[tuple[int, int, int]]:
    store_port, sync_port = free_port(), free_port()
    return [(rank, store_port, sync_port) for rank in range(WORLD)]
