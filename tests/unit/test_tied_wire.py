"""The wire's `tied` list (BucketMeta of bucket 0): round-trips, is optional (an older sender omits
it), and hostile values are refused like any other malformed name."""

from __future__ import annotations

import msgspec
import pytest

from lightning_weightsync.errors import ProtocolError
from lightning_weightsync.protocol.messages import MAX_NAME_LEN, BucketMeta, encode, validate

TIED = {"model.embed_tokens.weight": ["lm_head.weight"]}


def bucket(index: int = 0, tied: dict[str, list[str]] | None = None) -> BucketMeta:
    return BucketMeta(version=1, bucket_index=index, is_last=True, nbytes=0, entries=[], tied=tied or {})


def test_tied_round_trips_and_is_optional() -> None:
    decoder = msgspec.msgpack.Decoder(BucketMeta)
    (body,) = encode(bucket(tied=TIED))
    assert decoder.decode(body).tied == TIED
    old = msgspec.msgpack.encode(
        {"type": "bucket", "version": 1, "bucket_index": 0, "is_last": True, "nbytes": 0, "entries": []}
    )
    assert decoder.decode(old).tied == {}  # a sender without the field
    validate(bucket(tied=TIED))


@pytest.mark.parametrize(
    ("index", "tied", "pattern"),
    [
        (1, TIED, "only bucket 0"),
        (0, {"a": [""]}, "empty"),
        (0, {"a": ["x" * (MAX_NAME_LEN + 1)]}, "over"),
        (0, {"a": ["b"], "c": ["b"]}, "aliased twice"),
        (0, {"a": ["b"], "b": ["c"]}, "aliased twice"),
        (0, {"a": ["a"]}, "aliased twice"),
    ],
)
def test_hostile_tied_lists_are_refused(index: int, tied: dict[str, list[str]], pattern: str) -> None:
    with pytest.raises(ProtocolError, match=pattern):
        validate(bucket(index, tied))
