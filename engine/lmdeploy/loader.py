"""One LMDeploy rank's side of weightsync: load a committed version of the node's store into
LMDeploy's own (patched) model with the model's own `load_weights`.

LMDeploy 0.18.0's PyTorch engine builds its model classes (lmdeploy.pytorch.models.*): q/k/v are
one `qkv_proj`, gate/up one `gate_up_proj`, and the model's `load_weights` takes the checkpoint's
names and fuses (and, with tensor parallelism, shards) them itself. A rank here:

  1. attaches to the node's store on first use (an EngineClient, read-only mapping of the server's
     arenas; a CUDA model pins it) as NAME for rank 0 and NAME:tpR for the others, so
     GetServerInfo.engines shows what each rank serves;
  2. acquires the version (a lease), and checks every tensor written since the older of the
     request's since_generation and the rank's own record: its name (after the model's own
     `rename_weight`) must be one `load_weights` takes (a parameter, a part of a fused one, or one
     LMDeploy drops on purpose) and its shape the checkpoint's (safetensors headers of the model
     directory LMDeploy started from) or, with one rank, the parameter's own;
  3. agrees with the other ranks over LMDeploy's TP CPU group (Gloo): if any rank refused, no
     rank loads a byte, and every rank says why;
  4. feeds `load_weights` the tensors straight from the mapped store, runs LMDeploy's post-load
     processing (`process_weights_after_loading`, unless LMDeploy's own update route runs it), and
     releases the lease saying whether it applied.

The attachment is read from the environment once, on a rank's first load (AttachConfig):
WEIGHTSYNC_SERVER (the server's gRPC host:port) or WEIGHTSYNC_LOCAL_SOCKET (its unix socket),
WEIGHTSYNC_ENGINE_NAME (default "lmdeploy") and WEIGHTSYNC_TOKEN.

A refusal raises LoadError (reason, message). Reasons, the same as the SGLang loader's:
REQUEST_MALFORMED, CONFIG_INVALID, SERVER_UNREACHABLE, the store's own (VERSION_GONE,
STORE_EMPTY, ...), TENSOR_NOT_IN_MODEL, TENSOR_MISMATCH, RANK_REFUSED (another rank refused;
nothing loaded) and LOAD_FAILED (load_weights or the post-load processing raised part-way: the
rank's weights are a mix, and its next load takes every tensor).

Importing this module does not import LMDeploy; the model only needs `named_parameters` and
`load_weights` (LMDeploy's classes, or a stand-in).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from weightsync.common.logging import get_logger
from weightsync.engine.checkpoint_shapes import CheckpointShapes, safetensors_shapes, shape_problem
from weightsync.engine.client import EngineClient, EngineError, StoreSnapshot
from weightsync.engine.sglang.request import RequestError, UpdateRequest

logger = get_logger("weightsync.engine.lmdeploy")

ENGINE_NAME = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}$")
# The fused parameters of LMDeploy's dense models and the checkpoint tensors each is made of (the
# stacked_params_mapping of their load_weights); a model's own `packed_modules_mapping` wins.
DEFAULT_PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# Checkpoint tensors LMDeploy's load_weights drops on purpose.
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
    engine_name: str = "lmdeploy"
    """Rank 0's name in GetServerInfo.engines; rank R of tensor parallelism is NAME:tpR."""
    token: str = ""
    """The server's bearer token, if it has one."""
    timeout_s: float = 60.0
    """Connect/request timeout towards the server."""

    def __post_init__(self) -> None:
        if bool(self.server) == bool(self.local_socket):
            raise LoadError("CONFIG_INVALID", "set exactly one of WEIGHTSYNC_SERVER (host:port) and "
                            "WEIGHTSYNC_LOCAL_SOCKET (the server's unix socket) for LMDeploy's processes")
        if self.server and not ADDRESS.match(self.server):
            raise LoadError("CONFIG_INVALID", f"WEIGHTSYNC_SERVER must be host:port, got {self.server!r}")
        if self.local_socket and not os.path.isabs(self.local_socket):
            raise LoadError("CONFIG_INVALID", f"WEIGHTSYNC_LOCAL_SOCKET must be an absolute path, "
                            f"got {self.local_socket!r}")
        if not ENGINE_NAME.match(self.engine_name):
            raise LoadError("CONFIG_INVALID", "WEIGHTSYNC_ENGINE_NAME must be 1 to 128 characters of "
                            f"[A-Za-z0-9._:-], got {self.engine_name!r}")
        if not 0 < self.timeout_s <= 3600:
            raise LoadError("CONFIG_INVALID", f"the attach timeout must be in (0, 3600] s, got {self.timeout_s!r}")

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> AttachConfig:
        return cls(server=environ.get("WEIGHTSYNC_SERVER", ""), local_socket=environ.get("WEIGHTSYNC_LOCAL_SOCKET", ""),
                   engine_name=environ.get("WEIGHTSYNC_ENGINE_NAME", "") or "lmdeploy",
                   token=environ.get("WEIGHTSYNC_TOKEN", ""))


