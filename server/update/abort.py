"""How an update ends when it did not commit: its workers' update aborted, the store's update
released, a broken group left, and the buckets nobody awaited settled.

The session (session.py) runs `finish` once, whatever its end (committed, failed, its
handler cancelled), before the update gate is released; `finish` aborts only what the commit
did not finish.
"""

from __future__ import annotations

import asyncio

from weightsync.common.errors import WeightSyncError
from weightsync.common.logging import get_logger
from weightsync.server.tasks import retrieve_quietly
from weightsync.server.update.view import SessionView
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb

log = get_logger("weightsync.update")


async def finish(session: SessionView) -> None:
    """The end of every update: its readers stopped, its metrics recorded, the workers' update aborted
    unless it committed, the engines' leases and the group's idle mark given back."""
    for reading in session.reading:
        reading.cancel()
        retrieve_quietly(reading)
    services = session.services
    try:
        session.record()
        if not session.finished:
            await abort_workers(session)
    finally:
        await services.leases.write_done()
        if session.group is not None:
            services.groups.update_ended(session.group)


async def abort_workers(session: SessionView) -> None:
    """Every worker aborts the update, the store releases it (marking what a dead IN_PLACE owner may
    have written), and a broken group is left by every worker."""
    session.finished = True
    update = session.store_update
    if update is None:
        return
    services = session.services
    fleet = services.fleet
    settled = asyncio.ensure_future(settle_receives(session))
    aborted = await fleet.fan_out(session.bucket_timeout, fleet.alive_workers(),
                                  abort_update=wpb.AbortUpdateCommand(update_id=session.update_id))
    await settled
    aborted.log_errors("abort_failed_on_worker")
    # Workers that died holding an IN_PLACE bucket of theirs may have written some of it.
    for worker in fleet.workers:
        if not worker.alive:
            for sequence in session.forwarded_to(worker.index):
                session.touched(sequence)
    released = services.store.abort(update, torn=session.torn)
    fleet.forget_arenas(released)
    group = session.group
    if group is not None and group.state == pb.GROUP_STATE_BROKEN:
        # Every worker leaves: a group that failed one collective is unusable for all.
        left = await fleet.fan_out(services.command_timeout, fleet.alive_workers(),
                                   leave_group=wpb.LeaveGroupCommand(group_id=group.group_id))
        left.log_errors("leave_failed_on_worker")
    log.info("update_aborted", reason=session.failure.reason if session.failure else "",
             store_state=pb.StoreState.Name(services.store.state))
    services.publisher.publish_state()


async def settle_receives(session: SessionView) -> None:
    """Await the announced buckets' results that nobody awaited.

    When the stream is cancelled (the trainer died) while workers sit in a
    transfer, the driver stops awaiting that bucket. The workers still
    answer it (the abort is queued behind it anyway); a collective failure
    in that answer must still mark the group BROKEN, or the server would
    keep a group the workers already dropped.
    """
    pending = [bucket for reader in session.readers for bucket in reader.take_pending()]
    for bucket in pending:
        settled = await session.services.fleet.settle(bucket.receives, session.bucket_timeout)
        session.note_touched(bucket, settled.answers)
        for result in settled.errors:
            if isinstance(result, WeightSyncError):
                session.fail(result)
                session.note_broken(result)
