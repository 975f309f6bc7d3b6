"""STAND-IN for the parts of verl 0.9.1 our checkpoint engine touches (verl is not installed in CI). Clearly not verl.

Every name here mirrors verl's own, line for line where it has logic (`./dev verl-contract` runs the same tests
against the real package, tests/integration/test_verl_real.py):

- `CheckpointEngineRegistry`: verl/checkpoint_engine/base.py:49-113 (`register(backend)` a decorator storing
  the class, `get` raising ValueError for an unknown name, `new(backend, *args, **kwargs)` = `get(backend)(...)`);
- `CheckpointEngine`: base.py:116-226, the abstract methods and their signatures;
- `import_external_libs`: verl/utils/import_utils.py:81-88;
- `StandInManager`: `CheckpointEngineManager.__init__` (base.py:409-420), `build_process_group` (base.py:422-447)
  and `update_weights` (base.py:509-562): the steps, their order and the length checks on `build_topology`'s
  lists, with Ray's dispatch and `ray.get` replaced by the process-backed worker groups of
  `tests/support/verl_workers.py` (`execute_checkpoint_engine` is DP_COMPUTE, `update_weights` ONE_TO_ALL, as
  their `@register` in base.py:353-364 and verl/workers/engine_workers.py:727, 829 say).

`install()` puts `verl`, `verl.checkpoint_engine`, `verl.checkpoint_engine.base` and `verl.utils.import_utils`
into `sys.modules`, so `lightning_weightsync.integrations.verl` imports them as it imports verl's.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterator
from typing import Any

import torch

VERL_VERSION = "0.9.1"


class CheckpointEngineRegistry:
    """base.py:49-113."""

    _registry: dict[str, type[CheckpointEngine]] = {}
    _import_errors: dict[str, ImportError] = {}

    def register(backend: str) -> Callable[[type], type]:  # type: ignore[misc]  # as verl: no self, no classmethod
        def wrapper(cls: type) -> type:
            CheckpointEngineRegistry._registry[backend] = cls
            return cls

        return wrapper

    @classmethod
    def get(cls, backend: str) -> type[CheckpointEngine]:
        if backend not in cls._registry:
            raise ValueError(
                f"Checkpoint engine {backend} not registered, registered backends: {sorted(cls._registry)}"
            )
        return cls._registry[backend]

    @classmethod
    def new(cls, backend: str, *args: Any, **kwargs: Any) -> CheckpointEngine:
        return cls.get(backend)(*args, **kwargs)


class CheckpointEngine(ABC):
    """base.py:116-226: the abstract interface, signatures as verl declares them."""

    wire_format = "named_tensors"  # base.py:134

    @abstractmethod
    def prepare(self) -> dict[str, Any]: ...

    @classmethod
    @abstractmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]: ...

    @abstractmethod
    def init_process_group(self, **kwargs: Any) -> None: ...

    @abstractmethod
    def finalize(self) -> None: ...

    @abstractmethod
    async def send_weights(
        self, weights: Generator[tuple[str, torch.Tensor], None, None], global_steps: int | None = None
    ) -> Any: ...

    @abstractmethod
    async def receive_weights(self, global_steps: int | None = None) -> Any: ...


def import_external_libs(external_libs: str | list[str] | None = None) -> None:
    """verl/utils/import_utils.py:81-88."""
    if external_libs is None:
        return
    if not isinstance(external_libs, list):
        external_libs = [external_libs]
    for external_lib in external_libs:
        importlib.import_module(external_lib)


class StandInManager:
    """`CheckpointEngineManager` (base.py:380-562) without Ray: `ray_get` is the worker groups' `get`."""

    def __init__(self, config: Any, actor_wg: Any, replicas: list[Any], ray_get: Callable[[list[Any]], list[Any]]):
        self.config = config
        self.backend = config.backend
        import_external_libs(self.config.custom_backend_module or None)  # base.py:417
        self.backend_cls = CheckpointEngineRegistry.get(config.backend)  # base.py:418
        self.actor_wg = actor_wg
        self.replicas = replicas
        self.ray_get = ray_get

    def build_process_group(self, rollout: Any) -> None:
        actor_wg = self.actor_wg
        # 1. prepare all workers (base.py:426-430)
        metadata = self.ray_get(
            actor_wg.execute_checkpoint_engine(["prepare"] * actor_wg.world_size)
            + rollout.execute_checkpoint_engine(["prepare"] * rollout.world_size)
        )
        # 2. build communication topology between all workers (base.py:432-439)
        actor_wg_kwargs, rollout_kwargs = self.backend_cls.build_topology(
            actor_wg.world_size, rollout.world_size, metadata
        )
        for k, v in actor_wg_kwargs.items():
            assert len(v) == actor_wg.world_size, f"actor_wg_kwargs[{k}] must have length of {actor_wg.world_size}"
        for k, v in rollout_kwargs.items():
            assert len(v) == rollout.world_size, f"rollout_kwargs[{k}] must have length of {rollout.world_size}"
        actor_wg_kwargs["method"] = ["init_process_group"] * actor_wg.world_size
        rollout_kwargs["method"] = ["init_process_group"] * rollout.world_size
        # 3. init process group between all workers (base.py:444-447)
        self.ray_get(
            actor_wg.execute_checkpoint_engine(**actor_wg_kwargs) + rollout.execute_checkpoint_engine(**rollout_kwargs)
        )

    def update_weights(self, global_steps: int | None = None) -> dict[str, Any]:
        """base.py:509-562 (its replica calls, abort / release / resume, are no-ops here: no inference server)."""
        workers = []  # 2. a temporary worker group for all replicas (base.py:525-529)
        for replica in self.replicas:
            workers.extend(replica.workers)
        rollout = type(self.actor_wg)(workers)
        actor_wg = self.actor_wg
        self.build_process_group(rollout)  # 4. (base.py:536)
        results = self.ray_get(  # 5. update weights of all workers (base.py:539-542)
            actor_wg.update_weights(global_steps=global_steps, mode=self.backend)
            + rollout.update_weights(global_steps=global_steps)
        )
        sync_metrics: dict[str, Any] = {}  # base.py:545-548
        for result in results[: actor_wg.world_size]:
            if isinstance(result, dict):
                sync_metrics.update(result)
        self.ray_get(  # 6. finalize all workers (base.py:551-554)
            actor_wg.execute_checkpoint_engine(["finalize"] * actor_wg.world_size)
            + rollout.execute_checkpoint_engine(["finalize"] * rollout.world_size)
        )
        return sync_metrics


