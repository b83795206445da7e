"""The weightsync loader SGLang calls on every TP rank: `load(model, named_tensors)`.

SGLang calls it from `POST /update_weights_from_tensor` when the request's load_format is this
function's dotted path (weightsync.engine.sglang.LOAD_FORMAT) and the server was started with
`--custom-weight-loader` naming it. It runs in each TP rank's scheduler process, between
scheduler steps, with that rank's model. The request names a version (request.py), not weights;
each rank then:

  1. attaches to the node's store on first use (an EngineClient, read-only mapping of the
     server's arenas) as NAME for rank 0 and NAME:tpR for the others (NAME:ppPtpR with pipeline
     parallelism), so GetServerInfo.engines shows what each rank serves;
  2. acquires the version (a lease), and checks every tensor written since the older of the
     request's since_generation and the rank's own record: its name must be one the model's
     load_weights takes (a parameter, a part of a fused qkv_proj / gate_up_proj, or one SGLang
     drops on purpose) and its shape the checkpoint's;
  3. agrees with the other ranks over SGLang's own CPU group (Gloo): if any rank refused, or the
     ranks acquired different versions, no rank loads a byte, and every rank's message names
     every rank's outcome ("rank tp0/2 ready; rank tp1/2 refused: VERSION_GONE: ..."): SGLang
     answers with rank 0's message alone;
  4. feeds the model's own `load_weights` (SGLang shards, narrows and fuses) with those tensors,
     read straight from the mapped store, and releases the lease saying whether it applied.

The attachment is read from the environment once, when a rank first loads (AttachConfig):
WEIGHTSYNC_SERVER (the server's gRPC host:port) or WEIGHTSYNC_LOCAL_SOCKET (its unix socket),
WEIGHTSYNC_ENGINE_NAME (default "sglang") and WEIGHTSYNC_TOKEN.

A refusal raises LoadError (reason and message); SGLang itself would let any exception stop the
whole server, so the weightsync plugin (plugin.py) turns it into `success: false` with the
message. Reasons: REQUEST_MALFORMED, CONFIG_INVALID, SERVER_UNREACHABLE, the store's own
(VERSION_GONE, STORE_EMPTY, ...), TENSOR_NOT_IN_MODEL, TENSOR_MISMATCH, RANK_REFUSED (another rank
refused; nothing loaded), RANK_VERSIONS_DIFFER (the ranks' entries named, or generation 0 found,
different versions; nothing loaded) and LOAD_FAILED (load_weights raised part-way: the rank's weights are a
mix, and its next load takes every tensor).

This module imports SGLang only inside functions: it is importable (and testable with a stand-in
model) without SGLang.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from weightsync.common.logging import get_logger
from weightsync.engine.checkpoint_shapes import safetensors_shapes, shape_problem
from weightsync.engine.client import EngineClient, EngineError, StoreSnapshot
from weightsync.engine.sglang.request import RequestError, UpdateRequest

logger = get_logger("weightsync.engine.sglang")

ENGINE_NAME = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}$")
# Fused parameters of SGLang's dense models and the checkpoint tensors they are made of, where a
# model class does not say (its own `packed_modules_mapping` wins).
DEFAULT_PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# Checkpoint tensors SGLang's loaders drop on purpose.
DROPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class LoadError(RuntimeError):
    """A version this rank did not load; `reason` is machine-readable."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.detail = message


@dataclass(frozen=True, slots=True, kw_only=True)
class AttachConfig:
    """Where a rank finds the node's store (read once from the environment)."""

    server: str = ""
    """The weightsync server's gRPC host:port (its local socket is looked up); or local_socket."""
    local_socket: str = ""
    """The server's unix socket (GetServerInfo.local_socket)."""
    engine_name: str = "sglang"
    """Rank 0's name in GetServerInfo.engines; rank R of tensor parallelism is NAME:tpR."""
    token: str = ""
    """The server's bearer token, if it has one."""
    timeout_s: float = 60.0
    """Connect/request timeout towards the server."""

    def __post_init__(self) -> None:
        if bool(self.server) == bool(self.local_socket):
            raise LoadError("CONFIG_INVALID", "set exactly one of WEIGHTSYNC_SERVER (host:port) and "
                            "WEIGHTSYNC_LOCAL_SOCKET (the server's unix socket) for SGLang's processes")
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
        return cls(server=environ.get("WEIGHTSYNC_SERVER", ""), local_socket=environ.get("WEIGHTSYNC_LOCAL_SOCKET", ""),
                   engine_name=environ.get("WEIGHTSYNC_ENGINE_NAME", "") or "sglang",
                   token=environ.get("WEIGHTSYNC_TOKEN", ""))


