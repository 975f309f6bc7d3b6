"""The dtype allow-list: the only dtypes a wire message may name.

A name from the network is looked up here and nowhere else, so a hostile message cannot make
us call `getattr(torch, <anything>)`.
"""

from __future__ import annotations

import torch

from ..errors import ProtocolError

_CANDIDATES = (
    "float32", "float16", "bfloat16", "float64",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "bool", "complex64", "complex128",
)  # fmt: skip

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _CANDIDATES if isinstance(getattr(torch, name, None), torch.dtype)
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise ProtocolError(f"dtype {name!r} is not in the allow-list ({', '.join(DTYPES)})") from None


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ProtocolError(f"dtype {dtype} cannot be sent; supported: {', '.join(DTYPES)}") from None


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element; `dtype.itemsize` (torch >= 2.1) allocates nothing, unlike a probe tensor."""
    return dtype.itemsize
