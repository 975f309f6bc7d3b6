"""Against the REAL vLLM (skipped without it; `./dev vllm-contract` runs it in .venv-vllm-<version> on CPU,
for each supported release): the installed release's API snapshot equals what its source says, the plugin
registers our engine with vLLM's real factory, the factory builds it, and vLLM's own `update_weights` (base
class) drives our `receive_weights` through a real version from a real sender over gloo, bitwise."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

pytest.importorskip("vllm.distributed.weight_transfer.base")

from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from lightning_weightsync.demo.tiny_lm import build_model
from lightning_weightsync.errors import PeerError
from lightning_weightsync.rollout_engines.vllm import plugin
from lightning_weightsync.rollout_engines.vllm.extension import EXTENSION_CLASS, REPORT_METHOD
from lightning_weightsync.versions.sender import BlockingWeightSender
from tests.support.mp import free_port
from tests.support.transfer import engine_cfg
from tests.support.vllm_api import extract, snapshot, snapshot_path, supported_versions
from tests.support.vllm_standin import StandInModel

REPO = Path(__file__).resolve().parents[2]


def test_snapshot_matches_the_installed_vllm_source() -> None:
    installed = importlib.metadata.version("vllm")
    assert installed in supported_versions(), (
        f"vLLM {installed} has no snapshot (supported: {supported_versions()}): check rollout_engines/vllm and "
        f"trainer/fleet.py against its source, then pin {snapshot_path(installed).relative_to(REPO)} "
        "(python -m tests.support.vllm_api <its vllm package> <version>) and widen the vllm extra"
    )
    root = Path(importlib.util.find_spec("vllm").submodule_search_locations[0])  # type: ignore[union-attr]
    assert {"vllm_version": installed, **extract(root)} == snapshot(installed), (
        f"vLLM {installed} differs from its snapshot: re-check rollout_engines/vllm and trainer/fleet.py, "
        f"then regenerate {snapshot_path(installed).relative_to(REPO)}"
    )


def test_the_engine_picks_the_installed_releases_model_loader_hooks_by_feature() -> None:
    """0.34.0 removed mtp_validation and renamed the reload lifecycle (start_reload / finish_reload); the
    engine asks the installed vLLM what it has. The check here is of behaviour: while our engine loads a
    version, vLLM's MTP completeness check is off (0.33.0: the scoped flag; 0.34.0: an update is active)."""
    from vllm.model_executor.model_loader import reload

    from lightning_weightsync.rollout_engines.vllm.weight_transfer import reload_hooks

    hooks = reload_hooks()
    renamed = hasattr(reload, "start_reload")
    has_mtp_validation = importlib.util.find_spec("vllm.model_executor.model_loader.mtp_validation") is not None
    assert renamed != has_mtp_validation  # one or the other in each supported release
    assert hooks.begin is (reload.start_reload if renamed else reload.initialize_layerwise_reload)
    model = StandInModel(build_model().config)
    reload.record_metadata_for_reloading(model)
    hooks.begin(model)
    with hooks.load_context():
        if renamed:
            assert reload.weight_update_active()
        else:
            from vllm.model_executor.model_loader.mtp_validation import is_mtp_completeness_check_enabled

            assert not is_mtp_completeness_check_enabled()
        model.load_weights(build_model(seed=2).state_dict().items())
    hooks.finish(model, SimpleNamespace(dtype=torch.float32), torch.device("cpu"))
    assert not any(p.is_meta for p in model.parameters())
    if renamed:
        assert not reload.weight_update_active()


