"""`rollout.sink.type=safetensors`: every complete version becomes `<dir>/step_<version>.safetensors`.

Crash and power-loss safety. A version is written to a hidden temp file in the same directory
(`.step_<version>.safetensors.<pid>.tmp`), and `commit` then, in this order: writes the header,
flushes Python's buffer, fsyncs the file, renames it onto `step_<version>.safetensors`, and fsyncs
the directory. When `commit` returns, the file's complete content and its final name are on disk
(as far as the filesystem honours fsync). A crash or power loss at any earlier point leaves at
worst a temp file (removed on the next start) and the previous versions, never a truncated file
under a final name. Where the platform cannot fsync a directory (it is tried, and a refusal
ignored) the data is still durable, but after a power loss the newest name may be missing (the
file is never truncated). Pruning old versions (`keep_last`) is not synced on its own; a pruned
file may reappear after a power loss. An aborted version deletes its temp file.

Memory: tensors are written as they arrive, one at a time; the version is never held in memory.
The safetensors header (names, dtypes, offsets) can only be written once the version is complete,
so the file starts with a reserved header region (sized from the previous version's header, with
slack) that the real header, padded with spaces (valid JSON whitespace), is written into at commit.
Only if the header outgrows the reservation is the data copied once into a second temp file.

The file format is written by hand (it is 8 bytes of length, a JSON header and the raw bytes) so
that no version needs to be materialised as a dict for `safetensors.torch.save_file`; files load
with `safetensors.torch.load_file` and are checked that way in the tests.

Both apply policies behave the same here: a file is only ever visible whole.

Checkpoint directories (`rollout.sink.template_dir`): each version becomes
`<dir>/step_<version>/model.safetensors` plus copies of the template's non-weight files
(`config.json`, tokenizer files, `generation_config.json`, ...), so every version is a Hugging Face
checkpoint that `AutoModelForCausalLM.from_pretrained` or vLLM loads as is. They are staged in a
hidden temp directory (`.step_<version>.<pid>.tmpdir`); `model.safetensors` and every copied file
are fsynced, then the stage directory, then it is renamed onto `step_<version>/` and the parent
directory is fsynced: the same guarantee as above, for the directory as a whole. The one
non-atomic case: publishing a version whose `step_<version>/` already exists (a restarted trainer
re-sends it) first renames the old directory aside, then the new one into place, so for a moment
there is no `step_<version>/` at all (a crash right there leaves none; the older versions are
untouched and the aside copy is removed on the next start). A file name (no template), by
contrast, is replaced atomically.

Tied weights: a tensor sent once for several names (`begin(version, tied=...)`) is written once,
under the name it was sent as, which is what Hugging Face checkpoints of tied models hold
(`model.embed_tokens.weight`, no `lm_head.weight`): `from_pretrained` re-ties it from the config and
`safetensors.torch.load_model(model, path)` accepts the missing alias because the model shares it.
The aliases are recorded in the header's `__metadata__["tied"]` (JSON) for anyone who needs them.

LoRA adapter versions (`trainer.lora=adapter`): each version becomes the adapter directory PEFT's
`save_pretrained` writes, `<dir>/step_<version>/adapter_model.safetensors` (PEFT's names) plus
`adapter_config.json` (from the version's `LoraSpec`), which `PeftModel.from_pretrained(base, path)` and
vLLM's `--enable-lora` load as is; staged and renamed into place like a checkpoint directory. The base
weights do not belong in an adapter directory: a version that carries them is refused, naming
`trainer.lora_base=rollout_has` (whoever loads these directories has the base model already).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import shutil
import struct
from pathlib import Path
from typing import BinaryIO

import torch

from ...config import UserConfig
from ...errors import ConfigError, SinkError
from ...protocol.chunks import TensorMeta, as_bytes
from ...protocol.messages import LoraSpec
from ...transport.process import process_alive
from .base import Sink, SinkSettings
from .config import SafetensorsSinkSection, SinkSection

logger = logging.getLogger(__name__)

FINAL_RE = re.compile(r"^step_(\d+)\.safetensors$")
TEMP_RE = re.compile(r"^\.step_(\d+)\.safetensors\.(\d+)\.tmp2?$")
FINAL_DIR_RE = re.compile(r"^step_(\d+)$")
TEMP_DIR_RE = re.compile(r"^\.step_(\d+)\.(\d+)(?:\.old)?\.tmpdir$")  # .old: a replaced step_N/
WEIGHTS_NAME = "model.safetensors"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"  # PEFT's save_pretrained names
ADAPTER_CONFIG_NAME = "adapter_config.json"
# files of a template checkpoint that are weights (ours replace them), never copied
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
MIN_HEADER_RESERVE = 64 * 1024
COPY_CHUNK = 16 * 1024 * 1024

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _name, _code in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if isinstance(getattr(torch, _name, None), torch.dtype):
        SAFETENSORS_DTYPES[getattr(torch, _name)] = _code


def step_path(directory: str | os.PathLike[str], version: int) -> Path:
    return Path(directory) / f"step_{version}.safetensors"


def _buffer(data: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU uint8 tensor as a zero-copy buffer, without numpy (`Tensor.numpy()`
    needs it, and CPU torch does not depend on it: a fresh install's daemon died on its first version).
    Valid while `data` is alive."""
    return memoryview((ctypes.c_uint8 * data.numel()).from_address(data.data_ptr())).cast("B")