@dataclass(frozen=True, slots=True)
class RankPlace:
    """This process's place in SGLang's parallel groups, and the CPU group the ranks agree over."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    group: object | None = None
    """SGLang's TP CPU (Gloo) process group; None with one rank."""

    @property
    def label(self) -> str:
        return f"tp{self.tp_rank}/{self.tp_size}" + (f" pp{self.pp_rank}/{self.pp_size}" if self.pp_size > 1 else "")

    def engine_name(self, name: str) -> str:
        if self.tp_rank == 0 and self.pp_rank == 0:
            return name
        return f"{name}:pp{self.pp_rank}tp{self.tp_rank}" if self.pp_size > 1 else f"{name}:tp{self.tp_rank}"


def sglang_rank_place() -> RankPlace:
    """Where this SGLang scheduler process sits; one rank where SGLang's groups are not set up."""
    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        tp_size = int(parallel.tp_size)
        group = parallel.tp_group.cpu_group if tp_size > 1 else None
        return RankPlace(int(parallel.tp_rank), tp_size, int(parallel.pp_rank or 0), int(parallel.pp_size or 1), group)
    except Exception:  # noqa: BLE001 - no SGLang (a stand-in model): one rank
        return RankPlace()


def sglang_model_path() -> str:
    try:
        from sglang.srt.runtime_context import get_server_args

        return str(get_server_args().model_path or "")
    except Exception:  # noqa: BLE001 - no SGLang: names only
        return ""


class ModelNames:
    """The checkpoint names an SGLang model's load_weights takes, and their (whole) shapes.

    Names come from the model's parameters, directly or as a part of a fused one (q_proj ->
    qkv_proj, ...); shapes from the checkpoint SGLang started from (safetensors headers, read
    once): the model's own parameters are sharded and fused, so they cannot say."""

    def __init__(self, model: torch.nn.Module, checkpoint: dict[str, tuple[int, ...]] | None) -> None:
        self.model_class = type(model).__name__
        self.params = {name for name, _ in model.named_parameters()}
        packed = getattr(model, "packed_modules_mapping", None) or DEFAULT_PACKED
        self.parts = {part: fused for fused, parts in packed.items() for part in parts}
        config = getattr(model, "config", None)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.checkpoint = checkpoint
        self._targets: dict[str, str | None] = {}

    def target(self, name: str) -> str | None:
        """The parameter `name` loads into; None: SGLang drops it on purpose; "": not the model's."""
        if name not in self._targets:
            self._targets[name] = self._resolve(name)
        return self._targets[name]

    def _resolve(self, name: str) -> str | None:
        if name in self.params:
            return name
        module, _, leaf = name.rpartition(".")
        parent, _, last = module.rpartition(".")
        fused = self.parts.get(last)
        if fused is not None and f"{parent}.{fused}.{leaf}".lstrip(".") in self.params:
            return f"{parent}.{fused}.{leaf}".lstrip(".")
        if name.endswith(DROPPED_SUFFIXES) or (name == "lm_head.weight" and self.tied):
            return None
        return ""

    def shape_problem(self, name: str, tensor: torch.Tensor) -> str | None:
        return shape_problem(self.checkpoint, name, tensor.shape)


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


