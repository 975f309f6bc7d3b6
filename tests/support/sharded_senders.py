"""One trainer rank of a sharded sender group, without FSDP, for tests that drive `WeightSender` by hand.

The sharded tests (tests/integration/test_sharded*.py) each run a small gloo group whose ranks send
`torch.chunk` row shards of plain tensors. What every such rank does around its `send_weights` is the
same: join the group, exchange control addresses, then per version build its `Sharding` (rank 0
coordinates and relays its receivers to the others through `MembersRelay`; the rest serve exactly
those) and always finish the relay on rank 0, so no rank waits for a broadcast that never comes. That
lives here once; what each test does differently (a lying or corrupting sender, a dying rank, a wrong
advertised port, a claimed index) stays in the test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_weightsync.protocol.messages import SenderAddress
from lightning_weightsync.trainer.sharded import MembersRelay, exchange_addresses
from lightning_weightsync.versions.options import Sharding
from lightning_weightsync.versions.sender import WeightSender
from tools.sharded_links import row_shard  # noqa: F401 - the sharded tests import it from here

CPU = torch.device("cpu")


@contextlib.contextmanager
def gloo_group(rank: int, world: int, store_port: int) -> Iterator[None]:
    """This process as rank `rank` of a `world`-rank gloo group (rank 0 hosts the store on 127.0.0.1);
    the group is destroyed on exit, also when the block raised."""
    store = dist.TCPStore("127.0.0.1", store_port, world, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


class ShardedRank:
    """One rank's sender in an already joined gloo group: `addresses` is every rank's advertised control
    endpoint (an all-gather, so build it on every rank at the same point). `advertise` overrides the port
    this rank tells the others (a test of an address nobody serves)."""

    def __init__(self, sender: WeightSender, rank: int, advertise: int | None = None) -> None:
        self.sender, self.rank = sender, rank
        self.addresses = exchange_addresses("127.0.0.1", sender.port if advertise is None else advertise, CPU)

    async def send(self, shards: Any, version: int, index: int | None = None) -> Any:
        """`send_weights` of this rank's shards as its part of `version`; `index` is the sender index a
        rank > 0 marks its buckets with (default: its rank; a test of a rank claiming another's)."""
        relay = MembersRelay(CPU)
        try:
            if self.rank == 0:
                others = tuple(SenderAddress(h, p) for h, p in self.addresses[1:])
                sharding = Sharding(0, others=others, on_members=relay)
            else:
                sharding = Sharding(self.rank if index is None else index, members=tuple(relay.receive()))
            return await self.sender.send_weights(shards, version=version, sharding=sharding)
        finally:
            if self.rank == 0:
                relay.finish()

    async def outcome(self, shards: Any, version: int, index: int | None = None) -> str:
        """The outcome of `send`: "ok", or "failed: <the error>" (what the fault tests collect per version)."""
        try:
            await self.send(shards, version, index)
            return "ok"
        except Exception as exc:
            return f"failed: {exc}"
