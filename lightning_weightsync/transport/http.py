"""One JSON request to a rollout server's HTTP API, with errors that name the server and the knob.

The trainer drives rollout engines (vLLM, SGLang) over their own HTTP routes; both clients need the
same thing: a bounded request, the answer decoded as JSON (never anything else: the answer comes from
the network), and failures that say which server, which route and which setting to change. Standard
library only, so the trainer side needs no HTTP dependency.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from ..errors import PeerError, WeightSyncTimeout

MAX_ERROR_DETAIL = 500
"""Characters of an error answer quoted in the exception (enough for FastAPI's detail, not a page)."""


class JSONEndpoint:
    """A server's base URL; `request` sends one call. `label` prefixes every error ("vLLM rollout"),
    `timeout_knob` is the setting that bounds a request ("vllm.request_timeout_s") and `urls_knob` the one
    that lists the server ("vllm.urls")."""

    def __init__(self, url: str, timeout_s: float, *, label: str, timeout_knob: str, urls_knob: str) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.label, self.timeout_knob, self.urls_knob = label, timeout_knob, urls_knob

    def request(
        self,
        path: str,
        body: dict[str, Any] | None = None,
        query: dict[str, str] | None = None,
        method: str = "POST",
        uncapped: bool = False,
    ) -> Any:
        """The decoded JSON answer (None when empty or not JSON). Bounded by `timeout_s` unless `uncapped`
        (a call that lasts a whole transfer, bounded by the caller instead)."""
        timeout = None if uncapped else self.timeout_s
        target = f"{self.url}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(target, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:MAX_ERROR_DETAIL].decode(errors="replace")
            raise PeerError(f"{self.label} {self.url}: {method} {path} failed: HTTP {exc.code}: {detail}") from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                raise self._timeout(method, path) from None
            raise PeerError(
                f"{self.label} {self.url}: {method} {path}: cannot reach the server ({exc.reason}); "
                f"check {self.urls_knob}"
            ) from None
        except TimeoutError:
            raise self._timeout(method, path) from None
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return None

    def _timeout(self, method: str, path: str) -> WeightSyncTimeout:
        return WeightSyncTimeout(
            f"{self.label} {self.url}: {method} {path} got no answer within {self.timeout_knob}={self.timeout_s}s"
        )


__all__ = ["JSONEndpoint"]
