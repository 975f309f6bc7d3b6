"""What a config mistake says: the value and the type a right key takes, the recipe keys `config show` checks,
and a token's value hidden without hiding the message's own words."""

from __future__ import annotations

import pytest

from lightning_weightsync import ConfigError, load_config
from lightning_weightsync.cli import main

SHORT = "shortabc"[:5]  # "short": also a word of the message that refuses it


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("transport.bucket_size_mb=abc", "bucket_size_mb='abc' is not a number; expected a number like 512.0"),
        ("transport.port=x", "transport.port='x' is not an integer; expected an integer like 29600"),
        ("transport.host=", "transport.host is empty (null); expected a non-empty string like '127.0.0.1'"),
        ("trainer.min_receivers=1.5", "trainer.min_receivers='1.5' is not an integer"),
    ],
)
def test_a_wrong_value_for_a_right_key_names_the_value_and_the_type(override: str, said: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[override])
    assert said in str(err.value) and "invalid config key" not in str(err.value), str(err.value)


def test_an_unknown_key_is_still_called_one() -> None:
    with pytest.raises(ConfigError, match=r"invalid config key 'transport\.bogus'"):
        load_config(overrides=["transport.bogus=1"])


def test_a_short_token_is_hidden_but_the_words_of_its_message_are_not() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[f"transport.auth_token={SHORT}"])
    message = str(err.value)
    assert "a short token is guessed offline" in message and "<redacted>" not in message, message


def test_a_token_quoted_by_a_message_is_hidden() -> None:
    """OmegaConf quotes a value it cannot convert; a token given beside it never shows."""
    from lightning_weightsync.config.load import _scrub

    assert _scrub("Value 'hunter' of type 'str' could not be converted", ["hunter"]) == (
        "Value '<redacted>' of type 'str' could not be converted"
    )
    hidden = _scrub("transport.auth_token=hunter was refused", ["hunter"])
    assert hidden == "transport.auth_token=<redacted> was refused"
    long = "a-long-secret-0123456789"
    assert long not in _scrub(f"anything {long}x anywhere", [long])


def test_config_show_checks_the_recipe_keys_against_the_schema_the_yaml_names(capsys, monkeypatch) -> None:
    monkeypatch.chdir(__file__.rsplit("/tests/", 1)[0])  # recipes/ and examples/ resolve from the checkout
    assert main(["config", "show", "--config", "recipes/grpo_tiny_cpu.yaml", "recipe.stpes=3"]) == 2
    err = capsys.readouterr().err
    assert "recipe.stpes" in err and "Did you mean: 'steps'" in err, err
    assert main(["config", "show", "--config", "recipes/grpo_tiny_cpu.yaml", "recipe.steps=3"]) == 0
    assert "(recipe: against examples.grpo:GRPORecipe)" in capsys.readouterr().out
    assert main(["config", "show", "recipe.anything=3"]) == 0  # names no schema: said, not called validated
    assert "recipe: not checked here" in capsys.readouterr().out
