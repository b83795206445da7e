"""WeightSyncCheckpointEngine: verl's CheckpointEngine over weightsync, registered as "weightsync".

verl drives it per sync (CheckpointEngineManager.update_weights): `prepare` on every actor rank and
rollout worker, the class's `build_topology` on their answers, `init_process_group` with each one's
part of it, then `send_weights` on every actor rank beside `receive_weights` on every rollout
worker, then `finalize`. What each does here:

- actor rank 0 (verl's `is_master`) pushes the step's full tensors with the SDK (one
  WeightSyncClient kept across steps, so delta compares against the last commit) as the version
  str(global_steps), and publishes the outcome in a small TCPStore it hosts; every other actor rank
  drains its generator (FSDP gathers run on every rank) and waits for that outcome, so a failed
  push raises WeightSyncVerlError(PUSH_FAILED, rank=0) on every actor rank, and a sender that died
  SENDER_LOST (rank=0) on the others, each within timeout_s.
- a rollout worker waits (bounded) until its node's server has committed that version, or until
  the sender's outcome says the push failed (PUSH_FAILED, rank=0, at once) or the sender is gone
  (SENDER_LOST); it then leases the committed version
  through the EngineClient (the node's one store, mapped read-only, no copy), checks that the
  leased version is the one asked for, and yields its tensors to verl's server adapter; the lease
  is released (applied) when the adapter has taken them all.

The shape leaves room for several senders (one part of a version per actor rank): only the
sending rank's push changes; the outcome exchange already runs between every actor rank.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import structlog
import torch
from torch.distributed import TCPStore
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from weightsync.client import UpdateFailed, WeightSyncClient, WeightSyncClientError
from weightsync.engine import EngineClient, EngineError
from weightsync.integrations.verl.config import VerlSyncConfig
from weightsync.integrations.verl.errors import WeightSyncVerlError

log = structlog.get_logger("weightsync.integrations.verl")

BACKEND = "weightsync"
SENDER_RANK = 0
"""The actor rank that pushes (verl's is_master: the rank whose generator holds full tensors)."""
STATUS_POLL_S = 0.02
"""How often a waiting rollout worker asks its node's local socket for the committed version."""


def version_label(global_steps: int | None) -> str:
    if global_steps is None:
        raise WeightSyncVerlError("STEP_MISSING", "verl gave no global_steps: it is the version label")
    return str(int(global_steps))


async def _drain(weights: Any) -> list[tuple[str, torch.Tensor]]:
    """verl hands a generator (or an async one) of (name, tensor): take every item."""
    if hasattr(weights, "__aiter__"):
        return [item async for item in weights]
    return list(weights)


@CheckpointEngineRegistry.register(BACKEND)
class WeightSyncCheckpointEngine(CheckpointEngine):
    """verl's checkpoint engine "weightsync": rollout.checkpoint_engine.backend=weightsync."""

    def __init__(self, bucket_size: int, is_master: bool = False, **engine_kwargs: Any) -> None:
        # bucket_size (update_weights_bucket_megabytes) sizes verl's own buckets; weightsync's SDK
        # picks its own, so it is kept for nothing but the record.
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.config = VerlSyncConfig.from_engine_kwargs(**engine_kwargs)
        self.role: str | None = None
        self.rank = -1
        self.syncs = 0
        """Syncs this worker took part in: every worker counts alike (verl calls each once a sync),
        which names the sync's outcome in the sender's store."""
        self._client: WeightSyncClient | None = None
        self._engine_client: EngineClient | None = None
        self._outcomes: TCPStore | None = None

    # -- verl's lifecycle ---------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        """The sending rank opens its outcome store (once) and says where it listens."""
        if not self.is_master:
            return {}
        if self._outcomes is None:
            self._outcomes = TCPStore(self.config.outcome_host, 0, is_master=True, wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=self.config.timeout_s))
        return {"outcome_store": f"{self.config.outcome_host}:{self._outcomes.port}"}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """metadata lists the actor ranks' answers first (verl's order), then the rollout's."""
        store = metadata[SENDER_RANK].get("outcome_store", "") if actor_wg_world_size else ""
        actor = {"role": ["actor"] * actor_wg_world_size, "rank": list(range(actor_wg_world_size)),
                 "world_size": [actor_wg_world_size] * actor_wg_world_size,
                 "outcome_store": [store] * actor_wg_world_size}
        rollout = {"role": ["rollout"] * rollout_world_size, "rank": list(range(rollout_world_size)),
                   "world_size": [rollout_world_size] * rollout_world_size,
                   "outcome_store": [store] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, *, role: str, rank: int, world_size: int, outcome_store: str) -> None:
        """Connects what this worker's role needs, once: the SDK client (sender), the outcome store
        (every other worker), the node's EngineClient (rollout)."""
        self.role, self.rank = role, rank
        if role == "actor" and rank == SENDER_RANK:
            if not self.is_master:
                raise WeightSyncVerlError("CONFIG_INVALID", "actor rank 0 was built without is_master")
            if self._client is None:
                self._client = WeightSyncClient(list(self.config.servers), token=self.config.token,
                                                timeout=self.config.timeout_s)
        else:
            if self._outcomes is None:
                host, _, port = outcome_store.rpartition(":")
                try:
                    self._outcomes = TCPStore(host, int(port), is_master=False,
                                              timeout=datetime.timedelta(seconds=self.config.timeout_s))
                except (RuntimeError, ValueError) as error:
                    raise WeightSyncVerlError("SENDER_LOST", f"{role} {rank} cannot reach the sending rank's "
                                              f"outcome store {outcome_store!r}: {error}", rank=SENDER_RANK) from None
        if role == "rollout" and self._engine_client is None:
            self._engine_client = EngineClient(server=self.config.node_server or self.config.servers[0],
                                               name=f"verl-rollout-{rank}", token=self.config.token,
                                               timeout=self.config.timeout_s)

    def finalize(self) -> None:
        """Nothing per step: the client (its delta copy), the group and the store outlive a sync."""

    def close(self) -> None:
        for closable in (self._client, self._engine_client):
            if closable is not None:
                closable.close()
        self._client = self._engine_client = self._outcomes = None

    # -- actor side ------------------------------------------------------------------------------
    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | Any,
                           global_steps: int | None = None) -> dict[str, float]:
        if self.role != "actor":
            raise WeightSyncVerlError("NOT_INITIALIZED", "send_weights before init_process_group made this an actor rank")
        version = version_label(global_steps)
        self.syncs += 1
        key = f"weightsync/outcome/{self.syncs}"
        if self.rank != SENDER_RANK:
            await _drain(weights)  # the gathers of a sharded model run on every rank
            return await asyncio.to_thread(self._await_outcome, key, version)
        outcome: dict[str, Any] = {"ok": False, "reason": "PUSH_FAILED", "cause_reason": "", "message": ""}
        try:
            named = await _drain(weights)
            result = await asyncio.to_thread(self._push, named, version)
            outcome = {"ok": True, "seconds": result.seconds, "bytes_sent": result.bytes_sent,
                       "dense_bytes": result.dense_bytes}
        except UpdateFailed as error:
            outcome["cause_reason"], outcome["message"] = error.reason, str(error)
        except WeightSyncClientError as error:
            outcome["cause_reason"] = getattr(error, "reason", "") or type(error).__name__
            outcome["message"] = str(error)
        except BaseException as error:
            outcome["cause_reason"], outcome["message"] = type(error).__name__, str(error)
            self._publish(key, outcome)
            raise
        self._publish(key, outcome)
        return self._metrics(outcome, version)

    def _push(self, named: list[tuple[str, torch.Tensor]], version: str):
        assert self._client is not None
        if self.config.transport == "collective" and self._client.group_id is None:
            self._client.create_group(timeout=self.config.timeout_s)
        result = self._client.push(named, version=version, mode=self.config.mode, transport=self.config.transport,
                                   delta=self.config.delta)  # type: ignore[arg-type]
        log.info("verl sync pushed", version=version, seconds=round(result.seconds, 4),
                 bytes_sent=result.bytes_sent, dense_bytes=result.dense_bytes)
        return result

    def _publish(self, key: str, outcome: dict[str, Any]) -> None:
        if self._outcomes is not None:
            self._outcomes.set(key, json.dumps(outcome))

    def _await_outcome(self, key: str, version: str) -> dict[str, float]:
        assert self._outcomes is not None
        try:
            self._outcomes.wait([key], datetime.timedelta(seconds=self.config.timeout_s))
            outcome = json.loads(self._outcomes.get(key))
        except RuntimeError as error:  # torch's DistStoreError / a closed connection: the sender is gone
            raise WeightSyncVerlError("SENDER_LOST", f"actor rank {self.rank}: no outcome of version {version} "
                                      f"from sending rank {SENDER_RANK} within {self.config.timeout_s} s: {error}",
                                      rank=SENDER_RANK, version=version) from None
        return self._metrics(outcome, version)

    def _metrics(self, outcome: dict[str, Any], version: str) -> dict[str, float]:
        if not outcome["ok"]:
            raise WeightSyncVerlError(
                "PUSH_FAILED", f"actor rank {SENDER_RANK} failed to push version {version} "
                f"({outcome['cause_reason']}): {outcome['message']}",
                rank=SENDER_RANK, version=version, cause_reason=outcome["cause_reason"])
        return {"weightsync/push_s": float(outcome["seconds"]), "weightsync/bytes_sent": float(outcome["bytes_sent"]),
                "weightsync/dense_bytes": float(outcome["dense_bytes"])}

    # -- rollout side ----------------------------------------------------------------------------
    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """The committed tensors of version str(global_steps), as read-only views into the node's
        store: valid until the generator finishes (the adapter copies them into its model)."""
        if self.role != "rollout" or self._engine_client is None:
            raise WeightSyncVerlError("NOT_INITIALIZED", "receive_weights before init_process_group made this a rollout worker")
        version = version_label(global_steps)
        self.syncs += 1
        snapshot = await asyncio.to_thread(self._lease, version, f"weightsync/outcome/{self.syncs}")
        try:
            for name in sorted(snapshot.tensors):
                yield name, snapshot.tensors[name]
        except BaseException as error:
            snapshot.release(applied=False, error=f"{type(error).__name__}: {error}")
            raise
        snapshot.release(applied=True)

    def _lease(self, version: str, key: str):
        client = self._engine_client
        assert client is not None
        deadline = time.monotonic() + self.config.timeout_s
        held = ""
        while True:
            status = client.status()
            held = status.version.version
            if held == version:
                try:
                    snapshot = client.acquire(generation=status.version.generation,
                                              wait=max(0.001, deadline - time.monotonic()))
                except EngineError as error:
                    if error.reason not in ("VERSION_GONE", "STORE_UPDATING", "STORE_INCONSISTENT"):
                        raise
                else:
                    if snapshot.version.version == version:
                        return snapshot
                    snapshot.release(applied=False, error=f"leased {snapshot.version.version!r}, not {version!r}")
            else:
                self._sender_failed(key, version)
            if _later(held, version):
                raise WeightSyncVerlError("VERSION_GONE", f"rollout worker {self.rank}: the node holds version "
                                          f"{held!r}, later than {version!r}", version=version)
            if time.monotonic() >= deadline:
                raise WeightSyncVerlError("VERSION_NOT_COMMITTED", f"rollout worker {self.rank}: version {version!r} "
                                          f"not committed on its node within {self.config.timeout_s} s (it holds "
                                          f"{held!r})", version=version)
            time.sleep(STATUS_POLL_S)

    def _sender_failed(self, key: str, version: str) -> None:
        """Raises at once what the sender published for this sync, if it failed (or is gone)."""
        assert self._outcomes is not None
        try:
            if not self._outcomes.check([key]):
                return
            outcome = json.loads(self._outcomes.get(key))
        except RuntimeError as error:
            raise WeightSyncVerlError("SENDER_LOST", f"rollout worker {self.rank}: the sending rank's outcome store "
                                      f"is gone while waiting for version {version}: {error}",
                                      rank=SENDER_RANK, version=version) from None
        if not outcome["ok"]:
            self._metrics(outcome, version)  # raises PUSH_FAILED naming the sender


def _later(held: str, wanted: str) -> bool:
    return held.isdigit() and wanted.isdigit() and int(held) > int(wanted)
