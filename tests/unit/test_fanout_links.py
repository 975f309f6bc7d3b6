"""`tools/fanout_links.py`'s pure parts: its arguments, the row it writes, the bytes it reads from link
counters and the model it prints beside the measurement. The measurement itself needs network namespaces
(tests/integration/test_fanout_links.py)."""

from __future__ import annotations

import json

import pytest

from tools.fanout_links import (
    ROW_KEYS,
    STEADY_AFTER,
    counter_delta,
    link_table,
    make_row,
    parse_args,
    predicted_x,
    table,
    trainer_link_bytes,
)

MIB = 2**20


def test_arguments_take_lists_of_receivers_and_trainer_ranks() -> None:
    args = parse_args(["--mb", "16", "--rate-mbit", "100", "--receivers", "2", "4", "8", "--trainer-ranks", "1",
                       "2", "--json", "out/f.jsonl"])  # fmt: skip
    assert (args.mb, args.rate_mbit, args.receivers, args.trainer_ranks) == (16.0, 100, [2, 4, 8], [1, 2])
    assert str(args.json) == "out/f.jsonl" and args.topologies == ["star", "tree", "chain"]


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--receivers", "0"], "--receivers"),
        (["--trainer-ranks", "0"], "--trainer-ranks"),
        (["--mb", "-1"], "--mb"),
        (["--versions", "1"], "--versions"),
        (["--mb", "2", "--tensor-mb", "4"], "--tensor-mb"),
        (["--topologies", "ring"], "--topologies"),
        (["--late-joiner", "--kill"], "--kill"),
        (["--late-joiner", "--slow-link"], "--slow-link"),
        (["--late-joiner", "--trainer-ranks", "1", "2"], "--trainer-ranks"),
        (["--late-joiner", "--receivers", "1"], "--receivers"),
        (["--late-joiner", "--topologies", "star"], "--topologies"),
    ],
)
def test_bad_arguments_are_refused_naming_the_knob(argv: list[str], names: str, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert names in capsys.readouterr().err


def test_late_joiner_rows_take_the_other_rows_arguments() -> None:
    args = parse_args(["--late-joiner", "--receivers", "1", "4", "8", "--topologies", "tree", "chain"])
    assert args.late_joiner and not args.kill and args.receivers == [1, 4, 8]  # K = 1 is skipped, not refused
    assert parse_args([]).late_joiner is False


def test_counter_delta_is_what_moved_and_refuses_a_reset_counter() -> None:
    assert counter_delta({"tx": 100, "rx": 5}, {"tx": 1100, "rx": 7}) == {"tx": 1000, "rx": 2}
    with pytest.raises(ValueError, match="rx_bytes went back"):
        counter_delta({"tx": 1, "rx": 500}, {"tx": 2, "rx": 10})


def test_link_table_averages_each_link_over_the_steady_versions_only() -> None:
    lines = [
        {"link": "t0", "version": 1, "tx": 999, "rx": 999},  # builds the groups: not counted
        {"link": "t0", "version": 2, "tx": 100, "rx": 10},
        {"link": "t0", "version": 3, "tx": 300, "rx": 30},
        {"link": "r0", "version": 2, "tx": 900, "rx": 50},  # a receiver that forwards (tree)
        {"link": "r0", "version": 3, "tx": 1100, "rx": 70},
        {"link": "t1", "version": 2, "tx": 500, "rx": 0},
    ]
    assert STEADY_AFTER == 1
    links = link_table(lines)
    assert links == {"r0": {"tx": 1000, "rx": 60}, "t0": {"tx": 200, "rx": 20}, "t1": {"tx": 500, "rx": 0}}
    assert trainer_link_bytes(links) == 500  # the busiest trainer link, never a receiver's
    assert link_table([{"link": "t0", "version": 1, "tx": 4, "rx": 2}]) == {"t0": {"tx": 4, "rx": 2}}


def test_the_row_has_its_schema_and_normalizes_time_by_rate_and_slice() -> None:
    links = {"t0": {"tx": 3 * 16 * MIB, "rx": 1.0}, "r0": {"tx": 0.0, "rx": 16 * MIB}}
    row = make_row("tree", 4, 1, 16 * MIB, 100, [4.0, 4.2], links, True)
    assert tuple(row) == ROW_KEYS
    assert json.loads(json.dumps(row)) == row  # one JSON object a row
    assert row["seconds"] == pytest.approx(4.1)
    assert row["seconds_x_rate_over_slice"] == pytest.approx(4.1 * 12.5e6 / (16 * MIB))
    assert row["trainer_link_bytes"] == 3 * 16 * MIB
    assert row["predicted_x"] == 3.0  # ceil(log2(5))
    assert row["steady_versions"] == 2 and row["bitwise"] is True
    lines = table([row])
    assert lines[2].startswith("| tree | 4 | 1 | - | 4.10 |") and "48.0" in lines[2]


def test_the_model_is_fanout_md_s() -> None:
    s, c = 16 * MIB, MIB
    assert [predicted_x("star", k, 1, s, c) for k in (2, 4, 8)] == [2, 4, 8]
    assert predicted_x("star", 2, 2, s, c) == 1.0  # a receiver's ingress bounds it
    assert [predicted_x("tree", k, 1, s, c) for k in (2, 4, 8, 16)] == [2, 3, 4, 5]
    assert predicted_x("tree", 8, 2, s, c) == 2.0
    assert predicted_x("chain", 8, 1, s, c) == pytest.approx(1 + 7 / 16)
    with pytest.raises(ValueError, match="one of star, tree, chain"):
        predicted_x("ring", 2, 1, s, c)


def test_a_killed_row_says_when_the_version_failed_and_whether_the_survivors_held_the_rest() -> None:
    from tools.fanout_links import KILLED, killed_row

    senders = [
        {"link": "t0", "version": 1, "seconds": 2.0, "error": None},
        {"link": "t0", "version": 2, "seconds": 0.9, "error": f"PeerError: receiver {KILLED} disconnected"},
        {"link": "t0", "version": 3, "seconds": 2.5, "error": None},
    ]
    survivors = [{"link": "r0", "attempt": 1, "version": 1, "bitwise": True},
                 {"link": "r0", "attempt": 2, "error": "VersionAborted: ..."},
                 {"link": "r0", "attempt": 3, "version": 3, "bitwise": True}]  # fmt: skip
    got = [*survivors, {"link": KILLED, "attempt": 1, "version": 1, "bitwise": True}]
    row = killed_row("chain", 2, senders, got)
    assert (row["seconds_to_fail"], row["seconds_next_version"], row["later_versions_failed"]) == (0.9, 2.5, 0)
    assert row["survivors_failed_version_2"] == 1 and row["bitwise"] is True and KILLED in row["failed_with"]
    # a survivor that missed version 3, or held it wrong, is not a recovery
    assert killed_row("chain", 2, senders, [*got[:2], {"link": "r0", "attempt": 3, "error": "x"}])["bitwise"] is False
    assert killed_row("chain", 2, senders, [*got[:2], {**survivors[2], "bitwise": False}])["bitwise"] is False
