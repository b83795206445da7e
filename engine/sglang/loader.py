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

What every engine's rank does alike (attaching, acquiring, the checks, the agreement, the
release) is engine/rank_load.py's RankLoader; this module is SGLang's side of it: the request in
SGLang's named tensors, SGLang's model names, the every-rank message and SGLang's load_weights.

This module imports SGLang only inside functions: it is importable (and testable with a stand-in
model) without SGLang.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weightsync.common.logging import get_logger
from weightsync.engine import rank_load
from weightsync.engine.checkpoint_shapes import safetensors_shapes, shape_problem
from weightsync.engine.client import StoreSnapshot
from weightsync.engine.rank_load import (
    DEFAULT_PACKED,
    DROPPED_SUFFIXES,
    ApplyStats,
    LoadError,
    counted,
)
from weightsync.engine.request import RequestError, UpdateRequest

logger = get_logger("weightsync.engine.sglang")


@dataclass(frozen=True, slots=True, kw_only=True)
class AttachConfig(rank_load.AttachConfig):
    """Where an SGLang rank finds the node's store (read once from the environment)."""

    ENGINE = "SGLang"
    engine_name: str = "sglang"


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


class RankLoader(rank_load.RankLoader):
    """One SGLang rank's side of weightsync: its connection and what its model holds."""

    ENGINE = "sglang"
    logger = logger

    def load(self, model: torch.nn.Module, named_tensors: list) -> ApplyStats:
        """Load the version `named_tensors` names (request.py) into `model`, or raise LoadError having
        loaded nothing (every rank agrees first) or, for LOAD_FAILED, part of it."""
        return self._load(model, named_tensors, self._feed)

    def _request(self, raw: object) -> UpdateRequest:
        try:
            return UpdateRequest.from_named_tensors(raw)  # type: ignore[arg-type]
        except RequestError as error:
            raise LoadError(error.reason, str(error)) from None

    def _model_names(self, model: torch.nn.Module) -> ModelNames:
        return ModelNames(model, safetensors_shapes(self.model_path))

    def _verdicts(self, verdict: str, generation: int) -> list[tuple[str, str, int]]:
        return self._agree(verdict, generation)

    def _refusal(self, own: LoadError | None, verdicts: Sequence[tuple],
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

    def _failure(self, loads: Sequence[tuple], snapshot: StoreSnapshot) -> str | None:
        if not any(v for _, v, _ in loads):
            return None
        return (f"{self._label(snapshot)} loaded in part, the weights are a mix until the next load: "
                + outcomes(loads, ok="loaded", bad="failed"))

    def _feed(self, model: torch.nn.Module, snapshot: StoreSnapshot, selected: list[str], stats: ApplyStats) -> None:
        if selected:
            with torch.no_grad():
                model.load_weights(counted(snapshot, selected, stats))

    def _agree(self, verdict: str, generation: int) -> list[tuple[str, str, int]]:
        """Every rank's (label, verdict ("" = fine), generation it acquired (-1: none)), in rank order."""
        return [(str(r), str(v), int(g)) for r, v, g in self._gather((self.place.label, verdict, generation))]


OUTCOME_CHARS = 300
"""At most this much of one rank's verdict in a message (SGLang answers rank 0's message alone, and a
driver reads a bounded answer: every rank must fit)."""


def outcomes(verdicts: Sequence[tuple], *, ok: str, bad: str) -> str:
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