def test_plugin_registers_our_engine_and_the_factory_builds_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plugin.register()
    plugin.register()  # vLLM loads plugins in every process, possibly twice: idempotent
    from lightning_weightsync.rollout_engines.vllm.weight_transfer import (
        LightningWeightSyncEngine,
        LightningWeightSyncUpdateInfo,
    )

    assert issubclass(LightningWeightSyncEngine, WeightTransferEngine)
    assert not getattr(LightningWeightSyncEngine, "__abstractmethods__", None)

    port = free_port()
    cfg = engine_cfg(port, bucket_size_mb=0.03125)
    path = tmp_path / "sync.yaml"
    path.write_text(OmegaConf.to_yaml(cfg))
    monkeypatch.setenv("LIGHTNING_WEIGHTSYNC_CONFIG", str(path))
    # vLLM's base update_weights ends with torch.accelerator.synchronize(), which raises on a machine
    # without an accelerator; a vLLM GPU worker always has one. Nothing else is patched.
    if not torch.accelerator.is_available():
        monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a, **k: None)
    torch.manual_seed(3)
    model = StandInModel(build_model().config)
    model.post_load = PostLoadHook()  # a layer that derives state after loading (no tensors of its own)
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    record_metadata_for_reloading(model)  # as vLLM's model loader does for every model it builds
    vllm_config = SimpleNamespace(  # only the attributes the base __init__ and our engine read
        parallel_config=SimpleNamespace(),
        model_config=SimpleNamespace(quantization=None, enable_sleep_mode=False, dtype=torch.float32),
        speculative_config=None,
        offload_config=None,
    )
    engine = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend="lightning_weightsync"), vllm_config, torch.device("cpu"), model
    )
    assert type(engine) is LightningWeightSyncEngine
    assert isinstance(engine.parse_update_info({"version": 1}), LightningWeightSyncUpdateInfo)
    with pytest.raises(ValueError, match="Invalid update_info"):
        engine.parse_update_info({"nonsense": 1})

    sender = BlockingWeightSender(cfg)
    sender.start()
    try:
        expected = {k: v.detach().clone() for k, v in build_model(seed=5).state_dict().items()}
        errors: list[BaseException] = []

        def rollout(version: int = 1) -> None:
            try:
                engine.start_weight_update()
                engine.update_weights({"version": version, "timeout_s": 20})  # vLLM's own base method
                engine.finish_weight_update()
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=rollout)
        thread.start()
        stats = sender.send_weights(list(expected.items()), version=1)
        thread.join(30)
        assert not errors, errors
        assert stats.receivers == 1
        state = model.state_dict()
        assert all(torch.equal(state[k], v) for k, v in expected.items())
        assert engine.version == 1
        # an unquantized model goes through vLLM's layerwise reload too, as vLLM's own engines do it, and
        # the reload ended: no parameter is left on the meta device
        assert engine._needs_layerwise_reload() and not engine._reload_active
        assert not any(p.is_meta for p in model.parameters())
        # verify over HTTP: the class `--worker-extension-cls` names passes vLLM's injection check against its
        # real GPU worker (no name the worker has), and vLLM's own run_method finds our method by name
        from vllm.utils.import_utils import resolve_obj_by_qualname
        from vllm.v1.serial_utils import run_method
        from vllm.v1.worker.gpu_worker import Worker

        extension = resolve_obj_by_qualname(EXTENSION_CLASS)
        assert not [a for a in dir(extension) if not a.startswith("__") and hasattr(Worker, a)]
        worker = type("Worker", (extension,), {})()
        worker.weight_transfer_engine = engine
        report = run_method(worker, REPORT_METHOD, (), {})
        assert report["version"] == 1 and not report["incomplete"] and report["identity"] == engine.identity

        # version 2 breaks half-way inside vLLM's real layerwise reload (load_weights raises on a late tensor):
        # the layers processed before it hold version 2, vLLM's finalize puts the others back; the engine's
        # host copy (vllm.rollback=host) makes the model version 1 again, bitwise, nothing left on meta
        loads = model.load_weights

        def failing(weights: Any) -> Any:
            weights = list(weights)
            if any(name == "norm.weight" for name, _ in weights):
                raise ValueError("injected")
            return loads(weights)

        model.load_weights = failing  # type: ignore[method-assign]
        model.post_load.calls.clear()
        thread = threading.Thread(target=rollout, args=(2,))
        thread.start()
        with pytest.raises(PeerError, match=r"norm\.weight"):
            sender.send_weights(list({k: v + 1 for k, v in expected.items()}.items()), version=2)
        thread.join(30)
        assert len(errors) == 1 and "rolled back to version 1" in str(errors[0]), errors
        state = model.state_dict()
        assert all(torch.equal(state[k], v) for k, v in expected.items())
        assert engine.version == 1 and not engine.incomplete and not engine._reload_active
        # after the rollback, layers re-derive their state from the restored kernel-format tensors: 0.34.0 runs
        # every module's post-load hook (no argument) under weights_already_processed, as its own kernel-format
        # reload does (model_loader/reload/inplace.py:112-114); 0.33.0 re-processes deferred attention layers only
        from vllm.model_executor.model_loader import weight_utils

        if hasattr(weight_utils, "finalize_model_weights"):
            assert model.post_load.calls[-1] is True
        assert not any(p.is_meta for p in model.parameters())
    finally:
        engine.shutdown()
        sender.close()


