"""Naming rules (trainer/names.py): exact renames are exact, regex renames are regex, the served
child of a LightningModule-like wrapper is found by the documented rule, tied names are listed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_weightsync.config import load_config
from lightning_weightsync.errors import ConfigError
from lightning_weightsync.trainer.gather import named_full_state_dict
from lightning_weightsync.trainer.names import NameMapper, served_child, tied_names


def test_exact_rename_touches_only_the_whole_name() -> None:
    # issue 12 point 4: `norm.weight -> final_norm.weight` used to give `input_layerfinal_norm.weight`
    cfg = load_config(overrides=["trainer.names.rename={norm.weight: final_norm.weight}"])
    mapper = NameMapper.from_config(cfg.trainer.names)
    assert mapper("norm.weight") == "final_norm.weight"
    assert mapper("layers.0.input_layernorm.weight") == "layers.0.input_layernorm.weight"
    assert mapper("layers.0.post_attention_layernorm.weight") == "layers.0.post_attention_layernorm.weight"


def test_rename_regex_is_re_sub_in_order_after_exact_renames() -> None:
    mapper = NameMapper.from_config(
        {
            "rename": {"head.w": "lm_head.w"},
            "rename_regex": {r"\.w$": ".weight", r"^(lm_head)\.": r"out.\1."},
        }
    )
    assert mapper("head.w") == "out.lm_head.weight"  # exact first, then each regex on the previous result
    assert mapper("blocks.0.w") == "blocks.0.weight"
    assert mapper("blocks.0.w.x") == "blocks.0.w.x"  # anchored: no match, unchanged


def test_rename_to_empty_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.names\.rename maps a name to ''"):
        NameMapper.from_config({"rename": {"a": ""}})


class Net(nn.Module):
    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.body = nn.Linear(4, 4)
        self.lm_head = nn.Linear(4, 8, bias=False)
        if tie:
            self.lm_head.weight = self.embed.weight


class Holder(nn.Module):
    """What a LightningModule looks like to the rule: `self.model = network`, plus stateless extras."""

    def __init__(self, extra: nn.Module | None = None) -> None:
        super().__init__()
        self.model = Net()
        self.loss = nn.CrossEntropyLoss()  # no tensors: does not count
        if extra is not None:
            self.extra = extra


def test_served_child_rule() -> None:
    assert served_child(Holder()) == "model"
    assert served_child(Holder(extra=nn.Linear(2, 2))) is None  # two networks: ambiguous, send all
    own = Holder()
    own.scale = nn.Parameter(torch.ones(()))  # a tensor on the holder itself
    assert served_child(own) is None
    assert served_child(Net()) is None  # a bare network with several children


def test_tied_names_are_listed_once_under_the_sent_name() -> None:
    holder = Holder()
    sent = named_full_state_dict(holder, prefix="model", keep_on_rank=None)
    assert "embed.weight" in sent and "lm_head.weight" not in sent  # sent once, first name in module order
    assert tied_names(holder, prefix="model") == {"embed.weight": ("lm_head.weight",)}
    assert tied_names(Net(tie=False)) == {}
    # aliases go through the same rules; an excluded alias is not listed
    renamed = tied_names(Net(), names_cfg={"rename": {"lm_head.weight": "out.weight"}})
    assert renamed == {"embed.weight": ("out.weight",)}
    assert tied_names(Net(), names_cfg={"exclude": ["lm_head.*"]}) == {}


def test_sync_driver_reports_ties_under_its_own_rules() -> None:
    from lightning_weightsync.trainer.driver import SyncDriver

    cfg = load_config(overrides=["trainer.names.rename={lm_head.weight: head.weight}"])
    driver = SyncDriver(cfg, rank=0, device=None, prefix="model")
    assert driver.is_sender
    assert driver.tied(Holder()) == {"embed.weight": ("head.weight",)}
