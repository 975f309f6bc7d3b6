"""A CPU rollout worker for TRL's `AsyncGRPOTrainer`: a tiny Hugging Face model that receives every version.

`CpuRolloutWorker` satisfies TRL's `RolloutWorkerProtocol` (trl 1.16.0,
trl/experimental/async_grpo/async_grpo_trainer.py:115-152), so a whole AsyncGRPO run happens on CPU without vLLM:

    construction  spawn the rollout process: a `WeightReceiver` connected to the trainer's sender, and the model
                  loaded from `model_dir` (the checkpoint the trainer starts from)
    start()       generate: for each prompt of `prompts` in turn, `num_generations` completions sampled with the
                  weights held now, scored by `reward`, group-relative advantages, pushed to `rollout_buffer` as
                  TRL `RolloutSample`s tagged with the version they were generated with
    between       every version that starts is received whole (into shadow tensors, then copied into the model,
                  so a version that breaks mid-way leaves the previous one), between two groups
    stop()        stop the process

Build it on TRL's main process only (`rollout_worker=... if PartialState().is_main_process else None`): TRL
ignores it elsewhere (:1396-1398), and it must exist before the trainer's first sync (TRL calls `start()` only
after it, :232-234), or that sync has no receiver. `versions()` says, for every version the worker generated
with, the digest of the weights it held (`versions.verify.weights_digest`), for checks that they were the
trainer's. The worker is a test and an example, not a production generator: one process, sampled token by
token with the model's plain forward.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.synchronize import Event
from typing import Any

import torch

from ..config import UserConfig, settings
from ..errors import ConfigError, WeightSyncError, WeightSyncTimeout
from . import require

logger = logging.getLogger(__name__)

Reward = Callable[[Sequence[int], Sequence[int]], float]
"""(prompt token ids, completion token ids) -> reward. Module level (the rollout process is spawned)."""

POLL_S = 0.02  # how long the worker waits for a new version between two groups once it generates


@dataclass(frozen=True)
class RolloutJob:
    """What the rollout process does; picklable (it crosses the spawn)."""

    config: Any  # the typed WeightSyncConfig
    model_dir: str
    prompts: tuple[tuple[int, ...], ...]
    reward: Reward
    num_generations: int
    max_new_tokens: int
    temperature: float
    eos_token_id: int | None
    seed: int
    identity: str
    threads: int


class CpuRolloutWorker:
    """TRL `AsyncGRPOTrainer`'s `rollout_worker` on CPU, receiving every version with our `WeightReceiver`.

    Args:
        config: the same YAML / `load_config()` result as the trainer's `WeightSyncTransfer` (`transport.*`: where
            the sender listens; `rollout.identity`).
        model_dir: a Hugging Face checkpoint directory, the one the trainer starts from (`AsyncGRPOTrainer(model=)`).
        prompts: prompts as token ids, cycled.
        reward: `(prompt_ids, completion_ids) -> float`, a module-level function.
        num_generations: completions per prompt (a group; TRL's `num_generations`).
        max_new_tokens: tokens sampled per completion (fewer when `eos_token_id` is sampled).
        temperature, seed: sampling (a version's group is reproducible from the seed, the version and its index).
        eos_token_id: ends a completion; None: every completion is `max_new_tokens` long.
        queue_maxsize: `rollout_buffer`'s bound (the worker blocks when the trainer falls behind).
        threads: torch threads in the rollout process.
    """

    def __init__(
        self,
        config: UserConfig,
        model_dir: str,
        prompts: Sequence[Sequence[int]],
        reward: Reward,
        *,
        num_generations: int = 4,
        max_new_tokens: int = 4,
        temperature: float = 1.0,
        seed: int = 0,
        eos_token_id: int | None = None,
        queue_maxsize: int = 256,
        threads: int = 1,
    ) -> None:
        if not prompts or num_generations < 2 or max_new_tokens < 1:
            raise ConfigError(
                f"CpuRolloutWorker: needs prompts, num_generations >= 2 (got {num_generations}) for group-relative "
                f"advantages and max_new_tokens >= 1 (got {max_new_tokens})"
            )
        require("trl.experimental.async_grpo", "trl", "CpuRolloutWorker")
        typed = settings(config)
        self.plan = RolloutJob(
            config=typed,
            model_dir=str(model_dir),
            prompts=tuple(tuple(int(t) for t in p) for p in prompts),
            reward=reward,
            num_generations=int(num_generations),
            max_new_tokens=int(max_new_tokens),
            temperature=float(temperature),
            eos_token_id=eos_token_id,
            seed=int(seed),
            identity=typed.rollout.identity or "trl-cpu-rollout",
            threads=int(threads),
        )
        ctx = mp.get_context("spawn")
        self.rollout_buffer: Any = ctx.Queue(maxsize=queue_maxsize)
        self.metrics_queue: Any = ctx.Queue()
        self._events: Any = ctx.Queue()  # ("version", v, digest) | ("error", traceback)
        self._generate = ctx.Event()
        self._stop = ctx.Event()
        self._last_sample = ctx.Value("d", 0.0)
        self.model_version = 0  # what TRL says is live (update_model_version)
        self._versions: dict[int, str] = {}
        self._error: str | None = None
        self._started_at: float | None = None
        self.process = ctx.Process(
            target=_rollout_process,
            args=(self.plan, self.rollout_buffer, self._events, self._generate, self._stop, self._last_sample),
            name=f"cpu-rollout-{self.plan.identity}",
            daemon=True,
        )
        self.process.start()

    # -- RolloutWorkerProtocol ---------------------------------------------------------------------
    def start(self) -> None:
        """Begin generating (the process already receives versions)."""
        self._started_at = time.monotonic()
        self._generate.set()

    def stop(self) -> None:
        """Stop and join the rollout process (terminated if it does not stop within 10 s). Idempotent."""
        self._stop.set()
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=5)
        self._collect()

    def update_model_version(self, model_version: int) -> None:
        """TRL's live version; samples are tagged with the version the worker actually generated with."""
        self.model_version = int(model_version)

    def check_health(self, stale_after_s: float) -> None:
        """Raise when the rollout process died, or produced no sample within `stale_after_s` since `start()`."""
        self._collect()
        if not self.process.is_alive():
            why = self._error or f"exit code {self.process.exitcode}"
            raise WeightSyncError(f"CpuRolloutWorker: the rollout process is gone ({why})")
        if self._started_at is None:
            return
        last = self._last_sample.value or self._started_at
        now = time.monotonic()
        if now - max(last, self._started_at) > stale_after_s:
            raise WeightSyncTimeout(
                f"CpuRolloutWorker: no sample within {stale_after_s}s (AsyncGRPOConfig.heartbeat_stale_after_s)"
            )

    # -- what it received ----------------------------------------------------------------------------
    def versions(self) -> dict[int, str]:
        """{version: digest of the weights it held} for every version it received whole so far."""
        self._collect()
        return dict(self._versions)

    def _collect(self) -> None:
        while True:
            try:
                event = self._events.get_nowait()
            except (queue.Empty, OSError, ValueError):
                return
            if event[0] == "version":
                self._versions[int(event[1])] = str(event[2])
            elif event[0] == "error":
                self._error = str(event[1])


# ------------------------------------------------------------------------------------- the rollout process


def _rollout_process(
    plan: RolloutJob, buffer: Any, events: Any, generate: Event, stop: Event, last_sample: Any
) -> None:
    torch.set_num_threads(plan.threads)
    buffer.cancel_join_thread()  # at stop, samples the trainer never took must not hold the exit
    try:
        asyncio.run(_rollout_loop(plan, buffer, events, generate, stop, last_sample))
    except BaseException:
        events.put(("error", traceback.format_exc()))
        raise


async def _rollout_loop(plan: RolloutJob, buffer: Any, events: Any, generate: Event, stop: Event, last: Any) -> None:
    from ..versions.receiver import WeightReceiver
    from ..versions.verify import weights_digest

    transformers = require("transformers", "trl", "CpuRolloutWorker")
    model = transformers.AutoModelForCausalLM.from_pretrained(plan.model_dir).eval()
    held = dict(model.state_dict(keep_vars=True))  # tied weights: two names, one tensor
    shadow = {name: t.detach().clone() for name, t in held.items()}
    version: int | None = None
    group = 0
    async with WeightReceiver(plan.config, identity=plan.identity) as receiver:
        while not stop.is_set():
            generating = generate.is_set() and version is not None
            try:
                names = await _receive(receiver, shadow, POLL_S if generating else 0.2)
            except WeightSyncTimeout:
                names = None  # no new version: generate with the one held
            except WeightSyncError as exc:  # a version that broke mid-way: the model still holds the last one
                logger.warning("CpuRolloutWorker: a version failed, keeping version %s: %s", version, exc)
                names = None
            if names is not None:
                with torch.no_grad():
                    for name in names:
                        held[name].data.copy_(shadow[name])
                assert receiver.version is not None
                version = int(receiver.version)
                events.put(("version", version, weights_digest((n, held[n]) for n in names)))
                continue  # a newer one may be waiting already
            if not generating:
                continue
            assert version is not None
            for sample in _group(model, plan, version, group):
                while not stop.is_set():
                    with contextlib.suppress(queue.Full):
                        buffer.put(sample, timeout=0.2)
                        break
            last.value = time.monotonic()
            group += 1


async def _receive(receiver: Any, shadow: dict[str, torch.Tensor], wait_s: float) -> list[str]:
    """One whole version into the shadow tensors; the names received (`WeightSyncTimeout`: none started)."""
    names: list[str] = []

    def into(meta: Any) -> torch.Tensor | None:
        return shadow.get(meta.name)

    async for name, tensor in receiver.receive_weights(into=into, wait_s=wait_s):
        if name not in shadow:
            raise ConfigError(
                f"CpuRolloutWorker: the trainer sent {name!r}, which the rollout's model does not have "
                "(trainer.names.* maps names)"
            )
        if tensor.data_ptr() != shadow[name].data_ptr():  # not received in place (e.g. another dtype)
            shadow[name].copy_(tensor)
        names.append(name)
    return names


@torch.no_grad()
def _sample(
    model: Any, prompt: torch.Tensor, plan: RolloutJob, generator: torch.Generator
) -> tuple[list[int], list[float]]:
    """Sample one completion after `prompt` (1-D): its token ids and the log-probability each was sampled with."""
    seq, tokens, logprobs = prompt.unsqueeze(0), [], []
    for _ in range(plan.max_new_tokens):
        logits = model(input_ids=seq).logits[:, -1].float() / plan.temperature
        logp = torch.log_softmax(logits, dim=-1)
        token = torch.multinomial(logp.exp(), 1, generator=generator)
        tokens.append(int(token))
        logprobs.append(float(logp.gather(1, token)))
        seq = torch.cat([seq, token], dim=1)
        if plan.eos_token_id is not None and tokens[-1] == plan.eos_token_id:
            break
    return tokens, logprobs


def _group(model: Any, plan: RolloutJob, version: int, index: int) -> list[Any]:
    """One prompt's `num_generations` completions, scored, as TRL `RolloutSample`s."""
    import numpy as np

    sample_cls = require("trl.experimental.async_grpo.async_rollout_worker", "trl", "CpuRolloutWorker").RolloutSample
    prompt = list(plan.prompts[index % len(plan.prompts)])
    generator = torch.Generator().manual_seed((plan.seed * 1_000_003 + version) * 100_003 + index)
    completions = [_sample(model, torch.tensor(prompt), plan, generator) for _ in range(plan.num_generations)]
    rewards = torch.tensor([float(plan.reward(prompt, c)) for c, _ in completions])
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    samples = []
    for (tokens, logprobs), reward, advantage in zip(completions, rewards.tolist(), advantages.tolist(), strict=True):
        samples.append(
            sample_cls(
                prompt=[{"role": "user", "content": " ".join(map(str, prompt))}],
                completion=[{"role": "assistant", "content": " ".join(map(str, tokens))}],
                input_ids=np.asarray(prompt + tokens, dtype=np.int64),
                completion_mask=np.asarray([0] * len(prompt) + [1] * len(tokens), dtype=np.int64),
                old_log_probs=np.asarray([0.0] * len(prompt) + logprobs, dtype=np.float32),
                advantage=float(advantage),
                model_version=version,
                group_id=index,
                metrics={"reward": float(reward)},
                enqueued_at=time.time(),
            )
        )
    return samples


__all__ = ["CpuRolloutWorker", "Reward", "RolloutJob"]
