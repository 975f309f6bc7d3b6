"""Verify's cost, and full versus delta syncs: bytes on the wire and seconds.

One process, a real `WeightSender` and `WeightReceiver` over real ZeroMQ sockets and a gloo group (as the
engine tests run them), the receiver holding its version in tensors it updates in place (what the module
sink does with `rollout.apply: streaming`). Every figure is a ratio against the full sync of the same
stream measured in the same run:

- verify: the same full sync with `transport.verify` off, sample and full;
- synthetic: a Qwen3-8B-shaped stream (every dimension divided by `scale`, bf16) with 1 %, 10 % and 50 % of
  its elements changed, sent whole (delta off), as `auto` sends it and as `always` would;
- tiny LM: the example model trained with Adam at lr 1e-6, 1e-5 and 1e-4 (fp32 master weights, sent as
  bf16), one step between two syncs: the changed fraction a real update gives, and what delta makes of it;
  also the share of 4 KiB blocks holding a change (why the sender keeps a copy, not block checksums).

    python -m lightning_weightsync.bench.delta [--json] [--scale 4] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from ..config import load_config
from ..transport.process import free_port
from .inventory import model_stream

MiB = 1 << 20
SIZES: dict[str, dict[str, Any]] = {"small": {"scale": 16, "repeats": 1, "lm_dim": 128}, "default": {}}
"""`lightning-weightsync bench --size`: run() keyword arguments (default: the documented figures)."""
ESTIMATE_S = {"small": 30.0, "default": 240.0}
"""Seconds each size took on the 2-core development machine (printed before the run starts)."""

Weights = dict[str, torch.Tensor]


def _cfg(port: int, **knobs: str) -> Any:
    overrides = [f"transport.port={port}", "transport.bucket_size_mb=64", "transport.timeout_s=300",
                 "transport.ready_timeout_s=30", "transport.heartbeat_interval_s=0.2"]  # fmt: skip
    return load_config(overrides=overrides + [f"transport.{k}={v}" for k, v in knobs.items()])


class _Pair:
    """A sender and a receiver whose held tensors a delta is applied to, in place."""

    def __init__(self, **knobs: str) -> None:
        from ..versions.receiver import WeightReceiver
        from ..versions.sender import WeightSender

        port = free_port()
        self.sender = WeightSender(_cfg(port, **knobs))
        self.receiver = WeightReceiver(_cfg(port, **knobs), identity="bench")
        self.held: Weights = {}
        self.version = 0

    async def __aenter__(self) -> _Pair:
        await self.sender.start()
        await self.receiver.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.receiver.close()
        await self.sender.close()

    def _into(self, meta: Any) -> torch.Tensor | None:
        held = self.held.get(meta.name)
        ok = held is not None and tuple(held.shape) == meta.shape and held.dtype == meta.dtype
        return held if ok else None

    async def sync(self, weights: Weights) -> tuple[float, int, int]:
        """(seconds, bytes on the wire, tensors sent as deltas) of one version, sender start to receiver end."""
        version, self.version = self.version, self.version + 1
        self.receiver.delta_base = version - 1 if self.held else None

        async def receive() -> None:
            async for name, tensor in self.receiver.receive_weights(into=self._into, base=self._into):
                if self.held.get(name) is not tensor:
                    self.held[name] = tensor

        t0 = time.perf_counter()
        got = asyncio.ensure_future(receive())
        stats = await self.sender.send_weights(weights.items(), version=version)
        await got
        return time.perf_counter() - t0, stats.nbytes, stats.delta_tensors


def _best(results: list[tuple[float, int, int]]) -> tuple[float, int, int]:
    return min(results, key=lambda r: r[0])


def changed_weights(weights: Weights, fraction: float, seed: int) -> Weights:
    """`weights` with `fraction` of every floating tensor's elements moved to a neighbouring bf16 value."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in weights.items():
        new = tensor.clone()
        if new.is_floating_point() and new.numel():
            bits = new.view(-1).view(torch.int16) if new.element_size() == 2 else None
            pick = torch.rand(new.numel(), generator=g) < fraction
            if bits is not None:
                bits[pick] += 1
            else:
                new.view(-1)[pick] += 1e-3
        out[name] = new
    return out


