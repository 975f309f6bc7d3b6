"""`tools/fanout_late_joiner.py`'s pure parts: the late-joiner row built from what the trainer, the receivers,
the peer and the joiner wrote, its bitwise verdict, and the table. The measurement itself needs network namespaces
(tests/integration/test_fanout_links.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tools.fanout_late_joiner import (
    JOIN_AFTER,
    JOINER,
    LATE_KEYS,
    PEER,
    all_bitwise,
    expected_lines,
    late_joiner_row,
    late_receiver_overrides,
    late_table,
)
from tools.fanout_links import ROW_KEYS

MIB = 2**20
S = 16 * MIB


def trainer_lines(versions: int = 4) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = [
        {"link": "t0", "version": v, "seconds": float(v), "receivers": 2 + (v > JOIN_AFTER), "tx": v * S, "rx": v}
        for v in range(1, versions + 1)
    ]
    lines.insert(JOIN_AFTER, {"link": "t0", "phase": "catch_up", "seconds": 1.5, "tx": 700, "rx": 1600})
    return lines


def receiver_lines(versions: int = 4) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = [
        {"link": f"r{i}", "version": v, "bitwise": True, "tx": 10 * v + i, "rx": S + v}
        for v in range(1, versions + 1)
        for i in range(2)
    ]
    lines.append({"link": JOINER, "phase": "catch_up", "version": JOIN_AFTER, "seconds": 1.4, "bitwise": True,
                  "peer": "10.0.0.3:29790", "tx": 900, "rx": S + 5})  # fmt: skip
    lines.append({"link": PEER, "phase": "serve", "served": 1, "failed": [], "tx": S + 7, "rx": 800})
    lines += [{"link": JOINER, "version": v, "bitwise": True, "tx": 9, "rx": S} for v in range(JOIN_AFTER + 1, 5)]
    return lines


def test_the_row_is_the_version_before_the_joiner_then_the_catch_up_and_the_versions_it_joined() -> None:
    got = receiver_lines()
    assert len(got) == expected_lines(2, 4)
    row = late_joiner_row("chain", 2, S, 100, trainer_lines(), got)
    assert tuple(row) == LATE_KEYS and LATE_KEYS[: len(ROW_KEYS)] == ROW_KEYS  # the other rows' keys first
    assert json.loads(json.dumps(row)) == row  # one JSON object a row
    assert (row["seconds"], row["trainer_link_bytes"], row["steady_versions"]) == (2.0, 2 * S, 1)  # version 2 only
    assert sorted(row["links"]) == ["r0", "r1", "t0"]  # K receivers: the joiner was not in version 2
    assert row["links"]["r1"] == {"tx": 21, "rx": S + 2}
    assert (row["seconds_joined"], row["seconds_after"], row["receivers_joined"]) == (3.0, 4.0, 3)
    assert row["trainer_link_bytes_joined"] == 3 * S
    assert (row["caught_up_version"], row["catch_up_seconds"], row["trainer_pause_seconds"]) == (2, 1.4, 1.5)
    assert row["catch_up_x_rate_over_slice"] == pytest.approx(1.4 * 12.5e6 / S)
    assert row["catch_up_bytes"] == {"joiner_rx": S + 5, "peer_tx": S + 7, "trainer_tx": 700, "trainer_rx": 1600}
    assert (row["peer"], row["late_joiner"], row["bitwise"]) == (PEER, JOINER, True)
    line = late_table([row])[2]
    assert line.startswith("| chain | 2 | 1.40 |") and "| 2.00 / 3.00 / 4.00 | True |" in line
    # no version after the one it joined: nothing to average
    three = late_joiner_row("chain", 2, S, 100, trainer_lines(3), receiver_lines(3)[:-1])
    assert three["seconds_after"] is None and "/ 3.00 / - |" in late_table([three])[2]


def test_a_row_needs_the_version_before_the_joiner_and_the_one_it_joined() -> None:
    with pytest.raises(ValueError, match="needs 2 and 3"):
        late_joiner_row("tree", 2, S, 100, trainer_lines()[:3], receiver_lines())


@pytest.mark.parametrize(
    "broken",
    [
        "joiner's catch-up wrong",
        "joiner missed a version",
        "receiver held a version wrong",
        "receiver missed a version",
        "no catch-up",
    ],
)
def test_bitwise_is_every_receiver_every_version_and_the_joiner_from_its_catch_up_on(broken: str) -> None:
    got = receiver_lines()
    assert all_bitwise(2, 4, got)
    catch = next(i for i, e in enumerate(got) if e.get("phase") == "catch_up")
    if broken == "joiner's catch-up wrong":
        got[catch] = {**got[catch], "bitwise": False}
    elif broken == "joiner missed a version":
        got = [e for e in got if not (e["link"] == JOINER and e.get("version") == 4 and "phase" not in e)]
    elif broken == "receiver held a version wrong":
        got[3] = {**got[3], "bitwise": False}
    elif broken == "receiver missed a version":
        got = [e for e in got if not (e["link"] == "r1" and e.get("version") == 1)]
    else:
        del got[catch]
    assert not all_bitwise(2, 4, got), broken


def test_the_joiner_and_every_receiver_check_every_tensor_under_their_own_identity() -> None:
    joiner, peer = late_receiver_overrides("10.0.0.2", -1), late_receiver_overrides("10.0.0.2", 0)
    assert f"rollout.identity={JOINER}" in joiner and "rollout.identity=r0" in peer
    assert sum(o.startswith("rollout.identity=") for o in joiner) == 1
    assert all("transport.verify=full" in o and "transport.host=10.0.0.2" in o for o in (joiner, peer))
