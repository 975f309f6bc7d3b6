"""`transport.delta` in sharded send mode, through real processes: two trainer ranks (a gloo group, each
sending its torch.chunk row shards and diffing them against its own host copy of exactly those shards) and
one receiver applying into its own tensors, in place (`receive_weights(into=..., base=...)`).

Version 0 goes whole; version 1 changes ~1% of the elements: it lands bitwise, every shard as a delta, and
both ranks together send under 10% of the version's bytes; verify=full checks the rebuilt ranges. Version
2: the receiver no longer holds a version (it says -1 in its Ready), so both ranks send whole bytes, and it
still lands bitwise. The same with three receivers chained (transport.fanout=chain): each rank's group feeds
r0 -> r1 -> r2, the middle one forgets its version, and the head and middle forward both ranks' bytes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from lightning_weightsync import WeightReceiver, load_config
from lightning_weightsync.errors import ProtocolError
from lightning_weightsync.protocol.chunks import TensorMeta, as_bytes
from lightning_weightsync.protocol.tiling import TilingMerger
from lightning_weightsync.versions.delta import encode
from lightning_weightsync.versions.sharded import ShardDeltas
from tests.support.mp import free_port, run_workers
from tests.support.sharded_senders import ShardedRank, gloo_group, row_shard

WORLD = 2
VERSIONS = [0, 1, 2]
FORGET_BEFORE = 2  # the receiver drops its held version before this one: whole bytes must go


def _weights(version: int) -> dict[str, torch.Tensor]:
    """Version 0 random; each later version changes ~1% of the elements of the one before."""
    gen = torch.Generator().manual_seed(0)
    weights = {
        "w0": torch.randn(128, 96, generator=gen),
        "w1": torch.randn(257, 40, generator=gen).to(torch.bfloat16),  # odd rows: uneven shards
        "w2": torch.randn(300, generator=gen),
    }
    for v in range(1, version + 1):
        for t in weights.values():
            flat = t.view(-1)
            where = torch.randperm(flat.numel(), generator=gen)[: max(1, flat.numel() // 100)]
            flat[where] += torch.ones(len(where), dtype=t.dtype) * v
    return weights


def _common(port: int, fanout: str) -> list[str]:
    """Both sides' knobs; a chain (transport.fanout=chain) moves 4 KiB pieces of the 10 KiB buckets."""
    return [f"transport.port={port}", "transport.timeout_s=60", "transport.liveness_s=3",
            "transport.bucket_size_mb=0.01", "transport.delta=auto", "transport.verify=full",
            f"transport.fanout={fanout}", "transport.chain_piece_mb=0.00390625"]  # fmt: skip


def _sender(rank: int, trainer_port: int, port: int, fanout: str, receivers: int) -> list[tuple[int, int, int]]:
    """Sends every version; returns (bytes sent, tensors sent as a delta, bytes sent along chains) per version."""
    from lightning_weightsync import WeightSender

    cfg = load_config(overrides=[*_common(port if rank == 0 else 0, fanout), f"trainer.min_receivers={receivers}"])

    async def main() -> list[tuple[int, int, int]]:
        sent = []
        async with WeightSender(cfg) as sender:
            group = ShardedRank(sender, rank)
            for version in VERSIONS:
                shards = [(n, s) for n, t in _weights(version).items() if (s := row_shard(t, rank, WORLD)) is not None]
                stats = await group.send(shards, version)
                sent.append((stats.nbytes, stats.delta_tensors, stats.relayed_bytes))
        return sent

    with gloo_group(rank, WORLD, trainer_port):
        return asyncio.run(main())


def _receiver(index: int, port: int, fanout: str, forgets: bool) -> list[tuple[int, int, int, list[str], int]]:
    """Per version: (delta shards applied, tensors verified, base it held before, tensors not bitwise, bytes it
    forwarded along its chains)."""
    overrides = [*_common(port, fanout), "transport.heartbeat_interval_s=0.2", f"rollout.identity=rollout-{index}"]
    cfg = load_config(overrides=overrides)
    mine = {n: torch.zeros_like(t) for n, t in _weights(0).items()}

    async def main() -> list[tuple[int, int, int, list[str], int]]:
        out = []
        async with WeightReceiver(cfg) as receiver:
            for version in VERSIONS:
                if version == FORGET_BEFORE and forgets:
                    receiver.delta_base = None  # e.g. a restarted rollout: it holds nothing to apply a delta to
                held = -1 if receiver.delta_base is None else receiver.delta_base
                async for _ in receiver.receive_weights(into=lambda m: mine[m.name], base=lambda m: mine[m.name]):
                    pass
                stats, report = receiver.last_stats, receiver.last_verify
                assert stats is not None and report is not None
                want = _weights(version)
                wrong = [n for n, t in want.items() if not torch.equal(mine[n].view(-1).view(torch.uint8),
                                                                        t.view(-1).view(torch.uint8))]  # fmt: skip
                out.append((stats.delta_tensors, report.verified, held, wrong, stats.relayed_bytes))
        return out

    return asyncio.run(asyncio.wait_for(main(), 60))