@dataclass(frozen=True, slots=True)
class RankPlace:
    """This process's place in LMDeploy's tensor-parallel group, and the CPU group ranks agree over."""

    tp_rank: int = 0
    tp_size: int = 1
    group: object | None = None
    """LMDeploy's TP CPU (Gloo) process group; None with one rank."""

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise LoadError("CONFIG_INVALID", f"tp rank {self.tp_rank} is not in [0, {self.tp_size})")

    @property
    def label(self) -> str:
        return f"tp{self.tp_rank}/{self.tp_size}"

    def engine_name(self, name: str) -> str:
        return name if self.tp_rank == 0 else f"{name}:tp{self.tp_rank}"


def lmdeploy_rank_place() -> RankPlace:
    """Where this LMDeploy model agent sits (inside its `all_context()`); one rank where LMDeploy's
    distributed context is not set up (a model built outside an engine)."""
    try:
        from lmdeploy.pytorch.distributed import get_dist_manager

        context = get_dist_manager().current_context()
        tp_size = int(context.dist_config.tp)
        group = context.tp_group.cpu_group if tp_size > 1 else None
        return RankPlace(int(context.tp_group.rank) if tp_size > 1 else 0, tp_size, group)
    except Exception:  # noqa: BLE001 - no LMDeploy context: one rank
        return RankPlace()


def lmdeploy_post_load(model: torch.nn.Module) -> None:
    """LMDeploy's own post-load processing (each module's update_weights, then its
    process_weights_after_loading), as its loader runs it after a checkpoint."""
    from lmdeploy.pytorch.weight_loader.model_weight_loader import process_weights_after_loading

    process_weights_after_loading(model)


class ModelNames:
    """The checkpoint names an LMDeploy model's load_weights takes, and the shapes they must have."""

    def __init__(self, model: torch.nn.Module, checkpoint: CheckpointShapes | None, tp_size: int) -> None:
        self.model_class = type(model).__name__
        self.params = dict(model.named_parameters())
        packed = getattr(model, "packed_modules_mapping", None) or DEFAULT_PACKED
        self.parts = {part: fused for fused, parts in packed.items() for part in parts}
        self.rename: Callable[[str], str] = getattr(model, "rename_weight", None) or (lambda name: name)
        config = getattr(model, "config", None)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.checkpoint = checkpoint
        self.whole = tp_size == 1
        self._targets: dict[str, str | None] = {}

    def target(self, name: str) -> str | None:
        """The parameter `name` loads into; None: LMDeploy drops it on purpose; "": not the model's."""
        if name not in self._targets:
            self._targets[name] = self._resolve(self.rename(name))
        return self._targets[name]

    def _resolve(self, name: str) -> str | None:
        if name.endswith(DROPPED_SUFFIXES) or (self.tied and name == "lm_head.weight"):
            return None
        if name in self.params:
            return name
        module, _, leaf = name.rpartition(".")
        parent, _, last = module.rpartition(".")
        fused = self.parts.get(last)
        candidate = f"{parent}.{fused}.{leaf}".lstrip(".") if fused is not None else ""
        return candidate if candidate in self.params else ""

    def shape_problem(self, name: str, tensor: torch.Tensor) -> str | None:
        problem = shape_problem(self.checkpoint, name, tensor.shape)
        if problem is not None:
            return problem
        target = self.target(name)
        # One rank holds whole parameters: an unfused one must have the stored tensor's shape.
        if self.whole and target and target == self.rename(name) and tuple(self.params[target].shape) != tuple(tensor.shape):
            return f"{name!r} (model {list(self.params[target].shape)}, store {list(tensor.shape)})"
        return None


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


