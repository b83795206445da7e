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
  (integrations/shares.py), the same share each step; the update key is the sync's id. Each rank's
  whole tensors go with delta (config.delta) against its own last commit, its DTensor shards dense
  (the SDK's parts).
  Over "collective" every actor rank joins one transfer group (the actor ranks, then the servers'
  workers: create_group on every rank, in init_process_group, through the actor ranks' own Gloo
  group), made on the first sync and kept across syncs, made again after a failed one; each part
  sends its buckets point-to-point. close() deletes it.
  "one": actor rank 0 (verl's `is_master`) pushes everything, with delta against the last commit;
  every other actor rank drains its generator (the gathers run on every rank) and waits.
  Each sending rank beats while it sends and publishes its outcome in the small TCPStore rank 0
  hosts (outcomes.py), and every actor rank waits for every sender's: a failed push raises
  WeightSyncVerlError(PUSH_FAILED, rank=the rank at fault) on every actor rank, a sender that died
  SENDER_LOST (its rank) on the others, timeout_s after the senders' last sign of life.
- every sync is named by an id actor rank 0 draws at `prepare` (a run token drawn once per engine,
  and its count of syncs) and hands every worker through build_topology: the outcomes, and with
  every rank sending the update key, are keyed by it, so a worker built later (a restarted rollout
  replica, elastic scale-up) and a resumed run (global_steps back at 0, or a checkpoint's step)
  read this sync's and no other's.
- a rollout worker waits for the senders' outcomes (outcomes.py: PUSH_FAILED at once when one
  failed, SENDER_LOST when they stop showing signs of life for timeout_s), which say what this sync
  committed on each server (its store epoch and generation); it then leases exactly that generation
  from its node (rollout.py: the node's one store, mapped read-only, no copy; reconnecting to a node
  server that went away within timeout_s) and yields its tensors to verl's server adapter; the lease
  is released (applied) when the adapter has taken them all. The step label decides nothing: a node
  may hold the same label from another push, or a later one from a run before a resume.
- driver mode (receive "served"): the node's weightsync server drives the engine itself after each
  commit; a rollout worker's receive_weights yields nothing and returns once that engine serves the
  sync's commit (its node's WatchWeights events, served.py), or raises ENGINE_FAILED (the engine
  refused it) / VERSION_NOT_SERVED (not served within timeout_s of the commit).
"""

from __future__ import annotations

import asyncio
import datetime
import secrets
from collections.abc import AsyncIterator, Iterable
from typing import Any

import torch
import torch.distributed as dist
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from weightsync.client import (
    Part,
    PartGroupFailed,
    PartUpdateFailed,
    UpdateFailed,
    WeightSyncClient,
    WeightSyncClientError,
)
from weightsync.client.parts.part import is_dtensor
from weightsync.common.logging import get_logger
from weightsync.integrations.shares import share_out
from weightsync.integrations.verl.config import VerlSyncConfig
from weightsync.integrations.verl.errors import WeightSyncVerlError
from weightsync.integrations.verl.outcomes import (
    LORA_UNSUPPORTED,
    SENDER_RANK,
    OutcomeStore,
    blamed_rank,
    commits_of,
    sync_id,
)
from weightsync.integrations.verl.rollout import NodeReader

log = get_logger("weightsync.integrations.verl")

BACKEND = "weightsync"
__all__ = ["BACKEND", "LORA_UNSUPPORTED", "SENDER_RANK", "WeightSyncCheckpointEngine", "blamed_rank", "my_share",
           "refuse_lora", "version_label"]


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


@CheckpointEngineRegistry.register(BACKEND)
class WeightSyncCheckpointEngine(CheckpointEngine):
    """verl's checkpoint engine "weightsync": actor_rollout_ref.rollout.checkpoint_engine.backend=weightsync."""

    def __init__(self, bucket_size: int, is_master: bool = False, **engine_kwargs: Any) -> None:
        # bucket_size (update_weights_bucket_megabytes) sizes verl's own buckets; weightsync's SDK
        # picks its own, so it is kept for nothing but the record.
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.config = VerlSyncConfig.from_engine_kwargs(**engine_kwargs)
        self.role: str | None = None
        self.rank = -1
        self.run = secrets.token_hex(6)
        """Rank 0: this engine's run token, in every sync id it draws (a new engine, a new run)."""
        self.syncs = 0
        """Rank 0: the syncs it prepared (each sync id's count)."""
        self._sync: str | None = None
        """This sync's id (init_process_group gives it; send/receive take it: one sync, one id)."""
        self.senders: list[int] = [SENDER_RANK]
        """The actor ranks that push (init_process_group): all of them, or rank 0 alone."""
        self._client: WeightSyncClient | None = None
        self._outcomes: OutcomeStore | None = None
        self._reader: NodeReader | None = None
        """The rollout's connection to its node's server."""
        self._parts_group: Any = None
        """senders "all" over "collective": the actor ranks' own Gloo group (Part.group), bounded by timeout_s."""
        self._regroup = False
        """senders "all" over "collective": the last sync failed, so the next init_process_group makes the
        transfer group again on every actor rank (the servers may have marked it BROKEN)."""

    # -- verl's lifecycle ---------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        """Rank 0 opens its outcome store (once), draws this sync's id and says both; the others say nothing."""
        if not self.is_master:
            return {}
        if self._outcomes is None:
            self._outcomes = OutcomeStore.host(self.config.outcome_host, self.config.timeout_s)
        self.syncs += 1
        return {"outcome_store": str(self._outcomes.address), "sync": sync_id(self.run, self.syncs)}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """metadata lists the actor ranks' answers first (verl's order), then the rollout's."""
        ours = metadata[SENDER_RANK] if actor_wg_world_size else {}
        shared = {"outcome_store": ours.get("outcome_store", ""), "sync": ours.get("sync", ""),
                  "actor_world": actor_wg_world_size}
        actor = {"role": ["actor"] * actor_wg_world_size, "rank": list(range(actor_wg_world_size)),
                 "world_size": [actor_wg_world_size] * actor_wg_world_size,
                 **{key: [value] * actor_wg_world_size for key, value in shared.items()}}
        rollout = {"role": ["rollout"] * rollout_world_size, "rank": list(range(rollout_world_size)),
                   "world_size": [rollout_world_size] * rollout_world_size,
                   **{key: [value] * rollout_world_size for key, value in shared.items()}}
        return actor, rollout

    def init_process_group(self, *, role: str, rank: int, world_size: int, outcome_store: str, sync: str = "",
                           actor_world: int = 1) -> None:
        """This sync's id, and what this worker's role needs, connected once: the SDK client (each
        sending rank), the outcome store (every worker but rank 0, which hosts it; again when rank 0's
        store moved: a new rank 0), the rollout's node."""
        if not sync:
            raise WeightSyncVerlError("NOT_INITIALIZED", f"{role} {rank}: init_process_group without this sync's id "
                                      "(build_topology gives it, from actor rank 0's prepare)")
        self.role, self.rank, self._sync = role, rank, sync
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
            if self._outcomes is None or str(self._outcomes.address) != outcome_store:
                self._outcomes = OutcomeStore.connect(outcome_store, self.config.timeout_s, who=f"{role} {rank}")
        if role == "rollout":
            if self._reader is None:
                self._reader = NodeReader(self.config, rank)
            self._reader.connect_soon()

    def _take_sync(self, what: str) -> str:
        """This sync's id, once: a second send or receive without verl's init_process_group between is refused."""
        if self._sync is None:
            raise WeightSyncVerlError("NOT_INITIALIZED", f"{what} without init_process_group before it: verl's "
                                      "CheckpointEngineManager calls it before every sync")
        sync, self._sync = self._sync, None
        return sync

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
        if self._client is not None:
            self._client.close()
        if self._reader is not None:
            self._reader.close()
        self._client = self._outcomes = self._reader = None

    # -- actor side ------------------------------------------------------------------------------
    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | Any,
                           global_steps: int | None = None, peft_config: Any = None,
                           **_verl_kwargs: Any) -> dict[str, float]:
        """peft_config: a LoRA adapter's config, as verl hands it to its rollouts' update_weights (verl
        0.9.1 passes none to a checkpoint engine): LORA_UNSUPPORTED, as for adapter tensors in `weights`."""
        if self.role != "actor":
            raise WeightSyncVerlError("NOT_INITIALIZED", "send_weights before init_process_group made this an actor rank")
        version = version_label(global_steps)
        sync = self._take_sync("send_weights")
        assert self._outcomes is not None
        if self.rank not in self.senders:
            named = await _drain(weights)  # the gathers of a sharded model run on every rank
            refuse_lora(named, peft_config, version)  # every rank drained the same names: every rank refuses
            return await asyncio.to_thread(self._await_outcomes, sync, version)
        with self._outcomes.beating(sync):  # the waiting workers wait as long as this rank sends
            outcome = await self._send(weights, peft_config, version, sync)
        self._outcomes.publish(sync, self.rank, outcome)
        if outcome.get("reason") == LORA_UNSUPPORTED:
            raise WeightSyncVerlError(LORA_UNSUPPORTED, outcome["message"].removeprefix(f"{LORA_UNSUPPORTED}: "),
                                      version=version)
        try:
            return await asyncio.to_thread(self._await_outcomes, sync, version)
        except WeightSyncVerlError as error:
            self._regroup = error.reason != LORA_UNSUPPORTED  # the next init_process_group makes the group again
            raise

    async def _send(self, weights: Any, peft_config: Any, version: str, sync: str) -> dict[str, Any]:
        """This rank's push of the step: its outcome, to publish (a BaseException that is not the actor
        ranks' broken Gloo group is published, then raised)."""
        outcome: dict[str, Any] = {"ok": False, "reason": "PUSH_FAILED", "cause_reason": "", "message": ""}
        try:
            named = await _drain(weights)
            refuse_lora(named, peft_config, version)
            if self.config.all_send:
                named = my_share(named, self.rank, len(self.senders))
            result = await asyncio.to_thread(self._push, named, version, sync if self.config.all_send else None)
            return {"ok": True, "seconds": result.seconds, "bytes_sent": result.bytes_sent,
                    "dense_bytes": result.dense_bytes,
                    "commits": [[s.store_epoch, s.generation] for s in result.servers]}
        except WeightSyncVerlError as error:  # LORA_UNSUPPORTED: published as such, the others raise the same
            outcome["reason"] = error.reason
            outcome["cause_reason"], outcome["message"] = error.reason, str(error)
            self._regroup = error.reason != LORA_UNSUPPORTED  # LORA_UNSUPPORTED: nothing was sent
        except UpdateFailed as error:
            outcome["cause_reason"], outcome["message"] = error.reason, str(error)
            if isinstance(error, PartUpdateFailed):
                outcome["failed_part"], outcome["missing"] = error.failed_part, list(error.missing)
        except PartGroupFailed as error:
            # The actor ranks' Gloo group failed the parts' agreement before anything was sent: a rank is gone
            # (or did not come). This rank is not at fault: the sender that never publishes its outcome is named.
            outcome["cause_reason"], outcome["message"] = "PART_GROUP_FAILED", str(error)
            outcome["peer_lost"] = True
            self._regroup = True
        except WeightSyncClientError as error:
            outcome["cause_reason"] = getattr(error, "reason", "") or type(error).__name__
            outcome["message"] = str(error)
        except BaseException as error:
            outcome["cause_reason"], outcome["message"] = type(error).__name__, str(error)
            self._regroup = True
            if not (self._collective_parts and isinstance(error, RuntimeError)):
                self._outcomes.publish(sync, self.rank, outcome)  # type: ignore[union-attr]
                raise
            # The actor ranks' Gloo group broke under a collective of its own (torch's DistBackendError: a
            # rank died): as PartGroupFailed, this rank is not at fault.
            outcome["peer_lost"] = True
        return outcome

    def _push(self, named: list[tuple[str, torch.Tensor]], version: str, key: str | None):
        assert self._client is not None
        if self.config.transport == "collective" and self._client.group_id is None and not self._collective_parts:
            self._client.create_group(timeout=self.config.timeout_s)
        result = self._client.push(named, version=version, mode=self.config.mode, transport=self.config.transport,
                                   delta=self.config.delta, part_key=key)  # type: ignore[arg-type]
        log.info("verl sync pushed", version=version, rank=self.rank, tensors=len(named),
                 seconds=round(result.seconds, 4), bytes_sent=result.bytes_sent, dense_bytes=result.dense_bytes)
        return result

    def _await_outcomes(self, sync: str, version: str) -> dict[str, float]:
        """Every sender's outcome of this sync (outcomes.py: PUSH_FAILED naming the rank at fault,
        SENDER_LOST naming a sender that never said): the step's metrics."""
        assert self._outcomes is not None
        outcomes = self._outcomes.wait(sync, self.senders, version=version, who=f"actor rank {self.rank}")
        return {"weightsync/push_s": max(float(o["seconds"]) for o in outcomes.values()),
                "weightsync/bytes_sent": sum(float(o["bytes_sent"]) for o in outcomes.values()),
                "weightsync/dense_bytes": sum(float(o["dense_bytes"]) for o in outcomes.values())}

    # -- rollout side ----------------------------------------------------------------------------
    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """The tensors this sync committed (labelled str(global_steps)), as read-only views into the
        node's store: valid until the generator finishes (the adapter copies them into its model).
        Driver mode: nothing, once the node's engine serves them."""
        if self.role != "rollout":
            raise WeightSyncVerlError("NOT_INITIALIZED", "receive_weights before init_process_group made this a rollout worker")
        version = version_label(global_steps)
        sync = self._take_sync("receive_weights")
        assert self._outcomes is not None and self._reader is not None
        # Driver mode watches from now on: the engine may start on the commit, and fail, before the outcome.
        watching = self._reader.start_watching() if self.config.receive == "served" else None
        try:
            outcomes = await asyncio.to_thread(self._outcomes.wait, sync, self.senders, version=version,
                                               who=f"rollout worker {self.rank}")
        except BaseException:
            if watching is not None:
                watching.cancel()
            raise
        commits = commits_of(outcomes)
        if watching is not None:  # driver mode: the node's server updates the engine
            await asyncio.to_thread(self._reader.wait_served, version, commits, watching)
            return
        snapshot = await asyncio.to_thread(self._reader.lease, version, commits)
        try:
            for name in sorted(snapshot.tensors):
                yield name, snapshot.tensors[name]
        except BaseException as error:
            snapshot.release(applied=False, error=f"{type(error).__name__}: {error}")
            raise
        snapshot.release(applied=True)
