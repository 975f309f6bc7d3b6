"""Large tensors go direct, whatever their size relative to the bucket; stable producers overlap.

`transport.direct_min_mb`: every chunk of a tensor at least that large has a bucket of its own, is
broadcast from the caller's tensor and received into its destination (no pack, no merge copy); only
small tensors are packed. A producer that yields fresh tensors (`stable_tensors=True`) is asked for
the next tensor while the direct broadcast of the previous one is still in flight.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from lightning_weightsync import WeightReceiver, WeightSender
from tests.support.transfer import assert_bitwise, engine_cfg, expected_layout, with_timeout

KIB = 1024


def _tensor(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(seed))


async def _pair(**extra):
    sender = WeightSender(engine_cfg(0, bucket_size_mb=64 / 1024, **extra))
    await sender.start()
    receiver = WeightReceiver(engine_cfg(sender.port, bucket_size_mb=64 / 1024, **extra), identity="direct")
    await receiver.start()
    return sender, receiver


async def test_tensors_over_the_threshold_go_direct_in_buckets_of_their_own() -> None:
    # 64 KiB buckets, direct from 16 KiB: 40 KiB and 100 KiB tensors go direct (1 and 2 chunks), the 1 KiB
    # ones are packed; none of the direct chunks fills a bucket, so the old full-bucket rule sent none direct
    weights = [("s0", _tensor(KIB, 0)), ("mid", _tensor(40 * KIB, 1)), ("s1", _tensor(KIB, 2)),
               ("big", _tensor(100 * KIB, 3)), ("s2", _tensor(KIB, 4))]  # fmt: skip
    sender, receiver = await _pair(transport__direct_min_mb=16 / 1024)
    dest = {n: torch.zeros_like(t) for n, t in weights}
    try:

        async def consume() -> dict[str, torch.Tensor]:
            got = {}
            async for name, tensor in receiver.receive_weights(into=lambda m: dest[m.name]):
                assert tensor.data_ptr() == dest[name].data_ptr()
                got[name] = tensor.clone()
            return got

        got, stats = await with_timeout(asyncio.gather(consume(), sender.send_weights(weights, version=1)))
    finally:
        await receiver.close()
        await sender.close()
    # the small tensors share one packed bucket across the large ones, which go out first, as produced
    s0, mid, s1, big, s2 = weights
    assert_bitwise(got, [mid, big, s0, s1, s2])
    assert stats.direct_buckets == 3  # mid, big[0:64K], big[64K:100K]
    assert stats.num_buckets == 4  # [mid] [big 0] [big 1] [s0 s1 s2]
    assert receiver.last_stats.direct_buckets >= 3


async def test_threshold_zero_packs_everything_that_does_not_fill_a_bucket() -> None:
    weights = [("s0", _tensor(KIB, 0)), ("mid", _tensor(40 * KIB, 1)), ("s1", _tensor(KIB, 2))]
    sender, receiver = await _pair(transport__direct_min_mb=0)
    try:
        got, stats = await with_timeout(
            asyncio.gather(
                _collect(receiver),
                sender.send_weights(weights, version=1),
            )
        )
    finally:
        await receiver.close()
        await sender.close()
    assert_bitwise(got, weights)
    assert stats.direct_buckets == 0 and stats.num_buckets == 1


async def test_a_tensor_split_across_packed_buckets_is_not_interleaved_with_a_direct_one() -> None:
    # 64 KiB buckets, direct from 256 KiB: `p` (150 KiB) is packed, cut [63 KiB after s0 | a whole bucket,
    # sent alone | 23 KiB]; `d` (260 KiB) goes direct. A packed bucket holding part of a tensor must go out
    # before the next chunk sent alone, or the receiver would see another chunk in the middle of `p`
    # (small whole tensors may wait in the packed bucket while direct ones pass).
    weights = [("s0", _tensor(KIB, 0)), ("p", _tensor(150 * KIB, 1)), ("d", _tensor(260 * KIB, 2)),
               ("s1", _tensor(KIB, 3))]  # fmt: skip
    sender, receiver = await _pair(transport__direct_min_mb=256 / 1024)
    try:
        got, stats = await with_timeout(asyncio.gather(_collect(receiver), sender.send_weights(weights, version=1)))
    finally:
        await receiver.close()
        await sender.close()
    assert_bitwise(got, weights)  # [s0 p0] [p1] [p2] [d0]..[d4] [s1]: the producer's order
    assert stats.direct_buckets == 6
    assert (stats.num_buckets, stats.num_chunked_tensors) == expected_layout(weights, 64 * KIB, 256 * KIB) == (9, 2)


async def _collect(receiver: WeightReceiver) -> dict[str, torch.Tensor]:
    return {name: t.clone() async for name, t in receiver.receive_weights()}


class _WatchedList(list):
    """A list (so the sender may take the fast path without a flag) that calls `on_pull(name)` per item."""

    on_pull: Any = None

    def __iter__(self):
        for item in super().__iter__():
            self.on_pull(item[0])
            yield item


async def _next_pulled_while_broadcast_in_flight(stable: bool | None, as_list: bool = False) -> bool:
    """Stream [a, b1, b2, c] (a, b1, b2 direct) to a consumer that dawdles 1 s after `a`, holding its slot.
    The consumer gives no destinations, so the receiver takes the direct buckets into its slots: b2's
    (the slot of `a`) cannot complete until the consumer wakes. Returns whether the sender asked for `c`
    before the consumer woke up, i.e. while b2's broadcast was still in flight."""
    weights = [("a", _tensor(40 * KIB, 0)), ("b1", _tensor(40 * KIB, 1)), ("b2", _tensor(40 * KIB, 2)),
               ("c", _tensor(KIB, 3))]  # fmt: skip
    sender, receiver = await _pair(transport__direct_min_mb=16 / 1024)
    woke = asyncio.Event()
    pulled_before_wake: list[bool] = []

    def pulled(name: str) -> None:
        if name == "c":
            pulled_before_wake.append(not woke.is_set())

    def produce():
        for name, tensor in weights:
            pulled(name)
            yield name, tensor

    source: Any = produce()
    if as_list:
        source = _WatchedList(weights)
        source.on_pull = pulled

    async def consume() -> dict[str, torch.Tensor]:
        got = {}
        async for name, tensor in receiver.receive_weights():
            got[name] = tensor.clone()
            if name == "a":
                await asyncio.sleep(1.0)
                woke.set()
        return got

    try:
        got, _ = await with_timeout(
            asyncio.gather(consume(), sender.send_weights(source, version=1, stable_tensors=stable))
        )
    finally:
        await receiver.close()
        await sender.close()
    assert_bitwise(got, weights)
    return pulled_before_wake[0]


