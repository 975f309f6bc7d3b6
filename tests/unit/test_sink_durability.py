"""The safetensors sink's power-loss guarantee, checked through the order of its syscalls.

A kill -9 test cannot see a missing fsync: the page cache survives the process, so the file looks
complete afterwards whatever the order was. What a power loss would expose is the order itself, so
these tests wrap the real `os.fsync`, `os.replace` and `os.rename` (they still do their work) and
record, at the moment of each call, what the kernel holds: for an fsync, which inode the fd is and
its content as the OS sees it (so bytes still sitting in a Python buffer count as not synced); for
a rename, the inode and content being published. The rule checked for every rename onto a final
name (`step_N.safetensors`, or `step_N/` in template mode):

- the published file (every file of a published directory, and the directory's entries) was fsynced
  before the rename, with exactly the content it is published with;
- the parent directory is fsynced after the rename, so the new name itself survives.

Linux only: the fd is resolved through /proc/self/fd.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_weightsync import load_config
from lightning_weightsync.rollout.sinks import build_sink
from lightning_weightsync.rollout.sinks.safetensors import FINAL_DIR_RE, FINAL_RE, MIN_HEADER_RESERVE, step_path
from tests.unit.test_sinks import assert_same, drive, odd_weights, st_cfg

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="resolves fds through /proc (Linux)")

Inode = tuple[int, int]  # (st_dev, st_ino): survives renames, unlike a path


def _digest(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@dataclass
class Fsync:
    path: str
    inode: Inode
    is_dir: bool
    digest: str | None  # a file's content as the OS holds it at the fsync
    entries: frozenset[str] | None  # a directory's entries at the fsync


@dataclass
class Rename:
    src: str
    dst: str
    inode: Inode
    digest: str | None  # a file source's content at the rename
    files: dict[str, tuple[Inode, str]] = field(default_factory=dict)  # a directory source: name -> (inode, content)


Event = Fsync | Rename


class Recorder:
    """Wraps os.fsync / os.replace / os.rename with recorders that still call the real functions."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[Event] = []
        self.fail_dir_fsync = False  # a platform that cannot fsync a directory
        real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

        def fsync(fd: int) -> None:
            st = os.fstat(fd)
            is_dir = stat.S_ISDIR(st.st_mode)
            path = os.readlink(f"/proc/self/fd/{fd}")
            self.events.append(
                Fsync(
                    path=path,
                    inode=(st.st_dev, st.st_ino),
                    is_dir=is_dir,
                    # /proc/self/fd/N reopens the very inode, even a write-only or unlinked one
                    digest=None if is_dir else _digest(f"/proc/self/fd/{fd}"),
                    entries=frozenset(os.listdir(path)) if is_dir else None,
                )
            )
            if is_dir and self.fail_dir_fsync:
                raise OSError(errno.EINVAL, "Invalid argument (test: directory fsync unsupported)")
            real_fsync(fd)

        def wrap(real: Callable[..., None]) -> Callable[..., None]:
            def rename(src: str | os.PathLike[str], dst: str | os.PathLike[str], *args: object, **kw: object) -> None:
                st = os.stat(src)
                files = {}
                if stat.S_ISDIR(st.st_mode):
                    for p in Path(src).iterdir():
                        pst = p.stat()
                        files[p.name] = ((pst.st_dev, pst.st_ino), _digest(p))
                self.events.append(
                    Rename(
                        src=os.fspath(src),
                        dst=os.fspath(dst),
                        inode=(st.st_dev, st.st_ino),
                        digest=None if stat.S_ISDIR(st.st_mode) else _digest(src),
                        files=files,
                    )
                )
                real(src, dst, *args, **kw)

            return rename

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", wrap(real_replace))
        monkeypatch.setattr(os, "rename", wrap(real_rename))

    def clear(self) -> None:
        self.events.clear()

    def _synced_before(self, index: int, inode: Inode, digest: str) -> bool:
        return any(isinstance(e, Fsync) and e.inode == inode and e.digest == digest for e in self.events[:index])

    def check_published(self, directory: Path, name: str) -> None:
        """Assert the durability order for the one rename onto `directory/name` recorded so far."""
        target = os.fspath(directory / name)
        onto = [i for i, e in enumerate(self.events) if isinstance(e, Rename) and e.dst == target]
        assert len(onto) == 1, f"expected exactly one rename onto {target}, got {len(onto)}: {self.describe()}"
        i = onto[0]
        rename = self.events[i]
        assert isinstance(rename, Rename)
        final = directory / name
        if rename.files or final.is_dir():
            stage_synced = [e for e in self.events[:i] if isinstance(e, Fsync) and e.inode == rename.inode and e.is_dir]
            assert stage_synced, f"staged directory {rename.src} was never fsynced before the rename: {self.describe()}"
            assert stage_synced[-1].entries == set(rename.files), (
                f"staged directory fsynced with entries {sorted(stage_synced[-1].entries or ())}, "
                f"renamed with {sorted(rename.files)}"
            )
            assert set(rename.files) == {p.name for p in final.iterdir()}
            for fname, (inode, digest) in rename.files.items():
                assert self._synced_before(i, inode, digest), (
                    f"{fname} was renamed into {target} without an fsync of its complete content first: "
                    f"{self.describe()}"
                )
                assert _digest(final / fname) == digest
        else:
            assert rename.digest is not None
            assert self._synced_before(i, rename.inode, rename.digest), (
                f"{rename.src} was renamed onto {target} without an fsync of its complete content first "
                f"(data still buffered, or the fsync came after the rename): {self.describe()}"
            )
            assert _digest(final) == rename.digest
        parent = os.stat(directory)
        parent_synced = [
            e
            for e in self.events[i + 1 :]
            if isinstance(e, Fsync) and e.inode == (parent.st_dev, parent.st_ino) and name in (e.entries or ())
        ]
        assert parent_synced, f"{directory} was not fsynced after the rename onto {name}: {self.describe()}"

    def check_every_final_rename(self, directory: Path) -> int:
        """Every rename onto a final name was made durable; returns how many there were."""
        names = [
            Path(e.dst).name
            for e in self.events
            if isinstance(e, Rename)
            and Path(e.dst).parent == directory
            and (FINAL_RE.match(Path(e.dst).name) or FINAL_DIR_RE.match(Path(e.dst).name))
        ]
        for name in names:
            self.check_published(directory, name)
        return len(names)

    def describe(self) -> str:
        out = []
        for e in self.events:
            if isinstance(e, Fsync):
                what = f"entries={sorted(e.entries or ())}" if e.is_dir else f"sha={e.digest and e.digest[:8]}"
                out.append(f"fsync({Path(e.path).name} {what})")
            else:
                out.append(f"rename({Path(e.src).name} -> {Path(e.dst).name} sha={e.digest and e.digest[:8]})")
        return "[" + ", ".join(out) + "]"


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    return Recorder(monkeypatch)