class RankLoader:
    """One SGLang rank's side of weightsync: its connection and what its model holds."""

    def __init__(self, config: Callable[[], AttachConfig], place: RankPlace, model_path: str = "") -> None:
        self._config_source = config
        self.config: AttachConfig | None = None
        self.place = place
        self.model_path = model_path
        self.client: EngineClient | None = None
        self.served: dict[int, int] = {}
        """id(model) -> the generation it holds as loaded from the store (absent: unknown)."""
        self._names: dict[int, ModelNames] = {}
        self.last: ApplyStats | None = None

    def _attach(self) -> EngineClient:
        if self.client is None:
            if self.config is None:
                self.config = self._config_source()  # raises LoadError CONFIG_INVALID
            name = self.place.engine_name(self.config.engine_name)
            if len(name) > 128:
                raise LoadError("CONFIG_INVALID", f"rank {self.place.label}'s name {name!r} is over 128 characters")
            try:
                self.client = EngineClient(server=self.config.server or None,
                                           socket_path=self.config.local_socket or None, name=name,
                                           token=self.config.token or None, timeout=self.config.timeout_s)
            except EngineError as error:
                raise LoadError(error.reason, f"cannot attach to the weightsync store: {error}") from None
            except OSError as error:
                where = self.config.local_socket or self.config.server
                raise LoadError("SERVER_UNREACHABLE", f"cannot reach weightsync at {where}: {error}") from None
            logger.info("sglang_rank_attached", rank=self.place.label, name=name, socket=self.client.socket_path,
                        pid=os.getpid())
        return self.client

    def names(self, model: torch.nn.Module) -> ModelNames:
        key = id(model)
        if key not in self._names:
            self._names[key] = ModelNames(model, safetensors_shapes(self.model_path))
        return self._names[key]

    # -- one load ----------------------------------------------------------------------
    def load(self, model: torch.nn.Module, named_tensors: list) -> ApplyStats:
        """Load the version `named_tensors` names (request.py) into `model`, or raise LoadError having
        loaded nothing (every rank agrees first) or, for LOAD_FAILED, part of it."""
        stats = ApplyStats(rank=self.place.label)
        snapshot: StoreSnapshot | None = None
        selected: list[str] = []
        refusal: LoadError | None = None
        started = time.perf_counter()
        try:  # everything before the ranks agree: no exception may skip the agreement
            try:
                request = UpdateRequest.from_named_tensors(named_tensors)
            except RequestError as error:
                raise LoadError(error.reason, str(error)) from None
            snapshot = self._acquire(request, stats)
            stats.acquire_s = time.perf_counter() - started
            selected = self._select(model, snapshot, request, stats)
            stats.check_s = time.perf_counter() - started - stats.acquire_s
        except LoadError as error:
            refusal = error
        except Exception as error:  # noqa: BLE001 - any failure is this rank's refusal
            refusal = LoadError("LOAD_FAILED", f"{type(error).__name__}: {error}")
        generation = snapshot.generation if snapshot is not None else -1
        verdicts = self._agree("" if refusal is None else str(refusal), generation)
        refused = self._refusal(refusal, verdicts, snapshot)
        if refused is not None:
            if snapshot is not None:
                self._release_failed(snapshot, str(refused))
            logger.warning("sglang_update_refused", rank=self.place.label, reason=refused.reason, message=refused.detail)
            raise refused
        assert snapshot is not None
        failure = ""
        load_started = time.perf_counter()
        try:
            self._feed(model, snapshot, selected, stats)
        except Exception as error:  # noqa: BLE001 - reported below, with every rank's outcome
            failure = f"{type(error).__name__}: {error}"
        stats.load_s = time.perf_counter() - load_started
        loads = self._agree(failure, snapshot.generation)
        if any(v for _, v, _ in loads):
            self.served.pop(id(model), None)  # a mix of versions: the next load takes every tensor
            message = (f"{self._label(snapshot)} loaded in part, the weights are a mix until the next load: "
                       + outcomes(loads, ok="loaded", bad="failed"))
            self._release_failed(snapshot, f"LOAD_FAILED: {message}")
            logger.error("sglang_update_failed", rank=self.place.label, message=message)
            raise LoadError("LOAD_FAILED", message)
        snapshot.applied = True
        snapshot.release(applied=True)
        self.served[id(model)] = snapshot.generation
        self.last = stats
        logger.info("sglang_update_loaded", rank=self.place.label, version=stats.version, generation=stats.generation,
                    since_generation=stats.since_generation, tensors=stats.tensors, bytes=stats.bytes,
                    acquire_s=round(stats.acquire_s, 4), check_s=round(stats.check_s, 4),
                    load_s=round(stats.load_s, 4))
        return stats

    def _refusal(self, own: LoadError | None, verdicts: list[tuple[str, str, int]],
                 snapshot: StoreSnapshot | None) -> LoadError | None:
        """Why no rank loads, naming every rank's outcome; None when every rank is ready to load one
        and the same version. A rank that refused keeps its own reason; the others say RANK_REFUSED."""
        kept = f"{self._label(snapshot)} not loaded, the engine keeps its weights: "
        if any(verdict for _, verdict, _ in verdicts):
            return LoadError(own.reason if own is not None else "RANK_REFUSED",
                             kept + outcomes(verdicts, ok="ready", bad="refused"))
        if len({generation for _, _, generation in verdicts}) > 1:
            # Each rank reads its own entry of the request, and generation 0 (the current one) read
            # while a commit lands names two versions: never load two versions into one model.
            return LoadError("RANK_VERSIONS_DIFFER", kept + "the ranks acquired different versions ("
                             + "; ".join(f"rank {r} generation {g}" for r, _, g in verdicts)
                             + "): name the generation in the request")
        return None

    def _acquire(self, request: UpdateRequest, stats: ApplyStats) -> StoreSnapshot:
        client = self._attach()
        try:
            snapshot = client.acquire(generation=request.generation, wait=request.wait_s)
        except EngineError as error:
            raise LoadError(error.reason, str(error).partition(": ")[2] or str(error)) from None
        stats.version, stats.generation = snapshot.version.version, snapshot.generation
        return snapshot

    def _select(self, model: torch.nn.Module, snapshot: StoreSnapshot, request: UpdateRequest,
                stats: ApplyStats) -> list[str]:
        """The store tensors to load, checked against the model; raises before anything is touched."""
        own = self.served.get(id(model), -1)
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
            logger.warning("sglang_tensors_skipped", rank=self.place.label, count=len(bad), names=sorted(bad)[:5])
        return [n for n in changed if n not in bad and names.target(n) is not None]

    def _feed(self, model: torch.nn.Module, snapshot: StoreSnapshot, selected: list[str], stats: ApplyStats) -> None:
        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name in selected:
                tensor = snapshot.tensors[name]
                stats.tensors += 1
                stats.bytes += tensor.numel() * tensor.element_size()
                yield name, tensor

        if selected:
            with torch.no_grad():
                model.load_weights(tensors())

    def _agree(self, verdict: str, generation: int) -> list[tuple[str, str, int]]:
        """Every rank's (label, verdict ("" = fine), generation it acquired (-1: none)), in rank order."""
        return [(str(r), str(v), int(g)) for r, v, g in self._gather((self.place.label, verdict, generation))]

    def _gather(self, mine: tuple[str, str, int]) -> list:
        """`mine` and every other TP rank's, in rank order, over SGLang's TP CPU group (Gloo)."""
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
            logger.error("sglang_release_failed", rank=self.place.label, error=repr(release_error), after=error)


