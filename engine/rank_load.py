"""What every TP rank of an engine that loads from the node's store does, whichever engine it is
(SGLang's loader, engine/sglang/loader.py; LMDeploy's, engine/lmdeploy/loader.py).

A rank:

  1. attaches to the node's store on first use (an EngineClient, read-only mapping of the
     server's arenas) under the name its place gives (NAME for rank 0, NAME:tpR for the others),
     so GetServerInfo.engines shows what each rank serves; when that connection broke (the
     weightsync server stopped or restarted), it attaches again, looking the server's local
     socket up anew (a restarted server listens on a new one), until the request's wait_s is out;
     what it holds as loaded counts only in the store it was loaded from (a restarted server's
     store is a new one: the rank's next load takes every tensor);
  2. acquires the version the request names (a lease), and checks every tensor written since the
     older of the request's since_generation and the rank's own record against the model (the
     engine's ModelNames: which parameter a name loads into, and whether its shape fits) before a
     byte moves;
  3. agrees with the other ranks over the engine's TP CPU (Gloo) group: if any rank refused, no
     rank loads a byte, and every rank's message says why;
  4. lets the engine feed its model, agrees again, and releases the lease saying whether it
     applied (with the error where it did not).

RankLoader holds that sequence; an engine's subclass says how a request arrives, how its model's
names resolve, how the ranks' outcomes read in its message, and how its model is fed.

A refusal raises LoadError (reason and message). Reasons: REQUEST_MALFORMED, CONFIG_INVALID,
SERVER_UNREACHABLE, the store's own (VERSION_GONE, STORE_EMPTY, ...), TENSOR_NOT_IN_MODEL,
TENSOR_MISMATCH, RANK_REFUSED (another rank refused; nothing loaded), RANK_VERSIONS_DIFFER (SGLang:
the ranks acquired different versions; nothing loaded) and LOAD_FAILED (the feed raised part-way:
the rank's weights are a mix, and its next load takes every tensor).

Importing this module imports no engine.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from weightsync.common.logging import get_logger
from weightsync.engine.client import EngineClient, EngineError, StoreSnapshot
from weightsync.engine.request import UpdateRequest

ENGINE_NAME = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}$")
# The fused parameters of SGLang's and LMDeploy's dense models and the checkpoint tensors each is
# made of, where a model class does not say (its own `packed_modules_mapping` wins).
DEFAULT_PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# Checkpoint tensors the engines' loaders drop on purpose.
DROPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
RECONNECTABLE = ("SERVER_UNREACHABLE", "DEADLINE_EXCEEDED")
"""Attaching failed for a server that did not answer (stopped, restarting): tried again within wait_s."""
RECONNECT_POLL_S = 0.25
"""How often a rank tries again to attach while the server does not answer."""


class LoadError(RuntimeError):
    """A version this rank did not load; `reason` is machine-readable."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.detail = message


@dataclass(frozen=True, slots=True, kw_only=True)
class AttachConfig:
    """Where a rank finds the node's store (read once from the environment); an engine's subclass
    names the engine (ENGINE, and engine_name's default)."""

    ENGINE: ClassVar[str] = "the engine"
    """Whose processes the environment is set for, in messages ("SGLang", "LMDeploy")."""

    server: str = ""
    """The weightsync server's gRPC host:port (its local socket is looked up); or local_socket."""
    local_socket: str = ""
    """The server's unix socket (GetServerInfo.local_socket)."""
    engine_name: str = "engine"
    """Rank 0's name in GetServerInfo.engines; rank R of tensor parallelism is NAME:tpR."""
    token: str = ""
    """The server's bearer token, if it has one."""
    timeout_s: float = 60.0
    """Connect/request timeout towards the server."""

    def __post_init__(self) -> None:
        if bool(self.server) == bool(self.local_socket):
            raise LoadError("CONFIG_INVALID", "set exactly one of WEIGHTSYNC_SERVER (host:port) and "
                            f"WEIGHTSYNC_LOCAL_SOCKET (the server's unix socket) for {self.ENGINE}'s processes")
        if self.server and not ADDRESS.match(self.server):
            raise LoadError("CONFIG_INVALID", f"WEIGHTSYNC_SERVER must be host:port, got {self.server!r}")
        if self.local_socket and not os.path.isabs(self.local_socket):
            raise LoadError("CONFIG_INVALID", f"WEIGHTSYNC_LOCAL_SOCKET must be an absolute path, "
                            f"got {self.local_socket!r}")
        if not ENGINE_NAME.match(self.engine_name):
            raise LoadError("CONFIG_INVALID", "WEIGHTSYNC_ENGINE_NAME must be 1 to 128 characters of "
                            f"[A-Za-z0-9._:-], got {self.engine_name!r}")

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> AttachConfig:
        default = cls.__dataclass_fields__["engine_name"].default
        return cls(server=environ.get("WEIGHTSYNC_SERVER", ""), local_socket=environ.get("WEIGHTSYNC_LOCAL_SOCKET", ""),
                   engine_name=environ.get("WEIGHTSYNC_ENGINE_NAME", "") or default,
                   token=environ.get("WEIGHTSYNC_TOKEN", ""))


