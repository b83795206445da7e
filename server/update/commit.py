"""How an update commits, once every stream asked to and every bucket was applied (session.py):
engines reading what a STAGED patch rewrites finish first, every worker commits its assignment, and the
store's new layout and the new version are published in one step (no lease sees one without the
other). If a worker fails its commit, the session aborts (abort.py), knowing which patched
tensors may be torn.
"""

from __future__ import annotations

import time

from google.protobuf import duration_pb2

from weightsync.common.logging import get_logger
from weightsync.server.update.view import SessionView
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb

log = get_logger("weightsync.update")


async def commit(session: SessionView) -> pb.UpdateWeightsResponse:
    """Every worker commits, then the store's new layout and the new version are published in one step:
    the clients' UpdateCommitted. A worker's failure raises (the session aborts: abort.py)."""
    services = session.services
    store, update = services.store, session.store_update
    assert update is not None
    patched = store.patched_names(update)
    if store.live_writes_at_commit(update):
        # A STAGED patch is scattered into the live bytes at commit: engines reading the
        # committed version finish first, and none starts until the commit is done.
        await services.leases.before_write(staged=False, timeout=services.lease_timeout,
                                           generation=services.publisher.version.generation)
    async with services.leases.publishing_commit():
        committed = await services.fleet.fan_out(services.command_timeout,
                                                 commit_update=wpb.CommitUpdateCommand(update_id=session.update_id))
        if committed.errors:
            session.torn = patched if not session.in_place else set()  # some owners may have scattered theirs
            raise committed.errors[0]
        session.finished = True
        # One step: the store's new layout and the new version, with nothing in between.
        store.commit(update, services.publisher.next_generation)
        version = services.publisher.publish_version(session.begin.version)
    seconds = time.monotonic() - session.started
    duration = duration_pb2.Duration()
    duration.FromNanoseconds(int(seconds * 1e9))
    log.info("update_committed", version=session.begin.version, generation=version.generation,
             bytes=session.applied_bytes, seconds=round(seconds, 3))
    session.record()  # before the client can see the commit: a scrape right after it finds it counted
    return pb.UpdateWeightsResponse(
        committed=pb.UpdateCommitted(version=version.to_proto(), size_bytes=session.applied_bytes, duration=duration)
    )
