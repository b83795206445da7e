"""Drive a co-located vLLM after each commit, so a trainer speaks only weightsync.

`--engine vllm-http=http://127.0.0.1:8000` points at a vLLM server started with
VLLM_SERVER_DEV_MODE=1 and `--weight-transfer-config '{"backend": "weightsync"}'`.
After every commit (and whenever vLLM reports another version than the node's,
e.g. it restarted: a warm start) the driver calls vLLM's weight-transfer routes:

    /init_weight_transfer_engine (once per vLLM instance)
    /pause?mode=keep, /start_weight_update,
    /update_weights {"update_info": {"generation": g, "since_generation": s}},
    /finish_weight_update {"weight_version": label}, /resume

vLLM's worker then reads the node's store through weightsync.engine (the
weightsync backend: engine/vllm_backend.py). What vLLM serves, and since when,
goes to GetServerInfo.engines and WatchWeights.

The driver is a supervised background task: whatever vLLM answers (an HTTP
error, a 200 that is not a JSON object, garbage bytes), the attempt fails
with a typed reason that GetServerInfo.engines shows as last_error, is tried
again with backoff, and the next commit is driven at once. An unexpected
error is logged and the loop goes on; stop() never raises, so the server's
shutdown always reaches the local socket and the workers.

Every one of vLLM's workers (each tensor-parallel rank) attaches to the
node's local socket and reads the node's one host store, whatever GPU it and
the weightsync workers are on; driven ranks attach unnamed, and the driver
reports for the engine. The bearer token is read from the server's Credentials at each
initialization; after a SIGHUP reload vLLM is initialized again, so it
attaches with the current token.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from dataclasses import dataclass

from weightsync.common.logging import get_logger
from weightsync.server.credentials import Credentials
from weightsync.server.engines import EngineRegistry
from weightsync.server.publisher import Publisher

log = get_logger("weightsync.engine_driver")

POLL_SECONDS = 5.0
"""How often vLLM's version is checked between commits (a restarted vLLM is warm-started)."""
REQUEST_TIMEOUT_SECONDS = 300.0
MAX_ANSWER_BYTES = 1 << 20
"""vLLM's weight-transfer routes answer a few bytes of JSON; more than this is not such an answer."""
RETRY_SECONDS = (5.0, 10.0, 30.0, 60.0, 300.0)
"""A version vLLM refused is tried again after these delays (then every 300 s), or at once when
vLLM restarts; a new commit is tried at once."""
RESUME_AFTER_FAILURE_SECONDS = 30.0
LOOP_RETRY_SECONDS = (1.0, 5.0, 30.0)
"""After an unexpected error in the driver loop itself (a bug): wait, then carry on."""


class EngineCallFailed(Exception):
    """One call to the engine did not give a usable answer; `reason` is machine-readable."""

    reason = "ENGINE_CALL_FAILED"

    def __str__(self) -> str:
        return f"{self.reason}: {self.args[0] if self.args else ''}"


class EngineUnreachable(EngineCallFailed):
    """No answer at all (connection refused, reset, timed out)."""

    reason = "ENGINE_UNREACHABLE"


class EngineRefused(EngineCallFailed):
    """An HTTP error status."""

    reason = "ENGINE_REFUSED"


class EngineAnswerMalformed(EngineCallFailed):
    """A success status whose body is not a JSON object (garbage bytes, `[]`, a wrong type)."""

    reason = "ENGINE_ANSWER_MALFORMED"


def parse_answer(method: str, path: str, text: bytes) -> dict:
    """The JSON object vLLM answered; EngineAnswerMalformed for anything else. Empty means {}."""
    if not text.strip():
        return {}
    try:
        answer = json.loads(text)
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError both are ValueErrors
        raise EngineAnswerMalformed(f"{method} {path}: not JSON ({error}): {text[:200]!r}") from None
    if not isinstance(answer, dict):
        raise EngineAnswerMalformed(f"{method} {path}: expected a JSON object, got {type(answer).__name__}: "
                                    f"{text[:200]!r}")
    return answer


