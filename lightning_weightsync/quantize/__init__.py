"""Trainer-side quantization to the contract a rollout declares (block FP8, MXFP8), bitwise what the engines' own
quantizers compute; torch and the errors module only, so any layer above may use it."""

from .contract import QuantContract, QuantRule
from .schemes import SCHEMES, Scheme, quantize_fp8_block, quantize_fp8_block_ue8m0, quantize_mxfp8
from .shards import ShardBlocks, quantize_shard, shard_blocks
from .stream import QuantizedPart, QuantizedStream, Quantizer, QuantStats, quantize_stream

__all__ = [
    "SCHEMES",
    "QuantContract",
    "QuantRule",
    "QuantStats",
    "QuantizedPart",
    "QuantizedStream",
    "Quantizer",
    "Scheme",
    "ShardBlocks",
    "quantize_fp8_block",
    "quantize_fp8_block_ue8m0",
    "quantize_mxfp8",
    "quantize_shard",
    "quantize_stream",
    "shard_blocks",
]
