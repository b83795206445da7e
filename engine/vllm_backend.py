"""The "weightsync" weight-transfer backend for vLLM: a vLLM worker reads the node's store.

Runs inside vLLM's worker process (vLLM creates it after the model loads,
when started with `weight_transfer_config={"backend": "weightsync"}`; the
plugin in vllm_plugin.py registers it). vLLM's weight-transfer calls map to:

  init_weight_transfer_engine {"init_info": {"local_socket": PATH | "server": HOST:PORT,
                                             "engine_name": "", "token": ""}}
      attach an EngineClient to the node's store (the node's weightsync
      server; its local socket): every vLLM worker (tensor-parallel rank)
      maps the same one store, read-only, and loads its shard of it with
      vLLM's own load_weights. With an engine_name, the first rank attaches
      as that name and every other model-parallel rank as NAME:tpR (NAME:ppPtpR
      with pipeline parallelism), so GetServerInfo.engines shows what each
      rank serves; driven (no name), the ranks attach unnamed and the driver
      reports for the engine. ("worker" is accepted and ignored: older servers
      kept a replica per weightsync worker.)
  start_weight_update
      opens a session; touches nothing.
  update_weights {"update_info": {"generation": 0, "since_generation": -1}}
      pin the committed version (a lease; generation 0: the current one, else
      exactly that one or VERSION_GONE), check every tensor written since
      `since_generation` (-1: all) against the model, then load them with the
      model's own load_weights (vLLM maps names, fuses q/k/v and gate/up,
      shards, repacks) inside vLLM's layerwise-reload lifecycle, and finalize
      it, all in this one call; release the lease, saying applied or the error.
  finish_weight_update {"weight_version": label}
      vLLM records the label itself (EngineCore); nothing left to do here.

Why load *and* finalize in update_weights (and not initialize in start /
finalize in finish, as vLLM's docs suggest): between initialize and finalize
the layers sit on the meta device, and a forward pass then kills the
EngineCore ("Cannot copy out of meta tensor"). The offline LLM has no pause,
and even online nothing forbids a step between two RPCs; one RPC is atomic
with respect to the engine's step loop. CPU builds need the layerwise
lifecycle at all because their linear layers drop `.weight` after packing it
for oneDNN.

All or nothing: nothing is touched before every name (and, where the
checkpoint says, every shape) is known to fit. A fused layer is never
processed half-loaded: when an update writes q_proj only, k_proj and v_proj
(unchanged, from the store) go with it; if vLLM still reports a layer
partially loaded, the rest of the store is loaded too. Any failure discards
the layers not processed yet and finalizes, so they keep their current
weights: the engine keeps serving, the error names the tensor.

The store never forgets a name (a push with allow_new_tensors adds it for
good), so a name the model does not have is an error only in the version
that wrote it; a later version skips it with a warning, or no later version
could ever be applied (update_info "strict": false skips them always).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.logger import init_logger

from weightsync.engine.checkpoint_shapes import safetensors_shapes, shape_problem
from weightsync.engine.client import EngineClient, EngineError, StoreSnapshot

# Under "vllm.": vLLM's handler formats and keeps these records in its worker processes.
logger = init_logger("vllm.plugins.weightsync")

ENGINE_NAME = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}$")
# Tensors vLLM's AutoWeightsLoader drops by itself (old checkpoints carry them).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_pos_emb.inv_freq", "rotary_emb.cos_cached",
                    "rotary_emb.sin_cached")
EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")


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
    model-parallel rank shows as NAME:tpR (see rank_engine_name)."""
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


