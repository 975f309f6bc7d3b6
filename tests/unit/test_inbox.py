"""The sender's inbox (`transport/control/inbox.py`): what its socket thread read while the trainer did not,
per connection, within a budget. Pure bookkeeping, so checked here without sockets; the whole path (a
token holder flooding a trainer in its training step, real processes) is in
tests/integration/test_hostile_network.py."""

from __future__ import annotations

from lightning_weightsync.transport.control.inbox import MESSAGE_OVERHEAD, TRIM_TO, Inbox, message_cost


def _msg(route: bytes, n: int, size: int = 10) -> list[bytes]:
    return [route, n.to_bytes(4, "big") + b"x" * (size - 4)]


def _drain(inbox: Inbox) -> list[tuple[bytes, int]]:
    got = []
    while (frames := inbox.take()) is not None:
        got.append((frames[0], int.from_bytes(frames[1][:4], "big")))
    return got


def test_past_a_connections_message_budget_its_oldest_are_dropped_and_counted() -> None:
    """The newest survive: an idle receiver's latest Register carries the nonce its next Prepare echoes."""
    drops: list[tuple[bytes, str]] = []
    inbox = Inbox(messages_per_connection=4, on_drop=lambda route, why: drops.append((route, why)))
    for n in range(10):
        inbox.put(_msg(b"a", n))
    assert inbox.overflowed == 6 and len(drops) == 6 and drops[0][0] == b"a"
    assert "per-connection budget" in drops[0][1]
    assert _drain(inbox) == [(b"a", n) for n in range(6, 10)]
    assert inbox.nbytes == 0


def test_past_a_connections_byte_budget_its_oldest_are_dropped() -> None:
    cost = message_cost(_msg(b"a", 0, 1000))
    inbox = Inbox(bytes_per_connection=3 * cost)
    for n in range(5):
        inbox.put(_msg(b"a", n, 1000))
    assert inbox.overflowed == 2 and inbox.nbytes == 3 * cost
    assert [n for _, n in _drain(inbox)] == [2, 3, 4]


def test_a_flooding_connection_costs_another_connection_nothing() -> None:
    inbox = Inbox(messages_per_connection=8)
    inbox.put(_msg(b"honest", 0))
    for n in range(1000):
        inbox.put(_msg(b"flood", n))
    inbox.put(_msg(b"honest", 1))
    got = _drain(inbox)
    assert [n for route, n in got if route == b"honest"] == [0, 1]
    assert inbox.overflowed == 1000 - 8


def test_connections_are_served_in_turn() -> None:
    """A connection with a backlog cannot keep a receiver's `Ready` waiting behind it."""
    inbox = Inbox()
    for n in range(50):
        inbox.put(_msg(b"flood", n))
    inbox.put(_msg(b"honest", 0))
    assert (b"honest", 0) in _drain(inbox)[:2]


def test_past_the_total_the_largest_queues_are_cut_and_small_ones_kept() -> None:
    """Many connections, each within its own budget, together over the cap: the big queues lose their
    oldest messages down to a common level; a small (honest) queue keeps everything."""
    size = 1000
    cost = message_cost(_msg(b"x", 0, size))
    inbox = Inbox(messages_per_connection=100, bytes_per_connection=100 * cost, total_bytes=200 * cost)
    for n in range(3):
        inbox.put(_msg(b"honest", n, size))
    for route in (b"f1", b"f2", b"f3"):
        for n in range(80):
            inbox.put(_msg(route, n, size))
    assert inbox.nbytes <= 200 * cost and inbox.overflowed > 0
    got = _drain(inbox)
    assert [n for route, n in got if route == b"honest"] == [0, 1, 2]
    for route in (b"f1", b"f2", b"f3"):
        kept = [n for r, n in got if r == route]
        assert kept and kept == list(range(80 - len(kept), 80)), (route, kept)  # the newest are kept


def test_a_trim_frees_an_eighth_of_the_cap_so_the_next_messages_drop_nothing() -> None:
    """Past the total the queues are cut to TRIM_TO of it, not just under it: the messages that follow, up to an
    eighth of the cap, are all kept (a trim that freed only what was over would drop on nearly every message)."""
    size = 1000
    cost = message_cost(_msg(b"f1", 0, size))
    cap = 160 * cost
    inbox = Inbox(messages_per_connection=1000, bytes_per_connection=1000 * cost, total_bytes=cap)
    routes = [b"f1", b"f2", b"f3", b"f4"]
    n = 0
    while inbox.overflowed == 0:
        inbox.put(_msg(routes[n % 4], n, size))
        n += 1
    assert n == 161 and inbox.nbytes <= cap * TRIM_TO, (n, inbox.nbytes / cost)
    dropped = inbox.overflowed
    assert dropped >= 20, dropped  # 161 messages down to at most 140
    for _ in range(cap // 8 // cost - 1):  # another eighth of the cap, less one message: kept whole
        inbox.put(_msg(routes[n % 4], n, size))
        n += 1
    assert inbox.overflowed == dropped and inbox.nbytes <= cap


def test_a_message_costs_its_bytes_and_its_objects() -> None:
    assert message_cost([b"ab", b"cde"]) == 5 + MESSAGE_OVERHEAD