def _role(role: int, trainer_port: int, port: int, fanout: str, receivers: int) -> Any:
    if role < WORLD:
        return _sender(role, trainer_port, port, fanout, receivers)
    index = role - WORLD
    return _receiver(index, port, fanout, forgets=index == receivers // 2)  # the chain's middle one, or the lone one


@pytest.mark.parametrize(("fanout", "receivers"), [("broadcast", 1), ("chain", 3)], ids=["broadcast", "chain-of-3"])
def test_sharded_delta_at_one_percent_sends_under_a_tenth_of_the_bytes_bitwise(fanout: str, receivers: int) -> None:
    trainer_port, port = free_port(), free_port()
    args = [(r, trainer_port, port, fanout, receivers) for r in range(WORLD + receivers)]
    results = run_workers(_role, args, timeout_s=90)
    senders, every = results[:WORLD], results[WORLD:]
    whole = sum(t.numel() * t.element_size() for t in _weights(0).values())
    for index, received in enumerate(every):
        v0, v1, v2 = received
        for got in received:
            assert got[3] == [], f"not bitwise: {got}"
            assert got[1] == len(_weights(0)), f"not every tensor verified: {got}"
        assert v0[0] == 0 and v1[0] == 2 * len(_weights(0)) and v2[0] == 0, received  # every shard of v1 a delta
        assert (v1[2], v2[2]) == (0, -1 if index == receivers // 2 else 1), (index, received)
    sent = [sum(rank[v][0] for rank in senders) for v in range(len(VERSIONS))]
    deltas = [sum(rank[v][1] for rank in senders) for v in range(len(VERSIONS))]
    assert sent[0] == whole and sent[2] == whole, (sent, whole)  # whole versions: every byte, once
    assert deltas == [0, 2 * len(_weights(0)), 0], deltas
    assert sent[1] < whole / 10, f"a 1% change sent {sent[1]} of {whole} bytes"
    if fanout == "chain":  # each rank's link carries its bytes once; r0 and r1 forward both ranks', r2 keeps them
        assert all(rank[v][2] == rank[v][0] for rank in senders for v in range(len(VERSIONS))), senders
        forwarded = [[got[v][4] for v in range(len(VERSIONS))] for got in every]
        assert forwarded == [sent, sent, [0] * len(VERSIONS)], (forwarded, sent)


# -- one sender's payload chunks, stitched in order or refused (versions/sharded.py ShardDeltas) --------------


class _Stream:
    """What `ShardDeltas` reads of a sender's `BucketPipeline`: the tensors its buckets said arrive as a delta
    (name -> the tensor's meta, the base version) and the byte range each payload rebuilds."""

    def __init__(self, whole: TensorMeta, start: int, size: int) -> None:
        self.delta_metas = {whole.name: (whole, 0)}
        self.delta_ranges = {whole.name: (start, size)}


def _payload_chunks() -> tuple[torch.Tensor, torch.Tensor, TensorMeta, list[tuple[TensorMeta, torch.Tensor]]]:
    """(old, new, the tensor's meta, the payload of rows 32..63 as the pipeline yields it, in three chunks)."""
    gen = torch.Generator().manual_seed(3)
    old = torch.randn(64, 8, generator=gen)
    new = old.clone()
    new.view(-1)[torch.randperm(256, generator=gen)[:12] + 256] += 1.0  # 12 elements of rows 32..63
    payload = encode(new[32:].contiguous(), old[32:].contiguous(), 1024)
    assert payload is not None and payload.numel() == 16 + 256 // 8 + 12 * 4  # the bitmask format
    whole = TensorMeta("w", (64, 8), torch.float32, 0, 2048)
    cuts = [(0, 40), (40, 40), (80, 16)]
    chunks = [(TensorMeta("w", (96,), torch.uint8, at, n), payload[at : at + n].clone()) for at, n in cuts]
    return old, new, whole, chunks


@pytest.mark.parametrize("order", ["in-order", "swapped", "repeated"])
def test_a_delta_payload_chunk_out_of_order_or_repeated_is_refused_not_stitched(order: str) -> None:
    """One sender's chunks of one payload come in order (its bucket stream); a chunk at another byte than the
    next one expected (a hostile or broken sender) fails the version, never lands at the wrong place."""
    old, new, whole, chunks = _payload_chunks()
    deltas = ShardDeltas([_Stream(whole, 1024, 1024)], lambda meta, based_on: old)  # type: ignore[list-item]
    merger = TilingMerger(4096, None, "cpu", ["rank0"])
    merger.push(0, TensorMeta("w", (64, 8), torch.float32, 0, 1024), as_bytes(old[:32].contiguous()))  # rows 0..31
    sequence = {"in-order": chunks, "swapped": [chunks[0], chunks[2], chunks[1]], "repeated": [chunks[0], *chunks]}
    if order == "in-order":
        assert deltas.push(0, *chunks[0], merger) is None and deltas.push(0, *chunks[1], merger) is None
        name, got = deltas.push(0, *chunks[2], merger)  # type: ignore[misc]
        assert name == "w" and torch.equal(got, new) and deltas.applied == 1
        return
    with pytest.raises(ProtocolError, match=r"delta of 'w' from sender 0: chunk at byte (80|0) of its payload, 40"):
        for meta, data in sequence[order]:
            deltas.push(0, meta, data, merger)
    assert deltas.applied == 0
