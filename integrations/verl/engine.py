"""WeightSyncCheckpointEngine: verl's CheckpointEngine over weightsync, registered as "weightsync".

verl drives it per sync (CheckpointEngineManager.update_weights): `prepare` on every actor rank and
rollout worker, the class's `build_topology` on their answers, `init_process_group` with each one's
part of it, then `send_weights` on every actor rank beside `receive_weights` on every rollout
worker, then `finalize`. What each does here:

- the actor ranks push the step as the version str(global_steps), with the SDK (one
  WeightSyncClient per rank, kept across steps). Two ways, by `senders` (config.py):
  "all" (the default over INLINE): every actor rank pushes a share of the step, its own part of one
  version (weightsync.client.Part), so every actor NIC sends and the servers commit once, one
  generation for all: DTensors go as each rank's local shards (boxes), plain tensors (verl's
  generators gather: every rank holds them all) are shared out between the ranks by size
  (integrations/shares.py), the same share each step; rank 0 draws the update key and puts it in its
  outcome store. Each rank's whole tensors go with delta (config.delta) against its own last
  commit, its DTensor shards dense (the SDK's parts).
  Over "collective" every actor rank joins one transfer group (the actor ranks, then the servers'
  workers: create_group on every rank, in init_process_group, through the actor ranks' own Gloo
  group), made on the first sync and kept across syncs, made again after a failed one; each part
  sends its buckets point-to-point. close() deletes it.
  "one": actor rank 0 (verl's `is_master`) pushes everything, with delta against the last commit;
  every other actor rank drains its generator (the gathers run on every rank) and waits.
  Each sending rank publishes its outcome in the small TCPStore rank 0 hosts, and every actor rank
  waits for every sender's: a failed push raises WeightSyncVerlError(PUSH_FAILED, rank=the rank at
  fault) on every actor rank, a sender that died SENDER_LOST (its rank) on the others, each within
  timeout_s.
- a rollout worker waits (bounded) until its node's server has committed that version, or until
  a sender's outcome says the push failed (PUSH_FAILED, at once) or the store is gone
  (SENDER_LOST), connecting again to a node server that went away (stopped, restarted: a new
  local socket, looked up from its address) within the same bound; it then leases the committed
  version through the EngineClient (the node's one store, mapped read-only, no copy), checks that the
  leased version is the one asked for, and yields its tensors to verl's server adapter; the lease
  is released (applied) when the adapter has taken them all.
- driver mode (receive "served"): the node's weightsync server drives the engine itself after each
  commit; a rollout worker's receive_weights yields nothing and returns once that engine serves the
  version (its node's WatchWeights events, served.py), or raises ENGINE_FAILED (the engine refused
  it) / VERSION_NOT_SERVED (not served within timeout_s), PUSH_FAILED at once when a sender failed.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import queue
import secrets
import threading
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
import structlog
import torch
import torch.distributed as dist
from torch.distributed import TCPStore
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from weightsync.client import (
    Part,
    PartUpdateFailed,
    UpdateFailed,
    WeightSyncClient,
    WeightSyncClientError,
)
from weightsync.client.parts import is_dtensor
from weightsync.engine import EngineClient, EngineError, StoreSnapshot
from weightsync.integrations.shares import share_out
from weightsync.integrations.verl.config import VerlSyncConfig
from weightsync.integrations.verl.errors import WeightSyncVerlError
from weightsync.integrations.verl.served import ServedWatch
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.v1 import weight_sync_service_pb2_grpc as pb_grpc

log = structlog.get_logger("weightsync.integrations.verl")

BACKEND = "weightsync"
SENDER_RANK = 0
"""The actor rank that hosts the outcome store and draws each sync's update key (verl's is_master);
with senders "one", the only rank that pushes."""
STATUS_POLL_S = 0.02
"""How often a waiting rollout worker asks its node's local socket for the committed version."""
STREAM_GRACE_S = 5.0
"""A WatchWeights stream's gRPC deadline runs this much past the sync's bound, which decides first."""
RECONNECT_POLL_S = 0.25
"""How often a waiting rollout worker tries again to reach its node's server while it cannot."""


def version_label(global_steps: int | None) -> str:
    if global_steps is None:
        raise WeightSyncVerlError("STEP_MISSING", "verl gave no global_steps: it is the version label")
    return str(int(global_steps))


