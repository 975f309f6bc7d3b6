"""What a rollout declares its model loads: which checkpoint tensors arrive quantized, how, and which stay as
the trainer holds them.

The trainer cannot know this by itself: the same architecture is served bf16, online-quantized (the engine takes
bf16 and quantizes) or from a serialized FP8 checkpoint (the engine loads FP8 bytes and `weight_scale_inv`), and
a model keeps some tensors unquantized (embeddings, norms, often the router and the LM head, whatever a
checkpoint's `ignored_layers` names). So the rollout says it, the trainer follows it, and nothing is guessed: a
name the contract covers by no rule, or by two that disagree, is an error, not a bf16 fallback.

Names are checkpoint names (what the trainer sends, `model.layers.0.self_attn.q_proj.weight`), matched by
patterns whose `*` is one whole dotted component of digits (a layer or an expert index), so a 48-layer,
128-expert model is a few dozen patterns, not twenty thousand names.

The wire form (`to_wire` / `from_wire`) is plain data (dicts, lists, str, int: msgpack- and JSON-safe, never
pickle), bounded (`MAX_PATTERNS`, `MAX_PATTERN_LEN`) and checked field by field on decode, because it comes
from another process; `digest()` is the SHA-256 of its canonical JSON, for comparing the contracts of several
receivers.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ProtocolError, QuantizeError
from .schemes import SCHEMES

WIRE_FORMAT = 1
MAX_PATTERNS = 8192  # rules and kept patterns together
MAX_PATTERN_LEN = 512
MAX_BLOCK = 1 << 16
LAYOUTS = ("raw",)  # the checkpoint's own layout; kernel-packed scales (swizzled, UE8M0-repacked) are not produced
_COMPONENT = re.compile(r"[A-Za-z0-9_\-]+|\*")
_SUFFIX = re.compile(r"[A-Za-z0-9_]{1,64}")
_RULE_KEYS = {"pattern", "scheme", "block", "element_dtype", "scale_dtype", "scale_suffix", "layout"}


def _check_pattern(pattern: object, what: str) -> str:
    if not isinstance(pattern, str):
        raise QuantizeError(f"{what} is a {type(pattern).__name__}, not a string")
    if not 0 < len(pattern) <= MAX_PATTERN_LEN:
        raise QuantizeError(f"{what} is {len(pattern)} characters long (1 to {MAX_PATTERN_LEN})")
    bad = [c for c in pattern.split(".") if not _COMPONENT.fullmatch(c)]
    if bad:
        raise QuantizeError(f"{what} {pattern[:80]!r} has a component {bad[0][:40]!r} that is neither a name "
                            "(letters, digits, _ and -) nor a whole '*'")  # fmt: skip
    return pattern


def _key(name: str) -> tuple[str, ...]:
    """Names and patterns that could match share this: digit components and stars made one symbol."""
    return tuple("#" if c == "*" or c.isdigit() else c for c in name.split("."))


def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile(r"\.".join("[0-9]+" if c == "*" else re.escape(c) for c in pattern.split(".")))


@dataclass(frozen=True)
class QuantRule:
    """Tensors matching `pattern` arrive as `element_dtype` bytes of their own shape, plus a scale tensor named
    as the weight with its last component replaced by `scale_suffix` (`...q_proj.weight` ->
    `...q_proj.weight_scale_inv`), of `scale_dtype`, one per `block` (rows, columns) of the weight."""

    pattern: str
    scheme: str = "fp8_block"
    block: tuple[int, int] = (128, 128)
    element_dtype: str = "float8_e4m3fn"
    scale_dtype: str = "float32"
    scale_suffix: str = "weight_scale_inv"
    layout: str = "raw"

    def __post_init__(self) -> None:
        _check_pattern(self.pattern, "a rule's pattern")
        known = SCHEMES.get(self.scheme) if isinstance(self.scheme, str) else None
        if known is None:
            raise QuantizeError(f"quantization scheme {str(self.scheme)[:40]!r} is not one this library produces "
                                f"(known: {sorted(SCHEMES)}); the rollout must declare one of them")  # fmt: skip
        block = self.block
        if not (isinstance(block, tuple) and len(block) == 2 and all(type(b) is int for b in block)):
            raise QuantizeError(f"{self.pattern}: block must be two ints, got {str(block)[:40]}")
        if not all(0 < b <= MAX_BLOCK for b in block) or (known.fixed_block and block != known.default_block):
            takes = known.default_block if known.fixed_block else f"1 to {MAX_BLOCK} each"
            raise QuantizeError(f"{self.pattern}: block {block} is not one {self.scheme} takes ({takes})")
        produced = (str(known.element_dtype).removeprefix("torch."), str(known.scale_dtype).removeprefix("torch."))
        if (self.element_dtype, self.scale_dtype) != produced:
            asked = f"{self.element_dtype!s:.40} with {self.scale_dtype!s:.40}"
            raise QuantizeError(f"{self.pattern}: {self.scheme} produces {produced[0]} with {produced[1]} scales, "
                                f"the contract asks {asked}")  # fmt: skip
        if not isinstance(self.scale_suffix, str) or not _SUFFIX.fullmatch(self.scale_suffix):
            raise QuantizeError(f"{self.pattern}: scale_suffix {str(self.scale_suffix)[:80]!r} is not one name "
                                "component (letters, digits, _; up to 64)")  # fmt: skip
        if self.layout not in LAYOUTS:
            raise QuantizeError(f"{self.pattern}: layout {str(self.layout)[:40]!r} is not produced here "
                                f"(known: {list(LAYOUTS)}); kernel-packed scales are the engine's to make")  # fmt: skip

    def scale_name(self, name: str) -> str:
        return f"{name.rpartition('.')[0]}.{self.scale_suffix}" if "." in name else self.scale_suffix

    @property
    def torch_scale_dtype(self) -> torch.dtype:
        return SCHEMES[self.scheme].scale_dtype

    def to_wire(self) -> dict[str, Any]:
        return {"pattern": self.pattern, "scheme": self.scheme, "block": list(self.block),
                "element_dtype": self.element_dtype, "scale_dtype": self.scale_dtype,
                "scale_suffix": self.scale_suffix, "layout": self.layout}  # fmt: skip


@dataclass(frozen=True)
class QuantContract:
    """Rules for the tensors that arrive quantized, patterns for those that travel unchanged (`keep`)."""

    rules: tuple[QuantRule, ...] = ()
    keep: tuple[str, ...] = ()
    _index: dict[tuple[str, ...], list[tuple[re.Pattern[str], str, QuantRule | None]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if len(self.rules) + len(self.keep) > MAX_PATTERNS:
            raise QuantizeError(f"a contract holds {len(self.rules) + len(self.keep)} patterns (limit {MAX_PATTERNS})")
        for pattern in self.keep:
            _check_pattern(pattern, "a kept pattern")
        object.__setattr__(self, "rules", tuple(sorted(self.rules, key=lambda r: r.pattern)))
        object.__setattr__(self, "keep", tuple(sorted(self.keep)))
        patterns = [r.pattern for r in self.rules] + list(self.keep)
        if len(set(patterns)) != len(patterns):
            twice = next(p for p in patterns if patterns.count(p) > 1)
            raise QuantizeError(f"a contract names the pattern {twice!r} twice")
        entries = [(r.pattern, r) for r in self.rules] + [(p, None) for p in self.keep]
        for pattern, rule in entries:
            self._index.setdefault(_key(pattern), []).append((_regex(pattern), pattern, rule))

    def rule_for(self, name: str) -> QuantRule | None:
        """The rule `name` is quantized by, or None when the contract keeps it; an error when it says neither,
        or says both."""
        hits = [(pattern, rule) for rx, pattern, rule in self._index.get(_key(name), ()) if rx.fullmatch(name)]
        if not hits:
            raise QuantizeError(f"{name}: the rollout's quantization contract neither quantizes nor keeps this "
                                "tensor (its model does not load it under this name): rename or exclude it on the "
                                "trainer (trainer.names), or fix the contract")  # fmt: skip
        if len({id(rule) for _, rule in hits}) > 1:
            raise QuantizeError(f"{name}: the rollout's quantization contract says two things of it "
                                f"({[p for p, _ in hits]})")  # fmt: skip
        return hits[0][1]

    def to_wire(self) -> dict[str, Any]:
        return {"format": WIRE_FORMAT, "rules": [r.to_wire() for r in self.rules], "keep": list(self.keep)}

    @classmethod
    def from_wire(cls, data: object) -> QuantContract:
        """A contract from another process, every field checked before use: `ProtocolError` naming the field."""
        try:
            return _decode(data)
        except QuantizeError as exc:
            raise ProtocolError(f"quantization contract refused: {exc}") from None

    def digest(self) -> str:
        canonical = json.dumps(self.to_wire(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


def _decode(data: object) -> QuantContract:
    if not isinstance(data, dict) or set(data) != {"format", "rules", "keep"}:
        keys = sorted(map(str, data))[:8] if isinstance(data, dict) else type(data).__name__
        raise QuantizeError(f"expected a map of format, rules, keep; got {keys}")
    if data["format"] != WIRE_FORMAT or type(data["format"]) is not int:
        raise QuantizeError(f"wire format {str(data['format'])[:20]} is not {WIRE_FORMAT}")
    rules, keep = data["rules"], data["keep"]
    if not isinstance(rules, list) or not isinstance(keep, list):
        raise QuantizeError("rules and keep must be lists")
    if len(rules) + len(keep) > MAX_PATTERNS:
        raise QuantizeError(f"{len(rules) + len(keep)} patterns (limit {MAX_PATTERNS})")
    return QuantContract(tuple(_decode_rule(i, r) for i, r in enumerate(rules)), tuple(keep))


def _decode_rule(index: int, data: object) -> QuantRule:
    if not isinstance(data, dict) or set(data) != _RULE_KEYS:
        keys = sorted(map(str, data))[:10] if isinstance(data, dict) else type(data).__name__
        raise QuantizeError(f"rule {index}: expected the keys {sorted(_RULE_KEYS)}, got {keys}")
    for key in _RULE_KEYS - {"block"}:
        if not isinstance(data[key], str) or len(data[key]) > MAX_PATTERN_LEN:
            raise QuantizeError(f"rule {index}: {key} must be a string of at most {MAX_PATTERN_LEN} characters")
    block = data["block"]
    if not isinstance(block, list) or len(block) != 2 or not all(type(b) is int for b in block):
        raise QuantizeError(f"rule {index}: block must be a list of two ints")
    return QuantRule(**{**data, "block": (block[0], block[1])})
