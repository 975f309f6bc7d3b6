"""LoRA (`trainer.lora`, `rollout.sink.lora`): names, PEFT's merge bitwise, the spec on the wire, the trainer's
stream per mode, and the sinks (keep, merge, the adapter directory), one process, real PEFT models."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch

from lightning_weightsync import load_config, merge_weight_chunks, split_weight_chunks
from lightning_weightsync.errors import ConfigError, ProtocolError, SinkError
from lightning_weightsync.protocol.lora import adapter_name, base_name, merge_weight
from lightning_weightsync.protocol.messages import BucketMeta, LoraSpec, decode, encode
from lightning_weightsync.rollout.consume import begin_version
from lightning_weightsync.rollout.sinks.callable import CallableSink
from lightning_weightsync.rollout.sinks.module import ModuleSink
from lightning_weightsync.rollout.sinks.safetensors import SafetensorsSink
from lightning_weightsync.trainer.driver import SyncDriver
from tests.support.lora import RANK, TOKENS, adapter_state, build_base, build_gpt2_base, build_gpt2_peft, build_peft

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

BUCKET = 4096


def driver(*overrides: str) -> SyncDriver:
    return SyncDriver(load_config(overrides=list(overrides)), rank=0, device=None, prefix=None)


def stream(d: SyncDriver, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in d.weights(model)}


def train_step(model: torch.nn.Module, seed: int) -> None:
    """An optimizer-like change of every trainable tensor (the base stays frozen)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.01 * torch.randn(p.shape, generator=g))


async def drive(sink: Any, d: SyncDriver, model: torch.nn.Module, version: int) -> dict[str, torch.Tensor]:
    """One version through split -> merge(into=sink.destination) -> accept -> commit, as the daemon does."""
    weights = stream(d, model)
    begin_version(sink, version, d.tied(model), d.lora.spec)
    try:
        async for name, tensor in merge_weight_chunks(
            split_weight_chunks(weights.items(), BUCKET), BUCKET, into=sink.destination
        ):
            sink.accept(name, tensor)
    except BaseException as exc:
        sink.abort(version, str(exc))
        raise
    sink.commit(version)
    d.record.delivered(version, None)
    return weights