def write_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike[str], metadata: dict[str, str]) -> None:
    """A whole safetensors file in one go (the daemon's dump on exit), by hand like the sink: the format's
    own `save_file` needs numpy, which a CPU torch install may lack."""
    entries: dict[str, object] = {"__metadata__": metadata}
    datas, offset = [], 0
    for name, tensor in tensors.items():
        code = SAFETENSORS_DTYPES.get(tensor.dtype)
        if code is None:
            raise SinkError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store")
        data = as_bytes(tensor.detach().cpu())
        entries[name] = {"dtype": code, "shape": list(tensor.shape), "data_offsets": [offset, offset + data.numel()]}
        datas.append(data)
        offset += data.numel()
    header = json.dumps(entries, separators=(",", ":")).encode()
    header = header.ljust((len(header) + 7) // 8 * 8, b" ")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for data in datas:
            if data.numel():
                f.write(_buffer(data))


def _fsync_file(path: Path) -> None:
    """Flush a file written by someone else (`shutil.copy2`) to disk; errors propagate."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename into it) durable, where the platform allows.

    Best effort on purpose: some platforms (Windows) cannot open a directory, some filesystems
    refuse fsync on one (EINVAL); the files themselves are fsynced regardless.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def adapter_config(spec: LoraSpec) -> dict[str, object]:
    """The `adapter_config.json` of an adapter version: PEFT's `LoraConfig` fields, from the version's spec."""
    config: dict[str, object] = {
        "peft_type": "LORA",
        "task_type": spec.task_type,
        "base_model_name_or_path": None,
        "inference_mode": True,
        "r": spec.r,
        "lora_alpha": spec.lora_alpha,
        "target_modules": spec.target_modules,
        "lora_dropout": spec.lora_dropout,
        "use_rslora": spec.use_rslora,
        "use_dora": spec.use_dora,
        "fan_in_fan_out": spec.fan_in_fan_out,
        "bias": spec.bias,
        "modules_to_save": spec.modules_to_save or None,
        "rank_pattern": spec.rank_pattern,
        "alpha_pattern": spec.alpha_pattern,
    }
    if spec.lora_bias:  # only when set: a PEFT before 0.14 (no such field) still loads every other adapter
        config["lora_bias"] = True
    return config


class SafetensorsSink(Sink):
    """Writes each complete version to `<rollout.sink.dir>/step_<version>.safetensors`, keeps the last K."""

    blocking_io = True

    kind = "safetensors"

    def __init__(self, cfg: UserConfig | SinkSettings | SinkSection = None) -> None:
        super().__init__(cfg)
        own = self.settings.section
        assert isinstance(own, SafetensorsSinkSection)
        if not own.dir:
            raise ConfigError("rollout.sink.dir is not set; the safetensors sink needs a directory to write into")
        self.dir = Path(own.dir)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"rollout.sink.dir={str(self.dir)!r} cannot be created: {exc}") from None
        self.keep_last = own.keep_last
        self.template: Path | None = Path(own.template_dir) if own.template_dir else None
        if self.template is not None and not self.template.is_dir():
            raise ConfigError(
                f"rollout.sink.template_dir={str(self.template)!r} is not a directory; give a checkpoint directory "
                "holding config.json (and tokenizer files), e.g. the one the trainer's model came from"
            )
        self.file_mode: int | None = own.file_mode  # None: the umask decides
        self._stage: Path | None = None  # the version's temp directory (template mode)
        self._file: BinaryIO | None = None
        self._tmp: Path | None = None
        self._reserve = MIN_HEADER_RESERVE
        self._last_header_len = 0
        self._entries: dict[str, dict[str, object]] = {}
        self._data_len = 0
        self._remove_stale_temps()

    @property
    def latest_path(self) -> Path | None:
        """The weights file of the last complete version (inside its directory in template mode)."""
        if self.version is None:
            return None
        if self.lora_mode == "adapter":
            return self.dir / f"step_{self.version}" / ADAPTER_WEIGHTS_NAME
        return self.dir / f"step_{self.version}" / WEIGHTS_NAME if self.template else step_path(self.dir, self.version)

    @property
    def _adapter(self) -> bool:
        return self.lora is not None and self.lora.mode == "adapter"

    def _remove_stale_temps(self) -> None:
        for p in self.dir.iterdir():
            m = TEMP_RE.match(p.name) or TEMP_DIR_RE.match(p.name)
            if m and not process_alive(int(m.group(2))):
                logger.info("removing %s left by a crashed writer", p)
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)

    def _begin(self, version: int) -> None:
        if self._adapter and self.lora is not None and self.lora.base:
            raise SinkError(
                f"version {version} is a LoRA adapter that carries the base weights, which an adapter directory does "
                "not hold; set trainer.lora_base=rollout_has (the loader of these directories has the base model)"
            )
        if self.template is not None or self._adapter:
            self._stage = self.dir / f".step_{version}.{os.getpid()}.tmpdir"
            shutil.rmtree(self._stage, ignore_errors=True)
            self._stage.mkdir()
            if self.file_mode is not None:  # a directory's search bit wherever its read bit is set
                os.chmod(self._stage, self.file_mode | (self.file_mode & 0o444) >> 2)
            self._tmp = self._stage / (ADAPTER_WEIGHTS_NAME if self._adapter else WEIGHTS_NAME)
        else:
            self._tmp = self.dir / f".step_{version}.safetensors.{os.getpid()}.tmp"
        self._reserve = max(MIN_HEADER_RESERVE, (self._last_header_len * 5 // 4 + 4095) // 8 * 8)
        self._file = open(self._tmp, "wb")  # noqa: SIM115 - closed in commit/abort
        self._chmod(self._file.fileno())
        self._file.seek(8 + self._reserve)
        self._entries = {}
        self._data_len = 0

    def _chmod(self, fd: int) -> None:
        """rollout.sink.file_mode, set on the open file before a byte of the weights is in it."""
        if self.file_mode is not None:
            os.fchmod(fd, self.file_mode)

    def _destination(self, meta: TensorMeta) -> torch.Tensor | None:
        if meta.dtype not in SAFETENSORS_DTYPES:
            raise SinkError(
                f"tensor {meta.name!r} has dtype {meta.dtype}, which safetensors cannot store; "
                "cast it on the trainer with trainer.dtype or use another rollout.sink.type"
            )
        return None  # merge allocates one tensor; accept() writes it out and drops it

    def _accept(self, name: str, tensor: torch.Tensor) -> None:
        assert self._file is not None, "accept() outside begin()/commit()"
        code = SAFETENSORS_DTYPES.get(tensor.dtype)
        if code is None:
            raise SinkError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store")
        data = as_bytes(tensor.detach().cpu())
        nbytes = data.numel()
        if nbytes:
            self._file.write(_buffer(data))
        self._entries[name] = {
            "dtype": code,
            "shape": list(tensor.shape),
            "data_offsets": [self._data_len, self._data_len + nbytes],
        }
        self._data_len += nbytes

    def _header(self, version: int) -> bytes:
        metadata = {"format": "pt", "version": str(version)}
        tied = {source: list(aliases) for source, aliases in self.tied.items() if source in self._entries}
        if tied:
            metadata["tied"] = json.dumps(tied, separators=(",", ":"))
        header = {"__metadata__": metadata, **self._entries}
        return json.dumps(header, separators=(",", ":")).encode()

    def _commit(self, version: int) -> None:
        # Order (see the module docstring): write, flush, fsync the file, rename, fsync the directory.
        # Renaming before the data is on disk would let a power loss leave a truncated file under the
        # final name, which rollouts would load.
        assert self._file is not None and self._tmp is not None
        header = self._header(version)
        f, tmp = self._file, self._tmp
        self._file = None
        if len(header) <= self._reserve:
            try:
                f.seek(0)
                f.write(struct.pack("<Q", self._reserve))
                f.write(header.ljust(self._reserve, b" "))
                f.flush()  # Python's buffer -> the OS, so that the fsync covers every byte
                os.fsync(f.fileno())
            finally:
                f.close()
        else:  # header outgrew the reservation: copy the data once behind a header of the right size
            padded = header.ljust((len(header) + 7) // 8 * 8, b" ")
            tmp2 = tmp.with_name(tmp.name + "2")
            try:
                f.flush()
                with open(tmp2, "wb") as out, open(tmp, "rb") as src:
                    self._chmod(out.fileno())
                    out.write(struct.pack("<Q", len(padded)))
                    out.write(padded)
                    src.seek(8 + self._reserve)
                    shutil.copyfileobj(src, out, COPY_CHUNK)
                    out.flush()
                    os.fsync(out.fileno())
            finally:
                f.close()
            # tmp2's data is on disk; renaming it over the (temp) name is made durable by the
            # directory fsync after the final rename below, like the final rename itself
            os.replace(tmp2, tmp)
        if self._stage is not None:
            final = self._publish_dir(self._stage, version)
            self._stage = None
        else:
            final = step_path(self.dir, version)
            os.replace(tmp, final)
        self._tmp = None
        _fsync_dir(self.dir)  # the new name itself survives a power loss
        self._last_header_len = len(header)
        self._prune()
        logger.debug("wrote %s (%d tensors, %d bytes)", final, len(self._entries), self._data_len)

    def _publish_dir(self, stage: Path, version: int) -> Path:
        """Copy the template's non-weight files into the staged version, then rename it into place.

        Every copied file and the stage directory are fsynced before the rename (the weights file
        already is, by `_commit`): otherwise a power loss could leave `step_N/config.json` empty
        under a complete-looking directory. The caller fsyncs the parent directory afterwards.
        """
        if self._adapter and self.lora is not None:
            config = stage / ADAPTER_CONFIG_NAME
            with open(config, "w") as f:
                self._chmod(f.fileno())
                json.dump(adapter_config(self.lora), f, indent=2, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
        for src in sorted(self.template.iterdir()) if self.template is not None else ():
            if src.is_file() and not src.name.endswith(WEIGHT_SUFFIXES) and src.name not in WEIGHT_INDEXES:
                dst = stage / src.name
                shutil.copy2(src, dst)
                if self.file_mode is not None:
                    os.chmod(dst, self.file_mode)
                _fsync_file(dst)
        _fsync_dir(stage)
        final = self.dir / f"step_{version}"
        if final.exists():  # the same version again (a restarted trainer re-sends it): replace it whole
            # not atomic: between these two renames there is no step_N/ at all (documented above)
            old = self.dir / f".step_{version}.{os.getpid()}.old.tmpdir"
            os.replace(final, old)
            os.replace(stage, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(stage, final)
        return final

    def _prune(self) -> None:
        pattern = FINAL_DIR_RE if self.template is not None or self._adapter else FINAL_RE
        found = [(int(m.group(1)), p) for p in self.dir.iterdir() if (m := pattern.match(p.name))]
        found.sort(key=lambda vp: (vp[1].stat().st_mtime_ns, vp[0]))
        for _, old in found[: max(0, len(found) - self.keep_last)]:
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)

    def _abort(self, version: int, reason: str) -> bool:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tmp is not None:
            self._tmp.unlink(missing_ok=True)
            self._tmp.with_name(self._tmp.name + "2").unlink(missing_ok=True)
            self._tmp = None
        if self._stage is not None:
            shutil.rmtree(self._stage, ignore_errors=True)
            self._stage = None
        self._entries = {}
        return False  # nothing visible changed: the previous files are untouched

    def close(self) -> None:
        if self.in_flight is not None:
            self.abort(self.in_flight, "sink closed")
