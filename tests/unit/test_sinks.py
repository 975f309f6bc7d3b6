"""Sinks driven exactly as the daemon drives them: split -> merge(into=sink.destination) -> accept -> commit.

These tests need no network: the chunk stream is produced in-process by `split_weight_chunks`, so
they exercise the sinks' own contracts (bitwise result, atomicity, errors naming the tensor, crash-
safe files). The daemon and CLI tests run the same sinks behind real sockets.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_weightsync import SinkError, VersionAborted, load_config, merge_weight_chunks, split_weight_chunks
from lightning_weightsync.errors import ConfigError
from lightning_weightsync.protocol.chunks import TensorMeta
from lightning_weightsync.rollout.sinks import Sink, SinkState, build_sink, load_callable
from lightning_weightsync.rollout.sinks.callable import CallableSink
from lightning_weightsync.rollout.sinks.module import ModuleSink
from lightning_weightsync.rollout.sinks.safetensors import MIN_HEADER_RESERVE, SafetensorsSink, step_path

BUCKET = 1024  # bytes: smaller than the largest weight below, so chunking is exercised


class Tiny(torch.nn.Module):
    """A small model with a weight bigger than the bucket, a buffer, bf16 and a tied weight."""

    def __init__(self, vocab: int = 64, dim: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)  # 64*16*4 = 4 KiB > BUCKET
        self.proj = torch.nn.Linear(dim, dim)
        self.norm = torch.nn.LayerNorm(dim).to(torch.bfloat16)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


def build_tiny(vocab: int = 64, dim: int = 16) -> Tiny:
    return Tiny(vocab, dim)


def version_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ref = Tiny()
    out = {}
    for name, t in ref.state_dict().items():
        if t.is_floating_point():
            out[name] = torch.randn(t.shape, generator=g).to(t.dtype)
        else:
            out[name] = torch.full(t.shape, seed, dtype=t.dtype)
    out["head.weight"] = out["embed.weight"]
    return out


def module_cfg(apply: str = "atomic", **extra: str) -> object:
    overrides = [
        f"rollout.apply={apply}",
        "rollout.sink.type=module",
        "rollout.sink.factory=tests.unit.test_sinks:build_tiny",
    ]
    return load_config(overrides=overrides + [f"{k}={v}" for k, v in extra.items()])


async def drive(sink, weights, version: int, bucket: int = BUCKET, tied=None) -> None:
    """What the daemon does for one version, minus the network."""
    items = weights.items() if isinstance(weights, dict) else weights
    sink.begin(version, tied=tied)
    try:
        async for name, tensor in merge_weight_chunks(
            split_weight_chunks(items, bucket), bucket, into=sink.destination
        ):
            sink.accept(name, tensor)
    except BaseException as exc:
        sink.abort(version, str(exc))
        raise
    sink.commit(version)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


def broken(weights: dict[str, torch.Tensor], after: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The version's stream, dying after `after` tensors (a trainer crash mid-version)."""
    for i, item in enumerate(weights.items()):
        if i == after:
            raise VersionAborted("sender went away (test)")
        yield item


# --- module sink ------------------------------------------------------------------------------


@pytest.mark.parametrize("apply", ["atomic", "streaming"])
async def test_module_sink_applies_versions_bitwise(apply: str) -> None:
    sink = build_sink(module_cfg(apply))
    assert isinstance(sink, ModuleSink) and sink.state is SinkState.EMPTY
    for version in (0, 1, 2):
        weights = version_weights(version)
        await drive(sink, weights, version)
        assert sink.version == version and sink.state is SinkState.COMPLETE
        assert_same(sink.state_dict(), weights)


async def test_module_sink_streaming_writes_into_live_parameters() -> None:
    sink = build_sink(module_cfg("streaming"))
    assert isinstance(sink, ModuleSink)
    ptrs = {name: t.data_ptr() for name, t in sink.module.state_dict().items()}
    weights = version_weights(3)
    sink.begin(3)
    async for name, tensor in merge_weight_chunks(
        split_weight_chunks(weights.items(), BUCKET), BUCKET, into=sink.destination
    ):
        assert tensor.data_ptr() == ptrs[name], f"{name} was staged, not written in place"
        sink.accept(name, tensor)
    sink.commit(3)
    assert {n: t.data_ptr() for n, t in sink.module.state_dict().items()} == ptrs
    assert_same(sink.state_dict(), weights)


