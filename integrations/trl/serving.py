"""Which engine serves TRL's generations, and waiting until it serves a committed version.

TRL generates right after a sync: returning before vLLM took the new weights would make it
sample from the old policy without anyone noticing. So a sync ends only once the server
reports (GetServerInfo.engines) that the engine serves the pushed generation, and it ends
with an error, not a hang, when vLLM refuses it or does not take it within the timeout.
Pure functions over the protos plus an injected fetch/clock: testable without servers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

from weightsync.integrations.trl.errors import WeightSyncTrlError
from weightsync.v1 import weight_sync_service_pb2 as pb

DRIVEN_KIND = "vllm-http"
LOOPBACK = {"localhost", "127.0.0.1", "::1", "0.0.0.0", "::"}
"""Names of this host as TRL and the server may write them (TRL's default host is 0.0.0.0)."""


def canonical_url(url: str) -> str:
    """scheme://host:port/path, loopback names as 127.0.0.1, default ports explicit, no trailing slash."""
    parts = urlsplit(url.strip() if "://" in url else "http://" + url.strip())
    scheme = (parts.scheme or "http").lower()
    host = (parts.hostname or "").lower()
    host = "127.0.0.1" if host in LOOPBACK else host
    port = parts.port or (443 if scheme == "https" else 80)
    host = f"[{host}]" if ":" in host else host
    return f"{scheme}://{host}:{port}{parts.path.rstrip('/')}"


def find_engine(engines: Sequence[pb.EngineStatus], vllm_url: str, name: str | None, server: str) -> str:
    """The name of the engine that serves `vllm_url`: the one called `name`, or the driven
    (vllm-http) engine whose URL is vllm_url. Raises ENGINE_NOT_FOUND saying what to start."""
    if name is not None:
        for engine in engines:
            if engine.name == name:
                return engine.name
        raise WeightSyncTrlError("ENGINE_NOT_FOUND", f"the weightsync server {server} has no engine named {name!r} "
                                 f"(it has {', '.join(repr(e.name) for e in engines) or 'none'})")
    wanted = canonical_url(vllm_url)
    for engine in engines:
        if engine.kind == DRIVEN_KIND and canonical_url(engine.endpoint) == wanted:
            return engine.name
    driven = [e.endpoint for e in engines if e.kind == DRIVEN_KIND]
    raise WeightSyncTrlError(
        "ENGINE_NOT_FOUND",
        f"the weightsync server {server} does not drive the vLLM at {vllm_url} that TRL generates with "
        f"(it drives {', '.join(driven) or 'no vLLM'}): start it with --engine vllm-http={vllm_url}, "
        "or name its engine in WeightSyncConfig(engine=...)")


def _engine(engines: Sequence[pb.EngineStatus], name: str) -> pb.EngineStatus | None:
    return next((e for e in engines if e.name == name), None)


def serving_outcome(status: pb.EngineStatus | None, generation: int, before: pb.EngineStatus | None,
                    label: str) -> pb.EngineStatus | WeightSyncTrlError | None:
    """One look at the engine after committing `generation`: the status once it serves it, an
    error once it refused it, None while undecided.

    FAILED counts as a refusal of this version only when it is news: a failure that was already
    reported before the push (same error) belongs to an older version the driver has not
    retried yet, and the driver tries a new commit at once.
    """
    if status is None:
        return WeightSyncTrlError("ENGINE_NOT_FOUND", "the engine left the server's list while it applied "
                                  f"{label!r}")
    if status.state == pb.ENGINE_STATE_SERVING and status.applied_version.generation >= generation:
        return status
    if status.state == pb.ENGINE_STATE_FAILED and status.applied_version.generation < generation:
        stale = (before is not None and before.state == pb.ENGINE_STATE_FAILED
                 and before.last_error == status.last_error)
        if not stale:
            serving = status.applied_version.version or "its own checkpoint"
            return WeightSyncTrlError("ENGINE_FAILED", f"vLLM did not take {label!r} and keeps serving "
                                      f"{serving!r}: {status.last_error}")
    return None


def wait_serving(
    fetch: Callable[[], Sequence[pb.EngineStatus]],
    name: str,
    generation: int,
    label: str,
    *,
    before: pb.EngineStatus | None,
    timeout: float,
    interval: float = 0.05,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> pb.EngineStatus:
    """Poll until engine `name` serves `generation` (returns its status) or raise
    ENGINE_FAILED / ENGINE_TIMEOUT within `timeout` seconds."""
    deadline = clock() + timeout
    status = None
    while True:
        status = _engine(fetch(), name)
        outcome = serving_outcome(status, generation, before, label)
        if isinstance(outcome, WeightSyncTrlError):
            raise outcome
        if outcome is not None:
            return outcome
        if clock() >= deadline:
            state = pb.EngineState.Name(status.state) if status is not None else "gone"
            detail = f"; last error: {status.last_error}" if status is not None and status.last_error else ""
            raise WeightSyncTrlError("ENGINE_TIMEOUT", f"vLLM did not serve {label!r} (generation {generation}) "
                                     f"within {timeout:g} s: engine {name!r} is {state}{detail}")
        sleep(interval)