def _fraction_changed(a: Weights, b: Weights) -> tuple[float, float]:
    """(elements changed, 4 KiB blocks with at least one change), as fractions."""
    elements = changed = blocks = changed_blocks = 0
    for name, x in a.items():
        y = b[name]
        if not x.numel():
            continue
        diff = (x.reshape(-1).view(torch.uint8) != y.reshape(-1).view(torch.uint8)).view(-1)
        per_element = diff.view(x.numel(), -1).any(dim=1)
        elements += x.numel()
        changed += int(per_element.sum())
        pad = (-diff.numel()) % 4096
        padded = torch.cat([diff, torch.zeros(pad, dtype=torch.bool)]) if pad else diff
        rows = padded.view(-1, 4096).any(dim=1)
        blocks += rows.numel()
        changed_blocks += int(rows.sum())
    return changed / max(elements, 1), changed_blocks / max(blocks, 1)


async def _series(pair: _Pair, first: Weights, versions: list[Weights], repeats: int) -> tuple[float, int, int]:
    """Best of the syncs of `versions` after `first` (each a delta of the one before), `repeats` times."""
    results = []
    for _ in range(repeats):
        await pair.sync(first)
        results += [await pair.sync(v) for v in versions]
    return _best(results)


async def _verify_rows(stream: Weights, repeats: int) -> dict[str, Any]:
    rows = {}
    for mode in ("off", "sample", "full"):
        async with _Pair(verify=mode) as pair:
            await pair.sync(stream)  # forms the group
            rows[mode] = _best([await pair.sync(stream) for _ in range(repeats + 1)])[0]
    return {
        "seconds": rows,
        "full_over_off": rows["full"] / rows["off"],
        "sample_over_off": rows["sample"] / rows["off"],
    }


async def _delta_rows(first: Weights, nexts: list[Weights], repeats: int) -> dict[str, Any]:
    """off and always: the best sync of the series; auto: the last one, what it settled on after measuring a
    delta version and a whole one on this link (first: whole, forms the group; then a delta; a whole one to
    compare; a delta again; then whole for `PROBE_EVERY` versions if deltas measured slower)."""
    out: dict[str, Any] = {}
    for mode in ("off", "auto", "always"):
        async with _Pair(delta=mode) as pair:
            if mode == "auto":
                await pair.sync(first)
                for version in nexts:
                    seconds, nbytes, deltas = await pair.sync(version)
            else:
                seconds, nbytes, deltas = await _series(pair, first, nexts, repeats)
            out[mode] = {"seconds": seconds, "bytes": nbytes, "delta_tensors": deltas}
            wrong = [n for n, t in nexts[-1].items() if not torch.equal(pair.held[n].view(-1).view(torch.uint8),
                                                                        t.reshape(-1).view(torch.uint8))]  # fmt: skip
            if wrong:
                raise AssertionError(f"delta={mode}: the receiver does not hold the last version bitwise: {wrong[:3]}")
    full = out["off"]
    for mode in ("auto", "always"):
        out[mode]["bytes_ratio"] = out[mode]["bytes"] / full["bytes"]
        out[mode]["seconds_ratio"] = out[mode]["seconds"] / full["seconds"]
    return out


def _codec(first: Weights, new: Weights, always: bool = False) -> dict[str, float]:
    """Seconds per GiB of the model to encode a version against the sender's copy (diff, payload, copy update)
    and to apply it on a receiver (onto a held copy, in place), outside any transfer; and the link speed
    below which the bytes a delta saves take longer to move than the codec takes (where delta pays)."""
    from ..protocol.chunks import TensorMeta
    from ..versions.delta import DeltaBase, DeltaPolicy, VersionDelta, apply_delta

    base = DeltaBase()
    warm = VersionDelta(base, DeltaPolicy(keep=True, base_version=None, always=always))
    for name, tensor in first.items():
        warm.encode(name, tensor)
    held = {n: t.clone() for n, t in first.items()}
    coder = VersionDelta(base, DeltaPolicy(keep=True, base_version=0, always=always))
    t0 = time.perf_counter()
    out = {name: coder.encode(name, tensor) for name, tensor in new.items()}
    encode_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for name, (payload, size) in out.items():
        if size >= 0:
            t = held[name]
            apply_delta(payload, TensorMeta(name, tuple(t.shape), t.dtype, 0, 0), t, t, torch.device("cpu"))
    apply_s = time.perf_counter() - t0
    gib = sum(t.numel() * t.element_size() for t in new.values()) / (1 << 30)
    saved = sum(new[n].numel() * new[n].element_size() - size for n, (_, size) in out.items() if size >= 0)
    return {
        "encode_s_per_gib": encode_s / gib,
        "apply_s_per_gib": apply_s / gib,
        "pays_below_gbps": saved / (encode_s + apply_s) / 1e9,
    }