async def test_module_sink_atomic_is_invisible_until_commit() -> None:
    sink = build_sink(module_cfg("atomic"))
    assert isinstance(sink, ModuleSink)
    v0 = version_weights(0)
    await drive(sink, v0, 0)
    v1 = version_weights(1)
    sink.begin(1)
    async for name, tensor in merge_weight_chunks(
        split_weight_chunks(v1.items(), BUCKET), BUCKET, into=sink.destination
    ):
        sink.accept(name, tensor)
    assert_same(sink.state_dict(), v0)  # everything arrived, nothing visible yet
    sink.commit(1)
    assert_same(sink.state_dict(), v1)


async def test_module_sink_atomic_abort_keeps_previous_version() -> None:
    sink = build_sink(module_cfg("atomic"))
    v0 = version_weights(0)
    await drive(sink, v0, 0)
    with pytest.raises(VersionAborted):
        await drive(sink, broken(version_weights(1), after=3), 1)
    assert sink.version == 0 and sink.state is SinkState.COMPLETE and sink.in_flight is None
    assert_same(sink.state_dict(), v0)
    await drive(sink, version_weights(2), 2)  # and the next version still applies
    assert_same(sink.state_dict(), version_weights(2))


class Wide(torch.nn.Module):
    """18 parameters of 64K-256K floats: copying a version into them takes long enough to be caught
    half-way. `forward` is what a generation loop's reads boil down to: every parameter's min and max."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ParameterList(
            torch.nn.Parameter(torch.zeros(64 * 1024 * (1 + i % 4)), requires_grad=False) for i in range(18)
        )

    def forward(self) -> torch.Tensor:
        return torch.stack([torch.stack([p.amin(), p.amax()]) for p in self.blocks])


def whole_version(values: list[torch.Tensor]) -> int | None:
    """The version a snapshot holds if it is one whole version (every element of every tensor equal), else None."""
    lows = [float(v.min()) for v in values]
    highs = [float(v.max()) for v in values]
    if len(set(lows) | set(highs)) != 1:
        return None
    return int(lows[0])


def test_module_sink_atomic_readers_never_see_a_half_copied_version() -> None:
    """A reader thread taking snapshots while versions commit never sees two versions mixed: not through
    `state_dict()`, not by running the module under `sink.lock` as a generation loop does. This is what
    the commit's `with self.lock` buys; without it this test fails (tensors of two versions)."""
    sink = ModuleSink(module_cfg("atomic"), module=Wide())
    module = sink.module
    assert isinstance(module, Wide)
    versions = 40
    seen: list[int] = []
    mixed: list[str] = []
    taken = threading.Condition()
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            snapshot = list(sink.state_dict().values())
            with sink.lock, torch.no_grad():  # a generation loop: hold the lock while using the weights
                ran = module()
            for how, values in (("state_dict()", snapshot), ("module() under sink.lock", list(ran))):
                version = whole_version(values)
                if version is None:
                    mixed.append(f"{how}: {sorted({float(v) for t in values for v in t.unique()})}")
                else:
                    seen.append(version)
            with taken:
                taken.notify_all()

    def wait_for_reader(version: int) -> None:
        """The reader really runs alongside: it has seen `version` before the next one is sent."""
        with taken:
            assert taken.wait_for(lambda: version in seen or not thread.is_alive(), timeout=60), version
        assert thread.is_alive(), "reader thread died"

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: interleave the copy and the reads
    thread = threading.Thread(target=reader, name="reader", daemon=True)
    try:
        thread.start()
        wait_for_reader(0)
        for version in range(1, versions + 1):
            # the daemon's calls, without the chunk merge in between (its cost would only make the
            # commits a smaller share of the time the reader runs alongside)
            sink.begin(version)
            for i, p in enumerate(module.blocks):
                name = f"blocks.{i}"
                staged = sink.destination(TensorMeta(name, tuple(p.shape), p.dtype, 0, p.numel() * p.element_size()))
                assert staged is not None and staged.data_ptr() != p.data_ptr()  # a shadow, not the live tensor
                staged.fill_(version)
                sink.accept(name, staged)
            sink.commit(version)
            wait_for_reader(version)
    finally:
        stop.set()
        thread.join(60)
        sys.setswitchinterval(old)
    assert not mixed, f"{len(mixed)} of {len(seen) + len(mixed)} snapshots mixed versions, e.g. {mixed[:3]}"
    assert set(seen) == set(range(versions + 1)) and len(seen) >= 2 * versions
    assert sink.version == versions and whole_version(list(sink.state_dict().values())) == versions