@contextlib.contextmanager
def installed(engine_module: str) -> Iterator[None]:
    """`install()` for the duration of a block in this (the test's) process: afterwards `verl` and
    `engine_module`, which imported the stand-in, are gone from `sys.modules` again."""
    saved = {k: v for k, v in sys.modules.items() if k == "verl" or k.startswith("verl.")}
    for k in saved:  # the real verl, where it is installed (./dev verl-contract), steps aside meanwhile
        del sys.modules[k]
    install()
    sys.modules.pop(engine_module, None)
    try:
        yield
    finally:
        for k in [k for k in sys.modules if k == "verl" or k.startswith("verl.")]:
            del sys.modules[k]
        sys.modules.update(saved)
        sys.modules.pop(engine_module, None)


def install() -> None:
    """Make `import verl.checkpoint_engine.base` / `verl.utils.import_utils` find this stand-in."""
    if "verl" in sys.modules and not getattr(sys.modules["verl"], "STAND_IN", False):
        raise RuntimeError("the real verl is imported; the stand-in would shadow it")
    verl = types.ModuleType("verl")
    verl.STAND_IN = True  # type: ignore[attr-defined]
    verl.__version__ = VERL_VERSION  # type: ignore[attr-defined]
    engine_pkg = types.ModuleType("verl.checkpoint_engine")
    base = types.ModuleType("verl.checkpoint_engine.base")
    utils = types.ModuleType("verl.utils")
    import_utils = types.ModuleType("verl.utils.import_utils")
    for module, names in (
        (base, ("CheckpointEngine", "CheckpointEngineRegistry")),
        (engine_pkg, ("CheckpointEngine", "CheckpointEngineRegistry")),
        (import_utils, ("import_external_libs",)),
    ):
        for name in names:
            setattr(module, name, globals()[name])
    verl.__path__ = []  # type: ignore[attr-defined]  # packages, so submodule imports resolve in sys.modules
    engine_pkg.__path__ = []  # type: ignore[attr-defined]
    utils.__path__ = []  # type: ignore[attr-defined]
    verl.checkpoint_engine = engine_pkg  # type: ignore[attr-defined]
    verl.utils = utils  # type: ignore[attr-defined]
    engine_pkg.base = base  # type: ignore[attr-defined]
    utils.import_utils = import_utils  # type: ignore[attr-defined]
    sys.modules.update(
        {
            "verl": verl,
            "verl.checkpoint_engine": engine_pkg,
            "verl.checkpoint_engine.base": base,
            "verl.utils": utils,
            "verl.utils.import_utils": import_utils,
        }
    )
