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
import threading
import time
from collections.abc import Iterable, Iterator

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.logger import init_logger

from weightsync.engine import vllm_ranks
from weightsync.engine.client import EngineClient, EngineError, StoreSnapshot
from weightsync.engine.vllm_infos import (  # noqa: F401 - WeightSyncInitInfo and the rest: this module's API
    ADDRESS,
    ENGINE_NAME,
    PHASES,
    ApplyStats,
    WeightSyncInitInfo,
    WeightSyncUpdateError,
    WeightSyncUpdateInfo,
)
from weightsync.engine.vllm_model_names import ModelNames
from weightsync.engine.vllm_prepare import Preparation, Preparations, PrepareFailed
from weightsync.engine.vllm_ranks import model_parallel_rank, rank_engine_name
from weightsync.engine.vllm_staging import (
    StagingUnavailable,
    feed,
    stage,
    staging_disabled,
    staging_room,
)

RELEASE_WAIT_SECONDS = 30.0
"""The longest a call waits for the previous apply's release (the local socket's own bound is longer)."""
# Under "vllm.": vLLM's handler formats and keeps these records in its worker processes.
logger = init_logger("vllm.plugins.weightsync")

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


def _release_applied(snapshot: StoreSnapshot) -> None:
    """Report a swapped-in version as applied; a failure (the server went away) is logged: the model serves
    the version either way, and the lease goes with the connection."""
    try:
        snapshot.release(applied=True)
    except (EngineError, OSError) as error:
        logger.warning("weightsync: reporting generation %d as applied failed: %r", snapshot.generation, error)


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
        self._preparations = Preparations(self._stage_preparation)
        self._releasing: threading.Thread | None = None
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
        # Everything happened in update_weights; vLLM records the weight_version itself. A swapped-in
        # version's lease goes back after its apply returned: by the end of the update it has.
        self._session = False
        self._released()

    def shutdown(self) -> None:
        self._preparations.drop("the engine shuts down")
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except OSError:
                pass

    def _released(self) -> None:
        """Wait for the release the last apply left running (bounded: a local-socket round trip)."""
        releasing, self._releasing = self._releasing, None
        if releasing is not None:
            releasing.join(RELEASE_WAIT_SECONDS)

    def _require_client(self) -> EngineClient:
        if self._client is None:
            raise WeightSyncUpdateError("NOT_INITIALIZED", "call init_weight_transfer_engine first")
        return self._client

    # -- one update --------------------------------------------------------------------
    def receive_weights(self, update_info: WeightSyncUpdateInfo) -> None:
        client = self._require_client()
        self._released()  # the last apply's lease first: the server sees one engine state at a time
        if update_info.phase == "prepare":
            try:
                self._preparations.start(client, self._acquire(client, update_info), update_info, ApplyStats())
            except (EngineError, OSError) as error:
                raise WeightSyncUpdateError(getattr(error, "reason", "SERVER_UNREACHABLE"), str(error)) from None
            return
        if update_info.phase == "apply":
            self._apply_prepared(update_info)
            return
        stats = ApplyStats(apply_started=time.monotonic())
        started = time.perf_counter()
        snapshot, names, refusal = None, [], None
        try:
            snapshot = self._acquire(client, update_info)
            stats.acquire_s = time.perf_counter() - started
            names = self._select(snapshot, update_info, stats)
            stats.check_s = time.perf_counter() - started - stats.acquire_s
        except WeightSyncUpdateError as error:
            refusal = error if snapshot is None else self._not_applied(snapshot, error)
        if not self._agreed(refusal, snapshot):
            return
        try:
            if names:
                self._load(snapshot, names, stats)
        except BaseException as error:
            raise self._not_applied(snapshot, error) from (None if isinstance(error, WeightSyncUpdateError) else error)
        self._applied(snapshot, stats, started)

    def _agreed(self, refusal: WeightSyncUpdateError | None, held: StoreSnapshot | None) -> bool:
        """Whether every one of vLLM's ranks is ready to change its model (engine/vllm_ranks.py). A rank
        that refused, alone: its error. With several ranks, when any refused: the last rank raises one
        error naming each rank's outcome, every other rank gives `held` back unapplied, ends vLLM's
        update session itself and this returns False."""
        rank, size, group = vllm_ranks.world()
        if size == 1:
            if refusal is not None:
                raise refusal
            return True
        outcomes = vllm_ranks.gather(group, size, self.rank_label,
                                     "" if refusal is None else f"{refusal.reason}: {refusal.detail}")
        if all(not text for _, text in outcomes):
            return True
        reason, message = vllm_ranks.combined(outcomes)
        if held is not None and not held.released:
            _release_after_failure(held, f"{reason}: {message}")
        if rank == size - 1:
            raise WeightSyncUpdateError(reason, message)
        vllm_ranks.end_session(self)
        return False

    def _acquire(self, client: EngineClient, info: WeightSyncUpdateInfo) -> StoreSnapshot:
        try:
            return client.acquire(generation=info.generation, wait=info.wait_s)
        except EngineError as error:
            raise WeightSyncUpdateError(error.reason, str(error).partition(": ")[2] or str(error)) from None
        except OSError as error:  # LocalWireError too: the server went away (restarted): attach again
            raise WeightSyncUpdateError("SERVER_UNREACHABLE", f"the connection to weightsync at "
                                        f"{client.socket_path} is gone: {error}") from None

    def _not_applied(self, snapshot: StoreSnapshot, error: BaseException) -> WeightSyncUpdateError:
        """Release `snapshot` unapplied, saying why; the typed error to raise (the engine keeps its weights)."""
        label = f"version {snapshot.version.version!r} (generation {snapshot.generation})"
        if isinstance(error, WeightSyncUpdateError | PrepareFailed):
            reason = error.reason
            message = f"{label} not applied, the engine keeps its weights: {_described(error, error.detail)}"
        else:
            reason = "LOAD_FAILED"
            message = f"{label} not applied: {type(error).__name__}: {_described(error, str(error))}"
        _release_after_failure(snapshot, f"{reason}: {message}")
        logger.warning("weightsync: %s: %s", reason, message)
        return WeightSyncUpdateError(reason, message)

    def _applied(self, snapshot: StoreSnapshot, stats: ApplyStats, started: float, *, later: bool = False) -> None:
        # Finalized: every byte is in the model's own tensors; release() waits for the GPU copies
        # out of the store to finish before the lease goes. later (a swapped-in version, which read
        # nothing from the store in the apply): the release is a local-socket round trip the pause
        # need not hold, so it runs beside the engine's next steps, and the next call waits for it.
        if later:
            self._releasing = threading.Thread(target=_release_applied, args=(snapshot,), daemon=True,
                                               name="weightsync-release")
            self._releasing.start()
        else:
            snapshot.release(applied=True)
        stats.version, stats.generation = snapshot.version.version, snapshot.generation
        stats.total_s = time.perf_counter() - started
        stats.apply_ended = time.monotonic()
        self.last_apply = stats
        label = f"version {snapshot.version.version!r} (generation {snapshot.generation})"
        how = ""
        if stats.prepared_s:
            how = (f"; prepared while serving in {stats.prepared_s:.3f} s, then "
                   + (f"swapped in {stats.swap_s:.3f} s" if stats.staged else f"loaded in the pause ({stats.fallback})"))
        logger.info("weightsync: rank %s applied %s: %d tensors (%d to complete fused layers), %.1f MB in %.3f s "
                    "(acquire %.3f, check %.3f, load %.3f, finalize %.3f)%s%s", self.rank_label, label, stats.tensors,
                    stats.completed_from_store, stats.bytes / 1e6, stats.total_s, stats.acquire_s, stats.check_s,
                    stats.load_s, stats.finalize_s,
                    f"; skipped {len(stats.skipped)} stale unknown tensor(s)" if stats.skipped else "", how)

    def _stage_preparation(self, preparation: Preparation) -> None:
        """In the preparation's thread, while vLLM steps: check the version, then stage it (or say why not)."""
        from weightsync.client.intra_op import one_intra_op_thread

        stats = preparation.stats
        with one_intra_op_thread():  # beside vLLM's own OpenMP threads: no barrier waits on a busy core
            try:
                preparation.names = self._select(preparation.reading, preparation.request, stats)
            except WeightSyncUpdateError as error:
                raise PrepareFailed(error.reason, error.detail) from None
            tensors = preparation.reading.tensors
            needed = sum(tensors[n].numel() * tensors[n].element_size() for n in preparation.names)
            problem = ("WEIGHTSYNC_VLLM_STAGING=0" if staging_disabled()
                       else staging_room(self.device, needed) if preparation.names else "nothing to load")
            if problem is None:
                fed: set[str] = set()
                try:
                    preparation.staged = stage(self.model, self.model_config, feed(tensors, preparation.names, fed))
                    stats.tensors, stats.bytes = len(fed), needed
                except StagingUnavailable as error:
                    problem = str(error)
                except Exception as error:  # noqa: BLE001 - the live model is untouched: load it in the pause
                    logger.warning("weightsync: staging generation %d failed, it loads in the pause: %r",
                                   preparation.generation, error)
                    problem = f"staging failed: {type(error).__name__}: {error}"
            preparation.fallback = problem or ""

    def _apply_prepared(self, info: WeightSyncUpdateInfo) -> None:
        started = time.perf_counter()
        apply_started = time.monotonic()
        preparation, refusal = None, None
        try:
            preparation = self._preparations.take(info.generation, info.wait_s)
        except PrepareFailed as failure:
            logger.warning("weightsync: rank %s: %s", self.rank_label, failure)
            refusal = WeightSyncUpdateError(failure.reason, failure.detail)
        if not self._agreed(refusal, preparation.pinned if preparation else None):
            return
        pinned = preparation.pinned
        stats = preparation.stats
        stats.apply_started, stats.prepared_s = apply_started, preparation.prepare_s
        stats.staged, stats.fallback = preparation.staged is not None, preparation.fallback
        try:
            if preparation.staged is not None:
                swap_started = time.perf_counter()
                preparation.staged.swap()
                stats.swap_s = time.perf_counter() - swap_started
                preparation.staged = None
            elif preparation.names:
                self._load(pinned, preparation.names, stats)
        except BaseException as error:
            raise self._not_applied(pinned, error) from (None if isinstance(error, WeightSyncUpdateError) else error)
        pinned.applied = True
        self._applied(pinned, stats, started, later=stats.staged)

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
