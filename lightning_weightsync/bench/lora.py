"""A PEFT LoRA model's versions: bytes and seconds a version for `trainer.lora` adapter / merged / full.

One process, a real `WeightSender` and `WeightReceiver` over real ZeroMQ sockets and a gloo group (as the
engine tests run them); the trainer's stream is `SyncDriver.weights` of a Qwen3 built from config (no
download) with a LoRA adapter, rank 16 on every linear layer. Every mode sends a first version (with the
base, `trainer.lora_base: send_once`) and then `versions` more (the adapter changed in between, as an
optimizer step changes it); the figures are those later versions, the steady state. The baseline, measured
in the same run, is what a PEFT model sent before `trainer.lora` existed: every tensor of the wrapped model
as it is (`plain`). The receiver takes whole tensors and drops them (the transfer, not a sink's apply).

    python -m lightning_weightsync.bench.lora [--json] [--hidden 1024] [--layers 4] [--versions 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import torch

from ..config import load_config
from ..transport.process import free_port

MiB = 1 << 20
SIZES: dict[str, dict[str, Any]] = {"small": {"hidden": 256, "layers": 2, "versions": 2}, "default": {}}
"""`lightning-weightsync bench --size`: run() keyword arguments (default: the documented figures)."""
ESTIMATE_S = {"small": 10.0, "default": 20.0}
"""Seconds each size took on the 2-core development machine (printed before the run starts)."""
MODES = ("plain", "full", "merged", "adapter")


def _model(hidden: int, layers: int, rank: int) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=8192, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 128), num_key_value_heads=max(1, hidden // 256), head_dim=128,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    base = Qwen3ForCausalLM(config)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", init_lora_weights=False)
    return get_peft_model(base, lora)


def _step(model: torch.nn.Module, seed: int) -> None:
    """An optimizer step's worth of change to the adapter (the base is frozen)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(1e-3 * torch.randn(p.shape, generator=g))


async def _mode(mode: str, model: torch.nn.Module, versions: int) -> dict[str, Any]:
    from ..trainer.driver import SyncDriver
    from ..trainer.gather import iter_full_parameters
    from ..versions.receiver import WeightReceiver
    from ..versions.sender import WeightSender

    port = free_port()
    knobs = [f"transport.port={port}", "transport.bucket_size_mb=64", "transport.timeout_s=300",
             "transport.heartbeat_interval_s=0.2", "transport.verify=off"]  # fmt: skip
    lora = [] if mode == "plain" else [f"trainer.lora={mode}"]
    cfg = load_config(overrides=knobs + lora)
    driver = SyncDriver(cfg, rank=0, device=None, prefix=None)
    sender, receiver = WeightSender(cfg), WeightReceiver(cfg, identity="bench")
    await sender.start()
    await receiver.start()
    rows = []
    try:
        for version in range(versions + 1):
            weights = iter_full_parameters(model) if mode == "plain" else driver.weights(model)

            async def receive() -> None:
                async for _ in receiver.receive_weights():
                    pass

            t0 = time.perf_counter()
            got = asyncio.ensure_future(receive())
            stats = await sender.send_weights(weights, version=version, lora=driver.lora.spec)
            await got
            rows.append({"seconds": time.perf_counter() - t0, "nbytes": stats.nbytes, "tensors": stats.num_tensors})
            driver.record.delivered(version, None)
            _step(model, version)
    finally:
        await receiver.close()
        await sender.close()
    steady = rows[1:]
    return {
        "first_nbytes": rows[0]["nbytes"],
        "nbytes": steady[-1]["nbytes"],
        "tensors": steady[-1]["tensors"],
        "seconds": min(r["seconds"] for r in steady),
    }


def run(
    json_out: bool = False, *, hidden: int = 1024, layers: int = 4, versions: int = 3, rank: int = 16
) -> dict[str, Any]:
    try:
        model = _model(hidden, layers, rank)
    except ImportError as exc:
        print(f"lora benchmark skipped: {exc} (pip install 'lightning_weightsync[lora]' transformers)")
        return {"skipped": str(exc)}
    results = {mode: asyncio.run(_mode(mode, model, versions)) for mode in MODES}
    model_bytes = results["full"]["nbytes"]  # the plain model: every tensor once, merged
    base = results["plain"]
    for row in results.values():
        row["bytes_vs_plain"] = row["nbytes"] / base["nbytes"]
        row["seconds_vs_plain"] = row["seconds"] / base["seconds"] if base["seconds"] > 0 else float("nan")
    report = {"hidden": hidden, "layers": layers, "rank": rank, "model_bytes": model_bytes, "modes": results}
    if json_out:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"Qwen3 hidden {hidden}, {layers} layers, {model_bytes / MiB:.1f} MiB; LoRA r={rank} on every linear layer"
        )
        print(f"{'trainer.lora':<14}{'first MiB':>10}{'MiB/version':>13}{'s/version':>11}{'bytes':>9}{'seconds':>9}")
        for mode, row in results.items():
            print(
                f"{mode:<14}{row['first_nbytes'] / MiB:>10.2f}{row['nbytes'] / MiB:>13.2f}{row['seconds']:>11.3f}"
                f"{row['bytes_vs_plain']:>9.3f}{row['seconds_vs_plain']:>9.3f}"
            )
        print("(bytes, seconds: a later version's, as a ratio to `plain`, the PEFT model sent as it is)")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--versions", type=int, default=3)
    args = p.parse_args(argv)
    run(args.json, hidden=args.hidden, layers=args.layers, versions=args.versions)
    return 0


if __name__ == "__main__":
    sys.exit(main())
