"""The docs cannot drift: configuration.md lists exactly the structured config's keys and defaults,
every config key or CLI command a doc mentions exists, and every relative link resolves."""

from __future__ import annotations

import dataclasses
import enum
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_weightsync import cli
from lightning_weightsync.config import default_config

DOCS = Path(__file__).resolve().parent.parent.parent / "docs"
PACKAGE = DOCS.parent / "lightning_weightsync"
PAGES = (
    "quickstart.md", "concepts.md", "configuration.md", "backends.md", "operations.md", "security.md",
    "integrations.md",
)  # fmt: skip
FILE_SUFFIXES = {"log", "yaml", "jsonl", "safetensors", "py", "md"}  # `trainer.log` is a file name, not a key
ROW = re.compile(r"^\|\s*`(?P<key>[a-z_.]+)`\s*\|\s*`(?P<default>[^`]*)`\s*\|")


def structured_leaves(node: DictConfig, prefix: str = "") -> dict[str, Any]:
    """Flatten the structured config down to its fields (free-form mappings like `options` are leaves)."""
    out: dict[str, Any] = {}
    for key in node:
        path = f"{prefix}{key}"
        value_type = OmegaConf.get_type(node, key)
        child = node[key]
        if isinstance(child, DictConfig) and value_type is not None and dataclasses.is_dataclass(value_type):
            out.update(structured_leaves(child, f"{path}."))
        else:
            value = OmegaConf.to_container(child) if isinstance(child, DictConfig | ListConfig) else child
            out[path] = value.value if isinstance(value, enum.Enum) else value  # choices as users type them
    return out


def documented_defaults() -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for line in (DOCS / "configuration.md").read_text().splitlines():
        m = ROW.match(line)
        if m:
            assert m["key"] not in rows, f"{m['key']} documented twice"
            rows[m["key"]] = yaml.safe_load(m["default"])
    return rows


def test_configuration_md_matches_the_structured_config() -> None:
    code = structured_leaves(default_config())
    docs = documented_defaults()
    assert len(code) > 30  # the flattening found the fields, not just the three sections
    assert sorted(set(code) - set(docs)) == [], "keys missing from docs/configuration.md"
    assert sorted(set(docs) - set(code)) == [], "docs/configuration.md documents keys the config does not have"
    wrong = {k: (docs[k], code[k]) for k in code if docs[k] != code[k] or type(docs[k]) is not type(code[k])}
    # YAML reads `512.0` as float and `3` as int, exactly as the dataclass defaults are typed
    assert wrong == {}, "defaults in docs/configuration.md differ from config.py: {key: (docs, code)}"


@pytest.mark.parametrize("page", PAGES)
def test_page_exists_and_its_config_keys_exist(page: str) -> None:
    text = (DOCS / page).read_text()
    assert text.startswith("# "), f"{page} has no title"
    keys = set(structured_leaves(default_config()))
    sections = {k.rsplit(".", 1)[0] for k in keys} | {"transport", "trainer", "rollout"}
    for ref in {r.rstrip(".") for r in re.findall(r"`((?:transport|trainer|rollout)\.[a-z_.]+)", text)}:
        if ref in keys or ref in sections or ref.rsplit(".", 1)[-1] in FILE_SUFFIXES:
            continue
        module = PACKAGE.joinpath(*ref.split("."))
        if module.with_suffix(".py").is_file() or module.is_dir():  # `rollout.observability`: a module, not a key
            continue
        free_maps = ("rollout.sink.options", "trainer.names.rename", "trainer.names.rename_regex")
        assert any(ref.startswith(f"{free}.") for free in free_maps), (
            f"{page} mentions `{ref}`, which is not a config key"
        )


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page: str) -> None:
    text = (DOCS / page).read_text()
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert (DOCS / target).resolve().exists(), f"{page} links to missing {target}"