async def test_module_sink_streaming_abort_marks_incomplete_until_next_version() -> None:
    sink = build_sink(module_cfg("streaming"))
    await drive(sink, version_weights(0), 0)
    with pytest.raises(VersionAborted):
        await drive(sink, broken(version_weights(1), after=3), 1)
    assert sink.state is SinkState.INCOMPLETE and sink.version == 0
    await drive(sink, version_weights(2), 2)
    assert sink.state is SinkState.COMPLETE and sink.version == 2
    assert_same(sink.state_dict(), version_weights(2))


async def test_module_sink_unknown_name_is_named_and_previous_version_kept() -> None:
    sink = build_sink(module_cfg("atomic"))
    v0 = version_weights(0)
    await drive(sink, v0, 0)
    bad = dict(version_weights(1))
    bad["model.embed.weight"] = bad.pop("embed.weight")
    with pytest.raises(SinkError, match=r"'model\.embed\.weight'.*has 'embed\.weight'.*module_attr='model'"):
        await drive(sink, bad, 1)
    assert sink.version == 0 and sink.state is SinkState.COMPLETE
    assert_same(sink.state_dict(), v0)


@pytest.mark.parametrize(
    ("name", "tensor", "pattern"),
    [
        ("proj.weight", torch.zeros(16, 8), r"'proj\.weight' arrives as torch\.float32\[16, 8\].*\[16, 16\]"),
        ("norm.weight", torch.zeros(16), r"'norm\.weight'.*torch\.float32.*torch\.bfloat16.*trainer\.dtype"),
    ],
)
async def test_module_sink_shape_and_dtype_mismatch(name: str, tensor: torch.Tensor, pattern: str) -> None:
    sink = build_sink(module_cfg("atomic"))
    v0 = version_weights(0)
    await drive(sink, v0, 0)
    bad = dict(version_weights(1))
    bad[name] = tensor
    with pytest.raises(SinkError, match=pattern):
        await drive(sink, bad, 1)
    assert_same(sink.state_dict(), v0)


def test_module_sink_factory_errors_are_one_line() -> None:
    for factory, pattern in [
        ("no_such_pkg.mod:build", r"cannot import module 'no_such_pkg\.mod'"),
        ("tests.unit.test_sinks:nope", r"has no attribute 'nope'"),
        ("tests.unit.test_sinks.build_tiny", r"not of the form package\.module:function"),
        ("tests.unit.test_sinks:BUCKET", r"names a int, not a callable"),
        ("tests.unit.test_sinks:version_weights", r"returned a dict, not a torch\.nn\.Module|failed"),
    ]:
        cfg = load_config(overrides=["rollout.sink.type=module", f"rollout.sink.factory={factory}"])
        with pytest.raises(ConfigError, match=pattern) as info:
            build_sink(cfg)
        assert "\n" not in str(info.value) and "rollout.sink.factory" in str(info.value)
    with pytest.raises(ConfigError, match=r"rollout\.sink\.type=module \(the default\) needs rollout\.sink\.factory="):
        build_sink(load_config(overrides=["rollout.sink.type=module"]))


def test_module_sink_factory_options_are_keyword_arguments() -> None:
    cfg = load_config(
        overrides=[
            "rollout.sink.type=module",
            "rollout.sink.factory=tests.unit.test_sinks:build_tiny",
            "rollout.sink.options.vocab=32",
        ]
    )
    sink = build_sink(cfg)
    assert isinstance(sink, ModuleSink)
    assert sink.module.embed.weight.shape == (32, 16)


# --- safetensors sink -------------------------------------------------------------------------


def st_cfg(directory: Path, keep_last: int = 3, apply: str = "atomic"):
    return load_config(
        overrides=[
            "rollout.sink.type=safetensors",
            f"rollout.sink.dir={directory}",
            f"rollout.sink.keep_last={keep_last}",
            f"rollout.apply={apply}",
        ]
    )


