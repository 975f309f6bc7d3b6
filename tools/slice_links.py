"""Tensor-parallel rollouts over real, rate-limited links: does each TP rank take only its slice? (issue 45)

S trainer ranks send to rollout servers of K tensor-parallel ranks each. Every process (trainer rank and
rollout rank alike) runs in its own network namespace behind its own veth link (tools/netlab.py; needs
root), whose uplink is rate-limited with `tc qdisc ... tbf` inside the namespace; each rollout node's
downlink is limited too, by the same tbf on the bridge side of its veth (that end's egress is the node's
ingress). The trainer ranks send as `tools/sharded_links.py bench_sender` does: one rank sends whole
tensors, several send their rows of each tensor (`row_shard`, FSDP2's `Shard(0)`) in sharded mode.

Each rollout server is K processes with a gloo group of their own (their own TCPStore inside the lab) and
a 1-D mesh over it; each builds a module of the stream's names and shapes, `parallelize_module`d with
`ColwiseParallel` for `layers.*.up` (weight `Shard(0)`) and `RowwiseParallel` for `layers.*.down`
(weight `Shard(1)`), and receives with its own `WeightReceiver` into its DTensor parameters. After every
version each rank checks, bitwise, that its local shard is its slice of the version's full tensor.

Modes, per shape and each in fresh namespaces: `whole` (`transport.slices=false`: every receiver takes
every byte and keeps its box) and `sliced` (`transport.slices=true`: receivers declare their boxes and
each takes only its slice); the override goes to the trainer ranks too (one config on both sides, as a
deployment has it). A library whose config has no `transport.slices` yet runs `whole` without the override
(today's behaviour) and skips `sliced`.

Per row: seconds a version (rank 0's `send_weights`, the mean of the steady versions: the first two build
the groups and, sliced, teach the receivers their boxes), its speed-up over `whole` from the same run, and
the bytes each link moved a version (eth0's counters, read by each process inside its own namespace at the
start and end of each version): the busiest trainer link's TX and the busiest rollout link's RX, against
the model's size. MB here is 2**20 bytes, as `--mb`. gloo broadcasts along a binomial tree, so a trainer
link sends its part once per round (ceil(log2(receivers + 1)) rounds) and rollout links forward what they
got (their TX and the trainer links' RX are in each row's JSON line).

Quantized rows (`--modes bf16 fp8`): the same model's tensors in bf16, one trainer rank (a quantized version is
sent in gather mode), sliced both; in `fp8` every rollout rank declares a quantization contract
(`WeightReceiver.declare_contract`: every 2-D `*.weight`, each a linear's, block FP8 128 x 128) and receives into
DTensors of FP8 weights and of their float32 `weight_scale_inv` (each sharded as its weight: block rows of `up`,
block columns of `down`), so the trainer's sender quantizes every version to it and each rank takes its box of
each FP8 weight and the matching box of its scales; each checks both, bitwise, against vLLM's quantizer's bytes
(`lightning_weightsync.quantize`) of the version. The speed-up column of an `fp8` row is bf16's seconds over
fp8's, same run. Shapes for them: `1xKsN`, one trainer rank, N servers of K TP ranks.

    sudo .venv/bin/python -m tools.slice_links --rate-mbit 100 --mb 32 --versions 4 --shapes 2x2 4x4 2x2s
    sudo .venv/bin/python -m tools.slice_links --rate-mbit 100 --mb 32 --versions 5 --shapes 1x2s2 1x4s4 \
        --modes bf16 fp8
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MODULE = "tools.slice_links"  # what the lab's processes import (by name, not __main__)

from tools.netlab import Lab, netlab, skip_reason  # noqa: E402
from tools.sharded_links import await_versions, jsonl_lines, lab_run, limit_uplink, row_shard  # noqa: E402

if TYPE_CHECKING:
    import torch

TRAINER_PORT, PORT, TP_PORT = 29711, 29712, 29714  # inside the lab's private namespaces: nothing else binds there
ROWS = 2048  # `up` is (ROWS, cols), `down` (cols, ROWS): not square, so a transposed slice cannot pass
STEADY_AFTER = 2  # version 1 builds the groups; sliced, receivers declare their boxes after it
MIB = 2**20
MODES = ("whole", "sliced", "bf16", "fp8")
QUANTIZED_MODES = ("bf16", "fp8")  # the bf16 model, sliced, and that model quantized to block FP8 on the sender
BLOCK = 128


@dataclass(frozen=True)
class Shape:
    """`SxK` (S trainer ranks, one rollout server of K TP ranks), `SxKs` (two such servers) or `SxKsN` (N)."""

    text: str
    senders: int
    tp: int
    servers: int

    @classmethod
    def parse(cls, text: str) -> Shape:
        match = re.fullmatch(r"(\d+)x(\d+)(?:s(\d*))?", text)
        servers = 1 if not match or match[3] is None else int(match[3] or 2)
        if not match or int(match[1]) < 1 or int(match[2]) < 1 or servers < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: want SxK (e.g. 2x2), SxKs (two servers of K, e.g. 2x2s) or "
                                             "SxKsN (N servers of K, e.g. 1x4s4)")  # fmt: skip
        return cls(text, int(match[1]), int(match[2]), servers)

    @property
    def label(self) -> str:
        if self.servers > 1:
            return f"{self.senders} x ({self.servers} servers x {self.tp} TP)"
        return f"{self.senders} x {self.tp}"


def model_shapes(mb: float, tensor_mb: float, itemsize: int = 4) -> dict[str, tuple[int, int]]:
    """`layers.{i}.up.weight` (ROWS, cols) and `layers.{i}.down.weight` (cols, ROWS), each ~`tensor_mb` MiB of
    `itemsize`-byte elements (fp32: 4, bf16: 2), about `mb` MiB in all."""
    cols = max(1, int(tensor_mb * MIB / itemsize / ROWS))
    layers = max(1, round(mb / (2 * tensor_mb)))
    out: dict[str, tuple[int, int]] = {}
    for i in range(layers):
        out[f"layers.{i}.up.weight"] = (ROWS, cols)
        out[f"layers.{i}.down.weight"] = (cols, ROWS)
    return out


def itemsize_of(mode: str) -> int:
    return 2 if mode in QUANTIZED_MODES else 4


def stream(version: int, mb: float, tensor_mb: float, mode: str = "sliced") -> dict[str, torch.Tensor]:
    """The model of `version` (fp32; bf16 in the quantized modes, at weights' scale): a deterministic function of
    it, so every process can check what it received."""
    import torch

    gen = torch.Generator().manual_seed(version)
    shapes = model_shapes(mb, tensor_mb, itemsize_of(mode))
    if mode in QUANTIZED_MODES:
        return {name: (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16) for name, shape in shapes.items()}
    return {name: torch.randn(*shape, generator=gen) for name, shape in shapes.items()}


def model_bytes(mb: float, tensor_mb: float, mode: str = "sliced") -> int:
    size = itemsize_of(mode)
    return sum(rows * cols * size for rows, cols in model_shapes(mb, tensor_mb, size).values())


def tool_contract(names: list[str]) -> Any:
    """What the `fp8` rollout ranks declare: every 2-D `*.weight` (each a linear's: `up`, `down`) block FP8, by
    pattern (a layer index as `*`); nothing else is in the model to keep."""
    from lightning_weightsync.quantize import QuantContract, QuantRule

    patterns = sorted({re.sub(r"\.\d+\.", ".*.", name) for name in names})
    return QuantContract(rules=tuple(QuantRule(p, block=(BLOCK, BLOCK)) for p in patterns))


def shard_dim(name: str) -> int:
    """The dim a rollout rank's DTensor of `name` is split on: an up projection's (and its scales') rows
    (`ColwiseParallel`), a down projection's columns (`RowwiseParallel`)."""
    return 0 if ".up." in name else 1


def link_bytes() -> dict[str, int]:
    """This namespace's eth0 counters (the process runs inside its node's namespace, whose /sys is its own)."""
    stats = Path("/sys/class/net/eth0/statistics")
    return {key: int((stats / f"{key}_bytes").read_text()) for key in ("tx", "rx")}


def slices_known() -> bool:
    """Whether this library's config has `transport.slices` (the sliced knob; older ones reject the key)."""
    from lightning_weightsync.config import load_config
    from lightning_weightsync.errors import ConfigError

    try:
        load_config(overrides=["transport.slices=true"])
    except ConfigError:
        return False
    return True


def mode_overrides(mode: str, known: bool) -> list[str]:
    """The config overrides of a mode: the one place `transport.slices` is written (none when unknown)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}")
    return [f"transport.slices={'false' if mode == 'whole' else 'true'}"] if known else []


def slice_sender(rank: int, world: int, master: str, host: str, receivers: int, mb: float, tensor_mb: float,
                 versions: int, extra: list[str], out: str, mode: str = "sliced") -> None:  # fmt: skip
    """One trainer rank, as `sharded_links.bench_sender`: whole tensors alone, its rows of each in sharded mode."""
    import asyncio
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from lightning_weightsync.config import load_config
    from lightning_weightsync.protocol.messages import SenderAddress
    from lightning_weightsync.trainer.sharded import MembersRelay, exchange_addresses
    from lightning_weightsync.versions.options import Sharding
    from lightning_weightsync.versions.sender import WeightSender

    store = dist.TCPStore(master, TRAINER_PORT, world, is_master=rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    cfg = load_config(
        overrides=[f"transport.host={host}", f"transport.port={PORT}", "transport.timeout_s=300",
                   "transport.ready_timeout_s=60", "transport.bucket_size_mb=8",
                   f"trainer.min_receivers={receivers}", *extra]
    )  # fmt: skip

    async def main() -> None:
        async with WeightSender(cfg) as sender:
            addresses = exchange_addresses(host, sender.port, torch.device("cpu"))
            for version in range(1, versions + 1):
                tensors = stream(version, mb, tensor_mb, mode).items()
                relay = MembersRelay(torch.device("cpu"))
                dist.barrier()
                before = link_bytes()
                started = time.perf_counter()
                if world == 1:
                    stats = await sender.send_weights(list(tensors), version=version)
                elif rank == 0:
                    mine = [(n, s) for n, t in tensors if (s := row_shard(t, rank, world))]
                    others = tuple(SenderAddress(h, p) for h, p in addresses[1:])
                    try:
                        stats = await sender.send_weights(
                            mine, version=version, sharding=Sharding(0, others=others, on_members=relay)
                        )
                    finally:
                        relay.finish()
                else:
                    mine = [(n, s) for n, t in tensors if (s := row_shard(t, rank, world))]
                    sharding = Sharding(rank, members=tuple(relay.receive()))
                    stats = await sender.send_weights(mine, version=version, sharding=sharding)
                seconds = time.perf_counter() - started
                after = link_bytes()
                line = {"rank": rank, "version": version, "seconds": seconds, "nbytes": stats.nbytes,
                        "quantized": stats.quantized_tensors, "tx": after["tx"] - before["tx"],
                        "rx": after["rx"] - before["rx"]}  # fmt: skip
                with open(out, "a") as f:
                    f.write(json.dumps(line) + "\n")

    asyncio.run(main())
    dist.destroy_process_group()


def expected_local(param: Any, full: torch.Tensor) -> torch.Tensor:
    """The slice of `full` a DTensor parameter of a 1-D mesh holds on this rank, cut as DTensor cuts it
    (`torch.chunk` along a `Shard` dim; all of it where `Replicate`)."""
    import torch
    from torch.distributed.tensor import Shard

    (placement,) = param.placements
    if not isinstance(placement, Shard):
        return full
    (coordinate,) = param.device_mesh.get_coordinate()
    parts = torch.chunk(full, param.device_mesh.size(), dim=placement.dim)
    return parts[coordinate] if coordinate < len(parts) else full.narrow(placement.dim, 0, 0)


def quantized_targets(mode: str, mesh: Any, mb: float, tensor_mb: float,
                      versions: int) -> tuple[dict[str, Any], Any, dict[int, dict[str, torch.Tensor]]]:  # fmt: skip
    """A quantized mode's rollout rank: its DTensor of each tensor it loads (bf16 weights; or FP8 weights and their
    float32 scales, each split as its weight), the contract it declares (None for bf16), and, per version, the
    local tensor each must hold (computed before the first version, so no check delays a later one)."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    from lightning_weightsync.quantize import quantize_stream

    names = list(model_shapes(mb, tensor_mb, itemsize_of(mode)))
    contract = tool_contract(names) if mode == "fp8" else None
    (coordinate,) = mesh.get_coordinate()
    size = mesh.size()

    def local(name: str, full: torch.Tensor) -> torch.Tensor:
        return torch.chunk(full, size, dim=shard_dim(name))[coordinate].contiguous()

    wanted: dict[int, dict[str, torch.Tensor]] = {}
    for version in range(1, versions + 1):
        items = list(stream(version, mb, tensor_mb, mode).items())
        if contract is not None:
            items = list(quantize_stream(items, contract))
        wanted[version] = {name: local(name, tensor) for name, tensor in items}
    params: dict[str, Any] = {}
    weights = model_shapes(mb, tensor_mb, itemsize_of(mode))
    for name, tensor in wanted[1].items():
        shape = weights[name] if name in weights else _scale_shape(name, mb, tensor_mb)
        unit = size * (BLOCK if name in weights and contract is not None else 1)  # whole blocks a rank
        if shape[shard_dim(name)] % unit:
            raise ValueError(f"{name} {shape}: dim {shard_dim(name)} is not {size} TP ranks' whole blocks of "
                             f"{BLOCK}; change --tensor-mb")  # fmt: skip
        stride = (shape[1], 1)
        params[name] = DTensor.from_local(torch.empty_like(tensor), mesh, [Shard(shard_dim(name))], run_check=False,
                                          shape=torch.Size(shape), stride=stride)  # fmt: skip
    return params, contract, wanted


def _scale_shape(name: str, mb: float, tensor_mb: float) -> tuple[int, int]:
    rows, cols = model_shapes(mb, tensor_mb, 2)[name.removesuffix("_scale_inv")]
    return -(-rows // BLOCK), -(-cols // BLOCK)


def slice_receiver(server: int, tp: int, k: int, tp_master: str, master: str, mb: float, tensor_mb: float,
                   versions: int, extra: list[str], out: str, mode: str = "sliced") -> None:  # fmt: skip
    """Rank `tp` of rollout server `server`: a TP group of `k` of its own, a parallelized module (a quantized mode:
    its DTensors, `quantized_targets`), a receiver."""
    import asyncio
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from lightning_weightsync.config import load_config
    from lightning_weightsync.versions.receiver import WeightReceiver

    store = dist.TCPStore(tp_master, TP_PORT, k, is_master=tp == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=tp, world_size=k)
    mesh = init_device_mesh("cpu", (k,))
    contract, wanted = None, None
    if mode in QUANTIZED_MODES:
        params, contract, wanted = quantized_targets(mode, mesh, mb, tensor_mb, versions)
    else:
        root, layers = nn.Module(), nn.ModuleList()
        shapes = model_shapes(mb, tensor_mb)
        plan: dict[str, Any] = {}
        for i in range(len(shapes) // 2):
            rows, cols = shapes[f"layers.{i}.up.weight"]
            layer = nn.Module()
            layer.up = nn.Linear(cols, rows, bias=False)  # weight (rows, cols)
            layer.down = nn.Linear(rows, cols, bias=False)  # weight (cols, rows)
            layers.append(layer)
            plan[f"layers.{i}.up"], plan[f"layers.{i}.down"] = ColwiseParallel(), RowwiseParallel()
        root.layers = layers
        model = parallelize_module(root, mesh, plan)
        model.requires_grad_(False)
        params = dict(model.named_parameters())  # name -> its DTensor parameter
        assert sorted(params) == sorted(shapes), sorted(params)
    identity = f"s{server}-tp{tp}"
    cfg = load_config(
        overrides=[f"transport.host={master}", f"transport.port={PORT}", "transport.timeout_s=300",
                   "transport.ready_timeout_s=60", f"rollout.identity={identity}",
                   "transport.heartbeat_interval_s=0.2", *extra]
    )  # fmt: skip

    async def main() -> None:
        receiver = WeightReceiver(cfg)
        receiver.declare_contract(contract)  # before its first Ready: the sender quantizes to it
        async with receiver:
            for _ in range(versions):
                before = link_bytes()
                started = time.perf_counter()
                names = [name async for name, _ in receiver.receive_weights(into=lambda meta: params[meta.name])]
                seconds = time.perf_counter() - started
                after = link_bytes()
                version = int(receiver.version)  # type: ignore[arg-type]  # set once a version is received
                if wanted is not None:  # bytes: FP8 has no equality of its own
                    ok = sorted(names) == sorted(wanted[version]) and all(
                        torch.equal(params[n].to_local().view(torch.uint8), t.view(torch.uint8))
                        for n, t in wanted[version].items()
                    )
                else:
                    want = stream(version, mb, tensor_mb)
                    ok = sorted(names) == sorted(want) and all(
                        torch.equal(params[n].to_local(), expected_local(params[n], want[n])) for n in want
                    )
                last = receiver.last_stats
                busy, payload = (last.seconds, last.nbytes) if last is not None else (None, 0)
                with open(out, "a") as f:
                    f.write(json.dumps({"version": version, "identity": identity, "bitwise": ok, "seconds": seconds,
                                        "busy_s": busy, "nbytes": payload,
                                        "tx": after["tx"] - before["tx"],
                                        "rx": after["rx"] - before["rx"]}) + "\n")  # fmt: skip

    asyncio.run(main())
    dist.destroy_process_group()


def limit_downlink(lab: Lab, name: str, rate_mbit: int) -> None:
    """`tc tbf` on the bridge side of a node's veth: that end's egress is what the node receives."""
    burst = max(64 * 1024, rate_mbit * 1_000_000 // 8 // 100)  # ~10 ms of traffic, as limit_uplink
    lab_run("tc", "qdisc", "add", "dev", lab.nodes[name].host_if, "root", "tbf", "rate", f"{rate_mbit}mbit",
            "burst", str(burst), "latency", "50ms")  # fmt: skip


def per_version_max(lines: list[dict[str, Any]], who: str, key: str) -> float:
    """The busiest node's mean `key` bytes a version, over the steady versions of `lines`."""
    steady = [e for e in lines if e["version"] > STEADY_AFTER] or lines
    by_node: dict[Any, list[int]] = {}
    for e in steady:
        by_node.setdefault(e[who], []).append(e[key])
    return max(sum(v) / len(v) for v in by_node.values())


def run(lab: Lab, shape: Shape, mode: str, known: bool, rate_mbit: int, mb: float, tensor_mb: float,
        versions: int) -> dict[str, Any]:  # fmt: skip
    trainers = [f"t{rank}" for rank in range(shape.senders)]
    rollouts = [(s, tp, f"s{s}r{tp}") for s in range(shape.servers) for tp in range(shape.tp)]
    tag = f"{shape.text}-{mode}"
    try:
        for name in trainers:
            lab.add(name)
        for *_, name in rollouts:
            lab.add(name)
        for name in (*trainers, *(name for *_, name in rollouts)):
            limit_uplink(lab, name, rate_mbit)
        for *_, name in rollouts:
            limit_downlink(lab, name, rate_mbit)
        master = lab.nodes["t0"].ip
        extra = mode_overrides(mode, known)
        sent, received = lab.workdir / f"senders-{tag}.jsonl", lab.workdir / f"receivers-{tag}.jsonl"
        procs = []
        for s, tp, name in rollouts:
            tp_master = lab.nodes[f"s{s}r0"].ip
            code = (f"from {MODULE} import slice_receiver as f; f({s}, {tp}, {shape.tp}, {tp_master!r}, {master!r}, "
                    f"{mb}, {tensor_mb}, {versions}, {extra!r}, {str(received)!r}, {mode!r})")  # fmt: skip
            procs.append(lab.spawn(name, code, lab.workdir / f"{name}-{tag}.log"))
        for rank, name in enumerate(trainers):
            code = (f"from {MODULE} import slice_sender as f; f({rank}, {shape.senders}, {master!r}, "
                    f"{lab.nodes[name].ip!r}, {len(rollouts)}, {mb}, {tensor_mb}, {versions}, {extra!r}, "
                    f"{str(sent)!r}, {mode!r})")  # fmt: skip
            procs.append(lab.spawn(name, code, lab.workdir / f"{name}-{tag}.log"))
        got = await_versions(lab, procs, received, versions * len(rollouts), f"*-{tag}.log", f"{shape.text} {mode}")
        senders = jsonl_lines(sent)
    finally:
        lab.remove_nodes()  # the next run adds its own nodes
    rank0 = [e for e in senders if e["rank"] == 0 and e["version"] > STEADY_AFTER] or [
        e for e in senders if e["rank"] == 0
    ]
    steady = [e for e in got if e["version"] > STEADY_AFTER] or got
    return {
        "shape": shape.text,
        "label": shape.label,
        "mode": mode,
        "slices_key": known,
        "seconds": sum(e["seconds"] for e in rank0) / len(rank0),
        "steady_versions": len(rank0),
        "trainer_tx_MB": per_version_max(senders, "rank", "tx") / MIB,
        "trainer_rx_MB": per_version_max(senders, "rank", "rx") / MIB,
        "rollout_rx_MB": per_version_max(got, "identity", "rx") / MIB,
        "rollout_tx_MB": per_version_max(got, "identity", "tx") / MIB,
        "rollout_busy_s": max(e["busy_s"] or 0.0 for e in steady),
        "model_MB": model_bytes(mb, tensor_mb, mode) / MIB,
        "rollout_payload_MB": per_version_max(got, "identity", "nbytes") / MIB,
        "quantized_tensors": max(e.get("quantized", 0) for e in senders),
        "bitwise": all(e["bitwise"] for e in got),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--shapes",
        type=Shape.parse,
        nargs="+",
        default=[Shape.parse(s) for s in ("2x2", "4x4", "2x2s")],
        help="SxK: S trainer ranks, one rollout server of K TP ranks; SxKs: two such servers of K",
    )
    parser.add_argument("--rate-mbit", type=int, default=100, help="every node's link rate (tbf), each way")
    parser.add_argument("--mb", type=float, default=32.0, help="MiB per version")
    parser.add_argument("--tensor-mb", type=float, default=4.0)
    parser.add_argument("--versions", type=int, default=4, help="versions a run (the first two are not reported)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["whole", "sliced"],
                        help="whole / sliced: fp32; bf16 / fp8: the model in bf16, sliced, fp8 quantized to the "
                        "contract the rollout declares (one trainer rank: shapes 1xKsN)")  # fmt: skip
    args = parser.parse_args(argv)
    if any(m in QUANTIZED_MODES for m in args.modes) and any(s.senders > 1 for s in args.shapes):
        parser.error("bf16 / fp8 rows send from one trainer rank (a quantized version is sent in gather mode): "
                     "shapes 1xK or 1xKsN")  # fmt: skip
    reason = skip_reason()
    if reason:
        print(f"cannot run: {reason}")
        return 2
    known = slices_known()
    modes = [m for m in args.modes if known or m != "sliced"]
    if modes != args.modes:
        print("sliced: skipped (this library's config has no transport.slices yet)", flush=True)
    if args.versions <= STEADY_AFTER:
        print(f"only {args.versions} versions: none is steady, every version is reported", flush=True)
    rows: list[dict[str, Any]] = []
    failed = False
    with netlab() as lab:
        for shape in args.shapes:
            for mode in modes:
                try:
                    rows.append(run(lab, shape, mode, known, args.rate_mbit, args.mb, args.tensor_mb, args.versions))
                except RuntimeError as exc:
                    failed = True
                    print(f"{shape.text} {mode}: failed: {exc}", flush=True)
                    continue
                print(json.dumps(rows[-1]), flush=True)
    seconds = {(r["shape"], r["mode"]): r["seconds"] for r in rows}
    print(f"\nevery link {args.rate_mbit} Mbit/s ({args.rate_mbit / 8:.1f} MB/s) each way, a {args.mb} MiB model in "
          f"tensors of {args.tensor_mb} MiB, versions {STEADY_AFTER + 1}..{args.versions} (MB = MiB)")  # fmt: skip
    print("| S x K | mode | s a version | speed-up (whole/sliced, bf16/fp8) | max trainer-link MB sent a version "
          "| max rollout-link MB received a version | max rollout payload MB | model MB | bitwise |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        base, over = {"sliced": ("whole", "sliced"), "fp8": ("bf16", "fp8")}.get(r["mode"], ("", ""))
        before, after = seconds.get((r["shape"], base)), seconds.get((r["shape"], over))
        speedup = f"{before / after:.2f}" if before and after else "-"
        print(f"| {r['label']} | {r['mode']} | {r['seconds']:.2f} | {speedup} | {r['trainer_tx_MB']:.1f} | "
              f"{r['rollout_rx_MB']:.1f} | {r['rollout_payload_MB']:.1f} | {r['model_MB']:.1f} | "
              f"{r['bitwise']} |")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
