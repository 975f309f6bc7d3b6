"""A real `lightning-weightsync rollout` process that dies, without a word, as it starts forwarding the second
bucket of the second version it takes part in along a chain (transport.fanout=chain): the member killed mid-version.

    python -m tests.support.dying_rollout rollout key=value ...
"""

from __future__ import annotations

import os
import sys
from typing import Any

from lightning_weightsync import cli
from lightning_weightsync.transport.backends import torch_pg


def main(argv: list[str]) -> int:
    relay = torch_pg.start_relay
    firsts = 0  # versions begun: every version's first bucket is bucket 0

    def dying(pg: Any, data: Any, bucket_index: int, *rest: Any) -> Any:
        nonlocal firsts
        firsts += bucket_index == 0
        if firsts == 2 and bucket_index == 1:
            os._exit(0)  # no Bye, no ack: the kernel closes its sockets
        return relay(pg, data, bucket_index, *rest)

    torch_pg.start_relay = dying  # type: ignore[assignment]
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
