"""A vLLM worker's update in two calls: prepare while the engine serves, apply in its pause.

update_weights {"phase": "prepare"} (one short call between two engine steps) pins the
version twice (two leases: L1 to read it, L2 to hold it until the apply) and returns; a
thread of this worker then, while vLLM keeps stepping, checks every name and shape against
the model, and loads and processes the version into a staged shadow of the model
(engine/vllm_staging.py). When it is done it gives L1 back without applying: a rank attached
under a name then leaves APPLYING in GetServerInfo.engines, which is how a caller outside
vLLM learns that every rank is ready; the driver in the server watches the leases themselves
(each connection that held two on the version when the call returned: its first one). update_weights {"phase":
"apply"} then swaps the staged layers in (a copy of their processed tensors) and releases L2
as applied: that call is the whole pause.

    prepare ─▶ L1, L2 held: checking, staging (vLLM serves) ─▶ L1 released: ready
         ─▶ apply: swap, L2 released applied ─▶ serving the new version
    a failure while staging: L1 released with the error (the rank shows FAILED and why);
    the apply then raises it. A version that cannot be staged (no room, a layer vLLM
    processes only at finalize) is loaded in the apply instead, from L2's bytes.
    no apply within hold_s: the preparation is dropped and L2 released (an IN_PLACE push
    waits for it otherwise); the apply then raises NOT_PREPARED.

One preparation at a time per worker: a prepare replaces the one before (released unapplied).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from weightsync.engine.client import EngineClient, EngineError, StoreSnapshot
from weightsync.engine.vllm_staging import StagedModel

HOLD_SECONDS = 120.0
"""How long a prepared version waits for its apply before it is dropped (update_info "hold_s")."""


class PrepareFailed(Exception):
    """Staging ended with a typed failure (reason, detail): the apply raises it."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(slots=True)
class Preparation:
    """One version being (or done being) staged beside the live model."""

    reading: StoreSnapshot
    """L1: held while the version is read and staged; released (not applied) once staged."""
    request: Any
    """The update_info of the prepare (what to check and load)."""
    stats: Any
    """The apply's statistics, filled from the staging on."""
    hold_s: float
    pinned: StoreSnapshot | None = None
    """L2: held from the prepare call to the apply (released applied), or to the drop."""
    names: list[str] = field(default_factory=list)
    staged: StagedModel | None = None
    fallback: str = ""
    """Why the version was not staged: the apply loads it in the pause instead ("" when staged)."""
    failure: PrepareFailed | None = None
    prepare_s: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)
    dropped: bool = False
    expiry: threading.Timer | None = None

    @property
    def generation(self) -> int:
        return self.reading.generation

    def release_all(self, *, error: str = "") -> None:
        for snapshot in (self.reading, self.pinned):
            if snapshot is not None and not snapshot.released:
                release_quietly(snapshot, error)
        self.staged = None


def release_quietly(snapshot: StoreSnapshot, error: str = "") -> None:
    """Give a lease back unapplied; a failure to do so (the connection is gone) is not the caller's error:
    the lease goes with the connection anyway."""
    try:
        snapshot.release(applied=False, error=error)
    except (EngineError, OSError):
        pass


class Preparations:
    """The worker's one preparation and its background thread (see the module doc).

    stage(preparation) runs in the thread: it fills names, staged or fallback, or raises PrepareFailed;
    everything else (the leases, the hold, replacing and dropping) is done here."""

    def __init__(self, stage: Callable[[Preparation], None]) -> None:
        self._stage = stage
        self._lock = threading.Lock()
        self._current: Preparation | None = None

    def start(self, client: EngineClient, reading: StoreSnapshot, request: Any, stats: Any) -> Preparation:
        """Stage the version `reading` pins, in the background; replaces (drops) the one before. Pins it a
        second time first (L2, in the caller's call): a watcher that sees both leases of this connection
        when the call returned waits for the first one only, whatever the staging's speed."""
        self.drop("a newer prepare replaced it")
        preparation = Preparation(reading, request, stats, request.hold_s)
        try:
            preparation.pinned = client.acquire(generation=reading.generation, wait=request.wait_s)
        except BaseException:
            release_quietly(reading)
            raise
        with self._lock:
            self._current = preparation
        threading.Thread(target=self._run, args=(client, preparation), daemon=True,
                         name=f"weightsync-stage-g{reading.generation}").start()
        return preparation

    def _run(self, client: EngineClient, preparation: Preparation) -> None:
        started = time.perf_counter()
        try:
            self._stage(preparation)
            preparation.reading.release(applied=False)  # L1: what tells a watcher that this rank is ready
        except PrepareFailed as failure:
            preparation.failure = failure
        except EngineError as error:
            preparation.failure = PrepareFailed(error.reason, str(error).partition(": ")[2] or str(error))
        except BaseException as error:  # noqa: BLE001 - reported by the apply, typed
            preparation.failure = PrepareFailed("LOAD_FAILED", f"{type(error).__name__}: {error}")
        preparation.prepare_s = time.perf_counter() - started
        if preparation.failure is not None:
            preparation.release_all(error=f"{preparation.failure.reason}: {preparation.failure.detail}")
        with self._lock:
            preparation.done.set()
            if preparation.dropped:
                preparation.release_all()
            elif preparation.failure is None:
                preparation.expiry = threading.Timer(preparation.hold_s, self._expire, args=(preparation,))
                preparation.expiry.daemon = True
                preparation.expiry.start()

    def _expire(self, preparation: Preparation) -> None:
        with self._lock:
            if self._current is not preparation:
                return
            self._current = None
            preparation.dropped = True
        preparation.release_all()

    def take(self, generation: int, wait_s: float) -> Preparation:
        """The preparation of `generation` (0: whichever there is), once staged: it is the caller's from then
        on (to swap in and release). Raises PrepareFailed: NOT_PREPARED (none, another generation, dropped),
        PREPARE_TIMEOUT (still staging after wait_s; it goes on), or the staging's own failure."""
        with self._lock:
            preparation = self._current
        if preparation is None or (generation and preparation.generation != generation):
            have = "none" if preparation is None else f"generation {preparation.generation}"
            raise PrepareFailed("NOT_PREPARED", f"no preparation of generation {generation or 'current'} (this "
                                "rank holds " + have + "): send update_weights with phase 'prepare' first")
        if not preparation.done.wait(wait_s):
            raise PrepareFailed("PREPARE_TIMEOUT", f"generation {preparation.generation} is still being staged "
                                f"after {wait_s:g} s; it goes on: apply again later")
        with self._lock:
            if self._current is not preparation or preparation.dropped:
                raise PrepareFailed("NOT_PREPARED", f"the preparation of generation {preparation.generation} was "
                                    f"dropped (not applied within {preparation.hold_s:g} s)")
            self._current = None
            if preparation.expiry is not None:
                preparation.expiry.cancel()
        if preparation.failure is not None:
            raise preparation.failure
        return preparation

    def drop(self, why: str) -> None:
        """Forget the current preparation, releasing its leases unapplied (at the end of its staging, if
        that is still running)."""
        del why  # logged by the caller where it matters
        with self._lock:
            preparation, self._current = self._current, None
            if preparation is None:
                return
            preparation.dropped = True
            if preparation.expiry is not None:
                preparation.expiry.cancel()
            finished = preparation.done.is_set()
        if finished:
            preparation.release_all()