@dataclass(slots=True)
class VllmHttpDriver:
    name: str
    url: str
    publisher: Publisher
    engines: EngineRegistry
    local_socket: str
    credentials: Credentials
    _task: asyncio.Task | None = None
    _initialized: bool = False
    _initialized_at_reload: int = -1
    """credentials.reloads when vLLM was initialized: a later reload initializes it again."""
    _applied_generation: int = -1
    _applied_label: str | None = None
    """The weight_version we last set in vLLM; another one means another instance (warm-start it)."""
    _failed: tuple[int, str | None] | None = None
    """(generation, vLLM's version then) of the last refused apply."""
    _failures: int = 0
    _retry_at: float = 0.0

    @staticmethod
    def from_spec(spec: str, index: int, **parts) -> VllmHttpDriver:
        kind, _, url = spec.partition("=")
        return VllmHttpDriver(name=kind if index == 0 else f"{kind}-{index}", url=url.rstrip("/"), **parts)

    def start(self) -> None:
        self.engines.register(self.name, "vllm-http", self.url)
        self._task = asyncio.ensure_future(self._run())
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        error = task.exception()
        # _run only ends by cancellation; anything else is a bug, and must not go unnoticed.
        log.error("engine_driver_ended", engine=self.name, error=repr(error))
        self.engines.failed(self.name, f"DRIVER_STOPPED: the driver stopped: {error!r}")

    async def stop(self) -> None:
        """Stop driving; never raises (the server's shutdown must go on)."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        except Exception as error:  # noqa: BLE001 - already logged by _ended; shutdown goes on
            log.warning("engine_driver_stopped_with_error", engine=self.name, error=repr(error))

    async def _run(self) -> None:
        events = self.publisher.watchers.subscribe()
        errors = 0
        try:
            while True:
                try:
                    target = await self._converge()
                    await self._wait_for_commit_or_poll(events, target)
                    errors = 0
                except Exception as error:  # noqa: BLE001 - supervised: logged, reported, and we go on
                    delay = LOOP_RETRY_SECONDS[min(errors, len(LOOP_RETRY_SECONDS) - 1)]
                    errors += 1
                    log.exception("engine_driver_error", engine=self.name, retry_seconds=delay)
                    self.engines.failed(self.name, f"DRIVER_ERROR: {error!r}")
                    await asyncio.sleep(delay)
        finally:
            self.publisher.watchers.unsubscribe(events)

    async def _wait_for_commit_or_poll(self, events: asyncio.Queue, target: int) -> None:
        """Sleep until the node's generation is another than `target` (the one _converge worked
        towards: a commit while vLLM applied returns at once) or the poll. Every other event (most
        of them engine-state changes, our own included) is not a reason to call vLLM again: waking
        on those would spin while vLLM is down or keeps refusing a version."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + POLL_SECONDS
        while self.publisher.version.generation == target and (left := deadline - loop.time()) > 0:
            try:
                await asyncio.wait_for(events.get(), left)
            except TimeoutError:
                return

    async def _converge(self) -> int:
        """Make vLLM serve the node's version, if it does not already; the generation it worked
        towards (read before any call to vLLM)."""
        version = self.publisher.version
        if version.generation == 0:
            return 0
        served = None
        try:
            served = (await self._call("GET", "/weight_info")).get("weight_version")
            if served is not None and not isinstance(served, str):
                raise EngineAnswerMalformed(f"GET /weight_info: weight_version is {type(served).__name__}, "
                                            f"not a string: {served!r}"[:300])
            if served != self._applied_label:
                # Not what we set last: a new instance (or a restart) holds its own weights: all of them.
                self._initialized, self._applied_generation, self._applied_label = False, -1, None
            if served == version.version and self._applied_generation == version.generation:
                return version.generation
            if self._failed == (version.generation, served) and asyncio.get_running_loop().time() < self._retry_at:
                return version.generation  # refused a moment ago, nothing changed since: wait before asking again
            self.engines.applying(self.name)
            await self._apply(version.version, version.generation)
        except EngineUnreachable as error:
            self._initialized = False
            self.engines.unreachable(self.name, str(error))
            return version.generation
        except EngineCallFailed as error:
            if "VERSION_GONE" in str(error):
                # A newer commit replaced it while vLLM read: the node's generation is past the one
                # returned, so the wait returns at once and the next pass converges to the newer one.
                return version.generation
            self._failed = (version.generation, served if isinstance(served, str) else None)
            delay = RETRY_SECONDS[min(self._failures, len(RETRY_SECONDS) - 1)]
            self._retry_at = asyncio.get_running_loop().time() + delay
            self._failures += 1
            text = "; ".join([str(error), *getattr(error, "__notes__", ())])  # a failed /resume, too
            self.engines.failed(self.name, text)
            log.warning("engine_apply_failed", engine=self.name, version=version.version,
                        generation=version.generation, reason=error.reason, error=text, retry_seconds=delay)
            return version.generation
        self._applied_generation, self._applied_label = version.generation, version.version
        self._failed, self._failures = None, 0
        self.engines.applied(self.name, version)
        log.info("engine_applied", engine=self.name, version=version.version, generation=version.generation)
        return version.generation

    async def _apply(self, label: str, generation: int) -> None:
        if self._initialized and self._initialized_at_reload != self.credentials.reloads:
            self._initialized = False  # the token may have changed: vLLM must attach with the current one
        if not self._initialized:
            reloads = self.credentials.reloads
            await self._call("POST", "/init_weight_transfer_engine", {"init_info": {
                "local_socket": self.local_socket, "token": self.credentials.token}})
            self._initialized, self._initialized_at_reload = True, reloads
        await self._call("POST", "/pause?mode=keep")
        try:
            await self._call("POST", "/start_weight_update")
            # vLLM's worker reads generation `generation` (VERSION_GONE if a newer commit replaced it)
            # and loads what was written since the one it serves; on an error it keeps its weights.
            await self._call("POST", "/update_weights", {"update_info": {
                "generation": generation, "since_generation": self._applied_generation}})
            await self._call("POST", "/finish_weight_update", {"weight_version": label})
        except BaseException as failure:
            # Resume even so, but the failure is what the caller must see: a resume error is logged
            # and attached to it as a note, never raised in its place. Bounded: this also runs when
            # the server stops mid-apply.
            try:
                await asyncio.wait_for(self._call("POST", "/resume"), RESUME_AFTER_FAILURE_SECONDS)
            except Exception as resume_error:  # noqa: BLE001 - reported with the original error
                log.warning("engine_resume_failed", engine=self.name, error=str(resume_error),
                            after=str(failure))
                failure.add_note(f"and /resume failed too: {resume_error}")
            raise
        await self._call("POST", "/resume")

    async def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        return await asyncio.get_running_loop().run_in_executor(None, self._http, method, path, body)

    def _http(self, method: str, path: str, body: dict | None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_SECONDS) as response:  # noqa: S310 - operator's URL
                text = response.read(MAX_ANSWER_BYTES + 1)
        except urllib.error.HTTPError as error:
            detail = error.read(1000).decode(errors="replace")
            raise EngineRefused(f"{method} {path}: HTTP {error.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as error:
            raise EngineUnreachable(f"{method} {path}: {error}") from None
        except Exception as error:  # noqa: BLE001 - http.client's HTTPException (not HTTP at all) and the like
            raise EngineAnswerMalformed(f"{method} {path}: {type(error).__name__}: {error}") from None
        if len(text) > MAX_ANSWER_BYTES:
            raise EngineAnswerMalformed(f"{method} {path}: an answer over {MAX_ANSWER_BYTES} bytes")
        return parse_answer(method, path, text)
