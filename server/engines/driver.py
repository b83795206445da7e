"""Drive a co-located inference engine after each commit, so a trainer speaks only weightsync.

`HttpEngineDriver` is what every driven engine shares (the supervised loop, warm start, retries,
typed failures, reporting); `VllmHttpDriver` (server/engines/vllm.py) and `SglangHttpDriver`
(server/engines/sglang.py) are its two engines; server/engines/drivers.py makes one from an
--engine spec.

The driver is a supervised background task: whatever the engine answers (an HTTP
error, a 200 that is not a JSON object, garbage bytes), the attempt fails
with a typed reason that GetServerInfo.engines shows as last_error, is tried
again with backoff, and the next commit is driven at once. An unexpected
error is logged and the loop goes on; stop() never raises, so the server's
shutdown always reaches the local socket and the workers.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from weightsync.common.logging import get_logger
from weightsync.server.published.engine_registry import EngineRegistry
from weightsync.server.published.publisher import Publisher

log = get_logger("weightsync.engine_driver")

POLL_SECONDS = 5.0
"""How often the engine's version is checked between commits (a restarted engine is warm-started)."""
REQUEST_TIMEOUT_SECONDS = 300.0
MAX_ANSWER_BYTES = 1 << 20
"""The weight-update routes answer a few bytes of JSON; more than this is not such an answer."""
ERROR_ANSWER_MAX_BYTES = 64 * 1024
"""An error status's body is read up to this: a large tensor-parallel engine's refusal names each rank's
outcome (a few hundred bytes each, engine/sglang/loader.py), which fits many times over; a longer body is
cut here, saying so. All of it read is kept (EngineCallFailed.answer: VERSION_GONE is looked for there)."""
ERROR_DETAIL_MAX_CHARS = 1500
"""How much of an error status's body goes into the failure's message (last_error, which GetServerInfo
keeps to 2000 characters, and the log's `error`): its head, then how many characters were cut; the log's
`answer` then has all of it that was read."""
RETRY_SECONDS = (5.0, 10.0, 30.0, 60.0, 300.0)
"""A version the engine refused is tried again after these delays (then every 300 s), or at once when
it restarts; a new commit is tried at once."""
RESUME_AFTER_FAILURE_SECONDS = 30.0
LOOP_RETRY_SECONDS = (1.0, 5.0, 30.0)
"""After an unexpected error in the driver loop itself (a bug): wait, then carry on."""


class EngineCallFailed(Exception):
    """One call to the engine did not give a usable answer; `reason` is machine-readable."""

    reason = "ENGINE_CALL_FAILED"
    answer = ""
    """An error status's whole body as read (up to ERROR_ANSWER_MAX_BYTES), when the message shows less."""

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
    """The JSON object the engine answered; EngineAnswerMalformed for anything else. Empty means {}."""
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


def read_error_answer(error: urllib.error.HTTPError) -> str:
    """An error status's body, up to ERROR_ANSWER_MAX_BYTES (then a note of how much there was)."""
    try:
        raw = error.read(ERROR_ANSWER_MAX_BYTES + 1)
    except Exception as failure:  # noqa: BLE001 - reset while reading, http.client's IncompleteRead and the like
        return f"(the answer could not be read: {type(failure).__name__}: {failure})"
    text = raw[:ERROR_ANSWER_MAX_BYTES].decode(errors="replace")
    if len(raw) <= ERROR_ANSWER_MAX_BYTES:
        return text
    length = error.headers.get("Content-Length") if error.headers is not None else None
    of = f"of {length} bytes" if length and length.isdigit() else "bytes, and more followed"
    return f"{text} [answer cut at {ERROR_ANSWER_MAX_BYTES} {of}]"


def readable_detail(detail: str) -> str:
    """`detail` for a message: whole up to ERROR_DETAIL_MAX_CHARS, else its head and how much was cut."""
    if len(detail) <= ERROR_DETAIL_MAX_CHARS:
        return detail
    return f"{detail[:ERROR_DETAIL_MAX_CHARS]} [{len(detail) - ERROR_DETAIL_MAX_CHARS} more characters cut]"


def _with_notes(error: BaseException) -> str:
    return "; ".join([str(error), *getattr(error, "__notes__", ())])


