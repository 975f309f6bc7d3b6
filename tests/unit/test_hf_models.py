"""Real third-party models (transformers, built from config: no download) through the naming rules
and the sinks, in one process: the usual LightningModule shape (`self.model = HF model`) sends the
HF names, tied embeddings are sent once, and every sink gives back a model equal to the trainer's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from lightning_weightsync import load_config  # noqa: E402
from lightning_weightsync.rollout.sinks import build_sink  # noqa: E402
from lightning_weightsync.rollout.sinks.callable import CallableSink  # noqa: E402
from lightning_weightsync.rollout.sinks.module import ModuleSink  # noqa: E402
from lightning_weightsync.trainer.gather import iter_full_parameters  # noqa: E402
from lightning_weightsync.trainer.names import served_child, tied_names  # noqa: E402
from tests.unit.test_sinks import drive  # noqa: E402

TOKENS = torch.tensor([[1, 5, 9, 33, 60, 2]])


def tiny(kind: str, seed: int) -> nn.Module:
    common = {
        "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32,
        "tie_word_embeddings": True,
    }  # fmt: skip
    config = transformers.Qwen3Config(head_dim=8, **common) if kind == "qwen3" else transformers.LlamaConfig(**common)
    cls = transformers.Qwen3ForCausalLM if kind == "qwen3" else transformers.LlamaForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return cls(config).eval()


class Policy(nn.Module):
    """A LightningModule as the rule sees it: the HF model as `self.model`, a stateless loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.loss = nn.CrossEntropyLoss()


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
async def test_hf_tied_model_through_names_and_every_sink(kind: str, tmp_path: Path) -> None:
    trained = tiny(kind, seed=1)
    policy = Policy(trained)
    prefix = served_child(policy)
    assert prefix == "model"
    sent = dict(iter_full_parameters(policy, prefix=prefix, keep_on_rank=None))
    hf_names = set(trained.state_dict())
    assert set(sent) == hf_names - {"lm_head.weight"}  # HF names; the tied head sent once
    tied = tied_names(policy, prefix=prefix)
    assert tied == {"model.embed_tokens.weight": ("lm_head.weight",)}
    want = logits(trained)

    # module sink: the same class from another seed ends equal to the trainer, the tie intact
    sink = ModuleSink(load_config(), module=tiny(kind, seed=2))
    await drive(sink, sent, 0, tied=tied)
    assert sink.module.lm_head.weight is sink.module.model.embed_tokens.weight
    assert torch.equal(logits(sink.module), want)

    # safetensors sink with a template directory: from_pretrained loads each version as is
    template = tmp_path / "template"
    trained.config.save_pretrained(template)
    cfg = load_config(
        overrides=[
            "rollout.sink.type=safetensors", f"rollout.sink.dir={tmp_path / 'out'}",
            f"rollout.sink.template_dir={template}",
        ]
    )  # fmt: skip
    st = build_sink(cfg)
    await drive(st, sent, 0, tied=tied)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "step_0").eval()
    assert torch.equal(logits(loaded), want)

    # callable sink: every name the model has, so a strict load works
    got: dict[str, torch.Tensor] = {}
    fn_sink = CallableSink(load_config(overrides=["rollout.sink.type=callable"]), lambda v, ts: got.update(ts))
    await drive(fn_sink, sent, 0, tied=tied)
    fresh = tiny(kind, seed=3)
    fresh.load_state_dict(got, strict=True)
    assert torch.equal(logits(fresh), want)