class ModelNames:
    """The checkpoint names a vLLM model's load_weights takes, and their shapes where known.

    Shapes come from the checkpoint vLLM loaded (safetensors headers, read once); names also
    from the model itself: its parameters and persistent buffers (tied aliases included),
    reached directly, through the model's hf_to_vllm_mapper, or through packed_modules_mapping
    (q_proj -> qkv_proj, ...). vLLM's own parameter shapes cannot be used: they are sharded,
    fused, and on CPU the packed linear weights are empty.
    """

    def __init__(self, model: torch.nn.Module, model_config) -> None:
        self.model_class = type(model).__name__
        self.params = set(model.state_dict(keep_vars=True).keys())
        self.mapper = getattr(model, "hf_to_vllm_mapper", None)
        packed = getattr(model, "packed_modules_mapping", None) or {}
        self.packed = {part: fused for fused, parts in packed.items() for part in parts}
        self.checkpoint = _checkpoint_shapes(model_config)
        self._mapped: dict[str, str | None] = {}

    def vllm_name(self, name: str) -> str | None:
        """The model parameter `name` lands in (None: vLLM drops it on purpose)."""
        if name in self._mapped:
            return self._mapped[name]
        result: str | None = name if name in self.params else ""
        if result == "" and self.mapper is not None:
            try:
                mapped = self.mapper.map_name(name)
            except Exception:  # noqa: BLE001 - a mapper that cannot map it: try the other ways
                mapped = ""
            if mapped is None or mapped in self.params:
                result = mapped
        if result == "":
            module, _, leaf = name.rpartition(".")
            parent, _, last = module.rpartition(".")
            fused = self.packed.get(last)
            if fused is not None and f"{parent}.{fused}.{leaf}".lstrip(".") in self.params:
                result = f"{parent}.{fused}.{leaf}".lstrip(".")
        if result == "" and name.endswith(IGNORED_SUFFIXES):
            result = None
        self._mapped[name] = result
        return result

    def known(self, name: str) -> bool:
        return name in (self.checkpoint or {}) or self.vllm_name(name) != ""

    def shape_problem(self, name: str, tensor: torch.Tensor) -> str | None:
        return shape_problem(self.checkpoint, name, tensor.shape)

    def group(self, name: str) -> str:
        """The vLLM layer a checkpoint tensor loads into: names of one group are loaded together."""
        target = self.vllm_name(name) or name
        module = target.rpartition(".")[0]
        return EXPERT_INDEX.sub(".experts.", module + ".").rstrip(".")


def _checkpoint_shapes(model_config) -> dict[str, tuple[int, ...]] | None:
    """name -> shape of the safetensors checkpoint vLLM loaded; None if it cannot be found."""
    path = str(getattr(model_config, "model", "") or "")
    directory = path if os.path.isdir(path) else None
    if directory is None and path:
        try:  # a hub id: the files vLLM downloaded are in the local cache
            from huggingface_hub import snapshot_download

            directory = snapshot_download(path, revision=getattr(model_config, "revision", None),
                                          allow_patterns=["*.safetensors"], local_files_only=True)
        except Exception:  # noqa: BLE001 - no local copy: names only
            return None
    return safetensors_shapes(directory or "")


def _described(error: BaseException, text: str) -> str:
    """`text` and the notes a cleanup added to the error (they do not survive pickling otherwise)."""
    notes = getattr(error, "__notes__", None) or []
    return "; ".join([text, *notes])


def _release_after_failure(snapshot: StoreSnapshot, error: str) -> None:
    """Release a version that was not applied; a failure to release is logged, so that the error
    being raised is the apply's own (the lease goes with the connection anyway)."""
    try:
        snapshot.release(applied=False, error=error)
    except Exception as release_error:  # noqa: BLE001 - the caller raises the real error
        logger.error("weightsync: releasing the version failed: %r (after: %s)", release_error, error)


def model_parallel_rank() -> tuple[int, int, int, int]:
    """(tensor-parallel rank, size, pipeline-parallel rank, size) of this vLLM worker; (0, 1, 0, 1)
    where vLLM's parallel groups are not set up (a model used outside a vLLM worker)."""
    try:
        from vllm.distributed import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            return 0, 1, 0, 1
        tp, pp = parallel_state.get_tp_group(), parallel_state.get_pp_group()
        return tp.rank_in_group, tp.world_size, pp.rank_in_group, pp.world_size
    except Exception:  # noqa: BLE001 - no groups: one rank
        return 0, 1, 0, 1


