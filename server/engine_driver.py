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
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.error
import urllib.request
from dataclasses import dataclass

import structlog

from weightsync.server.engines import EngineRegistry
from weightsync.server.publisher import Publisher

log = structlog.get_logger("weightsync.engine_driver")

POLL_SECONDS = 5.0
"""How often vLLM's version is checked between commits (a restarted vLLM is warm-started)."""
REQUEST_TIMEOUT_SECONDS = 300.0
RETRY_SECONDS = (5.0, 10.0, 30.0, 60.0, 300.0)
"""A version vLLM refused is tried again after these delays (then every 300 s), or at once when
vLLM restarts; a new commit is tried at once."""


class EngineUnreachable(Exception):
    pass


@dataclass(slots=True)
class VllmHttpDriver:
    name: str
    url: str
    publisher: Publisher
    engines: EngineRegistry
    local_socket: str
    worker_index: int = 0
    token: str = ""
    _task: asyncio.Task | None = None
    _initialized: bool = False
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

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        events = self.publisher.watchers.subscribe()
        try:
            while True:
                await self._converge()
                # Sleep until a new commit or the poll. Every other event (most of them engine-state
                # changes, our own included) is not a reason to call vLLM again: waking on those
                # would spin while vLLM is down or keeps refusing a version.
                seen = self.publisher.version.generation
                deadline = loop.time() + POLL_SECONDS
                while self.publisher.version.generation == seen and (left := deadline - loop.time()) > 0:
                    try:
                        await asyncio.wait_for(events.get(), left)
                    except TimeoutError:
                        break
        finally:
            self.publisher.watchers.unsubscribe(events)

    async def _converge(self) -> None:
        """Make vLLM serve the node's version, if it does not already."""
        version = self.publisher.version
        if version.generation == 0:
            return
        served = None
        try:
            served = (await self._call("GET", "/weight_info")).get("weight_version")
            if served != self._applied_label:
                # Not what we set last: a new instance (or a restart) holds its own weights: all of them.
                self._initialized, self._applied_generation, self._applied_label = False, -1, None
            if served == version.version and self._applied_generation == version.generation:
                return
            if self._failed == (version.generation, served) and asyncio.get_running_loop().time() < self._retry_at:
                return  # refused a moment ago, nothing changed since: wait before asking again
            self.engines.applying(self.name)
            await self._apply(version.version, version.generation)
        except EngineUnreachable as error:
            self._initialized = False
            self.engines.unreachable(self.name, str(error))
            return
        except RuntimeError as error:
            if "VERSION_GONE" in str(error):
                return  # a newer commit replaced it while vLLM read: its event brings us back at once
            self._failed = (version.generation, served)
            self._retry_at = asyncio.get_running_loop().time() + RETRY_SECONDS[min(self._failures,
                                                                                  len(RETRY_SECONDS) - 1)]
            self._failures += 1
            self.engines.failed(self.name, str(error))
            log.warning("engine_apply_failed", engine=self.name, version=version.version,
                        generation=version.generation, error=str(error))
            return
        self._applied_generation, self._applied_label = version.generation, version.version
        self._failed, self._failures = None, 0
        self.engines.applied(self.name, version)
        log.info("engine_applied", engine=self.name, version=version.version, generation=version.generation)

    async def _apply(self, label: str, generation: int) -> None:
        if not self._initialized:
            await self._call("POST", "/init_weight_transfer_engine", {"init_info": {
                "local_socket": self.local_socket, "worker": self.worker_index, "token": self.token}})
            self._initialized = True
        await self._call("POST", "/pause?mode=keep")
        try:
            await self._call("POST", "/start_weight_update")
            # vLLM's worker reads generation `generation` (VERSION_GONE if a newer commit replaced it)
            # and loads what was written since the one it serves; on an error it keeps its weights.
            await self._call("POST", "/update_weights", {"update_info": {
                "generation": generation, "since_generation": self._applied_generation}})
            await self._call("POST", "/finish_weight_update", {"weight_version": label})
        finally:
            await self._call("POST", "/resume")

    async def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        return await asyncio.get_running_loop().run_in_executor(None, self._http, method, path, body)

    def _http(self, method: str, path: str, body: dict | None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_SECONDS) as response:  # noqa: S310 - operator's URL
                text = response.read()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:1000]
            raise RuntimeError(f"{method} {path}: HTTP {error.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as error:
            raise EngineUnreachable(f"{method} {path}: {error}") from None
        return json.loads(text) if text else {}
