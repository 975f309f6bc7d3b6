"""One send of a version (trainer/send.py), one value for a version's options (versions/options.py).

Blocking and background syncs, gather and sharded modes are one send with different sources and runners,
and a version's options one value (docs/concepts.md, "Adding an option to a version"): a change that makes a
second copy of the send, or threads an option as one more keyword, fails here.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import inspect
from pathlib import Path

import pytest

from lightning_weightsync.trainer import overlap, send
from lightning_weightsync.versions.options import VersionOptions
from lightning_weightsync.versions.sender import BlockingWeightSender, WeightSender
from tests.unit.test_layers import PACKAGE_DIR


def _calls(path: Path, method: str) -> list[int]:
    tree = ast.parse(path.read_text(), str(path))
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == method
    ]


def test_the_trainer_sends_a_version_in_one_place() -> None:
    callers = {
        str(path.relative_to(PACKAGE_DIR)): lines
        for path in sorted((PACKAGE_DIR / "trainer").glob("*.py"))
        if (lines := _calls(path, "send_weights"))
    }
    assert set(callers) == {"trainer/send.py"}, f"send_weights called outside trainer/send.py: {callers}"


def test_the_integrations_send_a_version_through_send_version() -> None:
    """TRL's and vLLM's trainer adapters send through `send_version` (the rollouts' update around the send and
    the drain written once), never by calling a sender's `send_weights` themselves."""
    for name in ("trl.py", "vllm_trainer.py"):
        path = PACKAGE_DIR / "integrations" / name
        tree = ast.parse(path.read_text(), str(path))
        called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert not _calls(path, "send_weights"), (
            f"integrations/{name} calls send_weights: {_calls(path, 'send_weights')}"
        )
        assert "send_version" in called, f"integrations/{name} does not send through send_version"


def test_the_send_keywords_are_exactly_the_version_options() -> None:
    """The keywords `send_weights` keeps for a caller that sets one option are the fields of `VersionOptions`,
    on both senders: a new option is a field there, not a keyword here."""
    fields = {f.name for f in dataclasses.fields(VersionOptions)}
    for cls in (WeightSender, BlockingWeightSender):
        params = set(inspect.signature(cls.send_weights).parameters) - {"self", "weights", "version", "options"}
        assert params == fields, (cls.__name__, params ^ fields)


def test_the_background_runner_is_given_what_it_sends_through_not_the_driver() -> None:
    path = PACKAGE_DIR / "trainer" / "overlap.py"
    text = path.read_text()
    (cls,) = [n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == "OverlapSync"]
    (fn,) = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "_send"]
    source = ast.get_source_segment(text, fn) or ""
    assert "driver" not in source, source
    assert list(inspect.signature(overlap.OverlapSync._send).parameters) == ["self", "snap", "route", "relay"]
    assert "send_version(" in source  # the same send the blocking runner calls
    driver_source = (PACKAGE_DIR / "trainer" / "driver.py").read_text()
    assert "send_version(" in driver_source and send.send_version.__module__.endswith("trainer.send")


def test_options_and_their_keywords_are_not_mixed() -> None:
    sender = WeightSender()
    with pytest.raises(TypeError, match="not both"):
        asyncio.run(sender.send_weights([], version=0, options=VersionOptions(), lora=None, tied={"a": ["b"]}))