async def test_stable_producer_overlaps_the_next_tensor_with_the_broadcast() -> None:
    assert await _next_pulled_while_broadcast_in_flight(stable=True)


async def test_unstable_producer_waits_for_the_broadcast_before_the_next_tensor() -> None:
    assert not await _next_pulled_while_broadcast_in_flight(stable=False)


async def test_a_list_takes_the_fast_path_without_a_flag_and_a_generator_keeps_the_safe_one() -> None:
    """The low-level API as the README shows it: a list (which cannot reuse memory) overlaps the next tensor
    with the broadcast by default; a generator of the caller's, which might, waits for it by default."""
    assert await _next_pulled_while_broadcast_in_flight(stable=None, as_list=True)
    assert not await _next_pulled_while_broadcast_in_flight(stable=None)


def test_which_iterables_hold_their_tensors() -> None:
    from lightning_weightsync.versions.source import holds_its_tensors

    model = torch.nn.Linear(2, 2)
    items = [("w", torch.zeros(1))]
    holding = [items, tuple(items), dict(items).items(), iter(items), iter(dict(items).items()),
               model.named_parameters(), model.named_buffers(), model.state_dict().items()]  # fmt: skip
    assert all(holds_its_tensors(w) for w in holding), [type(w).__name__ for w in holding if not holds_its_tensors(w)]
    mine = [(n, t) for n, t in items]
    assert not holds_its_tensors(x for x in mine)  # a generator may refill one buffer: the safe path
    assert not holds_its_tensors(map(tuple, mine))


async def test_a_tensor_whose_head_fills_a_bucket_and_whose_tail_is_packed_arrives_after_the_open_bucket() -> None:
    """`transport.direct_min_mb=0`: a chunk that fills a whole bucket goes direct; a tensor just over a bucket
    then sends its head direct and its tail packed. The packed bucket open before it goes out first: sent after
    the head, its tensors came between the tensor's chunks and the receiver refused the version."""
    weights = [("s1", _tensor(32 * KIB, 1)), ("s2", _tensor(32 * KIB, 2)), ("t", _tensor(64 * KIB + 4, 3))]
    sender, receiver = await _pair(transport__direct_min_mb=0)
    try:

        async def consume() -> dict[str, torch.Tensor]:
            return {name: tensor.clone() async for name, tensor in receiver.receive_weights()}

        got, stats = await with_timeout(asyncio.gather(consume(), sender.send_weights(weights, version=1)))
    finally:
        await receiver.close()
        await sender.close()
    assert_bitwise(got, weights)
    assert (stats.num_buckets, stats.direct_buckets) == (3, 1)  # [s1 s2] [t head, direct] [t tail]