def odd_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(40, 33, generator=g),  # 5280 bytes > bucket
        "bf16": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(seed, dtype=torch.int64),
        "mask": torch.rand(9, generator=g) > 0.5,
        "half": torch.randn(3, generator=g).half(),
    }


@pytest.mark.parametrize("apply", ["atomic", "streaming"])
async def test_safetensors_sink_writes_loadable_files_and_keeps_last(tmp_path: Path, apply: str) -> None:
    sink = build_sink(st_cfg(tmp_path, keep_last=2, apply=apply))
    assert isinstance(sink, SafetensorsSink)
    for version in (1, 2, 3):
        await drive(sink, odd_weights(version), version)
        assert sink.latest_path == step_path(tmp_path, version)
        assert_same(load_file(str(step_path(tmp_path, version))), odd_weights(version))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2.safetensors", "step_3.safetensors"]
    raw = step_path(tmp_path, 3).read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    assert json.loads(raw[8 : 8 + header_len])["__metadata__"]["version"] == "3"


async def test_safetensors_sink_header_larger_than_reservation(tmp_path: Path) -> None:
    sink = build_sink(st_cfg(tmp_path))
    # ~1500 tensors with long names: the header is well over the initial 64 KiB reservation
    weights = {f"layers.{i}.{'x' * 40}.weight": torch.full((2,), float(i)) for i in range(1500)}
    await drive(sink, weights, 7, bucket=4096)
    (header_len,) = struct.unpack("<Q", step_path(tmp_path, 7).read_bytes()[:8])
    assert header_len > MIN_HEADER_RESERVE
    assert_same(load_file(str(step_path(tmp_path, 7))), weights)
    await drive(sink, weights, 8, bucket=4096)  # next version reserves enough from the start
    assert_same(load_file(str(step_path(tmp_path, 8))), weights)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


async def test_safetensors_sink_abort_leaves_no_file(tmp_path: Path) -> None:
    sink = build_sink(st_cfg(tmp_path))
    await drive(sink, odd_weights(1), 1)
    with pytest.raises(VersionAborted):
        await drive(sink, broken(odd_weights(2), after=2), 2)
    assert [p.name for p in tmp_path.iterdir()] == ["step_1.safetensors"]
    assert sink.version == 1 and sink.state is SinkState.COMPLETE


async def test_safetensors_sink_rejects_dtype_it_cannot_store(tmp_path: Path) -> None:
    sink = build_sink(st_cfg(tmp_path))
    with pytest.raises(SinkError, match=r"'z'.*complex128.*trainer\.dtype"):
        await drive(sink, {"a": torch.ones(3), "z": torch.zeros(2, dtype=torch.complex128)}, 1)
    assert list(tmp_path.iterdir()) == []


def test_safetensors_sink_removes_temp_files_of_dead_writers(tmp_path: Path) -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    stale = tmp_path / f".step_4.safetensors.{proc.pid}.tmp"
    stale.write_bytes(b"partial")
    live = tmp_path / f".step_4.safetensors.{os.getpid()}.tmp"
    live.write_bytes(b"someone else's, still writing")
    build_sink(st_cfg(tmp_path))
    assert not stale.exists() and live.exists()


def test_safetensors_sink_needs_a_dir() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.sink\.dir is not set"):
        build_sink(load_config(overrides=["rollout.sink.type=safetensors"]))


# --- callable sink ----------------------------------------------------------------------------

SEEN: list[tuple[int, dict[str, torch.Tensor]]] = []


