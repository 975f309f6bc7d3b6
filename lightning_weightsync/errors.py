"""One exception hierarchy, so callers can catch `WeightSyncError` and know it came from us.

Messages name the offending value and the config knob that fixes it.
"""

from __future__ import annotations


class WeightSyncError(RuntimeError):
    """Base of every error this package raises on purpose."""


class ConfigError(WeightSyncError, ValueError):
    """A config value is unknown, out of range or inconsistent; raised at load time."""


class ProtocolError(WeightSyncError):
    """A chunk stream or control message is malformed, out of order, or unauthenticated."""


class WeightSyncTimeout(WeightSyncError, TimeoutError):
    """A bounded wait expired; the message names what was awaited and from whom."""


class PeerError(WeightSyncError):
    """A peer reported a failure or went away mid-version.

    When the bytes went out but some receivers nacked, `stats` holds the sender's `SendStats`.
    """

    stats: object | None = None


class VersionAborted(PeerError):
    """The sender aborted the version in flight; nothing of it may be applied."""


class CannotAsk(PeerError):
    """A rollout runs without what would say which weights its workers hold (a route, a worker method)."""


class Interrupted(WeightSyncError):
    """A version stopped on purpose before it was delivered (a SIGTERM / SIGINT on some trainer rank)."""


class SinkError(WeightSyncError):
    """A sink cannot accept a tensor (unknown name, wrong shape or dtype) or failed to apply."""


class VerifyError(WeightSyncError):
    """A merged tensor's bytes differ from what the sender fingerprinted (`transport.verify`): corrupted on the
    way; the version fails naming the tensor and nothing of it is applied."""


class DeltaError(WeightSyncError):
    """A delta (`transport.delta`) cannot be applied here: no held version, or another one than its base; the
    version fails, the held one stays, and the sender's next sync to this receiver is whole."""


class QuantizeError(WeightSyncError, ValueError):
    """A weight cannot be quantized to the rollout's contract (a NaN or inf in it, a shape or dtype the scheme
    does not take, a name the contract does not cover), or a contract is malformed; never answered by sending
    the bf16 tensor instead."""


class BackendUnavailable(WeightSyncError, ImportError):
    """An optional dependency (of a backend, an integration such as Lightning, or vLLM) or the hardware is
    missing; names the extra to install."""


_UNSAID = {
    "CancelledError": "cancelled: the process is stopping, or the caller gave up on it",
    "TimeoutError": "a wait expired",
    "KeyboardInterrupt": "interrupted (SIGINT)",
}


def explain(exc: BaseException) -> str:
    """`Type: message` for logs, acks and abort reasons. Some exceptions carry no message (a cancellation,
    a bare timeout), and a reason that reads `CancelledError: ` tells an operator nothing: those say
    what they mean instead."""
    text = str(exc).strip()
    name = type(exc).__name__
    if text:
        return f"{name}: {text}"
    return f"{name} ({_UNSAID.get(name, 'no message')})"