async def _drain(weights: Any) -> list[tuple[str, torch.Tensor]]:
    """verl hands a generator (or an async one) of (name, tensor): take every item."""
    if hasattr(weights, "__aiter__"):
        return [item async for item in weights]
    return list(weights)


def my_share(named: list[tuple[str, torch.Tensor]], rank: int, world: int) -> list[tuple[str, torch.Tensor]]:
    """What actor `rank` pushes of a step every rank drained alike: every DTensor (the SDK sends its
    local shard as a box), and its share of the plain tensors (share_out: every rank holds them all)."""
    plain = [(name, t) for name, t in named if not is_dtensor(t)]
    mine = set(share_out([(name, t.numel() * t.element_size()) for name, t in plain], world)[rank])
    return [(name, t) for name, t in named if is_dtensor(t) or name in mine]


LORA_UNSUPPORTED = "LORA_UNSUPPORTED"
ADAPTER_MARKERS = (".lora_A.", ".lora_B.", ".lora_embedding_A", ".lora_embedding_B", ".lora_magnitude_vector")
"""Parts of the names PEFT gives a LoRA adapter's tensors (get_peft_model_state_dict, as verl's
collect_lora_params yields them once the base model is synced)."""


def refuse_lora(named: list[tuple[str, torch.Tensor]], peft_config: Any, version: str) -> None:
    """LORA_UNSUPPORTED, before a byte moves, when verl hands over a LoRA adapter (its config, or its
    tensors): weightsync stores the tensors it gets, but no engine loader of weightsync loads an
    adapter from the node's store, so the rollout would keep serving the model without it."""
    adapter = [name for name, _ in named if any(marker in name for marker in ADAPTER_MARKERS)]
    if peft_config is None and not adapter:
        return
    what = (f"{len(adapter)} LoRA adapter tensors ({', '.join(adapter[:3])}{', ...' if len(adapter) > 3 else ''})"
            if adapter else "a LoRA adapter's config (peft_config)")
    raise WeightSyncVerlError(
        LORA_UNSUPPORTED, f"version {version}: verl handed over {what}; weightsync cannot have the rollout's engine "
        "load an adapter (its loaders load full weights, not a LoRA adapter and its config). Merge the adapter "
        "into the weights before the sync (actor_rollout_ref.model.lora.merge=True: verl then sends full "
        "weights), or use a checkpoint engine that loads adapters", version=version)


def _outcome_key(sync: int, rank: int) -> str:
    return f"weightsync/outcome/{sync}/{rank}"


def _update_key_key(sync: int) -> str:
    return f"weightsync/update-key/{sync}"