OUTCOME_CHARS = 300
"""At most this much of one rank's verdict in a message (SGLang answers rank 0's message alone, and a
driver reads a bounded answer: every rank must fit)."""


def outcomes(verdicts: list[tuple[str, str, int]], *, ok: str, bad: str) -> str:
    """Every rank's outcome in one line, ranks with the same verdict together:
    "rank tp0/2 ready; rank tp1/2 refused: VERSION_GONE: ..." (`ok`, `bad`: the words for a rank
    that was fine and one that was not)."""
    groups: dict[str, list[str]] = {}
    for rank, verdict, _ in verdicts:
        text = verdict if len(verdict) <= OUTCOME_CHARS else verdict[: OUTCOME_CHARS - 3] + "..."
        groups.setdefault(text, []).append(rank)
    return "; ".join(f"rank {', '.join(ranks)} " + (f"{bad}: {text}" if text else ok) for text, ranks in groups.items())


_RANK: RankLoader | None = None


def rank_loader() -> RankLoader:
    """This process's RankLoader, made on first use (reads the environment then, once)."""
    global _RANK
    if _RANK is None:
        _RANK = RankLoader(AttachConfig.from_environment, sglang_rank_place(), sglang_model_path())
    return _RANK


def load(model: torch.nn.Module, named_tensors: list) -> None:
    """SGLang's custom weight loader: load the version `named_tensors` names (request.py)."""
    rank_loader().load(model, named_tensors)


def last_summary() -> str:
    """What this rank's last successful load did (the plugin puts it in SGLang's answer)."""
    return _RANK.last.summary() if _RANK is not None and _RANK.last is not None else ""