@dataclass(slots=True)
class HttpEngineDriver:
    """What every driven engine shares: the supervised loop, the convergence towards the node's
    version (warm start, retries with backoff, VERSION_GONE), the reporting, and bounded HTTP
    calls whose failures are typed. An engine's driver says how to read the label it serves
    (`_served_label`), how to apply one version (`_apply`) and what to forget when it finds
    another instance or none (`_forget`)."""

    name: str
    url: str
    publisher: Publisher
    engines: EngineRegistry
    _task: asyncio.Task | None = field(default=None, kw_only=True)
    _applied_generation: int = field(default=-1, kw_only=True)
    _applied_label: str | None = field(default=None, kw_only=True)
    """The weight version we last set in the engine (or the one it had when we found it); another one
    means another instance (warm-start it)."""
    _failed: tuple[int, str | None] | None = field(default=None, kw_only=True)
    """(generation, the engine's version then) of the last refused apply."""
    _failures: int = field(default=0, kw_only=True)
    _retry_at: float = field(default=0.0, kw_only=True)
    timeout_s: float = field(default=REQUEST_TIMEOUT_SECONDS, kw_only=True)
    """Longest wait for any one answer of the engine."""

    kind = "http"

    def start(self) -> None:
        self.engines.register(self.name, self.kind, self.url)
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
        towards: a commit while the engine applied returns at once) or the poll. Every other event
        (most of them engine-state changes, our own included) is not a reason to call the engine
        again: waking on those would spin while it is down or keeps refusing a version."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + POLL_SECONDS
        while self.publisher.version.generation == target and (left := deadline - loop.time()) > 0:
            try:
                await asyncio.wait_for(events.get(), left)
            except TimeoutError:
                return

    async def _served_label(self) -> str | None:
        """The weight version the engine says it serves (None: it says none)."""
        raise NotImplementedError

    async def _apply(self, label: str, generation: int) -> None:
        """Make the engine load `generation` (what changed since self._applied_generation) and
        serve it as `label`; raises EngineCallFailed when it did not."""
        raise NotImplementedError

    def _forget(self) -> None:
        """Another instance, or none: forget what was set up in the one we knew."""

    async def _converge(self) -> int:
        """Make the engine serve the node's version, if it does not already; the generation it worked
        towards (read before any call to the engine)."""
        version = self.publisher.version
        if version.generation == 0:
            return 0
        served = None
        try:
            served = await self._served_label()
            if served != self._applied_label:
                # Not what we set last (or saw first): a new instance (or a restart) holds its own
                # weights: all of them. Its label is remembered, so that a retry is not another instance.
                self._forget()
                self._applied_generation, self._applied_label = -1, served
            if served == version.version and self._applied_generation == version.generation:
                return version.generation
            if self._failed == (version.generation, served) and asyncio.get_running_loop().time() < self._retry_at:
                return version.generation  # refused a moment ago, nothing changed since: wait before asking again
            self.engines.applying(self.name)
            await self._apply(version.version, version.generation)
        except EngineUnreachable as error:
            self._forget()
            self.engines.unreachable(self.name, _with_notes(error))
            return version.generation
        except EngineCallFailed as error:
            if "VERSION_GONE" in str(error) or "VERSION_GONE" in error.answer:
                # A newer commit replaced it while the engine read: the node's generation is past the
                # one returned, so the wait returns at once and the next pass converges to the newer one.
                return version.generation
            self._failed = (version.generation, served)
            delay = RETRY_SECONDS[min(self._failures, len(RETRY_SECONDS) - 1)]
            self._retry_at = asyncio.get_running_loop().time() + delay
            self._failures += 1
            text = _with_notes(error)  # a failed cleanup (/resume, /continue_generation), too
            self.engines.failed(self.name, text)
            log.warning("engine_apply_failed", engine=self.name, version=version.version,
                        generation=version.generation, reason=error.reason, error=text, retry_seconds=delay,
                        **({"answer": error.answer} if error.answer else {}))
            return version.generation
        self._applied_generation, self._applied_label = version.generation, version.version
        self._failed, self._failures = None, 0
        self.engines.applied(self.name, version)
        log.info("engine_applied", engine=self.name, version=version.version, generation=version.generation)
        return version.generation

    async def _cleanup(self, failure: BaseException, calls: list[tuple[str, str, dict | None]]) -> None:
        """After `failure`, make the calls that leave the engine serving (resume generation, close an
        update) even so; bounded, since this also runs when the server stops mid-apply. A cleanup
        error is logged and attached to the failure as a note, never raised in its place."""
        async def run() -> None:
            for method, path, body in calls:
                try:
                    await self._call(method, path, body)
                except Exception as cleanup_error:  # noqa: BLE001 - reported with the original error
                    log.warning("engine_cleanup_failed", engine=self.name, call=f"{method} {path}",
                                error=str(cleanup_error), after=str(failure))
                    failure.add_note(f"and {path} failed too: {cleanup_error}")

        try:
            await asyncio.wait_for(run(), RESUME_AFTER_FAILURE_SECONDS)
        except TimeoutError:
            failure.add_note(f"and the cleanup took over {RESUME_AFTER_FAILURE_SECONDS} s")

    async def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        return await asyncio.get_running_loop().run_in_executor(None, self._http, method, path, body)

    def _http(self, method: str, path: str, body: dict | None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:  # noqa: S310 - operator's URL
                text = response.read(MAX_ANSWER_BYTES + 1)
        except urllib.error.HTTPError as error:
            detail = self._error_detail(read_error_answer(error))
            refused = EngineRefused(f"{method} {path}: HTTP {error.code}: {readable_detail(detail)}")
            if len(detail) > ERROR_DETAIL_MAX_CHARS:
                refused.answer = detail
            raise refused from None
        except (urllib.error.URLError, OSError) as error:
            raise EngineUnreachable(f"{method} {path}: {error}") from None
        except Exception as error:  # noqa: BLE001 - http.client's HTTPException (not HTTP at all) and the like
            raise EngineAnswerMalformed(f"{method} {path}: {type(error).__name__}: {error}") from None
        if len(text) > MAX_ANSWER_BYTES:
            raise EngineAnswerMalformed(f"{method} {path}: an answer over {MAX_ANSWER_BYTES} bytes")
        return parse_answer(method, path, text)

    def _error_detail(self, body: str) -> str:
        """What an error status's body says, for last_error."""
        return body
