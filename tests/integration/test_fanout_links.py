"""`tools/fanout_links.py` over real namespaces and rate-limited links: the star sends each receiver its own
copy, gloo's tree fewer, and every receiver holds every version bitwise. Byte counts, never timings."""

from __future__ import annotations

import pytest

from tools.fanout_links import run
from tools.netlab import netlab, skip_reason

_SKIP = skip_reason()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_SKIP is not None, reason=f"network namespaces unavailable: {_SKIP}"),
]


@pytest.mark.timeout(300)
def test_star_sends_a_copy_a_receiver_and_the_tree_fewer() -> None:
    with netlab() as lab:
        star = run(lab, "star", 3, 1, 200, 4.0, 4.0, 2)
        tree = run(lab, "tree", 3, 1, 200, 4.0, 4.0, 2)
    s = star["slice_bytes"]
    for row in (star, tree):
        assert row["bitwise"] is True
        assert sorted(row["links"]) == ["r0", "r1", "r2", "t0"]
        assert all(row["links"][f"r{i}"]["rx"] >= s for i in range(3))  # every receiver took the model
    assert 3 * s <= star["trainer_link_bytes"] < 3.2 * s  # three lanes of one: three copies
    assert 2 * s <= tree["trainer_link_bytes"] < 2.2 * s  # binomial tree of 4: two rounds from the root