def blamed_rank(failed: dict[int, dict[str, Any]]) -> int:
    """The rank to name among the senders that failed a sync (their published outcomes, by rank):
    the lowest part a server named (failed_part: the part whose failure aborted the version, or whose
    declaration the union refused); else the lowest rank a server said never joined (missing); else
    the lowest sender that failed."""
    named = [int(o["failed_part"]) for o in failed.values() if o.get("failed_part") is not None]
    missing = [int(r) for o in failed.values() for r in o.get("missing", ())]
    return min(named or missing or failed)


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
        which names the sync's outcomes and update key in rank 0's store."""
        self.senders: list[int] = [SENDER_RANK]
        """The actor ranks that push (init_process_group): all of them, or rank 0 alone."""
        self._client: WeightSyncClient | None = None
        self._engine_client: EngineClient | None = None
        self._outcomes: TCPStore | None = None
        self._channel: grpc.Channel | None = None
        """Driver mode: the rollout's channel to its node's server (WatchWeights)."""
        self._parts_group: Any = None
        """senders "all" over "collective": the actor ranks' own Gloo group (Part.group), bounded by timeout_s."""
        self._regroup = False
        """senders "all" over "collective": the last sync failed, so the next init_process_group makes the
        transfer group again on every actor rank (the servers may have marked it BROKEN)."""

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
                 "outcome_store": [store] * actor_wg_world_size,
                 "actor_world": [actor_wg_world_size] * actor_wg_world_size}
        rollout = {"role": ["rollout"] * rollout_world_size, "rank": list(range(rollout_world_size)),
                   "world_size": [rollout_world_size] * rollout_world_size,
                   "outcome_store": [store] * rollout_world_size,
                   "actor_world": [actor_wg_world_size] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, *, role: str, rank: int, world_size: int, outcome_store: str,
                           actor_world: int = 1) -> None:
        """Connects what this worker's role needs, once: the SDK client (each sending rank), the
        outcome store (every worker but rank 0, which hosts it), the node's EngineClient (rollout)."""
        self.role, self.rank = role, rank
        self.senders = list(range(actor_world)) if self.config.all_send else [SENDER_RANK]
        if role == "actor" and rank == SENDER_RANK and not self.is_master:
            raise WeightSyncVerlError("CONFIG_INVALID", "actor rank 0 was built without is_master")
        if role == "actor" and rank in self.senders and self._client is None:
            part = None
            if self.config.all_send:
                group = self._actor_group(rank, actor_world) if self._collective_parts else None
                part = Part(rank=rank, world=actor_world, group=group, join_timeout=self.config.timeout_s)
            self._client = WeightSyncClient(list(self.config.servers), token=self.config.token,
                                            timeout=self.config.timeout_s, part=part)
        if role == "actor" and self._collective_parts:
            self._transfer_group(rank)
        if not (role == "actor" and rank == SENDER_RANK):
            if self._outcomes is None:
                host, _, port = outcome_store.rpartition(":")
                try:
                    self._outcomes = TCPStore(host, int(port), is_master=False,
                                              timeout=datetime.timedelta(seconds=self.config.timeout_s))
                except (RuntimeError, ValueError) as error:
                    raise WeightSyncVerlError("SENDER_LOST", f"{role} {rank} cannot reach the sending rank's "
                                              f"outcome store {outcome_store!r}: {error}", rank=SENDER_RANK) from None
        if role == "rollout" and self.config.receive == "served":
            if self._channel is None:
                self._channel = grpc.insecure_channel(self._node_address())
        elif role == "rollout" and self._engine_client is None:
            try:
                self._node()
            except NodeUnreachable:  # down for now (restarting): receive_weights connects, bounded
                pass

    @property
    def _collective_parts(self) -> bool:
        return self.config.all_send and self.config.transport == "collective"

    def _actor_group(self, rank: int, world: int) -> Any:
        """The actor ranks' own Gloo group, made once (a collective of verl's actor world, which every
        actor rank's init_process_group runs at once): the parts agree on the transfer group and each
        sync's key through it, each collective bounded by timeout_s (the trainer's own group may be
        NCCL, with the trainer's timeout)."""
        if self._parts_group is None:
            if not dist.is_initialized() or (dist.get_rank(), dist.get_world_size()) != (rank, world):
                seen = f"rank {dist.get_rank()} of {dist.get_world_size()}" if dist.is_initialized() else "not initialized"
                raise WeightSyncVerlError("CONFIG_INVALID", f"senders 'all' over 'collective' needs torch.distributed "
                                          f"initialized on every actor rank, its world the actor's ({world} ranks, "
                                          f"this one {rank}): here it is {seen}")
            self._parts_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.config.timeout_s))
        return self._parts_group

    def _transfer_group(self, rank: int) -> None:
        """senders "all" over "collective": the one transfer group of every actor rank and the servers'
        workers (create_group on every rank: part 0 creates it on the servers), made on the first sync and
        kept; after a failed sync every actor rank leaves it (part 0 deletes it on the servers) and makes
        a new one. The actor ranks decide it together (one all-reduce), so a rank that failed alone (its
        create, or the sync) has every rank make the group again. GROUP_FAILED when the group cannot be
        made within timeout_s."""
        assert self._client is not None
        try:
            # Whether any rank lacks the group or failed the last sync (one all-reduce on the actor ranks'
            # Gloo group, bounded by timeout_s): every rank then makes it again, or none does.
            need = torch.tensor([int(self._regroup or self._client.group_id is None)])
            dist.all_reduce(need, op=dist.ReduceOp.MAX, group=self._parts_group)
            self._regroup = True  # until the group is made: a rank that fails below makes it again next time
            if not need.item():
                self._regroup = False
                return
            if self._client.group_id is not None:
                try:
                    self._client.delete_group()
                except WeightSyncClientError as error:  # refused: that server drops it when our store closes
                    log.warning("verl group delete failed", rank=rank, error=str(error))
            group_id = self._client.create_group(timeout=self.config.timeout_s)
            self._regroup = False
        except (WeightSyncClientError, ValueError, RuntimeError) as error:
            raise WeightSyncVerlError("GROUP_FAILED", f"actor rank {rank}: the transfer group of the actor ranks and "
                                      f"the servers' workers was not made within {self.config.timeout_s} s: "
                                      f"{type(error).__name__}: {error}", rank=rank) from None
        log.info("verl transfer group made", rank=rank, group_id=group_id)

    def finalize(self) -> None:
        """Nothing per step: the client (its delta copy), the group and the store outlive a sync (verl calls
        finalize after every sync, and nothing when it is done: close() deletes the group, and the servers
        drop it by themselves once rank 0's process, whose rendezvous store it is, exits)."""

    def close(self) -> None:
        for closable in (self._client, self._engine_client):
            if closable is not None:
                closable.close()
        if self._channel is not None:
            self._channel.close()
        self._client = self._engine_client = self._outcomes = self._channel = None

    # -- actor side ------------------------------------------------------------------------------
    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | Any,
                           global_steps: int | None = None, peft_config: Any = None,
                           **_verl_kwargs: Any) -> dict[str, float]:
        """peft_config: a LoRA adapter's config, as verl hands it to its rollouts' update_weights (verl
        0.9.1 passes none to a checkpoint engine): LORA_UNSUPPORTED, as for adapter tensors in `weights`."""
        if self.role != "actor":
            raise WeightSyncVerlError("NOT_INITIALIZED", "send_weights before init_process_group made this an actor rank")
        version = version_label(global_steps)
        self.syncs += 1
        sync = self.syncs
        if self.rank not in self.senders:
            named = await _drain(weights)  # the gathers of a sharded model run on every rank
            refuse_lora(named, peft_config, version)  # every rank drained the same names: every rank refuses
            return await asyncio.to_thread(self._await_outcomes, sync, version)
        outcome: dict[str, Any] = {"ok": False, "reason": "PUSH_FAILED", "cause_reason": "", "message": ""}
        try:
            named = await _drain(weights)
            refuse_lora(named, peft_config, version)
            key = None
            if self.config.all_send:
                key = await asyncio.to_thread(self._update_key, sync, version)
                named = my_share(named, self.rank, len(self.senders))
            result = await asyncio.to_thread(self._push, named, version, key)
            outcome = {"ok": True, "seconds": result.seconds, "bytes_sent": result.bytes_sent,
                       "dense_bytes": result.dense_bytes}
        except WeightSyncVerlError as error:  # SENDER_LOST (rank 0's key never came), LORA_UNSUPPORTED
            if error.reason == LORA_UNSUPPORTED:  # published as such: the rollout raises the same at once
                outcome["reason"] = LORA_UNSUPPORTED
            outcome["cause_reason"], outcome["message"] = error.reason, str(error)
            self._publish(_outcome_key(sync, self.rank), outcome)
            self._regroup = error.reason != LORA_UNSUPPORTED  # LORA_UNSUPPORTED: nothing was sent
            raise
        except UpdateFailed as error:
            outcome["cause_reason"], outcome["message"] = error.reason, str(error)
            if isinstance(error, PartUpdateFailed):
                outcome["failed_part"], outcome["missing"] = error.failed_part, list(error.missing)
        except WeightSyncClientError as error:
            outcome["cause_reason"] = getattr(error, "reason", "") or type(error).__name__
            outcome["message"] = str(error)
        except BaseException as error:
            outcome["cause_reason"], outcome["message"] = type(error).__name__, str(error)
            self._regroup = True
            if not (self._collective_parts and isinstance(error, RuntimeError)):
                self._publish(_outcome_key(sync, self.rank), outcome)
                raise
            # The actor ranks' Gloo group broke under the parts' agreement (torch's DistBackendError: a rank
            # died). This rank is not at fault: the sender that never publishes its outcome is named.
            outcome["peer_lost"] = True
        self._publish(_outcome_key(sync, self.rank), outcome)
        try:
            return await asyncio.to_thread(self._await_outcomes, sync, version)
        except WeightSyncVerlError as error:
            self._regroup = error.reason != LORA_UNSUPPORTED  # the next init_process_group makes the group again
            raise

    def _update_key(self, sync: int, version: str) -> str:
        """The update key every rank's part of this sync sends: rank 0 draws it into its store, the
        others read it there (bounded by timeout_s: SENDER_LOST naming rank 0)."""
        assert self._outcomes is not None
        name = _update_key_key(sync)
        if self.rank == SENDER_RANK:
            key = f"{version}-{secrets.token_hex(6)}"
            self._outcomes.set(name, key)
            return key
        try:
            self._outcomes.wait([name], datetime.timedelta(seconds=self.config.timeout_s))
            return self._outcomes.get(name).decode()
        except RuntimeError as error:
            raise WeightSyncVerlError("SENDER_LOST", f"actor rank {self.rank}: no update key for version {version} "
                                      f"from rank {SENDER_RANK} within {self.config.timeout_s} s: {error}",
                                      rank=SENDER_RANK, version=version) from None

    def _push(self, named: list[tuple[str, torch.Tensor]], version: str, key: str | None):
        assert self._client is not None
        if self.config.transport == "collective" and self._client.group_id is None and not self._collective_parts:
            self._client.create_group(timeout=self.config.timeout_s)
        result = self._client.push(named, version=version, mode=self.config.mode, transport=self.config.transport,
                                   delta=self.config.delta, part_key=key)  # type: ignore[arg-type]
        log.info("verl sync pushed", version=version, rank=self.rank, tensors=len(named),
                 seconds=round(result.seconds, 4), bytes_sent=result.bytes_sent, dense_bytes=result.dense_bytes)
        return result

    def _publish(self, key: str, outcome: dict[str, Any]) -> None:
        if self._outcomes is not None:
            self._outcomes.set(key, json.dumps(outcome))

    def _await_outcomes(self, sync: int, version: str) -> dict[str, float]:
        """Every sender's outcome of this sync (bounded by timeout_s): the step's metrics, or
        PUSH_FAILED naming the rank at fault, or SENDER_LOST naming a sender that never said."""
        assert self._outcomes is not None
        outcomes: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + self.config.timeout_s
        for rank in self.senders:
            try:
                left = max(0.001, deadline - time.monotonic())
                self._outcomes.wait([_outcome_key(sync, rank)], datetime.timedelta(seconds=left))
                outcomes[rank] = json.loads(self._outcomes.get(_outcome_key(sync, rank)))
            except RuntimeError as error:  # torch's DistStoreError / a closed connection: the sender is gone
                failed = {r: o for r, o in outcomes.items() if not o["ok"] and not o.get("peer_lost")}
                if failed:  # one that said it failed explains the silence of the others (one that lost a peer not)
                    self._raise_failed(failed, version)
                raise WeightSyncVerlError("SENDER_LOST", f"actor rank {self.rank}: no outcome of version {version} "
                                          f"from sending rank {rank} within {self.config.timeout_s} s: {error}",
                                          rank=rank, version=version) from None
            if not outcomes[rank]["ok"] and not outcomes[rank].get("peer_lost"):
                self._raise_failed({rank: outcomes[rank]}, version)
        failed = {r: o for r, o in outcomes.items() if not o["ok"]}
        if failed:  # every sender said, some only that they lost a peer
            self._raise_failed(failed, version)
        return {"weightsync/push_s": max(float(o["seconds"]) for o in outcomes.values()),
                "weightsync/bytes_sent": sum(float(o["bytes_sent"]) for o in outcomes.values()),
                "weightsync/dense_bytes": sum(float(o["dense_bytes"]) for o in outcomes.values())}

    def _raise_failed(self, failed: dict[int, dict[str, Any]], version: str) -> None:
        """PUSH_FAILED naming the rank at fault (blamed_rank), with its own outcome when it published one;
        LORA_UNSUPPORTED (no rank) when a sender refused the step's LoRA adapter."""
        refused = [o for o in failed.values() if o.get("reason") == LORA_UNSUPPORTED]
        if refused:  # nothing was pushed, no rank at fault: verl handed over a LoRA adapter
            raise WeightSyncVerlError(LORA_UNSUPPORTED, refused[0]["message"].removeprefix(f"{LORA_UNSUPPORTED}: "),
                                      version=version)
        rank = blamed_rank(failed)
        reporter = rank if rank in failed else min(failed)
        outcome = failed[reporter]
        told = "" if reporter == rank else f" (as rank {reporter} reports)"
        raise WeightSyncVerlError(
            "PUSH_FAILED", f"actor rank {rank} failed to push version {version}{told} "
            f"({outcome['cause_reason']}): {outcome['message']}",
            rank=rank, version=version, cause_reason=outcome["cause_reason"])

    # -- rollout side ----------------------------------------------------------------------------
    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """The committed tensors of version str(global_steps), as read-only views into the node's
        store: valid until the generator finishes (the adapter copies them into its model)."""
        if self.role != "rollout":
            raise WeightSyncVerlError("NOT_INITIALIZED", "receive_weights before init_process_group made this a rollout worker")
        version = version_label(global_steps)
        self.syncs += 1
        if self.config.receive == "served":  # driver mode: the node's server updates the engine
            await asyncio.to_thread(self._wait_served, version, self.syncs)
            return
        snapshot = await asyncio.to_thread(self._lease, version, self.syncs)
        try:
            for name in sorted(snapshot.tensors):
                yield name, snapshot.tensors[name]
        except BaseException as error:
            snapshot.release(applied=False, error=f"{type(error).__name__}: {error}")
            raise
        snapshot.release(applied=True)

    def _node_address(self) -> str:
        return self.config.node_server or self.config.servers[0]

    def _wait_served(self, version: str, sync: int) -> None:
        """Driver mode: returns once the node's driven engine serves `version` (served.py decides on
        each WatchWeights event); raises at once what a sender published if its push failed; watches
        again, within the same bound, when the node's server went away."""
        assert self._channel is not None
        deadline = time.monotonic() + self.config.timeout_s
        watch = ServedWatch(version=version, engine=self.config.engine, node=self._node_address())
        metadata = (("authorization", f"Bearer {self.config.token}"),) if self.config.token else ()
        unreachable = ""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise watch.timed_out(self.config.timeout_s, unreachable)
            stream = pb_grpc.WeightSyncServiceStub(self._channel).WatchWeights(  # our deadline decides first
                pb.WatchWeightsRequest(), metadata=metadata, timeout=left + STREAM_GRACE_S)
            events: queue.Queue[pb.WatchWeightsResponse | grpc.RpcError | None] = queue.Queue()
            threading.Thread(target=_read_stream, args=(stream, events), daemon=True,
                             name=f"verl-watch-{self.rank}").start()
            try:
                broken = self._follow(watch, events, deadline, sync)
            finally:
                stream.cancel()
            if broken is None:
                log.info("verl sync served", version=version, rank=self.rank, engine=watch.engine,
                         generation=watch.committed)
                return
            if broken.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # the stream's own deadline: ours has passed
                raise watch.timed_out(self.config.timeout_s, unreachable)
            if broken.code() not in (grpc.StatusCode.UNAVAILABLE, None):
                raise WeightSyncVerlError("VERSION_NOT_SERVED", f"rollout worker {self.rank}: the node's server "
                                          f"refused WatchWeights: {broken.code()}: {broken.details()}",
                                          version=version)
            unreachable = f"{broken.code()}: {broken.details()}"
            watch.restart()
            self._sender_failed(sync, version)
            time.sleep(min(RECONNECT_POLL_S, max(0.0, deadline - time.monotonic())))

    def _follow(self, watch: ServedWatch, events: queue.Queue, deadline: float, sync: int) -> grpc.RpcError | None:
        """Reads one WatchWeights stream until the engine serves the version (None) or the stream
        breaks (its error); a failed sender's outcome is looked for between events."""
        while True:
            try:
                event = events.get(timeout=STATUS_POLL_S)
            except queue.Empty:
                self._sender_failed(sync, watch.version)
                if time.monotonic() >= deadline:
                    raise watch.timed_out(self.config.timeout_s, "") from None
                continue
            if isinstance(event, grpc.RpcError) or event is None:
                return event if event is not None else _StreamEnded()
            try:
                if watch.see(event) is not None:
                    return None
            except WeightSyncVerlError as error:
                if error.reason != "VERSION_GONE":  # a sender's failure explains a version never served
                    self._sender_failed(sync, watch.version)
                raise
            if time.monotonic() >= deadline:  # events that keep coming do not stretch the bound
                self._sender_failed(sync, watch.version)
                raise watch.timed_out(self.config.timeout_s, "")

    def _node(self) -> EngineClient:
        """The node's EngineClient, connected (again) when there is none: its local socket is looked
        up from the node's server each time, since a restarted server listens on a new one (its name
        carries the pid). NodeUnreachable when the server or its socket cannot be reached."""
        if self._engine_client is None:
            try:
                self._engine_client = EngineClient(server=self.config.node_server or self.config.servers[0],
                                                   name=f"verl-rollout-{self.rank}", token=self.config.token,
                                                   timeout=self.config.timeout_s)
            except OSError as error:  # the socket named is gone: the server stopped since it answered
                raise NodeUnreachable(f"{type(error).__name__}: {error}") from None
            except EngineError as error:
                if error.reason not in UNREACHABLE:
                    raise
                raise NodeUnreachable(str(error)) from None
        return self._engine_client

    def _drop_node(self) -> None:
        if self._engine_client is not None:
            self._engine_client.close()
            self._engine_client = None

    def _lease(self, version: str, sync: int):
        deadline = time.monotonic() + self.config.timeout_s
        held = ""
        unreachable = ""
        while True:
            try:
                snapshot, held = self._try_lease(version, deadline)
            except NodeUnreachable as error:  # stopped or restarting: its outcome or the deadline decides
                self._drop_node()
                snapshot, held, unreachable = None, "", str(error)
            else:
                unreachable = ""
            if snapshot is not None:
                return snapshot
            if held != version:
                self._sender_failed(sync, version)
            if _later(held, version):
                raise WeightSyncVerlError("VERSION_GONE", f"rollout worker {self.rank}: the node holds version "
                                          f"{held!r}, later than {version!r}", version=version)
            if time.monotonic() >= deadline:
                where = f"its node's server is unreachable ({unreachable})" if unreachable else f"it holds {held!r}"
                raise WeightSyncVerlError("VERSION_NOT_COMMITTED", f"rollout worker {self.rank}: version {version!r} "
                                          f"not committed on its node within {self.config.timeout_s} s ({where})",
                                          version=version)
            time.sleep(RECONNECT_POLL_S if unreachable else STATUS_POLL_S)

    def _try_lease(self, version: str, deadline: float) -> tuple[StoreSnapshot | None, str]:
        """One look at the node: (the snapshot of `version`, or None; the version it holds)."""
        client = self._node()
        try:
            status = client.status()
            held = status.version.version
            if held != version:
                return None, held
            try:
                snapshot = client.acquire(generation=status.version.generation,
                                          wait=max(0.001, deadline - time.monotonic()))
            except EngineError as error:
                if error.reason not in ("VERSION_GONE", "STORE_UPDATING", "STORE_INCONSISTENT"):
                    raise
                return None, held
        except OSError as error:  # the local connection broke (LocalWireError is one): the server went away
            raise NodeUnreachable(f"{type(error).__name__}: {error}") from None
        if snapshot.version.version == version:
            return snapshot, held
        snapshot.release(applied=False, error=f"leased {snapshot.version.version!r}, not {version!r}")
        return None, held

    def _sender_failed(self, sync: int, version: str) -> None:
        """Raises at once what a sender published for this sync, if it failed (or the store is gone)."""
        assert self._outcomes is not None
        failed: dict[int, dict[str, Any]] = {}
        try:
            for rank in self.senders:
                if self._outcomes.check([_outcome_key(sync, rank)]):
                    outcome = json.loads(self._outcomes.get(_outcome_key(sync, rank)))
                    if not outcome["ok"] and not outcome.get("peer_lost"):  # a lost peer names no rank at fault
                        failed[rank] = outcome
        except RuntimeError as error:
            raise WeightSyncVerlError("SENDER_LOST", f"rollout worker {self.rank}: the sending rank's outcome store "
                                      f"is gone while waiting for version {version}: {error}",
                                      rank=SENDER_RANK, version=version) from None
        if failed:
            self._raise_failed(failed, version)


UNREACHABLE = ("SERVER_UNREACHABLE", "DEADLINE_EXCEEDED")
"""EngineClient's reasons for a node server that did not answer (stopped, restarting), not one that refused."""


class NodeUnreachable(Exception):
    """The rollout's node server (or its local socket) cannot be reached now; retried until the deadline."""


def _read_stream(stream: Any, events: queue.Queue) -> None:
    """Feeds a WatchWeights stream's events into `events`, then its error (or None when it ended)."""
    try:
        for event in stream:
            events.put(event)
    except grpc.RpcError as error:
        events.put(error)
        return
    events.put(None)


class _StreamEnded(grpc.RpcError):
    """The server ended a WatchWeights stream (it is stopping): watched again, like an unreachable one."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "the server ended the WatchWeights stream"


def _later(held: str, wanted: str) -> bool:
    return held.isdigit() and wanted.isdigit() and int(held) > int(wanted)