def rank_engine_name(name: str, tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """The name a rank attaches as: `name` for the first rank (and "" stays "": a driven vLLM's
    ranks attach unnamed), NAME:tpR for the others (NAME:ppPtpR with pipeline parallelism). Each
    rank releases its own leases, so each reports what it applied under a name of its own: one
    shared record would show whichever rank released last."""
    if not name or (tp_rank == 0 and pp_rank == 0):
        return name
    return f"{name}:pp{pp_rank}tp{tp_rank}" if pp_size > 1 else f"{name}:tp{tp_rank}"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return device.type


class WeightSyncEngine(WeightTransferEngine[WeightSyncInitInfo, WeightSyncUpdateInfo]):
    """vLLM worker side of weightsync: applies the node's committed versions to the model."""

    init_info_cls = WeightSyncInitInfo
    update_info_cls = WeightSyncUpdateInfo
    # The node's store holds the target model's weights; a draft model is not in it.
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self._client: EngineClient | None = None
        self._names: ModelNames | None = None
        self._session = False
        self.last_apply: ApplyStats | None = None
        self.rank_label = "tp0/1"
        """This worker's place in vLLM's model-parallel groups (tp R/N, pp R/N), for logs."""

    # -- lifecycle ---------------------------------------------------------------------
    def init_transfer_engine(self, init_info: WeightSyncInitInfo) -> None:
        self.shutdown()  # a second init (the server restarted, a new driver) replaces the connection
        tp_rank, tp_size, pp_rank, pp_size = model_parallel_rank()
        self.rank_label = f"tp{tp_rank}/{tp_size}" + (f" pp{pp_rank}/{pp_size}" if pp_size > 1 else "")
        name = rank_engine_name(init_info.engine_name, tp_rank, pp_rank, pp_size)
        if len(name) > 128:
            raise WeightSyncUpdateError("ENGINE_NAME_INVALID", f"engine_name {init_info.engine_name!r} is too long for "
                                        f"rank {self.rank_label}'s name {name!r} (128 characters at most)")
        try:
            self._client = EngineClient(
                server=init_info.server or None, socket_path=init_info.local_socket or None,
                name=name, device=_device_name(self.device),
                token=init_info.token or None, timeout=init_info.timeout_s,
            )
        except EngineError as error:
            raise WeightSyncUpdateError(error.reason, f"cannot attach to the weightsync store: {error}") from None
        except OSError as error:
            where = init_info.local_socket or init_info.server
            raise WeightSyncUpdateError("SERVER_UNREACHABLE", f"cannot reach weightsync at {where}: {error}") from None
        logger.info("weightsync: rank %s attached to the node's store at %s as %r (device %s, pid %d)", self.rank_label,
                    self._client.socket_path, name or "(driven)", self._client.device, os.getpid())

    def start_weight_update(self) -> None:
        self._require_client()
        self._session = True

    def finish_weight_update(self) -> None:
        # Everything happened in update_weights; vLLM records the weight_version itself.
        self._session = False

    def shutdown(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except OSError:
                pass

    def _require_client(self) -> EngineClient:
        if self._client is None:
            raise WeightSyncUpdateError("NOT_INITIALIZED", "call init_weight_transfer_engine first")
        return self._client

    # -- one update --------------------------------------------------------------------
    def receive_weights(self, update_info: WeightSyncUpdateInfo) -> None:
        client = self._require_client()
        stats = ApplyStats()
        started = time.perf_counter()
        try:
            snapshot = client.acquire(generation=update_info.generation, wait=update_info.wait_s)
        except EngineError as error:
            raise WeightSyncUpdateError(error.reason, str(error).partition(": ")[2] or str(error)) from None
        stats.acquire_s = time.perf_counter() - started
        stats.version, stats.generation = snapshot.version.version, snapshot.generation
        label = f"version {snapshot.version.version!r} (generation {snapshot.generation})"
        try:
            names = self._select(snapshot, update_info, stats)
            stats.check_s = time.perf_counter() - started - stats.acquire_s
            if names:
                self._load(snapshot, names, stats)
        except WeightSyncUpdateError as error:
            message = f"{label} not applied, the engine keeps its weights: {_described(error, error.detail)}"
            _release_after_failure(snapshot, f"{error.reason}: {message}")
            logger.warning("weightsync: %s: %s", error.reason, message)
            raise WeightSyncUpdateError(error.reason, message) from None
        except BaseException as error:
            message = f"{label} not applied: {type(error).__name__}: {_described(error, str(error))}"
            _release_after_failure(snapshot, f"LOAD_FAILED: {message}")
            logger.warning("weightsync: LOAD_FAILED: %s", message)
            raise WeightSyncUpdateError("LOAD_FAILED", message) from error
        # Finalized: every byte is in the model's own tensors; release() waits for the GPU copies
        # out of the store to finish before the lease goes.
        snapshot.release(applied=True)
        stats.total_s = time.perf_counter() - started
        self.last_apply = stats
        logger.info("weightsync: rank %s applied %s: %d tensors (%d to complete fused layers), %.1f MB in %.3f s "
                    "(acquire %.3f, check %.3f, load %.3f, finalize %.3f)%s", self.rank_label, label, stats.tensors,
                    stats.completed_from_store, stats.bytes / 1e6, stats.total_s, stats.acquire_s, stats.check_s,
                    stats.load_s, stats.finalize_s,
                    f"; skipped {len(stats.skipped)} stale unknown tensor(s)" if stats.skipped else "")

    def _model_names(self) -> ModelNames:
        if self._names is None or self.model is not self._default_model:
            self._names = ModelNames(self.model, self.model_config)
        return self._names

    def _select(self, snapshot: StoreSnapshot, info: WeightSyncUpdateInfo, stats: ApplyStats) -> list[str]:
        """The store tensors to load, checked against the model; raises before anything is touched."""
        model = self._model_names()
        changed = snapshot.changed_since(info.since_generation)
        unknown = [n for n in changed if not model.known(n)]
        mismatched = [(n, p) for n in changed if n not in unknown
                      and (p := model.shape_problem(n, snapshot.tensors[n])) is not None]
        bad = set(unknown) | {n for n, _ in mismatched}
        if info.strict:
            # Only the version being applied can be refused for them: the store keeps every name
            # it ever received, so an older one would block every later version.
            fresh_unknown = [n for n in unknown if snapshot.written[n] == snapshot.generation]
            fresh_mismatched = [p for n, p in mismatched if snapshot.written[n] == snapshot.generation]
            if fresh_mismatched:
                raise WeightSyncUpdateError("TENSOR_MISMATCH", f"{len(fresh_mismatched)} tensor(s) do not fit "
                                            f"{model.model_class}: " + "; ".join(fresh_mismatched[:5]))
            if fresh_unknown:
                raise WeightSyncUpdateError("TENSOR_NOT_IN_MODEL", f"{len(fresh_unknown)} tensor(s) are not weights "
                                            f"of {model.model_class}: "
                                            + ", ".join(repr(n) for n in fresh_unknown[:5])
                                            + (" ..." if len(fresh_unknown) > 5 else ""))
        if bad:
            stats.skipped = sorted(bad)
            logger.warning("weightsync: skipping %d tensor(s) the model does not take (written by an earlier "
                           "version): %s", len(bad), ", ".join(sorted(bad)[:5]))
        selected = {n for n in changed if n not in bad and model.vllm_name(n) is not None}
        # Complete every touched layer: vLLM processes a layer once all its elements arrived, and a
        # layer left half-loaded would be processed with garbage in the rest.
        groups = {model.group(n) for n in selected}
        completion = {n for n in snapshot.tensors if n not in selected and n not in bad
                      and model.known(n) and model.vllm_name(n) is not None and model.group(n) in groups
                      and model.shape_problem(n, snapshot.tensors[n]) is None}
        stats.completed_from_store = len(completion)
        return sorted(selected | completion)

    def _load(self, snapshot: StoreSnapshot, names: list[str], stats: ApplyStats) -> None:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        load_started = time.perf_counter()
        fed: set[str] = set()

        def feed(batch: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
            for name in batch:
                fed.add(name)
                tensor = snapshot.tensors[name]
                stats.bytes += tensor.numel() * tensor.element_size()
                yield name, tensor

        initialize_layerwise_reload(self.model)
        try:
            with torch.no_grad():
                self.model.load_weights(feed(names))
                if self._partial_layers():
                    # Grouping by name missed a fused layer (an unusual model): load the rest of the
                    # store, which completes every layer.
                    rest = [n for n in sorted(snapshot.tensors) if n not in fed and n not in stats.skipped
                            and self._model_names().vllm_name(n) is not None]
                    logger.warning("weightsync: layers %s were loaded in part; loading the other %d tensors of "
                                   "the store too", self._partial_layers()[:3], len(rest))
                    stats.completed_from_store += len(rest)
                    self.model.load_weights(feed(rest))
                    partial = self._partial_layers()
                    if partial:
                        raise WeightSyncUpdateError("LAYER_INCOMPLETE", f"the store does not hold every weight of "
                                                    f"layer(s) {', '.join(partial[:3])}")
        except BaseException as failure:
            # Put the layers back, but the load's own error is the one raised: a failure while
            # restoring is logged and noted on it, never raised in its place.
            try:
                self._discard_unprocessed()
                finalize_layerwise_reload(self.model, self.model_config)
            except Exception as cleanup_error:  # noqa: BLE001 - reported with the original error
                logger.error("weightsync: restoring the layers after a failed load failed too: %r", cleanup_error)
                failure.add_note(f"restoring the layers failed too: {cleanup_error!r}")
            raise
        stats.tensors = len(fed)
        finalize_started = time.perf_counter()
        stats.load_s = finalize_started - load_started
        finalize_layerwise_reload(self.model, self.model_config)
        stats.finalize_s = time.perf_counter() - finalize_started
        snapshot.applied = True

    def _layer_infos(self):
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        for name, module in self.model.named_modules():
            info = LAYERWISE_INFO.get(module)
            if info is not None and info.can_load():
                yield name, module, info, is_deferred_attention_layer(module)

    def _partial_layers(self) -> list[str]:
        """Layers that got some but not all of their elements (processed only when complete)."""
        return [name or "<model>" for name, _, info, deferred in self._layer_infos()
                if not deferred and 0 < info.load_numel < (info.load_numel_total or 0)]

    def _discard_unprocessed(self) -> None:
        """Forget what layers buffered but did not process: finalize then puts their current
        tensors back instead of processing a half-loaded layer."""
        for _, _, info, _ in self._layer_infos():
            info.load_numel = 0
            info.loaded_weights.clear()