# -- names and the merge ------------------------------------------------------------------------------
def test_names_map_to_the_base_model_and_to_peft_save_names() -> None:
    raw = "base_model.model.model.layers.0.self_attn.q_proj"
    assert base_name(f"{raw}.base_layer.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert base_name(f"{raw}.base_layer.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert base_name("base_model.model.lm_head.original_module.weight") == "lm_head.weight"
    assert base_name("base_model.model.lm_head.modules_to_save.default.weight") == "lm_head.weight"
    assert base_name("policy.base_model.model.model.norm.weight") == "policy.model.norm.weight"
    assert base_name("model.norm.weight") == "model.norm.weight"  # not PEFT: unchanged
    assert adapter_name(f"{raw}.lora_A.default.weight") == f"{raw}.lora_A.weight"
    assert adapter_name("base_model.model.lm_head.modules_to_save.default.weight") == "base_model.model.lm_head.weight"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fan_in_fan_out", [False, True])
def test_merge_is_bitwise_peft_s_own_merge(dtype: torch.dtype, fan_in_fan_out: bool) -> None:
    model = build_peft().to(dtype)
    layer = model.base_model.model.model.layers[0].mlp.down_proj  # [64, 128], r=16
    weight, a, b = (
        layer.base_layer.weight.detach().clone(),
        layer.lora_A["default"].weight,
        layer.lora_B["default"].weight,
    )
    if fan_in_fan_out:  # PEFT's Conv1D layout: the weight is [in, out]; the delta is transposed
        layer.fan_in_fan_out = True
        layer.base_layer.weight.data = weight.T.contiguous()
        weight = weight.T.contiguous()
    ours = merge_weight(weight, a, b, layer.scaling["default"], fan_in_fan_out=fan_in_fan_out)
    layer.merge()
    assert ours.dtype == dtype and torch.equal(ours, layer.base_layer.weight)


# -- the spec on the wire -------------------------------------------------------------------------------
def _spec(**kw: Any) -> LoraSpec:
    fields: dict[str, Any] = {"mode": "adapter", "base": False, "r": 16, "lora_alpha": 32.0, "target_modules": ["q"]}
    return LoraSpec(**{**fields, **kw})


def test_the_spec_travels_in_bucket_0_and_round_trips() -> None:
    msg = BucketMeta(3, 0, True, 0, [], lora=_spec(rank_pattern={"q": 8}))
    assert decode(encode(msg)) == msg


@pytest.mark.parametrize(
    "bad",
    [
        {"mode": "sideways"},
        {"r": 0},
        {"r": 1 << 20},
        {"lora_alpha": float("nan")},
        {"lora_dropout": 1.0},
        {"bias": "some"},
        {"target_modules": [""]},
        {"target_modules": ["x"] * 2000},
        {"rank_pattern": {"q": 0}},
    ],
    ids=lambda kw: next(iter(kw)),
)
def test_a_bad_spec_is_refused_by_the_decoder(bad: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError, match=r"LoRA"):
        decode(encode(BucketMeta(3, 0, True, 0, [], lora=_spec(**bad))))


def test_only_bucket_0_may_carry_the_spec() -> None:
    with pytest.raises(ProtocolError, match=r"only bucket 0"):
        decode(encode(BucketMeta(3, 1, True, 0, [], lora=_spec())))


# -- the trainer's stream -------------------------------------------------------------------------------
def test_adapter_versions_carry_peft_s_save_names_and_the_base_once() -> None:
    model = build_peft(modules_to_save=["lm_head"])
    d = driver()  # trainer.lora=auto: adapter for a PEFT model
    first = stream(d, model)
    spec = d.lora.spec
    assert spec is not None and spec.mode == "adapter" and spec.base and spec.r == RANK
    assert spec.modules_to_save == ["lm_head"] and len(spec.target_modules) == 14
    saved = adapter_state(model)  # what save_pretrained writes
    assert all(torch.equal(first[n], t) for n, t in saved.items())
    base = {n: t for n, t in first.items() if n not in saved}
    plain = build_base().state_dict()
    assert set(base) == set(plain)  # the base under the plain model's names, lm_head's original included
    assert all(torch.equal(base[n], plain[n]) for n in plain)
    d.record.delivered(0, None)
    second = stream(d, model)
    assert set(second) == set(saved) and not d.lora.spec.base  # after a delivered version: only the adapter
    adapter_bytes = sum(t.numel() * t.element_size() for t in second.values())
    model_bytes = sum(t.numel() * t.element_size() for t in plain.values())
    assert adapter_bytes < model_bytes * 0.8  # lm_head's copy is most of it here


def test_a_failed_first_version_sends_the_base_again_and_rollout_has_never() -> None:
    model = build_peft()
    d = driver()
    stream(d, model)
    assert d.lora.spec.base
    stream(d, model)  # version 0 was not delivered: the base goes again
    assert d.lora.spec.base
    d = driver("trainer.lora_base=rollout_has")
    assert set(stream(d, model)) == set(adapter_state(model)) and not d.lora.spec.base


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_merged_and_full_equal_merge_and_unload_bitwise(dtype: str | None) -> None:
    model = build_peft(modules_to_save=["lm_head"])
    cast = getattr(torch, dtype) if dtype else torch.float32
    ref = copy.deepcopy(model).to(cast).merge_and_unload().state_dict()
    overrides = [f"trainer.dtype={dtype}"] if dtype else []
    full = stream(driver("trainer.lora=full", *overrides), model)
    assert set(full) == set(ref) and all(torch.equal(full[n], ref[n]) for n in ref)
    d = driver("trainer.lora=merged", *overrides)
    assert set(stream(d, model)) == set(ref)  # the first version: the base too
    d.record.delivered(0, None)
    changed = stream(d, model)
    assert len(changed) == 14 + 1  # every targeted linear layer, merged, and lm_head's trained copy
    assert all(torch.equal(changed[n], ref[n]) for n in changed)


def test_lora_knobs_are_checked_against_the_model() -> None:
    with pytest.raises(ConfigError, match=r"trainer.lora=adapter.*no PEFT model"):
        stream(driver("trainer.lora=adapter"), build_base())
    ia3 = peft.get_peft_model(build_base(), peft.IA3Config(target_modules=["q_proj"], feedforward_modules=[]))
    with pytest.raises(ConfigError, match=r"IA3, not LORA.*trainer.lora"):
        stream(driver(), ia3)
    dora = build_peft(use_dora=True)
    with pytest.raises(ConfigError, match=r"trainer.lora=merged.*use trainer.lora=adapter"):
        stream(driver("trainer.lora=merged"), dora)
    assert "lora_magnitude_vector" in " ".join(stream(driver(), dora))  # adapter mode sends DoRA as is


# -- the sinks -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("apply", ["atomic", "streaming"])
async def test_keep_every_version_s_adapter_equals_the_trainer_s(apply: str) -> None:
    trainer_model = build_peft(modules_to_save=["lm_head"])
    d = driver()
    cfg = load_config(overrides=[f"rollout.apply={apply}"])
    rollout = build_peft(seed=7, lora_seed=8, modules_to_save=["lm_head"])  # other values everywhere
    sink = ModuleSink(cfg, module=rollout)
    for version in range(3):
        await drive(sink, d, trainer_model, version)
        assert all(torch.equal(t, rollout.state_dict()[n]) for n, t in trainer_model.state_dict().items())
        assert torch.equal(rollout(input_ids=TOKENS).logits, trainer_model(input_ids=TOKENS).logits)
        train_step(trainer_model, version)


@pytest.mark.parametrize("apply", ["atomic", "streaming"])
async def test_merge_every_version_equals_merge_and_unload(apply: str) -> None:
    trainer_model = build_peft(modules_to_save=["lm_head"])
    d = driver()
    rollout = build_base(seed=7)  # a plain model, other base values: version 0 brings the base
    sink = ModuleSink(load_config(overrides=[f"rollout.apply={apply}", "rollout.sink.lora=merge"]), module=rollout)
    for version in range(3):
        await drive(sink, d, trainer_model, version)
        merged = copy.deepcopy(trainer_model).merge_and_unload()
        assert all(torch.equal(t, rollout.state_dict()[n]) for n, t in merged.state_dict().items())
        assert torch.equal(rollout(input_ids=TOKENS).logits, merged(input_ids=TOKENS).logits)
        train_step(trainer_model, version)


async def test_merge_onto_the_rollout_s_own_base() -> None:
    """trainer.lora_base=rollout_has: the first version's merge starts from the factory's weights."""
    trainer_model = build_peft()
    d = driver("trainer.lora_base=rollout_has")
    rollout = build_base(seed=0)
    sink = ModuleSink(load_config(overrides=["rollout.sink.lora=merge"]), module=rollout)
    for version in range(2):
        await drive(sink, d, trainer_model, version)
        merged = copy.deepcopy(trainer_model).merge_and_unload().state_dict()
        assert all(torch.equal(t, rollout.state_dict()[n]) for n, t in merged.items())
        train_step(trainer_model, version)


async def test_an_adapter_that_does_not_fit_the_rollout_is_refused_before_anything_is_applied() -> None:
    trainer_model = build_peft()
    rollout = build_peft(seed=7, lora_seed=8, r=8)
    before = {n: t.clone() for n, t in rollout.state_dict().items()}
    sink = ModuleSink(load_config(), module=rollout)
    with pytest.raises(SinkError, match=r"does not match the rollout's PEFT model.*r: trainer 16, rollout 8"):
        await drive(sink, driver(), trainer_model, 0)
    assert all(torch.equal(before[n], t) for n, t in rollout.state_dict().items()) and sink.version is None
    few = peft.get_peft_model(build_base(), peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj"]))
    with pytest.raises(SinkError, match=r"target_modules"):
        await drive(ModuleSink(load_config(), module=few), driver(), trainer_model, 0)
    with pytest.raises(SinkError, match=r"built no PEFT model.*rollout.sink.lora=merge"):
        await drive(ModuleSink(load_config(), module=build_base()), driver(), trainer_model, 0)

    class Smaller(torch.nn.Module):  # the merge rollout's model lacks the targets
        def __init__(self) -> None:
            super().__init__()
            self.model = torch.nn.Linear(4, 4)

    merge_cfg = load_config(overrides=["rollout.sink.lora=merge"])
    with pytest.raises(SinkError, match=r"targets .* that the rollout model has no weight for"):
        await drive(ModuleSink(merge_cfg, module=Smaller()), driver(), trainer_model, 0)


async def test_a_version_that_switches_modes_is_refused() -> None:
    trainer_model = build_peft()
    rollout = build_base()
    sink = ModuleSink(load_config(overrides=["rollout.sink.lora=merge"]), module=rollout)
    await drive(sink, driver("trainer.lora=merged"), trainer_model, 0)
    before = {n: t.clone() for n, t in rollout.state_dict().items()}
    train_step(trainer_model, 0)
    with pytest.raises(SinkError, match=r"trainer.lora=adapter but this rollout holds trainer.lora=merged"):
        await drive(sink, driver(), trainer_model, 1)
    assert all(torch.equal(before[n], t) for n, t in rollout.state_dict().items()) and sink.version == 0


def test_an_adapter_version_into_a_sink_that_cannot_load_it_is_refused() -> None:
    sink = CallableSink(load_config(overrides=["rollout.sink.target=builtins:print"]))
    with pytest.raises(SinkError, match=r"cannot load; set trainer.lora=merged"):
        begin_version(sink, 0, {}, _spec())
    begin_version(sink, 0, {}, _spec(mode="merged"))  # plain weights under base names: fine


async def test_safetensors_writes_adapter_directories_peft_loads(tmp_path: Any) -> None:
    trainer_model = build_peft(modules_to_save=["lm_head"])
    d = driver("trainer.lora_base=rollout_has")
    cfg = load_config(
        overrides=["rollout.sink.type=safetensors", f"rollout.sink.dir={tmp_path}", "rollout.sink.keep_last=2"]
    )
    sink = SafetensorsSink(cfg)
    for version in range(3):
        await drive(sink, d, trainer_model, version)
        train_step(trainer_model, version)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "step_2"]
    assert sorted(p.name for p in (tmp_path / "step_2").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert json.loads((tmp_path / "step_2" / "adapter_config.json").read_text())["r"] == RANK
    loaded = peft.PeftModel.from_pretrained(build_base(), str(tmp_path / "step_2"))
    sent = build_peft(modules_to_save=["lm_head"])
    for version in range(2):
        train_step(sent, version)
    theirs, ours = adapter_state(loaded), adapter_state(sent)
    assert set(theirs) == set(ours) and all(torch.equal(theirs[n], ours[n]) for n in ours)
    assert torch.equal(loaded(input_ids=TOKENS).logits, sent(input_ids=TOKENS).logits)
    with_base = SafetensorsSink(
        load_config(overrides=["rollout.sink.type=safetensors", f"rollout.sink.dir={tmp_path}/b"])
    )
    with pytest.raises(SinkError, match=r"trainer.lora_base=rollout_has"):
        await drive(with_base, driver(), trainer_model, 0)


# -- the variants PEFT users run (issue 43): each bitwise against PEFT's own merge_and_unload /
# get_peft_model_state_dict, on the trainer's stream and through the rollout's merge sink ----------------------
def _merge_sink(rollout: torch.nn.Module) -> ModuleSink:
    return ModuleSink(load_config(overrides=["rollout.sink.lora=merge"]), module=rollout)


def _assert_holds(rollout: torch.nn.Module, want: dict[str, torch.Tensor]) -> None:
    held = rollout.state_dict()
    differ = [n for n, t in want.items() if not (held[n].dtype == t.dtype and torch.equal(held[n], t))]
    assert not differ, differ[:5]


async def test_lora_bias_is_refused_where_it_cannot_be_merged_and_sent_as_peft_saves_it(tmp_path: Any) -> None:
    """`lora_bias=True`: PEFT merges `lora_B.bias * scaling` into the base layer's bias; `merged`/`full` and
    the merge sink do not, so they refuse it naming the knob (never weights silently without the bias); the
    adapter mode sends the biases under PEFT's names, and a keep rollout built alike holds them bitwise."""
    model = build_peft(lora_bias=True)
    for mode in ("merged", "full"):
        with pytest.raises(ConfigError, match=rf"trainer.lora={mode}: LoRA layer .*lora_bias.*trainer.lora=adapter"):
            stream(driver(f"trainer.lora={mode}"), model)
    d = driver("trainer.lora_base=rollout_has")
    sent = stream(d, model)
    saved = adapter_state(model)
    assert d.lora.spec.lora_bias and any(n.endswith(".lora_B.bias") for n in saved)
    assert set(sent) == set(saved) and all(torch.equal(sent[n], saved[n]) for n in saved)
    rollout = build_base(seed=7)
    before = {n: t.clone() for n, t in rollout.state_dict().items()}
    sink = _merge_sink(rollout)
    with pytest.raises(SinkError, match=r"lora_bias=True.*sink.lora=merge does not merge; set rollout.sink.lora=keep"):
        await drive(sink, driver("trainer.lora_base=rollout_has"), model, 0)
    _assert_holds(rollout, before)
    assert sink.version is None
    with pytest.raises(SinkError, match=r"lora_bias: trainer True, rollout False"):  # a keep model built without it
        await drive(ModuleSink(load_config(), module=build_peft(seed=7)), driver(), model, 0)
    keep = build_peft(seed=7, lora_seed=8, lora_bias=True)
    await drive(ModuleSink(load_config(), module=keep), driver(), model, 0)
    _assert_holds(keep, model.state_dict())
    files = load_config(overrides=["rollout.sink.type=safetensors", f"rollout.sink.dir={tmp_path}"])
    await drive(SafetensorsSink(files), driver("trainer.lora_base=rollout_has"), model, 0)
    assert json.loads((tmp_path / "step_0" / "adapter_config.json").read_text())["lora_bias"] is True
    loaded = adapter_state(peft.PeftModel.from_pretrained(build_base(), str(tmp_path / "step_0")))
    assert set(loaded) == set(saved) and all(torch.equal(loaded[n], saved[n]) for n in saved)


def test_a_resumed_run_sends_the_base_until_a_version_with_it_was_delivered() -> None:
    """The record says version 5 was delivered (a checkpoint of an earlier run): the new run's first version
    carries the base; when it fails, the next one carries it again, until one is delivered."""
    model = build_peft()
    d = driver()
    d.record.load_state_dict({"last_synced_version": 5, "failures": 0})
    for _failed in range(2):
        assert set(stream(d, model)) > set(adapter_state(model)) and d.lora.spec.base  # sent, never delivered
    d.record.delivered(8, None)
    assert set(stream(d, model)) == set(adapter_state(model)) and not d.lora.spec.base


async def test_a_resumed_run_whose_first_base_version_failed_brings_the_base_to_a_merge_rollout() -> None:
    trainer_model = build_peft()
    d = driver()
    d.record.load_state_dict({"last_synced_version": 5, "failures": 1})
    stream(d, trainer_model)  # version 6, with the base: its send failed
    rollout = build_base(seed=7)  # never got the base: holds other weights
    await drive(_merge_sink(rollout), d, trainer_model, 7)
    _assert_holds(rollout, copy.deepcopy(trainer_model).merge_and_unload().state_dict())


async def test_bf16_merge_with_a_scaling_that_rounds_is_peft_s_fp32_product_on_both_sides() -> None:
    """PEFT multiplies bf16 factors on a CPU in fp32 and casts the product back (its `get_delta_weight`); with
    alpha 20 over r 16 (scaling 1.25, not a power of two) that differs from a bf16 product, so only PEFT's way
    matches `merge_and_unload` bitwise."""
    model = build_peft(lora_alpha=20).to(torch.bfloat16)
    layer = model.base_model.model.model.layers[0].mlp.down_proj
    a, b, scaling = layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.scaling["default"]
    assert scaling == 1.25 and not torch.equal((b @ a) * scaling, ((b.float() @ a.float()) * scaling).bfloat16())
    ref = copy.deepcopy(model).merge_and_unload().state_dict()
    full = stream(driver("trainer.lora=full"), model)
    assert set(full) == set(ref) and all(full[n].dtype == torch.bfloat16 and torch.equal(full[n], ref[n]) for n in ref)
    rollout = build_base(seed=7).to(torch.bfloat16)
    await drive(_merge_sink(rollout), driver(), model, 0)
    _assert_holds(rollout, ref)


async def test_rslora_merges_with_alpha_over_sqrt_r_on_both_sides() -> None:
    model = build_peft(use_rslora=True, lora_alpha=20)
    assert model.base_model.model.model.layers[0].mlp.down_proj.scaling["default"] == 20 / 4  # not 20 / 16
    trainer_model = copy.deepcopy(model)
    d = driver()
    rollout = build_base(seed=7)
    sink = _merge_sink(rollout)
    for version in range(2):
        await drive(sink, d, trainer_model, version)
        ref = copy.deepcopy(trainer_model).merge_and_unload().state_dict()
        _assert_holds(rollout, ref)
        full = stream(driver("trainer.lora=full"), trainer_model)
        assert all(torch.equal(full[n], ref[n]) for n in ref)
        train_step(trainer_model, version)


async def test_fan_in_fan_out_conv1d_gpt2_merges_bitwise_on_both_sides() -> None:
    """GPT-2's `Conv1D` stores weights [in, out] (PEFT's `fan_in_fan_out=True`): lora_A [r, in] and lora_B
    [out, r] fit the transposed weight (c_attn [32, 96], mlp.c_fc [32, 128], mlp.c_proj [128, 32]); the merge
    sink accepts them and holds merge_and_unload's weights, and so does the trainer's merged stream."""
    trainer_model = build_gpt2_peft()
    d = driver()
    rollout = build_gpt2_base(seed=7)
    sink = _merge_sink(rollout)
    for version in range(2):
        await drive(sink, d, trainer_model, version)
        merged = copy.deepcopy(trainer_model).merge_and_unload()
        _assert_holds(rollout, merged.state_dict())
        tokens = TOKENS[:, :6]  # eval: no dropout
        assert torch.equal(rollout.eval()(input_ids=tokens).logits, merged.eval()(input_ids=tokens).logits)
        full = stream(driver("trainer.lora=full"), trainer_model)
        assert all(torch.equal(t, merged.state_dict()[n]) for n, t in full.items())
        train_step(trainer_model, version)