class Place(Protocol):
    """A rank's place in its engine's parallel groups (each engine's RankPlace)."""

    @property
    def tp_size(self) -> int: ...

    @property
    def group(self) -> object | None:
        """The engine's TP CPU (Gloo) process group; None with one rank."""

    @property
    def label(self) -> str: ...

    def engine_name(self, name: str) -> str: ...


class Names(Protocol):
    """What a rank checks a stored tensor against (each engine's ModelNames)."""

    model_class: str

    def target(self, name: str) -> str | None:
        """The parameter `name` loads into; None: the engine drops it on purpose; "": not the model's."""

    def shape_problem(self, name: str, tensor: torch.Tensor) -> str | None:
        """Why `tensor` does not fit as `name`; None: it fits (or is not checked)."""


@dataclass
class ApplyStats:
    """What one load did on this rank."""

    rank: str = ""
    version: str = ""
    generation: int = 0
    since_generation: int = -1
    tensors: int = 0
    bytes: int = 0
    skipped: list[str] = field(default_factory=list)
    acquire_s: float = 0.0
    check_s: float = 0.0
    load_s: float = 0.0

    def summary(self) -> str:
        skipped = f", skipped {len(self.skipped)} stale unknown tensor(s)" if self.skipped else ""
        return (f"weightsync {self.rank}: loaded version {self.version!r} (generation {self.generation}) since "
                f"generation {self.since_generation}: {self.tensors} tensors, {self.bytes} bytes in "
                f"{self.acquire_s + self.check_s + self.load_s:.3f} s{skipped}")


Feed = Callable[[torch.nn.Module, StoreSnapshot, list[str], ApplyStats], None]
"""An engine's feed of the selected tensors into its model (raises: LOAD_FAILED)."""


