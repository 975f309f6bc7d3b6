"""`tools/fanout_links.py` over real namespaces and rate-limited links: the star sends each receiver its own
copy, gloo's tree fewer, a chain one, and every receiver holds every version bitwise; a late joiner takes its
version from a peer, not over the trainer's link. Byte counts, never timings."""

from __future__ import annotations

import pytest

from tools.fanout_late_joiner import run_late_joiner
from tools.fanout_links import run
from tools.netlab import netlab, skip_reason

_SKIP = skip_reason()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_SKIP is not None, reason=f"network namespaces unavailable: {_SKIP}"),
]


@pytest.mark.timeout(300)
def test_star_sends_a_copy_a_receiver_the_tree_fewer_and_a_chain_one() -> None:
    with netlab() as lab:
        star = run(lab, "star", 3, 1, 200, 4.0, 4.0, 2)
        tree = run(lab, "tree", 3, 1, 200, 4.0, 4.0, 2)
        chain = run(lab, "chain", 3, 1, 200, 4.0, 4.0, 2)
    s = star["slice_bytes"]
    for row in (star, tree, chain):
        assert row["bitwise"] is True
        assert sorted(row["links"]) == ["r0", "r1", "r2", "t0"]
        assert all(row["links"][f"r{i}"]["rx"] >= s for i in range(3))  # every receiver took the model
    assert 3 * s <= star["trainer_link_bytes"] < 3.2 * s  # three lanes of one: three copies
    assert 2 * s <= tree["trainer_link_bytes"] < 2.2 * s  # binomial tree of 4: two rounds from the root
    assert s <= chain["trainer_link_bytes"] < 1.1 * s  # the chain's head only
    # r0 -> r1 -> r2: each but the tail forwards what it took, the tail nothing (a version's counters are read
    # when it is complete on that receiver: its last forwarded bytes may still sit in the socket's queue)
    sent = [chain["links"][f"r{i}"]["tx"] for i in range(3)]
    assert sent[0] >= 0.95 * s and sent[1] >= 0.95 * s and sent[2] < 0.1 * s, sent


@pytest.mark.timeout(300)
def test_a_late_joiner_catches_up_from_its_peer_and_the_trainer_link_carries_none_of_it() -> None:
    with netlab() as lab:
        row = run_late_joiner(lab, "chain", 2, 200, 4.0, 4.0, 3)
    s = row["slice_bytes"]
    assert row["bitwise"] is True and row["caught_up_version"] == 2  # every receiver, the joiner's catch-up and v3
    got = row["catch_up_bytes"]
    assert got["joiner_rx"] >= s and got["peer_tx"] >= s, got  # the version came over the peer's link
    assert got["trainer_tx"] < 0.01 * s, got  # and none of it over the trainer's (control messages only)
    assert row["receivers_joined"] == 3  # then the joiner took the trainer's next version as a member of the lane
    assert s <= row["trainer_link_bytes_joined"] < 1.1 * s  # the chain's head only, with the joiner in the chain
