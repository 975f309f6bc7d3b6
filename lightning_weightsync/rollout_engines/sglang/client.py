"""The trainer side of SGLang rollouts: each version's update window over SGLang's HTTP routes.

Per version (`trainer/fleet.py` runs each step on every rollout at once):

    POST /pause_generation {"mode": sglang.pause_mode}
    POST /begin_weight_update {}
    POST /update_weights_from_tensor {"serialized_named_tensors": [<empty list>] * tp_size,
          "load_format": "<our loader>", "flush_cache": ..., "weight_version": "v"}
          <- in a thread: SGLang calls our loader on every TP rank, which receives the version from our
             sender (broadcast meanwhile) into model.load_weights; the answer comes when all ranks did
    POST /end_weight_update {}
    POST /unload_lora_adapter {"lora_name"}  (adapter versions only, trainer.lora=adapter: TP rank 0 wrote
    POST /load_lora_adapter {"lora_name",     "<sglang.lora_dir>/step_v" while receiving; SGLang has no
          "lora_path": ".../step_v"}          in-place load, so the served name is unloaded and loaded again)
    GET  /model_info                         (verify: weight_version is "v")
    POST /continue_generation {}             (always, also after any failure)

SGLang records `weight_version` when the update call succeeds. Our loader cannot fail that call (an
exception there would end SGLang's scheduler: scheduler.py:2253 dispatches without a handler, 6370-6373
quit the server), so a failed receive is reported where the trainer hears it anyway, in the receiver's
nack; the session is then closed and the version marked `<v>-incomplete` here (`finish_update(None)`).
The trainer half of the engine: imports nothing of the rollout side, standard-library HTTP only.
"""

from __future__ import annotations

import logging

from ...errors import ConfigError, PeerError
from ...plugins import RolloutClient
from ...protocol.lora import adapter_path
from ...transport.http import JSONEndpoint
from . import api
from .config import SGLangConfig, SGLangPauseMode

logger = logging.getLogger(__name__)

ENGINE = "SGLang"  # how errors name it
TIMEOUT_KNOB = "sglang.request_timeout_s"


def clients(s: SGLangConfig) -> list[SGLangClient]:
    """One client per `sglang.urls` (the registry's entry point for the trainer side); `s` is the typed
    `sglang` section, all of the config this module reads."""
    return [
        SGLangClient(
            u,
            s.request_timeout_s,
            pause_mode=s.pause_mode,
            flush_cache=s.flush_cache,
            lora_name=s.lora_name,
            lora_dir=s.lora_dir,
        )
        for u in s.urls
    ]


