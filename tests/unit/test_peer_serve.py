"""A joiner's peer addresses are read once, and a wrong one is refused naming it (versions/peer_serve.py)."""

from __future__ import annotations

import pytest

from lightning_weightsync.errors import ConfigError
from lightning_weightsync.versions.peer_serve import peer_address


@pytest.mark.parametrize(
    ("address", "expect"),
    [("127.0.0.1:29700", ("127.0.0.1", 29700)), ("rollout-3:1", ("rollout-3", 1)), ("[::1]:29700", ("::1", 29700))],
)
def test_a_peer_address_is_host_and_port(address: str, expect: tuple[str, int]) -> None:
    assert peer_address(address) == expect


@pytest.mark.parametrize("address", ["rollout-3", ":29700", "rollout-3:", "rollout-3:port", "rollout-3:0", "h:65536"])
def test_a_wrong_peer_address_is_refused_naming_it(address: str) -> None:
    with pytest.raises(ConfigError, match="is not host:port") as err:
        peer_address(address)
    assert repr(address) in str(err.value)