class RankLoader:
    """One LMDeploy rank's connection to the node's store and what its model holds."""

    def __init__(self, config: Callable[[], AttachConfig], place: RankPlace, model_path: str = "",
                 post_load: Callable[[torch.nn.Module], None] = lmdeploy_post_load) -> None:
        self._config_source = config
        self.config: AttachConfig | None = None
        self.place = place
        self.model_path = model_path
        self.post_load = post_load
        self.client: EngineClient | None = None
        self.served: dict[int, int] = {}
        """id(model) -> the generation it holds as loaded from the store (absent: unknown)."""
        self._names: dict[int, ModelNames] = {}
        self.last: ApplyStats | None = None

    def _attach(self, model: torch.nn.Module) -> EngineClient:
        if self.client is None:
            if self.config is None:
                self.config = self._config_source()  # raises LoadError CONFIG_INVALID
            name = self.place.engine_name(self.config.engine_name)
            if len(name) > 128:
                raise LoadError("CONFIG_INVALID", f"rank {self.place.label}'s name {name!r} is over 128 characters")
            device = next((p.device for p in model.parameters()), torch.device("cpu"))
            try:
                self.client = EngineClient(server=self.config.server or None, socket_path=self.config.local_socket or None,
                                           name=name, device=str(device), token=self.config.token or None,
                                           timeout=self.config.timeout_s)
            except EngineError as error:
                raise LoadError(error.reason, f"cannot attach to the weightsync store: {error}") from None
            except OSError as error:
                where = self.config.local_socket or self.config.server
                raise LoadError("SERVER_UNREACHABLE", f"cannot reach weightsync at {where}: {error}") from None
            logger.info("lmdeploy_rank_attached", rank=self.place.label, name=name, socket=self.client.socket_path,
                        device=str(device), pid=os.getpid())
        return self.client

    def names(self, model: torch.nn.Module) -> ModelNames:
        key = id(model)
        if key not in self._names:
            self._names[key] = ModelNames(model, safetensors_shapes(self.model_path), self.place.tp_size)
        return self._names[key]

    def load(self, model: torch.nn.Module, request: UpdateRequest, *, post_load: bool = True) -> ApplyStats:
        """Load the version `request` names into `model`, or raise LoadError having loaded nothing
        (every rank agrees first) or, for LOAD_FAILED, part of it. post_load=False leaves LMDeploy's
        post-load processing to the caller (LMDeploy's own update routes run it once at the end)."""
        stats = ApplyStats(rank=self.place.label)
        snapshot: StoreSnapshot | None = None
        selected: list[str] = []
        refusal: LoadError | None = None
        started = time.perf_counter()
        try:  # everything before the ranks agree: no exception may skip the agreement
            if not isinstance(request, UpdateRequest):
                raise LoadError("REQUEST_MALFORMED", f"expected an UpdateRequest, got {type(request).__name__}")
            snapshot = self._acquire(model, request, stats)
            stats.acquire_s = time.perf_counter() - started
            selected = self._select(model, snapshot, request, stats)
            stats.check_s = time.perf_counter() - started - stats.acquire_s
        except LoadError as error:
            refusal = error
        except Exception as error:  # noqa: BLE001 - any failure is this rank's refusal
            refusal = LoadError("LOAD_FAILED", f"{type(error).__name__}: {error}")
        refused = [(rank, verdict) for rank, verdict in self._agree("" if refusal is None else str(refusal)) if verdict]
        if refused:
            own = refusal or LoadError("RANK_REFUSED", "; ".join(f"rank {r} refused: {v}" for r, v in refused))
            message = f"{self._label(snapshot)} not loaded, the engine keeps its weights: {own.detail}"
            if snapshot is not None:
                self._release_failed(snapshot, f"{own.reason}: {message}")
            logger.warning("lmdeploy_update_refused", rank=self.place.label, reason=own.reason, message=message)
            raise LoadError(own.reason, message)
        assert snapshot is not None
        failure = ""
        load_started = time.perf_counter()
        try:
            self._feed(model, snapshot, selected, stats)
            if post_load and selected:
                with torch.inference_mode():
                    self.post_load(model)
        except Exception as error:  # noqa: BLE001 - reported below, with every rank's outcome
            failure = f"{type(error).__name__}: {error}"
        stats.load_s = time.perf_counter() - load_started
        failed = [(rank, verdict) for rank, verdict in self._agree(failure) if verdict]
        if failed:
            self.served.pop(id(model), None)  # a mix of versions: the next load takes every tensor
            message = (f"{self._label(snapshot)} loaded in part, the weights are a mix until the next load: "
                       + "; ".join(f"rank {r}: {v}" for r, v in failed))
            self._release_failed(snapshot, f"LOAD_FAILED: {message}")
            logger.error("lmdeploy_update_failed", rank=self.place.label, message=message)
            raise LoadError("LOAD_FAILED", message)
        snapshot.applied = True
        snapshot.release(applied=True)
        self.served[id(model)] = snapshot.generation
        self.last = stats
        logger.info("lmdeploy_update_loaded", rank=self.place.label, version=stats.version, generation=stats.generation,
                    since_generation=stats.since_generation, tensors=stats.tensors, bytes=stats.bytes,
                    acquire_s=round(stats.acquire_s, 4), check_s=round(stats.check_s, 4), load_s=round(stats.load_s, 4))
        return stats

    def _acquire(self, model: torch.nn.Module, request: UpdateRequest, stats: ApplyStats) -> StoreSnapshot:
        client = self._attach(model)
        try:
            snapshot = client.acquire(generation=request.generation, wait=request.wait_s)
        except EngineError as error:
            raise LoadError(error.reason, str(error).partition(": ")[2] or str(error)) from None
        stats.version, stats.generation = snapshot.version.version, snapshot.generation
        return snapshot

    def _select(self, model: torch.nn.Module, snapshot: StoreSnapshot, request: UpdateRequest,
                stats: ApplyStats) -> list[str]:
        """The store tensors to load, checked against the model; raises before anything is touched."""
        since = min(request.since_generation, self.served.get(id(model), -1))
        stats.since_generation = since
        names = self.names(model)
        changed = snapshot.changed_since(since)
        unknown = [n for n in changed if names.target(n) == ""]
        mismatched = [(n, p) for n in changed if names.target(n)
                      and (p := names.shape_problem(n, snapshot.tensors[n])) is not None]
        bad = set(unknown) | {n for n, _ in mismatched}
        if request.strict:
            # Only the version that wrote them is refused for them: the store keeps every name it
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
            logger.warning("lmdeploy_tensors_skipped", rank=self.place.label, count=len(bad), names=sorted(bad)[:5])
        return [n for n in changed if n not in bad and names.target(n) is not None]

    def _feed(self, model: torch.nn.Module, snapshot: StoreSnapshot, selected: list[str], stats: ApplyStats) -> None:
        rename = self.names(model).rename

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name in selected:
                tensor = snapshot.tensors[name]
                stats.tensors += 1
                stats.bytes += tensor.numel() * tensor.element_size()
                yield rename(name), tensor

        if selected:
            with torch.inference_mode():
                model.load_weights(tensors())

    def _agree(self, verdict: str) -> list[tuple[str, str]]:
        """Every rank's verdict ("" = fine), in rank order, over LMDeploy's TP CPU group."""
        if self.place.group is None:
            return [(self.place.label, verdict)]
        import torch.distributed as dist

        gathered: list[object] = [None] * self.place.tp_size
        dist.all_gather_object(gathered, (self.place.label, verdict), group=self.place.group)
        return [(str(r), str(v)) for r, v in gathered]  # type: ignore[misc]

    @staticmethod
    def _label(snapshot: StoreSnapshot | None) -> str:
        if snapshot is None:
            return "the version"
        return f"version {snapshot.version.version!r} (generation {snapshot.generation})"

    def _release_failed(self, snapshot: StoreSnapshot, error: str) -> None:
        try:
            snapshot.release(applied=False, error=error)
        except Exception as release_error:  # noqa: BLE001 - the caller raises the real error
            logger.error("lmdeploy_release_failed", rank=self.place.label, error=repr(release_error), after=error)


_RANK: RankLoader | None = None


def rank_loader(model_path: str = "") -> RankLoader:
    """This process's RankLoader, made on first use (reads the environment then, once); model_path:
    the directory LMDeploy started from (its safetensors headers give the checkpoint's shapes)."""
    global _RANK
    if _RANK is None:
        _RANK = RankLoader(AttachConfig.from_environment, lmdeploy_rank_place(), model_path)
    return _RANK


def request_of(named_tensors: list) -> UpdateRequest:
    """The weightsync request in what an LMDeploy update route handed load_weights (REQUEST_MALFORMED
    as a LoadError if it is not one)."""
    try:
        return UpdateRequest.from_named_tensors(named_tensors)
    except RequestError as error:
        raise LoadError(error.reason, str(error)) from None
