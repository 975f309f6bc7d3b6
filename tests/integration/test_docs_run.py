"""Every code block in README.md and docs/ that claims to run is run (issue 12 point 6: the README's
low-level snippet was a coroutine never awaited, and its recipe line did not load).

A fenced block with a language is preceded by one marker line saying what it is:

    <!-- docs-test: run -->            python: run as a script; bash: run with `bash -euo pipefail`
    <!-- docs-test: config -->         yaml: loads and validates with `load_config`
    <!-- docs-test: skip <reason> -->  not run here (GPU, long-running daemon, ...), the reason says why

Blocks run from the repository root with the virtualenv's `bin/` first on PATH, each under a
timeout. A block without a marker fails the test on the pages listed in `MARKED`; on the other
pages it is reported as skipped, naming the page, until their owners mark them.
"""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from lightning_weightsync import load_config
from tests.support.mp import free_port, run_workers

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKED = {"README.md", "quickstart.md", "concepts.md", "configuration.md"}
TIMEOUT_S = 120
MARKER = re.compile(r"^<!-- docs-test: (?P<kind>run|config|skip)(?: (?P<reason>.*?))? -->$")
FENCE = re.compile(r"^```(?P<lang>[a-z]*)\s*$")


@dataclass
class Block:
    page: str
    line: int
    lang: str
    code: str
    kind: str | None
    reason: str | None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(path: Path) -> list[Block]:
    out: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        marker = MARKER.match(lines[i - 1]) if i else None
        if m["lang"]:
            out.append(
                Block(
                    path.name, i + 1, m["lang"], "\n".join(lines[i + 1 : end]) + "\n",
                    marker["kind"] if marker else None, marker["reason"] if marker else None,
                )
            )  # fmt: skip
        i = end + 1
    return out


ALL = [b for page in PAGES for b in blocks(page)]
PORT = re.compile(r"(?<=port=)\d{4,5}\b|(?<=127\.0\.0\.1:)\d{4,5}\b")


def on_free_ports(code: str) -> str:
    """A block's fixed ports (`...port=29650`, `127.0.0.1:9450`: what a user types) swapped for free ones, the
    same number for the same port, so blocks and the tests beside them never collide on one."""
    chosen: dict[str, str] = {}
    return PORT.sub(lambda m: chosen.setdefault(m[0], str(free_port())), code)


def test_the_runner_finds_the_blocks() -> None:
    readme = [b for b in ALL if b.page == "README.md"]
    assert sum(b.kind == "run" for b in readme) >= 3  # the one-liner, the CLI lines, the low-level snippet
    assert any(b.kind == "skip" and b.reason for b in ALL)


def run_as_script(path: str) -> None:
    """`python PATH`: the block's own globals, `__name__ == "__main__"`, its folder first on sys.path."""
    sys.argv = [path]
    sys.path.insert(0, str(Path(path).parent))
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise


@pytest.mark.parametrize("block", ALL, ids=[b.id for b in ALL])
def test_doc_block(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if block.kind is None:
        if block.page in MARKED:
            pytest.fail(
                f"{block.id}: ```{block.lang} block without a <!-- docs-test: run|config|skip reason --> marker"
            )
        pytest.skip(f"{block.id}: not marked yet (its page's owner: add a docs-test marker)")
    if block.kind == "skip":
        assert block.reason, f"{block.id}: a skipped block must say why"
        pytest.skip(f"{block.id}: {block.reason}")
    if block.kind == "config":
        assert block.lang == "yaml", f"{block.id}: only yaml blocks are configs"
        path = tmp_path / "block.yaml"
        path.write_text(block.code)
        load_config(path)  # raises ConfigError naming the key
        return
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env["PYTHONPATH"] = str(REPO)
    if block.lang == "python":
        script = tmp_path / "block.py"
        script.write_text(on_free_ports(block.code))
        # as `python block.py` from the repository root, in a worker forked from the test session's forkserver
        # (torch already imported: a fresh interpreter would spend seconds on that before the block's first line)
        for key in ("PATH", "PYTHONPATH"):
            monkeypatch.setenv(key, env[key])
        monkeypatch.chdir(REPO)
        run_workers(run_as_script, [(str(script),)], timeout_s=TIMEOUT_S)
        return
    if block.lang == "bash":
        cmd = ["bash", "-euo", "pipefail", "-c", on_free_ports(block.code)]
    else:
        raise AssertionError(f"{block.id}: cannot run a ```{block.lang} block; mark it config or skip")
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, f"{block.id} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
