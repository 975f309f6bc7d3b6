"""An engine worker's sink for every version: plain weights into the model, LoRA adapters into a directory.

Why: vLLM and SGLang serve LoRA adapters from PEFT adapter directories they load by path (vLLM's
`/v1/load_lora_adapter`, SGLang's `/load_lora_adapter`); neither has a route that takes an adapter's
tensors from a worker. Our workers already receive every version over our data plane, so an adapter version
(`trainer.lora=adapter`) is written by one worker of the server (worker / TP rank 0) as the adapter
directory the safetensors sink writes (`<lora_dir>/step_<version>/adapter_model.safetensors` +
`adapter_config.json`, staged and renamed into place, fsynced), and the trainer's client then has the
engine load that path under the served adapter's name (`rollout_engines/<engine>/client.py`). The other workers
drain the version: they hold the same bytes and need none of them.

Plain and merged/full versions (`trainer.lora=merged|full`: plain weights under the base model's names) go
to `model.load_weights` as before (`ModelLoadSink`). An adapter version that carries the base weights is
refused before anything is applied: the server loaded its base model from its checkpoint, and an adapter
directory holds no base (`trainer.lora_base=rollout_has`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from ..errors import SinkError
from ..protocol.chunks import TensorMeta
from ..protocol.messages import LoraSpec
from ..rollout.consume import VersionSink
from ..rollout.sinks.config import SafetensorsSinkSection
from ..rollout.sinks.safetensors import SafetensorsSink
from .worker import ModelLoadSink

KEEP_LAST = 3
"""Adapter versions kept in `lora_dir` (the one served and two before it, for a load still reading one)."""


class AdapterDirectory:
    """Where this server's adapter versions go: `<lora_dir>/step_<version>/`, written by one worker.

    Args:
        lora_dir: the engine's `<engine>.lora_dir` (None: adapter versions are refused, naming `knob`).
        knob: that setting's name, for errors (`vllm.lora_dir`).
        writes: True on the one worker that writes (rank 0); the others drain adapter versions.
    """

    def __init__(self, lora_dir: str | None, knob: str, *, writes: bool) -> None:
        self.lora_dir, self.knob, self.writes = lora_dir, knob, writes
        self._sink: SafetensorsSink | None = None  # built at the first adapter version (creates the directory)

    def sink(self) -> SafetensorsSink | None:
        """The safetensors sink that writes adapter directories on this worker; None on the others."""
        if not self.lora_dir:
            raise SinkError(
                f"an adapter version (trainer.lora=adapter) arrived, but {self.knob} is not set: set it to a directory "
                "the server can read (the same value on the trainer, which names it to the server), or send "
                "trainer.lora=merged"
            )
        if not self.writes:
            return None
        if self._sink is None:
            self._sink = SafetensorsSink(SafetensorsSinkSection(dir=self.lora_dir, keep_last=KEEP_LAST))  # atomic
        return self._sink


class EngineVersionSink(VersionSink):
    """The receive loop's sink in an engine worker (`consume.VersionSink`, taking the LoRA spec): each version
    goes to `model.load_weights` (`ModelLoadSink`), or, if it is a LoRA adapter, to `adapters`."""

    takes_lora = True

    def __init__(
        self,
        model: torch.nn.Module,
        expected: int | None,
        adapters: AdapterDirectory,
        aliases: Mapping[str, str] | None = None,
        *,
        after_load: Callable[[], None] | None = None,
        check: Callable[[Mapping[str, tuple[tuple[int, ...], torch.dtype]]], None] | None = None,
    ) -> None:
        self.model_sink = ModelLoadSink(model, expected, aliases, after_load=after_load, check=check)
        self.adapters = adapters
        self.adapter: SafetensorsSink | None = None  # the version in flight's writer (adapter versions, rank 0)
        self.is_adapter = False  # the version in flight is a LoRA adapter

    @property
    def touched(self) -> bool:
        """Whether a failed version reached the model (an adapter version never does)."""
        return self.model_sink.touched

    def begin(
        self, version: int, tied: Mapping[str, Sequence[str]] | None = None, lora: LoraSpec | None = None
    ) -> None:
        self.is_adapter = lora is not None and lora.mode == "adapter"
        self.adapter = None
        if not self.is_adapter:
            self.model_sink.begin(version, tied)
            return
        assert lora is not None
        expected = self.model_sink.expected
        if expected is not None and version != expected:
            raise SinkError(f"the trainer announced version {expected} but version {version} arrived")
        if lora.base:
            raise SinkError(
                f"version {version} is a LoRA adapter that carries the base weights; a rollout engine serves adapters "
                "on the base model it loaded from its checkpoint: set trainer.lora_base=rollout_has (or "
                "trainer.lora=merged to send merged weights)"
            )
        self.adapter = self.adapters.sink()
        if self.adapter is not None:
            self.adapter.begin(version, tied=tied, lora=lora)

    def destination(self, meta: TensorMeta) -> torch.Tensor | None:
        if self.adapter is not None:
            return self.adapter.destination(meta)
        return None if self.is_adapter else self.model_sink.destination(meta)

    def accept(self, name: str, tensor: torch.Tensor) -> None:
        if self.adapter is not None:
            self.adapter.accept(name, tensor)
        elif not self.is_adapter:
            self.model_sink.accept(name, tensor)

    def commit(self, version: int) -> None:
        if self.adapter is not None:
            self.adapter.commit(version)  # the directory is whole under its final name before the version is acked
        elif not self.is_adapter:
            self.model_sink.commit(version)

    def abort(self, version: int, reason: str) -> None:
        if self.adapter is not None:
            self.adapter.abort(version, reason)
        elif not self.is_adapter:
            self.model_sink.abort(version, reason)


__all__ = ["AdapterDirectory", "EngineVersionSink"]