@pytest.mark.parametrize("page", PAGES)
def test_cli_commands_in_docs_exist(page: str) -> None:
    parser = cli.build_parser()
    commands = set(parser._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    for command in re.findall(r"lightning-weightsync ([a-z-]+)", (DOCS / page).read_text()):
        assert command in commands, f"{page} uses `lightning-weightsync {command}`, which does not exist"


# -- what the docs quote from the code (issue 25 item 7: each of these had drifted) --------------------


@pytest.mark.parametrize("page", (*PAGES, "../README.md"))
def test_test_paths_in_docs_exist(page: str) -> None:
    text = (DOCS / page).read_text()
    for path in set(re.findall(r"\b(tests/[\w/]+\.py)\b", text)):
        assert (DOCS.parent / path).is_file(), f"{page} names {path}, which does not exist"


def _as_pattern(fmt: str) -> re.Pattern[str]:
    """The daemon's %-format as a regex of what it renders: numbers for %d/%f, and for %s a size as
    `human_bytes` writes it (`195 KiB`, not `0.20 MB`: the quickstart had the units of an older format)."""
    pattern = ""
    for literal, conversion in re.findall(r"([^%]*)(%[-.\d]*[dsf]|$)", fmt):
        if literal.endswith("; ") and conversion == "%s":  # a note after the figures (`whole`, `delta of ...`): text
            pattern += re.escape(literal) + r"(?:whole|delta of version \d+: .+)"
            continue
        pattern += re.escape(literal) + {"": "", "s": r"[\d.]+ (?:B|[KMGT]iB)"}.get(conversion[-1:], r"[-\d.]+")
    return re.compile(pattern + "$")


@pytest.mark.parametrize(("side", "module", "verb"), [("daemon", "rollout/observability.py", "applied"),
                                                      ("trainer", "versions/sender.py", "sent")])  # fmt: skip
def test_the_quickstart_quotes_the_log_line_of_each_side(side: str, module: str, verb: str) -> None:
    fmt = re.search(rf'"(version %d {verb}: [^"]+)"', (PACKAGE / module).read_text())
    assert fmt, f"the {side}'s per-version format string moved: update this test"
    quoted = re.search(rf"`(version \d+ {verb}: [^`]+)`", (DOCS / "quickstart.md").read_text())
    matches = bool(quoted) and _as_pattern(fmt[1]).match(quoted[1]) is not None
    assert matches, f"docs/quickstart.md quotes {quoted and quoted[1]!r}; the {side} logs {fmt[1]!r}"


def test_the_quickstart_s_log_lines_quote_the_demo_model_s_size() -> None:
    """What section 3's run prints is the tiny LM's stream: its bytes and tensors (the page said 195 KiB while the
    run printed 198)."""
    from lightning_weightsync import iter_full_parameters
    from lightning_weightsync.demo.tiny_lm import build_model
    from lightning_weightsync.versions.stats import human_bytes

    stream = list(iter_full_parameters(build_model()))
    size = human_bytes(sum(t.numel() * t.element_size() for _, t in stream))
    text = (DOCS / "quickstart.md").read_text()
    quoted = re.findall(r"`version 8 (?:applied|sent): ([\d.]+ [KMG]?i?B) in [^`]*?, (\d+) tensors", text)
    assert len(quoted) == 2, quoted
    assert quoted == [(size, str(len(stream)))] * 2, f"the demo model streams {size} in {len(stream)} tensors"


def test_the_backends_table_says_what_the_gpu_results_report() -> None:
    """A backend whose device-check step reports a GPU run in the Results section is not "not run on a GPU" in the
    table at the top of the same page (it was, for cuda_ipc, nccl and nixl, after the H200 run)."""
    text = (DOCS / "backends.md").read_text()
    results = text[text.index("### Results") :]
    steps = {"cuda_ipc": "| `cuda_ipc_stream`", "nixl": "| `nixl_stream`", "nccl": "NCCL world-size-1 test passed"}
    for backend, step in steps.items():
        row = re.search(rf"^\| `{backend}` \|.*$", text, flags=re.M)
        assert row, f"no table row for {backend}"
        if step in results:
            assert "not run on a GPU" not in row[0] and "H200" in row[0], f"{backend}: the table and Results disagree"


def test_the_quickstart_says_what_ran_on_a_gpu() -> None:
    text = (DOCS / "quickstart.md").read_text()
    section = text[text.index("## 4. ") :]
    assert "Not run on GPUs" not in section and "backends.md#results" in section


@pytest.mark.parametrize("page", (*PAGES, "changes.md", "../README.md"))
def test_pages_say_what_is_true_today_without_issue_numbers(page: str) -> None:
    """History (what was broken, what a fix measured before) belongs in changes.md, and no page names issues: a
    reader has no issue tracker to look them up in."""
    text = (DOCS / page).read_text()
    assert not re.findall(r"(?im)^#.*\bissues? \d+", text), f"{page}: an issue number in a heading"
    assert not re.findall(r"(?i)\bissues? \d+", text), f"{page}: names an issue"
    if page != "changes.md":
        assert not re.findall(r"(?im)before the fix|before issue|^\|.*before -> after", text), f"{page}: history"


def test_the_default_identity_is_documented_as_it_is_built() -> None:
    import os
    import socket

    from lightning_weightsync.transport.control import default_identity

    assert default_identity() == f"{socket.gethostname()}-{os.getpid()}"
    for path in (DOCS.parent / "configs" / "default.yaml", PACKAGE / "config" / "schema.py"):
        assert "<hostname>-<pid>" in path.read_text(), path
