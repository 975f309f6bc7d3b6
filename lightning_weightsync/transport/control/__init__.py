"""ZeroMQ control plane: registration, liveness, signed messages and the data-plane rendezvous; one
job a file: `link.py` (endpoints, CURVE keys, the ZAP check), `sender.py` and `receiver.py` (the two
socket ends), `store.py` (the rendezvous store behind the sender's socket). It moves messages and
knows no version policy: what a message means for a version of weights is `versions/steps.py`'s.
"""

from __future__ import annotations

from .link import CurveKeys, curve_keys, endpoint
from .receiver import ReceiverControl, default_identity
from .sender import Peer, SenderControl
from .store import ControlPlaneStore, StoreServer

__all__ = [
    "ControlPlaneStore",
    "CurveKeys",
    "Peer",
    "ReceiverControl",
    "SenderControl",
    "StoreServer",
    "curve_keys",
    "default_identity",
    "endpoint",
]
