"""Drive a co-located vLLM server after each commit: `--engine vllm-http=URL`.

`--engine vllm-http=http://127.0.0.1:8000` points at a vLLM server started with
VLLM_SERVER_DEV_MODE=1 and `--weight-transfer-config '{"backend": "weightsync"}'`.
After every commit (and whenever vLLM reports another version than the node's,
e.g. it restarted: a warm start) the driver calls vLLM's weight-transfer routes:

    /init_weight_transfer_engine (once per vLLM instance)
    /start_weight_update,
    /update_weights {"update_info": {"generation": g, "since_generation": s, "phase": "prepare"}},
        (vLLM's ranks pin generation g twice and stage it beside the live model while vLLM keeps
        generating; the driver waits until each rank gives back the first of its two leases)
    /update_weights {"update_info": {"generation": g, "phase": "apply"}}   (the swap: vLLM's pause)
    /finish_weight_update {"weight_version": label}

vLLM's worker reads the node's store through weightsync.engine (the weightsync
backend: engine/vllm_backend.py, engine/vllm_prepare.py). No /pause and /resume:
vLLM runs each of these calls between two of its steps, and the apply loads a whole
version in one call, so generation never sees a half-loaded model; the pause is the
apply alone (docs/engines/vllm.md). What vLLM serves, and since when, goes to
GetServerInfo.engines and WatchWeights.

Every one of vLLM's workers (each tensor-parallel rank) attaches to the
node's local socket and reads the node's one host store, whatever GPU it and
the weightsync workers are on; driven ranks attach unnamed, and the driver
reports for the engine. The bearer token is read from the server's Credentials at each
initialization; after a SIGHUP reload vLLM is initialized again, so it
attaches with the current token.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from weightsync.common.logging import get_logger
from weightsync.server.credentials import Credentials
from weightsync.server.engines.driver import (
    EngineAnswerMalformed,
    EngineCallFailed,
    EngineRefused,
    HttpEngineDriver,
)
from weightsync.server.store.leases import LeaseTable

log = get_logger("weightsync.engine_driver")

STAGED_POLL_SECONDS = 0.005
"""How often the leases are looked at while vLLM's ranks stage a version."""


@dataclass(slots=True)
class VllmHttpDriver(HttpEngineDriver):
    """vLLM's weight-transfer routes (the module's docstring)."""

    local_socket: str
    credentials: Credentials
    leases: LeaseTable | None = None
    """The node's leases: the driver learns from them that vLLM's ranks staged a version. None: vLLM
    loads each version in one update_weights call (the pause then holds the load)."""
    _initialized: bool = field(default=False, kw_only=True)
    _initialized_at_reload: int = field(default=-1, kw_only=True)
    """credentials.reloads when vLLM was initialized: a later reload initializes it again."""

    kind = "vllm-http"

    @staticmethod
    def from_spec(spec: str, index: int, **parts) -> VllmHttpDriver:
        kind, _, url = spec.partition("=")
        return VllmHttpDriver(name=kind if index == 0 else f"{kind}-{index}", url=url.rstrip("/"), **parts)

    def _forget(self) -> None:
        self._initialized = False

    async def _served_label(self) -> str | None:
        served = (await self._call("GET", "/weight_info")).get("weight_version")
        if served is not None and not isinstance(served, str):
            raise EngineAnswerMalformed(f"GET /weight_info: weight_version is {type(served).__name__}, "
                                        f"not a string: {served!r}"[:300])
        return served

    async def _apply(self, label: str, generation: int) -> None:
        if self._initialized and self._initialized_at_reload != self.credentials.reloads:
            self._initialized = False  # the token may have changed: vLLM must attach with the current one
        if not self._initialized:
            reloads = self.credentials.reloads
            await self._call("POST", "/init_weight_transfer_engine", {"init_info": {
                "local_socket": self.local_socket, "token": self.credentials.token}})
            self._initialized, self._initialized_at_reload = True, reloads
        update = {"generation": generation, "since_generation": self._applied_generation}
        await self._call("POST", "/start_weight_update")
        # A failed update_weights ends vLLM's update session itself (its worker resets it), and vLLM keeps
        # serving what it served; a prepared version it never applies is dropped by its ranks (hold_s).
        if self.leases is None:
            await self._call("POST", "/update_weights", {"update_info": update})
        else:
            for attempt in (0, 1):
                await self._call("POST", "/update_weights", {"update_info": {**update, "phase": "prepare",
                                                                              "hold_s": self.timeout_s}})
                await self._staged(generation)
                try:
                    await self._call("POST", "/update_weights", {"update_info": {**update, "phase": "apply"}})
                    break
                except EngineRefused as refused:
                    # A preparation can be gone by the apply (vLLM attached again, a newer prepare, its hold):
                    # vLLM's failed call ended its session; prepare once more.
                    if attempt or "NOT_PREPARED" not in str(refused):
                        raise
                    log.warning("engine_not_prepared", engine=self.name, generation=generation)
                    await self._call("POST", "/start_weight_update")
        await self._call("POST", "/finish_weight_update", {"weight_version": label})

    async def _staged(self, generation: int) -> None:
        """Until each vLLM rank staged `generation`: each rank's connection holds two leases on it when the
        prepare call returns (engine/vllm_prepare.py) and gives the first back once staged or failed (the
        apply then says which). A connection holding one is another reader, or a rank already done."""
        reading = reading_leases(self.leases.leases, generation)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while reading & self.leases.leases.keys():
            if loop.time() > deadline:
                raise EngineCallFailed(f"vLLM's ranks did not stage generation {generation} within "
                                       f"{self.timeout_s:g} s")
            await asyncio.sleep(STAGED_POLL_SECONDS)


def reading_leases(leases: dict, generation: int) -> set[int]:
    """The leases vLLM's ranks read `generation` with, right after the prepare call: the first (lowest id) of
    each connection that holds two or more on it; a connection holding one is another reader, or a rank
    that already staged."""
    held: dict[int, list[int]] = {}
    for lease_id, lease in leases.items():
        if lease.generation == generation:
            held.setdefault(lease.owner, []).append(lease_id)
    return {min(ids) for ids in held.values() if len(ids) >= 2}
