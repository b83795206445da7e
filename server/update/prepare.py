"""The start of an update, before the client hears `ready`: the engines' leases on the bytes it
would write, the store's update derived, its memory admitted and allocated, the arenas mapped
in every worker, and each worker handed its assignment (prepare_update).

Once `prepare` set `session.store_update`, an abort is owed to the store and the workers
(abort.py), whatever fails after.
"""

from __future__ import annotations

import asyncio

from weightsync.server.store.node_store import StoreUpdate
from weightsync.server.update.admission import StagingNeed
from weightsync.server.update.view import SessionView
from weightsync.worker.v1 import worker_pb2 as wpb


async def prepare(session: SessionView) -> None:
    services = session.services
    fleet, store = services.fleet, services.store
    # Engines reading the bytes this update would write finish first (see server/store/leases.py).
    await services.leases.before_write(staged=not session.in_place, timeout=services.lease_timeout,
                                       generation=services.publisher.version.generation)
    update = store.prepare(update_id=session.update_id, plan=session.plan, plan_id=session.plan_id,
                           mode=session.begin.mode, allow_new_tensors=session.begin.allow_new_tensors,
                           workers=len(fleet.workers))
    session.store_update = update  # from here on, abort is owed to the store and the workers
    services.admission.check(store_bytes=update.needed_bytes, staging=staging_needs(session, update))
    await store.allocate(update)
    arenas = [store.arena(a) for a in store.arena_ids()]
    timeout = services.command_timeout
    mapped = await asyncio.gather(*(fleet.map_arenas(w, arenas, timeout) for w in fleet.workers),
                                  return_exceptions=True)
    for result in mapped:
        if isinstance(result, BaseException):
            raise result
    group_id = session.group.group_id if session.group else ""
    lane_starts = [stream.first for stream in session.streams] if len(session.streams) > 1 else []

    def assignment(index: int) -> wpb.PrepareUpdateCommand:
        command = store.assignment(update, index, update_id=session.update_id, group_id=group_id)
        command.lane_starts.extend(lane_starts)  # several streams' buckets interleave: a lane each
        return command

    prepared = await fleet.fan_out(timeout, command_for=lambda w: {"prepare_update": assignment(w.index)})
    prepared.raise_first()


def staging_needs(session: SessionView, update: StoreUpdate) -> list[StagingNeed]:
    """What each worker's staging must hold for this update (admission counts what it adds): the largest
    general-path bucket it owns, per stream when several feed the update (each stream is a lane of its own
    on the worker: their buckets interleave)."""
    largest = max((r.size_bytes for r in update.plan.routes), default=0)
    needs = []
    for worker in session.services.fleet.workers:
        if session.broadcast_to_all and not worker.host_memory:
            needs.append(StagingNeed(worker, 2 * largest, on_device=True))
            continue
        by_lane = [max((r.size_bytes for k, r in enumerate(update.plan.routes) if stream.owns(k)
                        and update.owners[k] == worker.index and r.receive_into is None), default=0)
                   for stream in session.streams]
        needs.append(StagingNeed(worker, by_lane[0], on_device=False, lane_bytes=sum(by_lane[1:])))
    return needs
