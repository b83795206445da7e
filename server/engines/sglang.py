"""Drive a co-located SGLang server after each commit: `--engine sglang-http=URL`.

SGLang is started with weightsync's loader (`--custom-weight-loader
weightsync.engine.sglang.loader.load`, and WEIGHTSYNC_SERVER or WEIGHTSYNC_LOCAL_SOCKET in its
environment: engine/sglang/). After every commit, and whenever SGLang reports another weight
version than the one the driver set last (a new or restarted SGLang: a warm start, every tensor),
the driver calls SGLang's routes, each with the spec's timeout_s:

    GET  /model_info                  the weight_version it serves
    GET  /server_info                 its tp_size (once per instance)
    POST /pause_generation            {"mode": retract | abort | in_place}
    POST /begin_weight_update         {}
    POST /update_weights_from_tensor  update_body(UpdateRequest(generation=G, since_generation=S))
    POST /end_weight_update           {}
    POST /update_weight_version       {"new_version": label, "abort_all_requests": false}
    POST /continue_generation         {}

The update request names the version, not weights: each TP rank's loader acquires generation G
from the node's store and loads what changed since S (-1 on a warm start). SGLang's ranks report
to GetServerInfo.engines themselves (WEIGHTSYNC_ENGINE_NAME, NAME:tpR); the driver's entry
(kind sglang-http) says what the engine as a whole serves: SERVING a version once every call
above succeeded.

Every failure is typed as the vLLM driver's are (driver.py): no answer ENGINE_UNREACHABLE,
an error status (SGLang answers 400 with `success: false` and its message, e.g. a loader's
TENSOR_NOT_IN_MODEL) ENGINE_REFUSED, a 200 that is not a JSON object or lacks a boolean `success`
ENGINE_ANSWER_MALFORMED, a 200 with `success: false` ENGINE_REFUSED. On any failure after the
pause, the failure is in the driven entry at once (a load stuck past timeout_s shows as
ENGINE_UNREACHABLE then, not after the cleanup), and the driver still ends an update it began and
continues generation (bounded; their own failures are appended to last_error), so SGLang keeps
serving its last version and generating.
Only the label is set after the weights: SGLang's weight_version changes only when the whole
update succeeded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from weightsync.common.logging import get_logger
from weightsync.engine.request import UpdateRequest
from weightsync.engine.sglang.request import update_body
from weightsync.server.engines.driver import (
    EngineAnswerMalformed,
    EngineCallFailed,
    EngineRefused,
    EngineUnreachable,
    HttpEngineDriver,
)

log = get_logger("weightsync.sglang_driver")

# Routes whose answer is {"success": bool, "message": str}.
_SUCCESS_ROUTES = ("/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update",
                   "/update_weight_version")


@dataclass(slots=True)
class SglangHttpDriver(HttpEngineDriver):
    """SGLang's weight-update routes (the module's docstring)."""

    pause_mode: str = field(default="retract", kw_only=True)
    """/pause_generation's mode (config.EngineSpec.pause)."""
    _tp_size: int | None = field(default=None, kw_only=True)
    """The instance's tensor-parallel size, read from /server_info before its first update."""

    kind = "sglang-http"

    def _forget(self) -> None:
        self._tp_size = None

    async def _served_label(self) -> str | None:
        served = (await self._call("GET", "/model_info")).get("weight_version")
        if served is not None and not isinstance(served, str):
            raise EngineAnswerMalformed(f"GET /model_info: weight_version is {type(served).__name__}, "
                                        f"not a string: {served!r}"[:300])
        return served

    async def _read_tp_size(self) -> int:
        tp_size = (await self._call("GET", "/server_info")).get("tp_size")
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise EngineAnswerMalformed(f"GET /server_info: tp_size must be a positive integer, got {tp_size!r}"[:300])
        return tp_size

    async def _apply(self, label: str, generation: int) -> None:
        if self._tp_size is None:
            self._tp_size = await self._read_tp_size()
        since = self._applied_generation if self._applied_generation < generation else -1
        # in_place keeps running requests and their KV cache: SGLang refuses to flush it then.
        body = update_body(UpdateRequest(generation=generation, since_generation=since), tp_size=self._tp_size,
                           flush_cache=self.pause_mode != "in_place")
        cleanup: list[tuple[str, str, dict | None]] = [("POST", "/continue_generation", {})]
        try:
            await self._call("POST", "/pause_generation", {"mode": self.pause_mode})
            # From here on an update may be open (even a begin that timed out may have opened one):
            # end it on failure; an end with none open is refused, which is only noted.
            cleanup.insert(0, ("POST", "/end_weight_update", {}))
            await self._call("POST", "/begin_weight_update", {})
            await self._call("POST", "/update_weights_from_tensor", body)
            cleanup.pop(0)
            await self._call("POST", "/end_weight_update", {})
            await self._call("POST", "/update_weight_version", {"new_version": label, "abort_all_requests": False})
        except BaseException as failure:
            self._report_at_once(failure)
            await self._cleanup(failure, cleanup)
            raise
        await self._call("POST", "/continue_generation", {})

    def _report_at_once(self, failure: BaseException) -> None:
        """A failed call is in the driven entry before the cleanup runs: a stuck SGLang answers the cleanup's
        calls no sooner than the update (up to RESUME_AFTER_FAILURE_SECONDS more), and the entry would say
        APPLYING, no error, all that time. The driver's own report after the cleanup adds its notes."""
        if isinstance(failure, EngineUnreachable):
            self.engines.unreachable(self.name, str(failure))
        elif isinstance(failure, EngineCallFailed):
            self.engines.failed(self.name, str(failure))

    async def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        answer = await HttpEngineDriver._call(self, method, path, body)
        if path in _SUCCESS_ROUTES:
            success = answer.get("success")
            if not isinstance(success, bool):
                raise EngineAnswerMalformed(f"{method} {path}: expected a boolean 'success', got "
                                            f"{json.dumps(answer)[:200]}")
            if not success:
                raise EngineRefused(f"{method} {path}: success false: {_message(answer)}")
        return answer

    def _error_detail(self, body: str) -> str:
        """SGLang's error answers are {"success": false, "message": ...}: the message."""
        try:
            answer = json.loads(body)
        except ValueError:
            return body
        return _message(answer) if isinstance(answer, dict) and "message" in answer else body


def _message(answer: dict) -> str:
    message = answer.get("message")
    return message if isinstance(message, str) else json.dumps(answer)[:1000]
