"""Reasons that travel in acks, aborts and logs say something (issue 25 item 9: a daemon stopped
mid-version logged "CancelledError: " with nothing after it)."""

from __future__ import annotations

import asyncio

import pytest

from lightning_weightsync.errors import SinkError, explain


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (asyncio.CancelledError(), "CancelledError (cancelled: the process is stopping, or the caller gave up on it)"),
        (TimeoutError(), "TimeoutError (a wait expired)"),
        (RuntimeError(), "RuntimeError (no message)"),
        (SinkError("  disk full \n"), "SinkError: disk full"),
    ],
)
def test_every_reason_says_something(exc: BaseException, expected: str) -> None:
    assert explain(exc) == expected
