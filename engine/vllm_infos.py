"""What vLLM hands the weightsync backend (init_info, update_info), checked, and what it reports.

engine/vllm_backend.py parses these from the dictionaries of vLLM's weight-transfer calls; a bad
value is a ValueError naming the field, raised before anything is touched.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

from weightsync.engine.vllm_prepare import HOLD_SECONDS

ENGINE_NAME = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}$")


class WeightSyncUpdateError(RuntimeError):
    """An update that was not applied: the engine serves what it served before. `reason` is
    machine-readable (TENSOR_NOT_IN_MODEL, TENSOR_MISMATCH, VERSION_GONE, STORE_EMPTY, ...)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.detail = message

    def __reduce__(self):  # survives pickling between vLLM processes
        return (type(self), (self.reason, self.detail))


def _int(value: object, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass
class WeightSyncInitInfo(WeightTransferInitInfo):
    """How the worker reaches the node's store (init_weight_transfer_engine's init_info)."""

    local_socket: str = ""
    """The server's local socket (GetServerInfo.local_socket); or give `server`."""
    server: str = ""
    """The server's gRPC address (host:port); its local socket is looked up."""
    worker: int = -1
    """Ignored: the node has one store, which every tensor-parallel rank reads (kept so that drivers of
    older servers, which name a worker, still attach)."""
    engine_name: str = ""
    """Empty when the server drives this vLLM (--engine) and reports for it; else the name the
    server shows in GetServerInfo.engines (kind "local") for the first rank; every other
    model-parallel rank shows as NAME:tpR (engine/vllm_ranks.py: rank_engine_name)."""
    token: str = ""
    """The server's bearer token, if it has one."""
    timeout_s: float = 60.0
    """Connect/request timeout towards the server."""

    def __post_init__(self) -> None:
        for name in ("local_socket", "server", "engine_name", "token"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"init_info.{name} must be a string, got {getattr(self, name)!r}")
        if bool(self.local_socket) == bool(self.server):
            raise ValueError("init_info needs exactly one of local_socket (the server's unix socket) "
                             "and server (its gRPC host:port)")
        if self.local_socket and not os.path.isabs(self.local_socket):
            raise ValueError(f"init_info.local_socket must be an absolute path, got {self.local_socket!r}")
        if self.server and not ADDRESS.match(self.server):
            raise ValueError(f"init_info.server must be host:port, got {self.server!r}")
        self.worker = _int(self.worker, "init_info.worker", -1)
        if self.engine_name and not ENGINE_NAME.match(self.engine_name):
            raise ValueError("init_info.engine_name must be empty or 1 to 128 characters of [A-Za-z0-9._:-], "
                             f"got {self.engine_name!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int | float) or not self.timeout_s > 0:
            raise ValueError(f"init_info.timeout_s must be a positive number, got {self.timeout_s!r}")


PHASES = ("load", "prepare", "apply")


@dataclass
class WeightSyncUpdateInfo(WeightTransferUpdateInfo):
    """Which committed version to apply (update_weights' update_info)."""

    generation: int = 0
    """The version to apply: 0 = the store's current one; else exactly that generation."""
    since_generation: int = -1
    """The generation this engine serves now: only tensors written after it are loaded
    (-1: every tensor, a warm start)."""
    wait_s: float = 30.0
    """How long to wait while an IN_PLACE update is writing the store."""
    strict: bool = True
    """False: skip tensors the model does not have instead of refusing the version."""
    phase: str = "load"
    """"load": read, check and load the version in this one call (the engine does not step meanwhile).
    "prepare": pin the version and return; this rank checks and stages it while the engine serves
    (engine/vllm_prepare.py). "apply": swap the prepared version in (the pause is this call)."""
    hold_s: float = HOLD_SECONDS
    """prepare: how long the prepared version waits for its apply before it is dropped."""

    def __post_init__(self) -> None:
        self.generation = _int(self.generation, "update_info.generation", 0)
        self.since_generation = _int(self.since_generation, "update_info.since_generation", -1)
        if self.generation and self.since_generation >= self.generation:
            raise ValueError(f"update_info.since_generation ({self.since_generation}) must be below "
                             f"generation ({self.generation})")
        if isinstance(self.wait_s, bool) or not isinstance(self.wait_s, int | float) or self.wait_s < 0:
            raise ValueError(f"update_info.wait_s must be a number >= 0, got {self.wait_s!r}")
        if not isinstance(self.strict, bool):
            raise ValueError(f"update_info.strict must be a boolean, got {self.strict!r}")
        if self.phase not in PHASES:
            raise ValueError(f"update_info.phase must be one of {', '.join(PHASES)}, got {self.phase!r}")
        if isinstance(self.hold_s, bool) or not isinstance(self.hold_s, int | float) or not self.hold_s > 0:
            raise ValueError(f"update_info.hold_s must be a positive number, got {self.hold_s!r}")


@dataclass
class ApplyStats:
    """What the last update_weights did (logged; tests and benchmarks read it in-process)."""

    version: str = ""
    generation: int = 0
    tensors: int = 0
    bytes: int = 0
    skipped: list[str] = field(default_factory=list)
    completed_from_store: int = 0
    """Tensors loaded beyond the changed ones, to complete fused layers."""
    acquire_s: float = 0.0
    check_s: float = 0.0
    load_s: float = 0.0
    finalize_s: float = 0.0
    total_s: float = 0.0
    """The update_weights call that applied it: the engine's pause."""
    prepared_s: float = 0.0
    """Prepared updates: checking and staging, while the engine served (0 for phase "load")."""
    swap_s: float = 0.0
    """Prepared and staged: copying the staged layers into the live model."""
    staged: bool = False
    fallback: str = ""
    """Prepared but not staged: why (the apply loaded it instead)."""
    apply_started: float = 0.0
    apply_ended: float = 0.0
    """The applying call on CLOCK_MONOTONIC (time.monotonic), comparable across the node's processes."""