class PostLoadHook(torch.nn.Module):
    """A module with vLLM's post-load hook, as 0.34.0 calls it (`process_weights_after_loading()`,
    model_executor/layers/attention/attention.py:620 in 0.34.0); records whether weights were marked
    already processed (kernel format) when it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[bool] = []

    def process_weights_after_loading(self) -> None:
        from vllm.model_executor.utils import is_weights_pre_processed

        self.calls.append(is_weights_pre_processed())


def test_the_launcher_execs_vllm_serve_with_our_engine_and_config(tmp_path: Path) -> None:
    """`lightning-weightsync rollout rollout.engine=vllm` replaces itself with `vllm serve` (a recording
    stand-in executable named `vllm` first on PATH; the real one needs a GPU)."""
    import os
    import subprocess
    import sys

    record = tmp_path / "argv.json"
    fake = tmp_path / "vllm"
    fake.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"json.dump({{'argv': sys.argv[1:], 'env': {{k: os.environ.get(k) for k in "
        f"('VLLM_SERVER_DEV_MODE', 'LIGHTNING_WEIGHTSYNC_CONFIG')}}}}, open({str(record)!r}, 'w'))\n"
    )
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    cmd = [sys.executable, "-m", "lightning_weightsync.cli", "rollout", "rollout.engine=vllm", "vllm.model=m",
           "vllm.serve_args=[--port,8123]", "transport.port=29777"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(record.read_text())
    assert got["argv"] == ["serve", "m", "--weight-transfer-config", '{"backend": "lightning_weightsync"}', "--port",
                           "8123", "--worker-extension-cls", EXTENSION_CLASS]  # fmt: skip
    assert got["env"]["VLLM_SERVER_DEV_MODE"] == "1"
    assert OmegaConf.load(got["env"]["LIGHTNING_WEIGHTSYNC_CONFIG"]).transport.port == 29777
    os.unlink(got["env"]["LIGHTNING_WEIGHTSYNC_CONFIG"])


def test_vllms_own_plugin_discovery_registers_our_engine_and_its_factory_builds_it() -> None:
    """Through the entry point vLLM itself loads in every process (`load_general_plugins` reads the
    `vllm.general_plugins` group of the installed distributions), not a direct `plugin.register()`; then
    vLLM's factory builds our engine from the name alone, as a worker's `init_weight_transfer_engine` does."""
    import os
    import subprocess
    import sys

    code = (
        "from types import SimpleNamespace\n"
        "import torch\n"
        "from vllm.plugins import load_general_plugins\n"
        "from vllm.config.weight_transfer import WeightTransferConfig\n"
        "from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as F\n"
        "load_general_plugins()\n"
        "print('lightning_weightsync' in F._registry)\n"
        "cfg = SimpleNamespace(parallel_config=SimpleNamespace(), speculative_config=None, offload_config=None,\n"
        "                      model_config=SimpleNamespace(quantization=None, enable_sleep_mode=False))\n"
        "engine = F.create_engine(WeightTransferConfig(backend='lightning_weightsync'), cfg, torch.device('cpu'),\n"
        "                         torch.nn.Linear(2, 2))\n"
        "print(type(engine).__module__ + '.' + type(engine).__name__)\n"
        "engine.shutdown()\n"
    )  # a fresh interpreter: nothing of ours imported before vLLM's discovery runs
    env = {k: v for k, v in os.environ.items() if k != "LIGHTNING_WEIGHTSYNC_CONFIG"}  # built bare: no receiver
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-2:] == [
        "True",
        "lightning_weightsync.rollout_engines.vllm.weight_transfer.LightningWeightSyncEngine",
    ], out.stdout[-2000:]
