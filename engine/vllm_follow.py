"""Keep an offline `vllm.LLM` at the node's latest committed version.

    from vllm import LLM
    from weightsync.engine.vllm_follow import follow

    llm = LLM(model=..., weight_transfer_config={"backend": "weightsync"}, ...)
    follower = follow(llm, server="127.0.0.1:50051", name="rollout-0")
    while training:
        follower.apply_pending()          # between generate calls: applies a newer version, if any
        outputs = llm.generate(prompts, params)

`follow` connects once (init_weight_transfer_engine in each of vLLM's
workers: every tensor-parallel rank maps the node's one store read-only and
loads its own shard with vLLM's load_weights; the first rank attaches as
engine `name`, the others as `name`:tpR, and GetServerInfo.engines shows
each, kind "local", with the version it serves). `apply_pending()` asks the
server for its committed version (a cheap local-socket call) and, when it is
newer than what vLLM serves, runs vLLM's own weight-update calls:
start_weight_update, update_weights({"update_info": {"generation": g,
"since_generation": applied}}) (only the tensors written since, read from
the node's shared memory) and finish_weight_update(weight_version=label),
so `llm.get_weight_version()` is the pushed label. The first call applies
every tensor (a warm start from the node's store). A version that fails is
not retried; the next commit is; vLLM keeps serving what it served.

Threading: `LLM.generate` is synchronous and `LLM` is not thread-safe (the
engine client's sockets, and with VLLM_ENABLE_V1_MULTIPROCESSING=0 the
model itself). An update must never run while generate does. Either call
`apply_pending()` from the thread that calls generate, between calls; or
start the background mode (`follow(..., background=True)` or `.start()`)
and run every generate under the follower's lock: `follower.generate(...)`
or `with follower.serving(): llm.generate(...)`. The background thread
polls every `poll` seconds and applies under the same lock.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import re
import threading
from collections.abc import Iterator

from weightsync.engine.client import EngineClient
from weightsync.engine.vllm_backend import WeightSyncUpdateError
from weightsync.v1 import weight_sync_service_pb2 as pb

log = logging.getLogger("weightsync.engine.vllm_follow")

_REASON = re.compile(r"\b([A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+): ")
_READABLE = (pb.STORE_STATE_CONSISTENT, pb.STORE_STATE_UPDATING)  # UPDATING: a STAGED update; live bytes are whole
VERSION_GONE_RETRIES = 5
"""How many times apply_pending goes on to a newer version when a commit replaced the one being read."""


class VllmFollower:
    """Applies the node's newer committed versions to an offline vllm.LLM (see the module doc)."""

    def __init__(self, llm, *, server: str | None = None, socket_path: str | None = None, name: str = "vllm",
                 worker: int = -1, token: str | None = None, timeout: float = 60.0, strict: bool = True) -> None:
        self.llm = llm
        self.name = name
        self.strict = strict
        self.lock = threading.RLock()
        """Held while an update runs; hold it around generate in background mode."""
        self.applied_generation = -1
        self.applied_version = ""
        self.last_error = ""
        """Why the last failed version was not applied ("" after a success)."""
        self._failed_generation = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        # This connection only reads the version and store state (this process may have no GPU at all).
        # vLLM's workers attach on their own (the first rank as `name`, the others as `name`:tpR):
        # every rank maps the node's one store.
        self._status = EngineClient(server=server, socket_path=socket_path, name="",
                                    token=token, timeout=timeout)
        try:
            llm.init_weight_transfer_engine({"init_info": {
                "local_socket": self._status.socket_path, "worker": worker,
                "engine_name": name, "token": token or "", "timeout_s": timeout}})
        except BaseException:
            self._status.close()
            raise

    # -- foreground ----------------------------------------------------------------------
    def pending(self) -> pb.WeightVersion | None:
        """The committed version vLLM should apply next, or None."""
        status = self._status.status()
        generation = status.version.generation
        if (generation == 0 or generation <= self.applied_generation or generation == self._failed_generation
                or status.store_state not in _READABLE):
            return None
        return status.version

    def apply_pending(self, *, raise_errors: bool = False) -> bool:
        """Apply the node's committed version if it is newer than vLLM's; True if it did.

        Call between generate calls (never concurrently with one). A failed version leaves vLLM
        serving what it served; it is recorded in `last_error` (and raised as
        WeightSyncUpdateError with raise_errors) and not tried again. A version a newer commit
        replaced while vLLM read it (VERSION_GONE: with tensor parallelism, some ranks may have
        applied it) is followed at once by the newer one, so every rank serves one version again
        before this returns. A store an update kept busy past the lease wait (STORE_UPDATING)
        is tried again at the next call.
        """
        with self.lock:
            for _ in range(VERSION_GONE_RETRIES + 1):
                version = self.pending()
                if version is None:
                    return False
                try:
                    self.llm.start_weight_update()
                    # On an error vLLM's worker closes the session itself (and our backend rolled back).
                    self.llm.update_weights({"update_info": {
                        "generation": version.generation, "since_generation": self.applied_generation,
                        "strict": self.strict}})
                    self.llm.finish_weight_update(weight_version=version.version)
                except Exception as error:  # noqa: BLE001 - reported, and the engine still serves
                    text = str(error)
                    reason = error.reason if isinstance(error, WeightSyncUpdateError) else (
                        m.group(1) if (m := _REASON.search(text)) else "LOAD_FAILED")
                    if reason == "VERSION_GONE":
                        # A newer commit replaced it while the ranks read it: with tensor parallelism one
                        # rank may have applied it and another not. Apply the newer one now (all that was
                        # written since the version every rank serves), before vLLM generates again.
                        continue
                    if reason == "STORE_UPDATING":
                        # An update kept the store busy past the lease wait: the version is fine, try later.
                        self.last_error = text
                        log.warning("vLLM did not apply %s yet: %s", version.version, text)
                        return False
                    self._failed_generation = version.generation
                    self.last_error = text
                    log.warning("vLLM did not apply %s (generation %d): %s", version.version, version.generation,
                                text)
                    if raise_errors:
                        raise WeightSyncUpdateError(reason, text) from error
                    return False
                self.applied_generation = version.generation
                self.applied_version = version.version
                self.last_error = ""
                return True
            log.warning("vLLM did not apply a version: %d newer commits replaced it while it read; its ranks may "
                        "serve different versions until the next apply", VERSION_GONE_RETRIES + 1)
            return False

    # -- background -------------------------------------------------------------------------
    def start(self, poll: float = 0.2) -> VllmFollower:
        """Poll and apply in a thread; every generate must then hold `lock` (see serving())."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, args=(poll,), name=f"vllm-follow-{self.name}",
                                            daemon=True)
            self._thread.start()
            # A daemon thread still applying (torch ops) when the interpreter finalizes aborts the
            # process (see common.patch_kernels.warm_up_in_background): exit stops it first.
            atexit.register(self.stop)
        return self

    def _loop(self, poll: float) -> None:
        while not self._stop.wait(poll):
            try:
                self.apply_pending()
            except Exception as error:  # noqa: BLE001 - the server went away: keep trying
                log.warning("vLLM follower: %s", error)

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """Hold off updates while the body runs (wrap generate calls in background mode)."""
        with self.lock:
            yield

    def generate(self, *args, **kwargs):
        """llm.generate under the follower's lock."""
        with self.lock:
            return self.llm.generate(*args, **kwargs)

    def stop(self) -> None:
        """Stop the background thread (apply_pending still works)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            atexit.unregister(self.stop)

    def close(self) -> None:
        """Stop the background thread and the status connection (vLLM's worker keeps its own)."""
        self.stop()
        self._status.close()

    def __enter__(self) -> VllmFollower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def follow(llm, *, server: str | None = None, socket_path: str | None = None, name: str = "vllm",
           poll: float = 0.2, background: bool = False, worker: int = -1, token: str | None = None,
           timeout: float = 60.0, strict: bool = True) -> VllmFollower:
    """Connect `llm` (started with weight_transfer_config={"backend": "weightsync"}) to the node's
    server (gRPC `server` address, or its `socket_path`) and return its follower. With
    background=True a thread applies new versions every `poll` seconds (generate under its lock)."""
    follower = VllmFollower(llm, server=server, socket_path=socket_path, name=name, worker=worker, token=token,
                            timeout=timeout, strict=strict)
    if background:
        follower.start(poll)
    return follower
