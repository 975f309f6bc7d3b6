"""What a rollout answers to "which version do I hold, and do my weights match it" (daemon: GET /weights).

The receiver remembers, for the last version it took whole, the fingerprint of every tensor it checked
(`versions/verify.py`: they matched the trainer's on arrival, or the version would have failed). Where the
sink holds its tensors (`Sink.snapshot`: the module sink), the answer recomputes their fingerprints now
and compares, so memory corrupted *after* the sync shows too; elsewhere it is what was checked on arrival.
The shape follows vLLM's POST /weight_checker (vllm 0.33.0, entrypoints/rl/online/api_router.py:232-266):
`checksums` {name: digest}, `match`, `mismatches` (names, sorted), so one script can compare both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..versions.verify import VerifyReport, compare_checksums, held_checksums


def held_weights_report(
    version: int | None,
    complete: bool,
    report: VerifyReport | None,
    snapshot: Mapping[str, torch.Tensor] | None,
) -> dict[str, Any]:
    """The /weights body. `version`/`complete`: what the sink holds; `report`: what the receiver checked of
    the version it took last; `snapshot`: the sink's tensors now, or None where it does not hold them."""
    answer: dict[str, Any] = {"version": version, "complete": complete}
    if report is None or not complete or report.version != version:
        # nothing held, or the held version is not the one checked (a streaming version broke since)
        return {**answer, "verify": None, "match": None, "mismatches": [], "checked": "nothing", "checksums": {}}
    answer.update(report.as_dict())
    answer["version"] = version
    if snapshot is not None and report.checksums:
        held = held_checksums(snapshot, list(report.checksums))
        answer.update(compare_checksums(held, report.checksums), checked="now")
    else:
        answer.update(match=report.complete, mismatches=[], checked="on arrival")
    return answer


__all__ = ["held_weights_report"]