class RankLoader:
    """One rank's connection to the node's store and what its model holds; an engine's subclass
    sets ENGINE and logger and supplies the hooks below."""

    ENGINE: ClassVar[str] = "engine"
    """The prefix of this engine's log events (sglang_update_loaded, ...)."""
    logger: ClassVar[Any] = get_logger("weightsync.engine")

    def __init__(self, config: Callable[[], AttachConfig], place: Place, model_path: str = "") -> None:
        self._config_source = config
        self.config: AttachConfig | None = None
        self.place = place
        self.model_path = model_path
        self.client: EngineClient | None = None
        self.served: dict[int, tuple[int, int]] = {}
        """id(model) -> (store epoch, generation) it holds as loaded from that store (absent: unknown)."""
        self._names: dict[int, Names] = {}
        self.last: ApplyStats | None = None

    # -- the engine's hooks --------------------------------------------------------------
    def _request(self, raw: object) -> UpdateRequest:
        """The request `raw` carries; raises LoadError (REQUEST_MALFORMED) if it carries none."""
        raise NotImplementedError

    def _model_names(self, model: torch.nn.Module) -> Names:
        raise NotImplementedError

    def _attach_options(self, model: torch.nn.Module) -> dict[str, str]:
        """Extra EngineClient arguments for this model (also logged when attached)."""
        return {}

    def _verdicts(self, verdict: str, generation: int) -> Sequence[tuple]:
        """Every rank's outcome of one step (verdict "" = fine), in rank order; this rank acquired
        `generation` (-1: none)."""
        raise NotImplementedError

    def _refusal(self, own: LoadError | None, verdicts: Sequence[tuple],
                 snapshot: StoreSnapshot | None) -> LoadError | None:
        """Why no rank loads (`own`: this rank's refusal); None when every rank may load."""
        raise NotImplementedError

    def _failure(self, loads: Sequence[tuple], snapshot: StoreSnapshot) -> str | None:
        """The message of a load some rank failed part-way; None when every rank loaded."""
        raise NotImplementedError

    # -- one load ----------------------------------------------------------------------
    def names(self, model: torch.nn.Module) -> Names:
        key = id(model)
        if key not in self._names:
            self._names[key] = self._model_names(model)
        return self._names[key]

    def _load(self, model: torch.nn.Module, raw: object, feed: Feed) -> ApplyStats:
        """Load the version `raw` names into `model` with `feed`, or raise LoadError having loaded
        nothing (every rank agrees first) or, for LOAD_FAILED, part of it."""
        stats = ApplyStats(rank=self.place.label)
        snapshot: StoreSnapshot | None = None
        selected: list[str] = []
        refusal: LoadError | None = None
        started = time.perf_counter()
        try:  # everything before the ranks agree: no exception may skip the agreement
            request = self._request(raw)
            snapshot = self._acquire(model, request, stats)
            stats.acquire_s = time.perf_counter() - started
            selected = self._select(model, snapshot, request, stats)
            stats.check_s = time.perf_counter() - started - stats.acquire_s
        except LoadError as error:
            refusal = error
        except Exception as error:  # noqa: BLE001 - any failure is this rank's refusal
            refusal = LoadError("LOAD_FAILED", f"{type(error).__name__}: {error}")
        generation = snapshot.generation if snapshot is not None else -1
        verdicts = self._verdicts("" if refusal is None else str(refusal), generation)
        refused = self._refusal(refusal, verdicts, snapshot)
        if refused is not None:
            if snapshot is not None:
                self._release_failed(snapshot, str(refused))
            self.logger.warning(f"{self.ENGINE}_update_refused", rank=self.place.label, reason=refused.reason,
                                message=refused.detail)
            raise refused
        assert snapshot is not None
        failure = ""
        load_started = time.perf_counter()
        try:
            feed(model, snapshot, selected, stats)
        except Exception as error:  # noqa: BLE001 - reported below, with every rank's outcome
            failure = f"{type(error).__name__}: {error}"
        stats.load_s = time.perf_counter() - load_started
        message = self._failure(self._verdicts(failure, snapshot.generation), snapshot)
        if message is not None:
            self.served.pop(id(model), None)  # a mix of versions: the next load takes every tensor
            self._release_failed(snapshot, f"LOAD_FAILED: {message}")
            self.logger.error(f"{self.ENGINE}_update_failed", rank=self.place.label, message=message)
            raise LoadError("LOAD_FAILED", message)
        snapshot.applied = True
        try:
            snapshot.release(applied=True)
        except OSError as error:  # the server went away after the load: the weights are in, the lease with it
            self.logger.warning(f"{self.ENGINE}_release_lost", rank=self.place.label, error=str(error))
            self._detach()
        self.served[id(model)] = (snapshot.version.store_epoch, snapshot.generation)
        self.last = stats
        self.logger.info(f"{self.ENGINE}_update_loaded", rank=self.place.label, version=stats.version,
                         generation=stats.generation, since_generation=stats.since_generation,
                         tensors=stats.tensors, bytes=stats.bytes, acquire_s=round(stats.acquire_s, 4),
                         check_s=round(stats.check_s, 4), load_s=round(stats.load_s, 4))
        return stats

    def _attach(self, model: torch.nn.Module) -> EngineClient:
        if self.client is None:
            if self.config is None:
                self.config = self._config_source()  # raises LoadError CONFIG_INVALID
            name = self.place.engine_name(self.config.engine_name)
            if len(name) > 128:
                raise LoadError("CONFIG_INVALID", f"rank {self.place.label}'s name {name!r} is over 128 characters")
            options = self._attach_options(model)
            try:
                self.client = EngineClient(server=self.config.server or None, socket_path=self.config.local_socket or None,
                                           name=name, token=self.config.token or None, timeout=self.config.timeout_s,
                                           **options)
            except EngineError as error:
                raise LoadError(error.reason, f"cannot attach to the weightsync store: {error}") from None
            except OSError as error:
                where = self.config.local_socket or self.config.server
                raise LoadError("SERVER_UNREACHABLE", f"cannot reach weightsync at {where}: {error}") from None
            self.logger.info(f"{self.ENGINE}_rank_attached", rank=self.place.label, name=name,
                             socket=self.client.socket_path, **options, pid=os.getpid())
        return self.client

    def _detach(self) -> None:
        """Forget a connection that broke: the next use attaches again."""
        if self.client is not None:
            try:
                self.client.close()
            except OSError:
                pass
            self.client = None

    def _acquire(self, model: torch.nn.Module, request: UpdateRequest, stats: ApplyStats) -> StoreSnapshot:
        """The version the request names, leased; a connection that broke (the server stopped or restarted)
        is made again, until request.wait_s is out (then SERVER_UNREACHABLE, or what attaching said)."""
        deadline = time.monotonic() + request.wait_s
        while True:
            try:
                client = self._attach(model)
                snapshot = client.acquire(generation=request.generation,
                                          wait=max(0.0, deadline - time.monotonic()))
                break
            except EngineError as error:
                raise LoadError(error.reason, str(error).partition(": ")[2] or str(error)) from None
            except LoadError as error:  # attaching: the server is not back (yet)
                if error.reason not in RECONNECTABLE or time.monotonic() >= deadline:
                    raise
            except OSError as error:  # the connection broke: the server went away since the last load
                self._detach()
                self.logger.warning(f"{self.ENGINE}_reconnecting", rank=self.place.label, error=str(error))
                if time.monotonic() >= deadline:
                    raise LoadError("SERVER_UNREACHABLE", f"the connection to weightsync broke ({error}) and "
                                    f"was not made again within {request.wait_s:g} s") from None
                continue
            time.sleep(min(RECONNECT_POLL_S, max(0.0, deadline - time.monotonic())))
        stats.version, stats.generation = snapshot.version.version, snapshot.generation
        return snapshot

    def _select(self, model: torch.nn.Module, snapshot: StoreSnapshot, request: UpdateRequest,
                stats: ApplyStats) -> list[str]:
        """The store tensors to load, checked against the model; raises before anything is touched."""
        epoch, generation = self.served.get(id(model), (0, -1))
        own = generation if epoch == snapshot.version.store_epoch else -1  # another store: every tensor
        since = min(request.since_generation, own)
        stats.since_generation = since
        names = self.names(model)
        changed = snapshot.changed_since(since)
        unknown = [n for n in changed if names.target(n) == ""]
        mismatched = [(n, p) for n in changed if names.target(n) != ""
                      and (p := names.shape_problem(n, snapshot.tensors[n])) is not None]
        bad = set(unknown) | {n for n, _ in mismatched}
        if request.strict:
            # Only the version that wrote them can be refused for them: the store keeps every name it
            # ever received, so refusing an older one would block every later version.
            fresh_mismatched = [p for n, p in mismatched if snapshot.written[n] == snapshot.generation]
            fresh_unknown = [n for n in unknown if snapshot.written[n] == snapshot.generation]
            if fresh_mismatched:
                raise LoadError("TENSOR_MISMATCH", f"{len(fresh_mismatched)} tensor(s) do not fit "
                                f"{names.model_class}: " + "; ".join(fresh_mismatched[:5]))
            if fresh_unknown:
                raise LoadError("TENSOR_NOT_IN_MODEL", f"{len(fresh_unknown)} tensor(s) are not weights of "
                                f"{names.model_class}: " + ", ".join(repr(n) for n in fresh_unknown[:5])
                                + (" ..." if len(fresh_unknown) > 5 else ""))
        stats.skipped = sorted(bad)
        if bad:
            self.logger.warning(f"{self.ENGINE}_tensors_skipped", rank=self.place.label, count=len(bad),
                                names=sorted(bad)[:5])
        return [n for n in changed if n not in bad and names.target(n) is not None]

    def _gather(self, mine: tuple) -> list:
        """`mine` and every other TP rank's, in rank order, over the engine's TP CPU group (Gloo)."""
        if self.place.group is None:
            return [mine]
        import torch.distributed as dist

        gathered: list[object] = [None] * self.place.tp_size
        dist.all_gather_object(gathered, mine, group=self.place.group)
        return gathered

    @staticmethod
    def _label(snapshot: StoreSnapshot | None) -> str:
        if snapshot is None:
            return "the version"
        return f"version {snapshot.version.version!r} (generation {snapshot.generation})"

    def _release_failed(self, snapshot: StoreSnapshot, error: str) -> None:
        try:
            snapshot.release(applied=False, error=error)
        except Exception as release_error:  # noqa: BLE001 - the caller raises the real error
            self.logger.error(f"{self.ENGINE}_release_failed", rank=self.place.label, error=repr(release_error),
                              after=error)


def counted(snapshot: StoreSnapshot, selected: list[str], stats: ApplyStats,
            rename: Callable[[str], str] = lambda name: name) -> Iterator[tuple[str, torch.Tensor]]:
    """The selected tensors, straight from the mapped store, as (rename(name), tensor), counted into
    `stats` as they are taken."""
    for name in selected:
        tensor = snapshot.tensors[name]
        stats.tensors += 1
        stats.bytes += tensor.numel() * tensor.element_size()
        yield rename(name), tensor
