"""A version quantized on the trainer to the contract its receivers declare (quantize/), both sides.

    receiver   `DeclaredContract`: the contract its model loads (`WeightReceiver.declare_contract`), sent whole
               before every Ready (`Contract`, a few KiB of patterns), the Ready naming its digest
    sender     `version_contract`: the one contract every receiver of the version declared, or none; receivers
               that disagree, a digest whose body did not come, or a body that does not decode refuse the version
               before anything is sent (named, with the knob); then every tensor the caller yields goes through
               the contract's quantizer (`QuantizedSource`) before the lanes cut it: slices, verify, delta and
               layout once all see the bytes the rollout loads, an FP8 weight and its scale tensor

The rollout's model is the authority on what it loads, so the sender never decides it, and never falls back
to sending a tensor as the trainer holds it where the contract asks for it quantized: a NaN weight, a name the
contract does not cover, or a scheme this library does not make fails the version (a local failure: the group
is kept) with the rollout still serving the previous one. One version is sent one way: receivers of one sender
that want different contracts (one FP8 server, one bf16) are refused, each named, rather than served half.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping

import torch

from ..errors import ProtocolError, QuantizeError
from ..protocol.chunks import TensorShard
from ..protocol.messages import CONTRACT_BYTES, Contract, Plan, Ready, contract_digest
from ..quantize import QuantContract, Quantizer, QuantStats
from ..transport.control import Peer, ReceiverControl


class DeclaredContract:
    """What a receiver declared: the contract's canonical JSON (the body of its `Contract` message) and digest."""

    def __init__(self, contract: QuantContract) -> None:
        self.contract = contract
        self.body = json.dumps(contract.to_wire(), sort_keys=True, separators=(",", ":")).encode()
        if len(self.body) > CONTRACT_BYTES:
            raise QuantizeError(
                f"the quantization contract is {len(self.body)} bytes as JSON (limit {CONTRACT_BYTES}): its "
                f"{len(contract.rules)} rules and {len(contract.keep)} kept patterns are too many; name tensors by "
                "patterns (a digit component as '*') rather than one by one"
            )
        self.digest = contract_digest(self.body)

    def message(self, identity: str) -> Contract:
        return Contract(identity, self.digest, self.body)


class ContractDeclaration:
    """A receiver's side: the contract it declared (or none), sent whole before every Ready, checked in the plan."""

    def __init__(self) -> None:
        self.declared: DeclaredContract | None = None

    def declare(self, contract: QuantContract | None) -> None:
        self.declared = DeclaredContract(contract) if contract is not None else None

    async def send(self, control: ReceiverControl, identity: str) -> str:
        """Before a Ready: the contract's `Contract` message (so no version is sent without it); its digest."""
        if self.declared is None:
            return ""
        await control.send(self.declared.message(identity))
        return self.declared.digest

    def check(self, plan: Plan, address: str) -> None:
        """A plan sent by another contract than the one declared would put bytes of the wrong format into the model."""
        declared = self.declared.digest if self.declared is not None else ""
        if plan.contract != declared:
            raise ProtocolError(
                f"version {plan.version}: the sender at {address} sends it by quantization contract "
                f"{plan.contract or 'none'}, this receiver declared {declared or 'none'}; nothing of it is applied"
            )


def version_contract(
    version: int, peers: list[Peer], readies: Mapping[str, Ready], contracts: dict[str, Contract]
) -> tuple[str, QuantContract | None]:
    """The contract (digest, decoded) every receiver of `version` declared, or ("", None) when none did."""
    for identity in [i for i in contracts if all(p.identity != i for p in peers)]:
        del contracts[identity]  # only this version's receivers' contracts are kept: bounded by the registry
    wants: dict[str, list[str]] = {}
    for peer in peers:
        wants.setdefault(readies[peer.identity].contract, []).append(peer.identity)
    if len(wants) > 1:
        said = "; ".join(f"{', '.join(sorted(who))}: {digest or 'none (tensors as the trainer holds them)'}"
                         for digest, who in sorted(wants.items()))  # fmt: skip
        raise QuantizeError(
            f"version {version}: its receivers declare different quantization contracts ({said}); one version is "
            "sent one way: point the rollouts that load another format at a trainer sender of their own"
        )
    digest, who = next(iter(wants.items()))
    if not digest:
        return "", None
    declared = contracts.get(who[0])
    if declared is None or declared.digest != digest:
        raise ProtocolError(f"version {version}: receiver {who[0]} named quantization contract {digest} in its Ready "
                            "but its contract did not arrive (lost on a full queue): it is sent again with the next "
                            "version")  # fmt: skip
    try:
        wire = json.loads(declared.body)
    except ValueError as exc:
        why = f"version {version}: receiver {who[0]}'s"
        raise ProtocolError(f"{why} quantization contract is not JSON: {exc}") from None
    return digest, QuantContract.from_wire(wire)


def version_quantizer(
    version: int, peers: list[Peer], readies: Mapping[str, Ready], contracts: dict[str, Contract]
) -> tuple[str, QuantizedSource | None]:
    """The digest the plans name and the quantizer of the contract every receiver of `version` declared, or ("",
    None); receivers that disagree, or a contract that does not decode, raise (nothing was sent yet)."""
    digest, contract = version_contract(version, peers, readies, contracts)
    return digest, QuantizedSource(contract) if contract is not None else None


class QuantizedSource:
    """The caller's tensors as the contract says the rollout loads them, one at a time, each quantized off the
    event loop (block FP8 of a large weight takes CPU seconds; the control plane keeps being served)."""

    def __init__(self, contract: QuantContract) -> None:
        self._quantizer = Quantizer(contract)

    @property
    def stats(self) -> QuantStats:
        return self._quantizer.stats

    async def one(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return await asyncio.to_thread(self._quantizer.one, name, tensor)

    async def shard(self, name: str, shard: TensorShard) -> list[tuple[str, torch.Tensor | TensorShard]]:
        """This sender's shard (sharded send mode) as shards of the FP8 weight and of its scales, quantized here
        where it holds whole blocks (`quantize/shards.py`; refused where it cuts one); kept tensors as they are."""
        if shard.box is not None:
            raise QuantizeError(f"{name}: a shard of a box cannot be quantized to the rollout's contract")
        parts = await asyncio.to_thread(self._quantizer.shard, name, shard.shape, shard.byte_offset, shard.data)
        if parts is None:
            return [(name, shard)]
        return [(p.name, TensorShard(p.shape, p.dtype, p.byte_offset, p.data)) for p in parts]


__all__ = ["ContractDeclaration", "DeclaredContract", "QuantizedSource", "version_contract", "version_quantizer"]
