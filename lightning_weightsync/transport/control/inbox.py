"""The sender's inbox: what its socket thread read and the trainer has not yet looked at, one queue per
connection, within a budget.

Why it exists: libzmq must never stop reading a control connection (`transport/sockets.py`: a full
receive pipe plus a reset peer aborts the process), so the sender's ROUTER has no receive high-water
mark, and a trainer in a training step reads nothing for minutes. Whatever a peer sends meanwhile has to
wait somewhere; before, it waited in libzmq's pipe without bound (~260 B a message, as fast as a token
holder could send). Now a thread reads the socket all the time (`router.py`) and the messages wait here,
where they are counted and capped.

The budget, and why these numbers. An honest receiver sends a handful of messages per version (`Ready`,
`Ack`, a `BucketDone` per stalled bucket, a few `StoreRequest`s while the data-plane group forms) and one
`Register` per `transport.heartbeat_interval_s` while idle; the sender reads every `PUMP_EVERY_S` while a
version runs, so only the idle `Register`s pile up: 256 of them is 8.5 minutes of training step at the
default 2 s, about 125 KiB (a sealed `Register` is ~250 B, counted with its Python objects as ~500).
Past a budget the OLDEST message of that connection goes: for an honest peer that is a superseded
`Register` (the newest one carries the nonce the seal of its `Prepare` must answer, and the receiver remembers only its
last 256), for a flooder its own backlog; a flood never costs another connection its messages. The total
cap bounds many connections together: past it, the largest queues are cut (oldest first) to a common
level, 7/8 of the cap, so a trim is rare and honest (small) queues are the last to lose anything.

Thread-safe: the socket thread `put`s, the asyncio side `take`s; one lock, held for a few dict and deque
operations.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

QUEUE_MESSAGES = 256  # per connection: 8.5 min of an idle receiver's Registers at the default 2 s heartbeat
QUEUE_BYTES = 1 << 20  # per connection: 256 honest messages are ~125 KiB; 15 of the largest legal frame
TOTAL_BYTES = 32 << 20  # all connections together (a full queue of honest Registers each: ~260 receivers)
MESSAGE_OVERHEAD = 256  # bytes a queued message costs beyond its frames (measured: a list of 4 bytes objects, 220)
TRIM_TO = 7 / 8  # past TOTAL_BYTES the largest queues are cut until this fraction of it is left


def message_cost(frames: list[bytes]) -> int:
    """What one queued message is counted as: its bytes and the Python objects that hold them."""
    return sum(len(f) for f in frames) + MESSAGE_OVERHEAD


@dataclass
class _Queue:
    messages: deque[tuple[list[bytes], int]] = field(default_factory=deque)  # (frames, cost), oldest first
    nbytes: int = 0


class Inbox:
    """Messages keyed by connection (their first frame, the ROUTER's route), taken round-robin so a
    connection that floods cannot delay an honest receiver's `Ready` by more than one message."""

    def __init__(
        self,
        *,
        messages_per_connection: int = QUEUE_MESSAGES,
        bytes_per_connection: int = QUEUE_BYTES,
        total_bytes: int = TOTAL_BYTES,
        on_drop: Callable[[bytes, str], None] | None = None,
    ) -> None:
        self.messages_per_connection = messages_per_connection
        self.bytes_per_connection = bytes_per_connection
        self.total_bytes = total_bytes
        self._on_drop = on_drop
        self._queues: OrderedDict[bytes, _Queue] = OrderedDict()  # the next to serve first; none empty
        self._lock = threading.Lock()
        self.nbytes = 0  # counted cost of every queued message
        self.overflowed = 0  # messages dropped to keep the budget

    def __len__(self) -> int:
        with self._lock:
            return sum(len(q.messages) for q in self._queues.values())

    def __bool__(self) -> bool:
        return bool(self._queues)

    def put(self, frames: list[bytes]) -> None:
        """Queue one message (`frames[0]` is its connection); drop what the budget no longer holds."""
        route, cost = frames[0], message_cost(frames)
        dropped: list[tuple[bytes, str]] = []
        with self._lock:
            queue = self._queues.get(route)
            if queue is None:
                queue = self._queues[route] = _Queue()
            queue.messages.append((frames, cost))
            queue.nbytes += cost
            self.nbytes += cost
            while len(queue.messages) > self.messages_per_connection or queue.nbytes > self.bytes_per_connection:
                self._drop_oldest(route, queue)
                dropped.append((route, self._over_connection()))
            if not queue.messages:
                del self._queues[route]
            if self.nbytes > self.total_bytes:
                dropped += self._trim()
        self.overflowed += len(dropped)
        if self._on_drop is not None:
            for where, why in dropped:
                self._on_drop(where, why)

    def take(self) -> list[bytes] | None:
        """The oldest message of the next connection in turn, or None when nothing is queued."""
        with self._lock:
            if not self._queues:
                return None
            route, queue = next(iter(self._queues.items()))
            frames, cost = queue.messages.popleft()
            queue.nbytes -= cost
            self.nbytes -= cost
            if queue.messages:
                self._queues.move_to_end(route)
            else:
                del self._queues[route]
            return frames

    def _drop_oldest(self, route: bytes, queue: _Queue) -> None:
        _, cost = queue.messages.popleft()
        queue.nbytes -= cost
        self.nbytes -= cost

    def _over_connection(self) -> str:
        return (
            f"its queue is over the per-connection budget ({self.messages_per_connection} messages, "
            f"{self.bytes_per_connection >> 10} KiB) while the trainer was not reading; its oldest message is "
            "dropped (an honest receiver sends a handful per version)"
        )

    def _trim(self) -> list[tuple[bytes, str]]:
        """Cut every queue above a common level (found by bisection) until TRIM_TO of the cap is left;
        the oldest messages go first. Called only past the cap, and then frees an eighth of it."""
        target = int(self.total_bytes * TRIM_TO)
        sizes = [q.nbytes for q in self._queues.values()]
        low, high = 0, max(sizes)  # the level: sum(min(size, level)) <= target holds at `low`
        while low < high:
            mid = (low + high + 1) // 2
            if sum(min(s, mid) for s in sizes) <= target:
                low = mid
            else:
                high = mid - 1
        why = (
            f"the queues of all connections together are over {self.total_bytes >> 20} MiB while the trainer was "
            "not reading; the largest queues lose their oldest messages"
        )
        dropped: list[tuple[bytes, str]] = []
        for route, queue in list(self._queues.items()):
            while queue.nbytes > low:
                self._drop_oldest(route, queue)
                dropped.append((route, why))
            if not queue.messages:
                del self._queues[route]
        return dropped
