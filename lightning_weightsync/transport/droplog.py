"""Dropped-message reporting that a flood cannot turn into a log flood: every socket that reads what a
peer sent (the control plane, the shm / nixl release sockets) reports a drop through one of these."""

from __future__ import annotations

import logging
import math
import time

DROP_LOG_INTERVAL_S = 10.0  # at most one WARNING line per reporter and interval for dropped messages

_logger = logging.getLogger(__name__)


class DropLog:
    """The first drop is a WARNING; later ones are counted (`dropped`) and summarised in at most one
    line every `interval_s`, so 20,000 garbage frames cost one line, not 20,000."""

    def __init__(
        self,
        what: str,
        interval_s: float = DROP_LOG_INTERVAL_S,
        log: logging.Logger | None = None,
        level: int = logging.WARNING,
    ) -> None:
        self.what, self.interval_s, self.level = what, interval_s, level
        self.log = log or _logger
        self.dropped = 0
        self._last = -math.inf
        self._unreported = 0

    def note(self, peer: str, reason: object) -> None:
        self.dropped += 1
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            more = f" (and {self._unreported} more since the last report)" if self._unreported else ""
            self.log.log(self.level, "%s from %s: %s%s", self.what, peer, reason, more)
            self._last, self._unreported = now, 0
        else:
            self._unreported += 1
            self.log.debug("%s from %s: %s", self.what, peer, reason)