def record(version: int, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    SEEN.append((version, dict(tensors)))


def explode(version: int, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    for name, _ in tensors:
        if name == "bf16":
            raise RuntimeError("rollout engine refused bf16")


def callable_cfg(apply: str, target: str = "tests.unit.test_sinks:record"):
    return load_config(
        overrides=["rollout.sink.type=callable", f"rollout.sink.target={target}", f"rollout.apply={apply}"]
    )


@pytest.mark.parametrize("apply", ["atomic", "streaming"])
async def test_callable_sink_gets_each_version(apply: str) -> None:
    SEEN.clear()
    sink = build_sink(callable_cfg(apply))
    assert isinstance(sink, CallableSink)
    for version in (5, 6):
        await drive(sink, odd_weights(version), version)
    assert [v for v, _ in SEEN] == [5, 6]
    for version, got in SEEN:
        assert_same(got, odd_weights(version))


async def test_callable_sink_streaming_abort_raises_inside_the_function() -> None:
    seen: list[str] = []
    errors: list[BaseException] = []

    def fn(version: int, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        try:
            for name, _ in tensors:
                seen.append(name)
        except VersionAborted as exc:
            errors.append(exc)
            raise

    sink = CallableSink(callable_cfg("streaming"), fn=fn)
    with pytest.raises(VersionAborted):
        await drive(sink, broken(odd_weights(1), after=3), 1)
    assert seen == ["big", "bf16", "empty"]
    assert len(errors) == 1 and "sender went away" in str(errors[0])
    assert sink.state is SinkState.INCOMPLETE


async def test_callable_sink_atomic_never_sees_a_broken_version() -> None:
    SEEN.clear()
    sink = build_sink(callable_cfg("atomic"))
    with pytest.raises(VersionAborted):
        await drive(sink, broken(odd_weights(1), after=3), 1)
    assert SEEN == [] and sink.state is SinkState.EMPTY


@pytest.mark.parametrize("apply", ["atomic", "streaming"])
async def test_callable_sink_function_error_is_a_sink_error(apply: str, caplog: pytest.LogCaptureFixture) -> None:
    sink = build_sink(callable_cfg(apply, "tests.unit.test_sinks:explode"))
    with pytest.raises(SinkError, match=r"rollout\.sink\.target='tests\.unit\.test_sinks:explode' raised RuntimeError"):
        await drive(sink, odd_weights(1), 1)
    assert sink.version is None and sink.in_flight is None
    # the function is gone: the abort does not wait on its iterator (it used to, 10 s, then warned
    # that the function "does not consume its iterator")
    assert "does not consume" not in caplog.text


RELEASE_STUCK = threading.Event()


def stuck_after_one(version: int, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    next(tensors)
    RELEASE_STUCK.wait(30)  # user code blocked (a lock, a full queue of its own)


async def test_callable_sink_that_stops_reading_fails_the_version_bounded(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A streaming function stuck in its own code fails the version after transport.timeout_s
    (before: the daemon waited forever), the abort abandons it after ABORT_JOIN_TIMEOUT_S with a
    warning, and the sink stays usable."""
    from lightning_weightsync.rollout.sinks import callable as callable_sink

    monkeypatch.setattr(callable_sink, "ABORT_JOIN_TIMEOUT_S", 0.3)
    cfg = callable_cfg("streaming", "tests.unit.test_sinks:stuck_after_one")
    cfg.transport.timeout_s = 0.5
    sink = build_sink(cfg)
    RELEASE_STUCK.clear()
    try:
        with pytest.raises(SinkError, match=r"did not read its next tensor within transport\.timeout_s=0\.5s"):
            await drive(sink, odd_weights(1), 1)
        assert "does not consume its iterator; abandoning it" in caplog.text
        assert sink.version is None and sink.in_flight is None and sink.state is SinkState.INCOMPLETE
    finally:
        RELEASE_STUCK.set()


def test_callable_sink_bad_target() -> None:
    with pytest.raises(ConfigError, match=r"sink\.target='tests\.unit\.test_sinks:nothing_here'.*no attribute"):
        build_sink(callable_cfg("atomic", "tests.unit.test_sinks:nothing_here"))
    with pytest.raises(ConfigError, match=r"rollout\.sink\.target is not set"):
        build_sink(load_config(overrides=["rollout.sink.type=callable"]))


def test_load_callable_resolves_dotted_attributes() -> None:
    assert load_callable("tests.unit.test_sinks:Tiny.forward", "k") is Tiny.forward


def test_every_daemon_sink_type_is_registered_once() -> None:
    """`rollout.sink.type` choices and the sink registry cannot drift: every choice has exactly one
    registered class, and a rollout engine is no sink type (it is `rollout.engine`, with no special case
    here)."""
    from lightning_weightsync.config import SinkType
    from lightning_weightsync.plugins import ROLLOUT_ENGINES
    from lightning_weightsync.rollout.sinks import SINKS

    assert set(SINKS) == set(SinkType)
    assert not set(ROLLOUT_ENGINES) & {t.value for t in SinkType}
    with pytest.raises(ConfigError, match=r"rollout\.sink\.type"):
        load_config(overrides=["rollout.sink.type=vllm"])


def test_only_sinks_that_hold_tensors_offer_a_snapshot() -> None:
    from lightning_weightsync.config import SinkType
    from lightning_weightsync.rollout.sinks import SINKS

    assert SINKS[SinkType.safetensors].snapshot is Sink.snapshot  # writes to disk: nothing to dump
    assert SINKS[SinkType.module].snapshot is not Sink.snapshot


# --- tied weights (issue 12 point 3), name hints (points 2 and 7) --------------------------------


def sent_once(seed: int) -> dict[str, torch.Tensor]:
    """What a trainer sends for `Tiny`: the tied head only once, under the embedding's name."""
    weights = version_weights(seed)
    del weights["head.weight"]
    return weights


TIED = {"embed.weight": ("head.weight",)}


@pytest.mark.parametrize("apply", ["atomic", "streaming"])
async def test_module_sink_tied_weight_sent_once_no_warning(apply: str, caplog: pytest.LogCaptureFixture) -> None:
    sink = build_sink(module_cfg(apply))
    assert isinstance(sink, ModuleSink)
    for version in (1, 2):
        with caplog.at_level("WARNING"):
            await drive(sink, sent_once(version), version, tied=TIED if version == 2 else None)
        assert "keep their old values" not in caplog.text  # the alias shares the embedding's storage
        assert_same(sink.state_dict(), version_weights(version))
        assert sink.module.head.weight is sink.module.embed.weight  # still one Parameter
    # a tensor the version really did not carry is still reported
    partial = sent_once(3)
    del partial["proj.bias"]
    with caplog.at_level("WARNING"):
        await drive(sink, partial, 3)
    assert "'proj.bias'" in caplog.text and "'head.weight'" not in caplog.text


class Untied(Tiny):
    def __init__(self) -> None:
        super().__init__()
        self.head.weight = torch.nn.Parameter(torch.zeros(64, 16))  # the rollout built its copy untied


@pytest.mark.parametrize("apply", ["atomic", "streaming"])
async def test_module_sink_restores_a_tie_the_wire_declares(apply: str) -> None:
    sink = ModuleSink(module_cfg(apply), module=Untied())
    await drive(sink, sent_once(1), 1, tied=TIED)
    assert torch.equal(sink.module.head.weight, version_weights(1)["embed.weight"])
    assert sink.module.head.weight.data_ptr() != sink.module.embed.weight.data_ptr()


async def test_module_sink_name_mismatch_names_module_attr() -> None:
    sink = build_sink(module_cfg())
    prefixed = {f"model.{k}": v for k, v in sent_once(1).items()}
    with pytest.raises(SinkError) as info:
        await drive(sink, prefixed, 1)
    message = str(info.value)
    assert "module_attr='model'" in message and "trainer.names.strip_prefixes=[model.]" in message
    assert "not in the rollout module" in message


@pytest.mark.parametrize("apply", ["atomic", "streaming"])
async def test_callable_sink_yields_every_tied_name(apply: str) -> None:
    got: dict[int, list[tuple[str, torch.Tensor]]] = {}

    def fn(version: int, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        got[version] = list(tensors)

    cfg = load_config(overrides=["rollout.sink.type=callable", f"rollout.apply={apply}"])
    sink = CallableSink(cfg, fn)
    await drive(sink, sent_once(1), 1, tied=TIED)
    names = [n for n, _ in got[1]]
    assert names.index("head.weight") == names.index("embed.weight") + 1
    assert sorted(names) == sorted(version_weights(1))
    held = dict(got[1])
    assert held["head.weight"] is held["embed.weight"]
    assert_same(held, version_weights(1))


def test_sink_rejects_inconsistent_tied_lists() -> None:
    sink = CallableSink(load_config(overrides=["rollout.sink.type=callable"]), lambda v, t: None)
    with pytest.raises(SinkError, match="aliased twice"):
        sink.begin(1, tied={"a": ("b",), "c": ("b",)})
    with pytest.raises(SinkError, match="non-empty"):
        sink.begin(1, tied={"a": ("",)})


async def test_safetensors_sink_tied_file_loads_strictly_like_a_hf_checkpoint(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_model

    sink = build_sink(st_cfg(tmp_path))
    await drive(sink, sent_once(1), 1, tied=TIED)
    path = step_path(tmp_path, 1)
    assert "head.weight" not in load_file(str(path))  # written once, as HF writes tied checkpoints
    with safe_open(str(path), "pt") as f:
        assert json.loads(f.metadata()["tied"]) == {"embed.weight": ["head.weight"]}
    model = Tiny()
    _, unexpected = load_model(model, str(path), strict=True)  # the tie covers the absent alias
    assert not unexpected
    assert_same({k: v.detach() for k, v in model.state_dict().items()}, version_weights(1))


def st_args(out: Path) -> list[str]:
    return ["rollout.sink.type=safetensors", f"rollout.sink.dir={out}"]


async def test_safetensors_sink_template_dir_makes_checkpoint_directories(tmp_path: Path) -> None:
    template = tmp_path / "template"
    template.mkdir()
    (template / "config.json").write_text('{"model_type": "tiny"}')
    (template / "tokenizer.json").write_text("{}")
    (template / "model.safetensors").write_bytes(b"old weights, never copied")
    (template / "model.safetensors.index.json").write_text("{}")
    out = tmp_path / "out"
    cfg = load_config(
        overrides=[
            "rollout.sink.type=safetensors", f"rollout.sink.dir={out}", "rollout.sink.keep_last=2",
            f"rollout.sink.template_dir={template}",
        ]
    )  # fmt: skip
    sink = build_sink(cfg)
    for version in (1, 2, 3, 3):  # the same version twice: a restarted trainer re-sends it
        if sink.version == version:
            sink = build_sink(cfg)
        await drive(sink, odd_weights(version), version)
    assert sorted(p.name for p in out.iterdir()) == ["step_2", "step_3"]  # keep_last, no temp dirs left
    step = out / "step_3"
    assert sorted(p.name for p in step.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert sink.latest_path == step / "model.safetensors"
    assert_same(load_file(str(step / "model.safetensors")), odd_weights(3))
    with pytest.raises(ConfigError, match="template_dir"):
        build_sink(load_config(overrides=[*st_args(out), f"rollout.sink.template_dir={tmp_path}/nope"]))


async def test_safetensors_sink_template_abort_leaves_nothing(tmp_path: Path) -> None:
    template = tmp_path / "template"
    template.mkdir()
    (template / "config.json").write_text("{}")
    out = tmp_path / "out"
    cfg = load_config(
        overrides=["rollout.sink.type=safetensors", f"rollout.sink.dir={out}", f"rollout.sink.template_dir={template}"]
    )
    sink = build_sink(cfg)
    with pytest.raises(VersionAborted):
        await drive(sink, broken(odd_weights(1), after=2), 1)
    assert list(out.iterdir()) == []


def test_factory_import_error_mentions_pythonpath() -> None:
    with pytest.raises(ConfigError, match="PYTHONPATH"):
        load_callable("no_such_module_anywhere:build", "rollout.sink.factory")


@pytest.mark.parametrize("template", [False, True], ids=["file", "template-dir"])
async def test_safetensors_sink_writes_with_the_configured_mode(tmp_path: Path, template: bool) -> None:
    """Issue 24 item 6: the weights files were 0644 (the umask) with no way to keep them to this user."""
    import stat

    args = [*st_args(tmp_path / "out"), "rollout.sink.file_mode=0600"]
    if template:
        (tmp_path / "tpl").mkdir()
        (tmp_path / "tpl" / "config.json").write_text("{}")
        args.append(f"rollout.sink.template_dir={tmp_path / 'tpl'}")
    sink = build_sink(load_config(overrides=args))
    await drive(sink, odd_weights(1), 1)
    assert sink.latest_path is not None
    written = [p for p in sink.latest_path.parent.iterdir()] if template else [sink.latest_path]
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in written}
    assert set(modes.values()) == {0o600}, modes
    if template:
        assert stat.S_IMODE(sink.latest_path.parent.stat().st_mode) == 0o700
    with pytest.raises(ConfigError, match=r"rollout\.sink\.file_mode=44 \(octal\)"):
        load_config(overrides=[*st_args(tmp_path), "rollout.sink.file_mode=044"])