class SGLangClient(RolloutClient):
    """One SGLang server (`sglang serve` with `--custom-weight-loader` naming our loader)."""

    engine = ENGINE
    timeout_knob = TIMEOUT_KNOB

    def __init__(
        self,
        url: str,
        timeout_s: float,
        *,
        pause_mode: SGLangPauseMode = SGLangPauseMode.retract,
        flush_cache: bool = True,
        lora_name: str = "policy",
        lora_dir: str | None = None,
    ) -> None:
        self.http = JSONEndpoint(
            url, timeout_s, label="SGLang rollout", timeout_knob=TIMEOUT_KNOB, urls_knob="sglang.urls"
        )
        self.url = self.name = self.http.url
        self.pause_mode = SGLangPauseMode(pause_mode)
        # in_place keeps the running requests in the batch, and SGLang's flush fails while any runs
        self.flush_cache = flush_cache and self.pause_mode is not SGLangPauseMode.in_place
        self.tp_size: int | None = None
        self.lora_name, self.lora_dir = lora_name, lora_dir
        self._version: int | None = None  # the version of the open session

    def workers(self) -> int | None:
        """TP x PP ranks (each one receiver), from `GET /server_info`; dp_size must be 1: SGLang's tensor
        update path asserts it, so a dp_size > 1 server is refused here, before anything is paused."""
        info = self.http.request(api.SERVER_INFO, method="GET")
        if not isinstance(info, dict):
            return None
        dp, tp, pp = (info.get(k, 1) for k in ("dp_size", "tp_size", "pp_size"))
        if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (dp, tp, pp)):
            return None
        if dp != 1:
            raise ConfigError(
                f"SGLang rollout {self.url} runs dp_size={dp}; its weight-update path (/update_weights_from_tensor, "
                "our loader) works only with dp_size 1: run one server per data-parallel replica (--dp-size 1) and "
                "list each in sglang.urls"
            )
        self.tp_size = tp
        return int(tp * pp)

    def pause(self) -> None:
        self.http.request(api.PAUSE, {"mode": str(self.pause_mode)})

    def start_update(self) -> None:
        if self.tp_size is None:  # not asked yet (no trainer.min_receivers check): one payload per TP rank
            self.workers()
        self.http.request(api.BEGIN, {})

    def update(self, version: int, receive_timeout_s: float | None) -> None:
        """Lasts the whole transfer (not capped by request_timeout_s; each rank's receive is bounded by its
        transport.timeout_s, the trainer's wait by RolloutFleet). A failed call closes the session, which
        SGLang leaves open after a failed update, so the next version can begin."""
        self._version = version
        body = {
            "serialized_named_tensors": [api.EMPTY_NAMED_TENSORS] * (self.tp_size or 1),
            "load_format": api.LOADER,
            "flush_cache": self.flush_cache,
            "weight_version": str(version),
        }
        try:
            self.http.request(api.UPDATE, body, uncapped=True)
        except Exception:
            self._end_quietly()
            raise

    def finish_update(self, weight_version: str | None) -> None:
        """Close the session. After a failed version (None) SGLang already recorded the version our update
        call named, over weights that may be partly loaded: say so in its weight_version."""
        self.http.request(api.END, {})
        if weight_version is None and self._version is not None:
            marked = {"new_version": f"{self._version}-incomplete", "abort_all_requests": False}
            self.http.request(api.SET_VERSION, marked)

    def check_adapter(self) -> None:
        """Before an adapter version is paused for: where the adapter is written, and a pause mode that lets the
        unload of the previous adapter finish (SGLang's unload waits for every request using it, api.py)."""
        if not self.lora_dir:
            raise ConfigError(
                f"SGLang rollout {self.url}: an adapter version (trainer.lora=adapter) needs sglang.lora_dir, the "
                "directory (as the server sees it) where its TP rank 0 writes each version for /load_lora_adapter; set "
                "it on both sides, or set trainer.lora=merged"
            )
        if self.pause_mode is not SGLangPauseMode.abort:
            raise ConfigError(
                f"SGLang rollout {self.url}: adapter versions replace the served adapter by /unload_lora_adapter, "
                f"which waits for every request using it to finish; with sglang.pause_mode={self.pause_mode} the "
                "paused requests never do: set sglang.pause_mode=abort (or trainer.lora=merged)"
            )

    def load_adapter(self, version: int) -> None:
        """Serve adapter `version` under `lora_name`: unload the name (not loaded yet is fine), then load the
        directory TP rank 0 wrote while receiving it. SGLang answers 400 naming --enable-lora when LoRA is off."""
        assert self.lora_dir, "check_adapter() first"
        try:
            try:
                self.http.request(api.UNLOAD_LORA, {"lora_name": self.lora_name})
            except PeerError as exc:
                if "does not exist" not in str(exc):  # the first version (or a restarted trainer): nothing to unload
                    raise
            self.http.request(
                api.LOAD_LORA, {"lora_name": self.lora_name, "lora_path": adapter_path(self.lora_dir, version)}
            )
        except PeerError as exc:
            self._mark_incomplete(version)  # SGLang recorded the version with the update call
            raise self._lora_error(exc, version) from None

    def _mark_incomplete(self, version: int) -> None:
        try:
            self.http.request(api.SET_VERSION, {"new_version": f"{version}-incomplete", "abort_all_requests": False})
        except Exception as exc:  # the load's own error is the one to report
            logger.warning("SGLang rollout %s: marking version %d incomplete failed: %s", self.url, version, exc)

    def _lora_error(self, exc: PeerError, version: int) -> PeerError:
        text = str(exc)
        if "enable-lora" in text or ("HTTP 404" in text and "Not Found" in text):
            return PeerError(
                f"SGLang rollout {self.url}: cannot load adapter version {version} ({text[:300]}); start the server "
                "with --enable-lora (with --max-lora-rank and --lora-target-modules covering the adapter), or set "
                "trainer.lora=merged"
            )
        return exc

    def after_update(self, version: int) -> None:
        """Nothing: the cache was flushed by the update call itself (`flush_cache`)."""

    def verify(self, version: int) -> None:
        """SGLang reports the version it holds (`/model_info`): that it holds this one is all it can say."""
        held = self.weight_version()
        if held != str(version):
            raise PeerError(f"SGLang rollout {self.url}: reports weight_version {held!r} after version {version}")

    def resume(self) -> None:
        self.http.request(api.RESUME, {})

    def weight_version(self) -> str | None:
        info = self.http.request(api.MODEL_INFO, method="GET")
        version = info.get("weight_version") if isinstance(info, dict) else None
        return None if version is None else str(version)

    def _end_quietly(self) -> None:
        try:
            self.http.request(api.END, {})
        except Exception as exc:  # the update's own error is the one to report
            logger.warning("SGLang rollout %s: closing the update window after a failed update: %s", self.url, exc)


__all__ = ["SGLangClient", "clients"]