def _train_lm(lr: float, dim: int, steps: int) -> list[Weights]:
    """The tiny LM's weights as bf16, before and after each of `steps` Adam steps at `lr` (fp32 master)."""
    from ..demo.tiny_lm import build_model

    torch.manual_seed(0)
    model = build_model({"dim": dim, "n_layers": 4, "vocab_size": 4096, "n_heads": 4, "max_seq_len": 64})
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    tokens = torch.randint(0, 4096, (8, 65), generator=torch.Generator().manual_seed(1))
    snaps = [{n: t.detach().to(torch.bfloat16) for n, t in model.state_dict().items() if t.is_floating_point()}]
    for _ in range(steps):
        for _ in range(3):  # the optimizer's moments settle first: a step like one deep in training
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            snaps.append({n: t.detach().to(torch.bfloat16) for n, t in model.state_dict().items()
                          if t.is_floating_point()})  # fmt: skip
    return snaps[-(steps + 1) :]


def run(json_out: bool = False, *, scale: int = 4, repeats: int = 2, lm_dim: int = 512) -> dict[str, Any]:
    progress: Callable[[str], None] = lambda what: print(f"  [delta] {what}", file=sys.stderr, flush=True)  # noqa: E731
    torch.set_num_threads(1)
    stream = {n: t.contiguous() for n, t in model_stream("qwen3-8b", scale=scale, extras=False)}
    nbytes = sum(t.numel() * t.element_size() for t in stream.values())
    report: dict[str, Any] = {"synthetic_mb": nbytes / MiB, "scale": scale}
    progress(f"verify off / sample / full on the Qwen3-8B/{scale} stream ({nbytes / MiB:.0f} MiB)")
    report["verify"] = asyncio.run(_verify_rows(stream, repeats))
    report["synthetic"] = {}
    for fraction in (0.01, 0.10, 0.50):
        progress(f"full vs delta, {fraction:.0%} of the elements changed")
        nexts = [changed_weights(stream, fraction, seed=1)]
        for seed in (2, 3, 4):  # successive versions, each `fraction` away from the one before
            nexts.append(changed_weights(nexts[-1], fraction, seed=seed))
        row = asyncio.run(_delta_rows(stream, nexts, repeats))
        row["changed"], row["changed_blocks"] = _fraction_changed(stream, nexts[0])
        row["codec"] = _codec(stream, nexts[0])
        report["synthetic"][f"{fraction:.0%}"] = row
        del nexts
    report["tiny_lm"] = {}
    for lr in (1e-6, 1e-5, 1e-4):
        progress(f"tiny LM (dim {lm_dim}) at lr {lr:g}")
        snaps = _train_lm(lr, lm_dim, steps=4)
        row = asyncio.run(_delta_rows(snaps[0], snaps[1:], repeats))
        row["changed"], row["changed_blocks"] = _fraction_changed(snaps[-2], snaps[-1])
        row["codec"] = _codec(snaps[-2], snaps[-1])
        row["model_mb"] = sum(t.numel() * t.element_size() for t in snaps[0].values()) / MiB
        report["tiny_lm"][f"{lr:g}"] = row
    if json_out:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return report


def _print(report: dict[str, Any]) -> None:
    v = report["verify"]
    print(f"verify, Qwen3-8B/{report['scale']} stream ({report['synthetic_mb']:.0f} MiB), full sync seconds vs off:")
    print(f"  full {v['full_over_off']:.3f}x, sample {v['sample_over_off']:.3f}x")
    print("full vs delta (bytes and seconds as a fraction of the same stream sent whole):")
    print(
        "  case                  changed  blocks   auto bytes  auto s   always bytes  always s"
        "   codec s/GiB (encode+apply)  pays below GB/s"
    )
    for group, rows in (("synthetic", report["synthetic"]), ("tiny LM lr", report["tiny_lm"])):
        for key, r in rows.items():
            print(
                f"  {group + ' ' + key:20s} {r['changed']:7.2%} {r['changed_blocks']:7.1%}"
                f"   {r['auto']['bytes_ratio']:9.3f}  {r['auto']['seconds_ratio']:6.2f}"
                f"   {r['always']['bytes_ratio']:11.3f}  {r['always']['seconds_ratio']:8.2f}"
                f"   {r['codec']['encode_s_per_gib']:.2f}+{r['codec']['apply_s_per_gib']:.2f}"
                f"                 {r['codec']['pays_below_gbps']:.2f}"
            )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--scale", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--lm-dim", type=int, default=512)
    a = p.parse_args(argv)
    run(a.json, scale=a.scale, repeats=a.repeats, lm_dim=a.lm_dim)
    return 0


if __name__ == "__main__":
    sys.exit(main())