async def test_file_is_fsynced_whole_before_rename_and_directory_after(tmp_path: Path, recorder: Recorder) -> None:
    """Also when a version is written again over its own file (a restarted trainer re-sends it)."""
    sink = build_sink(st_cfg(tmp_path))
    for version in (1, 2, 2):
        if sink.version == version:
            sink = build_sink(st_cfg(tmp_path))
        recorder.clear()
        await drive(sink, odd_weights(version), version)
        recorder.check_published(tmp_path, step_path(tmp_path, version).name)
        assert_same(load_file(str(step_path(tmp_path, version))), odd_weights(version))


async def test_header_outgrowing_reservation_is_fsynced_before_rename(tmp_path: Path, recorder: Recorder) -> None:
    """The second temp file (`.tmp2`, data copied behind a larger header) is the one published.

    The data (1500 one-byte tensors) is small enough to stay in Python's write buffer, so an fsync
    without a flush before it would sync a file missing its data."""
    sink = build_sink(st_cfg(tmp_path))
    weights = {f"layers.{i}.{'x' * 40}.weight": torch.full((1,), i % 256, dtype=torch.uint8) for i in range(1500)}
    await drive(sink, weights, 7, bucket=4096)
    assert any(isinstance(e, Rename) and e.src.endswith(".tmp2") for e in recorder.events), "path not taken"
    header = step_path(tmp_path, 7).read_bytes()[:8]
    assert int.from_bytes(header, "little") > MIN_HEADER_RESERVE
    recorder.check_published(tmp_path, "step_7.safetensors")
    assert_same(load_file(str(step_path(tmp_path, 7))), weights)


def template_cfg(tmp_path: Path) -> tuple[object, Path]:
    template = tmp_path / "template"
    template.mkdir()
    (template / "config.json").write_text('{"model_type": "tiny"}')
    (template / "tokenizer.json").write_text('{"vocab": {}}')
    (template / "model.safetensors").write_bytes(b"old weights, never copied")
    out = tmp_path / "out"
    cfg = load_config(
        overrides=["rollout.sink.type=safetensors", f"rollout.sink.dir={out}", f"rollout.sink.template_dir={template}"]
    )
    return cfg, out


async def test_template_directory_files_are_fsynced_before_rename(tmp_path: Path, recorder: Recorder) -> None:
    """model.safetensors *and* the copied config/tokenizer files, and the staged directory's entries,
    are on disk before `step_N/` appears; also when the same version is published again (a restarted
    trainer re-sends it) and the old directory is swapped out."""
    cfg, out = template_cfg(tmp_path)
    sink = build_sink(cfg)
    for version in (1, 2, 2):
        if sink.version == version:
            sink = build_sink(cfg)
        recorder.clear()
        await drive(sink, odd_weights(version), version)
        recorder.check_published(out, f"step_{version}")
        step = out / f"step_{version}"
        assert sorted(p.name for p in step.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
        assert (step / "config.json").read_text() == '{"model_type": "tiny"}'
    assert recorder.check_every_final_rename(out) == 1


async def test_directory_fsync_unsupported_is_tolerated(tmp_path: Path, recorder: Recorder) -> None:
    """Some platforms (and filesystems) refuse fsync on a directory: the version is still published."""
    recorder.fail_dir_fsync = True
    cfg, out = template_cfg(tmp_path)
    for sink, directory, final in (
        (build_sink(st_cfg(tmp_path / "plain")), tmp_path / "plain", step_path(tmp_path / "plain", 1)),
        (build_sink(cfg), out, out / "step_1" / "model.safetensors"),
    ):
        await drive(sink, odd_weights(1), 1)
        assert any(isinstance(e, Fsync) and e.is_dir for e in recorder.events), "no directory fsync was tried"
        assert_same(load_file(str(final)), odd_weights(1))
        assert not [p for p in directory.iterdir() if p.name.startswith(".")]


def test_aside_copy_of_a_replaced_directory_is_removed_on_start(tmp_path: Path) -> None:
    """A crash between the two renames of a re-published `step_N/` leaves `.step_N.<pid>.old.tmpdir`."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    cfg, out = template_cfg(tmp_path)
    out.mkdir()
    aside = out / f".step_3.{proc.pid}.old.tmpdir"
    aside.mkdir()
    (aside / "model.safetensors").write_bytes(b"the old step_3")
    build_sink(cfg)
    assert not aside.exists()
