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

What every engine's rank does alike (attaching, acquiring, the checks, the agreement, the
release) is engine/rank_load.py's RankLoader; this module is LMDeploy's side of it: its model
names (rename_weight, the fused parameters, the whole-parameter shapes with one rank), its
messages, and its load_weights followed by the post-load processing.

Importing this module does not import LMDeploy; the model only needs `named_parameters` and
`load_weights` (LMDeploy's classes, or a stand-in).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from weightsync.common.logging import get_logger
from weightsync.engine import rank_load
from weightsync.engine.checkpoint_shapes import CheckpointShapes, safetensors_shapes, shape_problem
from weightsync.engine.client import StoreSnapshot
from weightsync.engine.rank_load import (
    DEFAULT_PACKED,
    DROPPED_SUFFIXES,
    ApplyStats,
    LoadError,
    counted,
)
from weightsync.engine.request import RequestError, UpdateRequest

logger = get_logger("weightsync.engine.lmdeploy")


@dataclass(frozen=True, slots=True, kw_only=True)
class AttachConfig(rank_load.AttachConfig):
    """Where an LMDeploy rank finds the node's store (read once from the environment)."""

    ENGINE = "LMDeploy"
    engine_name: str = "lmdeploy"

    def __post_init__(self) -> None:
        rank_load.AttachConfig.__post_init__(self)
        if not 0 < self.timeout_s <= 3600:
            raise LoadError("CONFIG_INVALID", f"the attach timeout must be in (0, 3600] s, got {self.timeout_s!r}")


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
        target = self.target(name)
        if not target:  # dropped on purpose (or not the model's): LMDeploy never reads its shape
            return None
        problem = shape_problem(self.checkpoint, name, tensor.shape)
        if problem is not None:
            return problem
        # One rank holds whole parameters: an unfused one must have the stored tensor's shape.
        if self.whole and target == self.rename(name) and tuple(self.params[target].shape) != tuple(tensor.shape):
            return f"{name!r} (model {list(self.params[target].shape)}, store {list(tensor.shape)})"
        return None


class RankLoader(rank_load.RankLoader):
    """One LMDeploy rank's connection to the node's store and what its model holds."""

    ENGINE = "lmdeploy"
    logger = logger

    def __init__(self, config: Callable[[], AttachConfig], place: RankPlace, model_path: str = "",
                 post_load: Callable[[torch.nn.Module], None] = lmdeploy_post_load) -> None:
        super().__init__(config, place, model_path)
        self.post_load = post_load

    def load(self, model: torch.nn.Module, request: UpdateRequest, *, post_load: bool = True) -> ApplyStats:
        """Load the version `request` names into `model`, or raise LoadError having loaded nothing
        (every rank agrees first) or, for LOAD_FAILED, part of it. post_load=False leaves LMDeploy's
        post-load processing to the caller (LMDeploy's own update routes run it once at the end)."""

        def feed(model: torch.nn.Module, snapshot: StoreSnapshot, selected: list[str], stats: ApplyStats) -> None:
            self._feed(model, snapshot, selected, stats)
            if post_load and selected:
                with torch.inference_mode():
                    self.post_load(model)

        return self._load(model, request, feed)

    def _request(self, raw: object) -> UpdateRequest:
        if not isinstance(raw, UpdateRequest):
            raise LoadError("REQUEST_MALFORMED", f"expected an UpdateRequest, got {type(raw).__name__}")
        return raw

    def _model_names(self, model: torch.nn.Module) -> ModelNames:
        return ModelNames(model, safetensors_shapes(self.model_path), self.place.tp_size)

    def _attach_options(self, model: torch.nn.Module) -> dict[str, str]:
        """A CUDA model's rank pins the mapped store."""
        return {"device": str(next((p.device for p in model.parameters()), torch.device("cpu")))}

    def _verdicts(self, verdict: str, generation: int) -> list[tuple[str, str]]:
        return self._agree(verdict)  # LMDeploy's ranks compare verdicts alone

    def _refusal(self, own: LoadError | None, verdicts: Sequence[tuple],
                 snapshot: StoreSnapshot | None) -> LoadError | None:
        """Why no rank loads: this rank's own refusal, or RANK_REFUSED naming the ranks that refused."""
        refused = [(rank, verdict) for rank, verdict in verdicts if verdict]
        if not refused:
            return None
        own = own or LoadError("RANK_REFUSED", "; ".join(f"rank {r} refused: {v}" for r, v in refused))
        return LoadError(own.reason, f"{self._label(snapshot)} not loaded, the engine keeps its weights: {own.detail}")

    def _failure(self, loads: Sequence[tuple], snapshot: StoreSnapshot) -> str | None:
        failed = [(rank, verdict) for rank, verdict in loads if verdict]
        if not failed:
            return None
        return (f"{self._label(snapshot)} loaded in part, the weights are a mix until the next load: "
                + "; ".join(f"rank {r}: {v}" for r, v in failed))

    def _feed(self, model: torch.nn.Module, snapshot: StoreSnapshot, selected: list[str], stats: ApplyStats) -> None:
        if selected:
            with torch.inference_mode():
                model.load_weights(counted(snapshot, selected, stats, self.names(model).rename))

    def _agree(self, verdict: str) -> list[tuple[str, str]]:
        """Every rank's verdict ("" = fine), in rank order, over LMDeploy's TP CPU group."""
        return [(str(r), str(v)) for r, v in self._gather((self.place.label, verdict))]


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
