"""The WeightSyncService servicer: one method per RPC, over the node's parts (server/node.py).

Each method checks its request (checks.py), asks the node's parts, and answers; the
node builds and holds everything. An update stream is run by an UpdateSession
(server/update/session.py) under the node's update gate (server/update/gate.py); the streams of an update's parts,
once joined (server/parts/joins.py), by one session that part 0's handler runs (server/update/gathering.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from collections.abc import AsyncIterator

import structlog

from weightsync.common import dtypes
from weightsync.common.errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    WeightSyncError,
)
from weightsync.common.logging import get_logger
from weightsync.common.plan_id import plan_id_of
from weightsync.server.node import SERVICE_NAME, Node
from weightsync.server.parts.joins import PartJoins, Ticket
from weightsync.server.parts.rules import PART_TRANSPORTS, DtypeShape, boxes_refused, parts_not_run
from weightsync.server.rpc.checks import (
    check_begin,
    group_for,
    group_record,
    plan_for,
    require_base,
)
from weightsync.server.store.box_checksums import checked_boxes, compute_box_checksums
from weightsync.server.update.gathering import PartFeed, PartUpdates
from weightsync.server.update.session import UpdateSession
from weightsync.server.update.streams import store_plan
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.v1 import weight_sync_service_pb2_grpc as pb_grpc
from weightsync.worker.v1 import worker_pb2 as wpb

log = get_logger("weightsync.service")

JOIN_MARGIN_SECONDS = 5.0
"""Workers answer a join by its deadline (+1 s, from when they started it); this much more before
the server gives up on them (and restarts them): room for the command's queueing and the answer's
way back on a loaded node, where a late answer would cost a worker restart."""
CHECKSUM_LEASE_SECONDS = 5.0
"""A checksum read waits this long at most for a commit being published to end."""
_reader_ids = itertools.count(-1, -1)
"""Lease owners for the server's own reads of the store (engines' connections count up from 1)."""


class WeightSyncServicer(pb_grpc.WeightSyncServiceServicer):
    def __init__(self, node: Node) -> None:
        self.node = node
        self.joins = PartJoins()
        """The parts of updates sent by several trainer processes, while they join (BeginUpdate.part)."""
        self.part_updates = PartUpdates()
        """The joined parts' streams, until part 0's handler starts their update."""

    # -- RPCs ----------------------------------------------------------------------
    async def GetServerInfo(self, request: pb.GetServerInfoRequest, context) -> pb.GetServerInfoResponse:
        return self.node.info()

    async def CreateTransferGroup(self, request: pb.CreateTransferGroupRequest, context) -> pb.CreateTransferGroupResponse:
        record = group_record(request, self.node.supervisor.workers)
        if record.group_id in self.node.groups:
            raise AlreadyExists("GROUP_ALREADY_EXISTS", f"group {record.group_id!r} already exists", group_id=record.group_id)
        self.node.require_serving()
        self.node.groups.add(record)
        structlog.contextvars.bind_contextvars(group_id=record.group_id)
        log.info("group_creating", world_size=record.world_size, rank_offset=record.rank_offset)
        join = wpb.JoinGroupCommand(
            group_id=record.group_id, store_host=request.store_host, store_port=request.store_port,
            world_size=record.world_size, backend=record.backend, trainer_ranks=record.trainer_ranks,
        )
        join.timeout.FromTimedelta(record.timeout)
        timeout = record.timeout.total_seconds() + JOIN_MARGIN_SECONDS
        def join_as(worker) -> dict[str, object]:
            command = wpb.JoinGroupCommand()
            command.CopyFrom(join)
            command.rank = record.rank_offset + worker.index
            return {"join_group": command}

        joined = False
        try:
            (await self.node.supervisor.fan_out(timeout, command_for=join_as)).raise_first()
            joined = True
        finally:
            if not joined:
                # Leave nothing half-joined, even if this RPC was cancelled.
                self.node.groups.remove(record.group_id)
                self.node.background.spawn(self.node.leave_everywhere(record.group_id), "leave_group")
                log.warning("group_create_failed")
        self.node.groups.joined(record)
        log.info("group_ready")
        return pb.CreateTransferGroupResponse(group=record.to_proto())

    async def DeleteTransferGroup(self, request: pb.DeleteTransferGroupRequest, context) -> pb.DeleteTransferGroupResponse:
        record = self.node.groups.get(request.group_id)
        if record is None:
            raise NotFound("GROUP_NOT_FOUND", f"no group {request.group_id!r}", group_id=request.group_id[:128])
        active = self.node.gate.running_update()
        if active is not None and getattr(active, "group", None) is record:
            raise FailedPrecondition(
                "UPDATE_IN_PROGRESS", f"update {active.update_id} is running on group {record.group_id!r}",
                group_id=record.group_id, update_id=active.update_id,
            )
        if record.state == pb.GROUP_STATE_JOINING:
            raise FailedPrecondition("GROUP_JOINING", f"group {record.group_id!r} is still joining", group_id=record.group_id)
        self.node.groups.remove(record.group_id)
        await self.node.leave_everywhere(record.group_id)
        log.info("group_deleted", group_id=record.group_id)
        return pb.DeleteTransferGroupResponse()

    async def ListTransferGroups(self, request: pb.ListTransferGroupsRequest, context) -> pb.ListTransferGroupsResponse:
        return pb.ListTransferGroupsResponse(groups=[g.to_proto() for g in self.node.groups.sorted()])

    async def GetTensorChecksums(self, request: pb.GetTensorChecksumsRequest, context) -> pb.GetTensorChecksumsResponse:
        names = list(request.names)
        if len(set(names)) != len(names):
            duplicate = next(n for n in names if names.count(n) > 1)
            raise InvalidArgument("TENSOR_NAME_DUPLICATE", f"tensor {duplicate!r} is asked for twice",
                                  tensor=duplicate[:256])
        node = self.node
        running = node.gate.running_update()
        if running is not None and getattr(running, "in_place", True):
            raise FailedPrecondition("STORE_UPDATING", "an IN_PLACE update is writing the store; ask again after it "
                                     "commits or aborts")
        # The committed bytes, read by the server itself under a lease (a STAGED update running meanwhile
        # writes only shadows; the lease keeps the next one from writing these before the read ends).
        owner = next(_reader_ids)
        lease = await node.leases.grant(lambda: node.publisher.version, owner, CHECKSUM_LEASE_SECONDS)
        try:
            if request.boxes:  # names only whole (none: none), each box's tensor checked as a name is
                asked = sorted(set(names) | {ref.name for ref in request.boxes})
                not_stored = node.store.checksum_targets(asked)[1]
                targets = sorted(set(names) - set(not_stored))
                boxes = checked_boxes(request.boxes, {n: tuple(t.shape) for n, t in node.store.tensors.items()},
                                      node.store.stores)
            else:
                (targets, not_stored), boxes = node.store.checksum_targets(names), []
            tensors = await asyncio.to_thread(node.store.compute_checksums, targets)
            box_sums = await asyncio.to_thread(compute_box_checksums, boxes, node.store.view)
        finally:
            await node.leases.release(lease.lease_id, owner)
        return pb.GetTensorChecksumsResponse(version=lease.version.to_proto(), store_state=node.store.state,
                                             tensors=tensors, not_stored=not_stored, boxes=box_sums)

    async def WatchWeights(self, request: pb.WatchWeightsRequest, context) -> AsyncIterator[pb.WatchWeightsResponse]:
        queue = self.node.publisher.watchers.subscribe()
        try:
            yield self.node.publisher.event()
            while True:
                yield await queue.get()
        finally:
            self.node.publisher.watchers.unsubscribe(queue)

    async def UpdateWeights(self, requests: AsyncIterator[pb.UpdateWeightsRequest], context) -> AsyncIterator[pb.UpdateWeightsResponse]:
        try:
            first = await anext(requests)
        except StopAsyncIteration:
            raise InvalidArgument("BEGIN_MISSING", "the stream closed before a begin message") from None
        if first.WhichOneof("message") != "begin":
            raise InvalidArgument("BEGIN_MISSING", "the first message must be begin")
        begin = first.begin
        try:
            check_begin(begin, self.node.transports())
            refusal = boxes_refused(begin, begin.plan)  # a box outside a part, off the parts' transports, or deferred
            if refusal is not None:
                raise refusal
            ticket = self.joins.enter(begin) if begin.HasField("part") else None
        except WeightSyncError as error:
            if begin.HasField("part"):
                self.joins.refused(begin.part, error)  # the other parts fail at once, with this reason
            raise
        try:
            group = group_for(begin, self.node.groups)
            plan, plan_id, summary = plan_for(begin, self.node.plans, self.node.config.limits,
                                              self.node.ingress.slot_bytes if self.node.ingress else 0)
            if not begin.HasField("plan") and (refusal := boxes_refused(begin, plan)) is not None:
                raise refusal  # a plan_id naming a plan with a box
            self.node.require_serving()
            publisher = self.node.publisher
            require_base(begin, summary, publisher.version, publisher.store_state())
            if ticket is not None:
                self.joins.declare(ticket, begin.part, plan, stored=self._stored, stores=self.node.store.stores)
        except WeightSyncError as error:
            if ticket is not None:
                self.joins.fail(ticket, error)  # the other parts learn which part failed
            raise
        if ticket is not None:
            # aclosing: a part cancelled while gRPC holds a keepalive still tells the others it left.
            async with contextlib.aclosing(self._joined(ticket)) as keepalives:
                async for waiting in keepalives:
                    yield waiting
        if ticket is not None and ticket.rendezvous.world > 1:
            responses = self._part_update(ticket, group, begin, plan, plan_id, summary, requests)
        else:
            responses = self._update(group, begin, plan, plan_id, summary, requests)
        try:
            # aclosing: the session's clean-up runs here, before the gate is released, even
            # when this handler is cancelled while gRPC holds one of its responses.
            async with contextlib.aclosing(responses) as updating:
                async for response in updating:
                    if ticket is not None and response.WhichOneof("message") == "committed":
                        self.joins.committed(begin.part.update_key, response.committed.version.generation)
                    yield response
        except WeightSyncError as error:
            if ticket is not None:
                self.joins.ended(begin.part.update_key, error)  # a later part under the key gets it
            raise

    async def _update(self, group, begin: pb.BeginUpdate, plan, plan_id: str, summary,
                      requests: AsyncIterator[pb.UpdateWeightsRequest]) -> AsyncIterator[pb.UpdateWeightsResponse]:
        """An update fed by this stream alone (no part, or a world of 1)."""
        gate = self.node.gate
        gate.require_idle()
        update_id = uuid.uuid4().hex[:16]
        session = UpdateSession(self.node.session_services, update_id, group, begin, plan, plan_id)
        async with gate.running(session):
            self._bind(update_id, group, begin)
            async with contextlib.aclosing(session.run(requests)) as responses:
                async for response in responses:
                    if response.WhichOneof("message") == "committed":
                        self.node.plans.remember(plan_id, plan, summary)
                    yield response

    async def _part_update(self, ticket: Ticket, group, begin: pb.BeginUpdate, plan, plan_id: str, summary,
                           requests: AsyncIterator[pb.UpdateWeightsRequest]) -> AsyncIterator[pb.UpdateWeightsResponse]:
        """One part's stream of an update of several (server/update/gathering.py): part 0's handler runs the update fed
        by every part's stream, the others relay their own responses."""
        key, world, rank = ticket.rendezvous.key, ticket.rendezvous.world, ticket.rank
        gathering = self.part_updates.hand_in(key, world, rank, PartFeed(plan, plan_id, requests))
        if rank != 0:
            session = await self.part_updates.session(gathering)
            responses = session.follow(rank)
        else:
            started = False
            try:
                feeds = await self.part_updates.gathered(gathering)
                gate = self.node.gate
                gate.require_idle()
                whole, streams = store_plan([(r, feed.plan, feed.plan_id) for r, feed in feeds.items()])
                session = UpdateSession(self.node.session_services, uuid.uuid4().hex[:16], group, begin, whole,
                                        plan_id_of(whole), streams=streams)
                self.part_updates.started(gathering, session)
                started = True
            except WeightSyncError as error:
                self.part_updates.failed(gathering, error)
                raise
            finally:
                if not started:
                    self.part_updates.left(gathering)
            responses = self._drive(session, gate, group, begin, feeds[0].requests,
                                    {r: f.requests for r, f in feeds.items() if r})
        async with contextlib.aclosing(responses) as relayed:
            async for response in relayed:
                if response.WhichOneof("message") == "committed":
                    self.node.plans.remember(plan_id, plan, summary)
                yield response

    async def _drive(self, session: UpdateSession, gate, group, begin: pb.BeginUpdate,
                     requests: AsyncIterator[pb.UpdateWeightsRequest],
                     following: dict[int, AsyncIterator[pb.UpdateWeightsRequest]],
                     ) -> AsyncIterator[pb.UpdateWeightsResponse]:
        """Part 0: the update of every part's stream, under the gate (its responses are part 0's)."""
        async with gate.running(session):
            self._bind(session.update_id, group, begin)
            async with contextlib.aclosing(session.run(requests, following)) as responses:
                async for response in responses:
                    yield response

    def _bind(self, update_id: str, group, begin: pb.BeginUpdate) -> None:
        structlog.contextvars.bind_contextvars(update_id=update_id, group_id=group.group_id if group else "",
                                               transport=pb.Transport.Name(begin.transport))

    async def _joined(self, ticket: Ticket) -> AsyncIterator[pb.UpdateWeightsResponse]:
        """A part's keepalives until every part of its update joined and their union was checked. A world this
        server does not run (_runs_parts) ends PARTS_UNAVAILABLE for every part there."""
        try:
            async for waiting in self.joins.wait(ticket):
                yield waiting
        except WeightSyncError:
            raise
        except BaseException:  # cancelled while it waited: the other parts learn that this one left
            self.joins.fail(ticket, Aborted("STREAM_CLOSED", "the part's stream ended while its parts joined"))
            raise
        key, world = ticket.rendezvous.key, ticket.rendezvous.world
        if world > 1 and (why := self._runs_parts(ticket.rendezvous.first, world)) is not None:
            refusal = parts_not_run(key, world, why)
            self.joins.ended(key, refusal)
            raise refusal

    def _runs_parts(self, begin: pb.BeginUpdate, world: int) -> str | None:
        """None: this server runs an update of `world` parts as `begin` (the first part's) sends it: INLINE, any
        world (more parts than ingress slots take turns: update.streams.SlotPool); SHM, each part with a run of
        slots of its own; COLLECTIVE, over a group whose trainer ranks are the parts (part rank = group rank,
        each part sending point-to-point, common/receive_order.py). Else why not."""
        transport = begin.transport
        if transport not in PART_TRANSPORTS:
            return f"this server does not run parts over {pb.Transport.Name(transport)}"
        if transport == pb.TRANSPORT_COLLECTIVE:
            group = self.node.groups.get(begin.group_id)
            trainers = group.trainer_ranks if group is not None else 0
            if trainers != world:
                return (f"group {begin.group_id!r} holds {trainers} trainer rank(s) "
                        "(CreateTransferGroupRequest.trainer_ranks): an update of parts over it needs one per part, "
                        "ranks 0..world-1: create the group from every part (create_group() on each rank)")
            return None
        ingress = self.node.ingress
        if ingress is None:
            return "this server has no ingress"
        if transport == pb.TRANSPORT_SHM and world > ingress.slot_count:
            return f"over SHM it runs at most as many parts as its {ingress.slot_count} ingress slots"
        return None

    def _stored(self) -> dict[str, DtypeShape]:
        """The dtype and shape of every tensor the store holds (what a part may declare unchanged)."""
        return {name: DtypeShape(dtypes.from_torch(t.dtype), t.shape) for name, t in self.node.store.tensors.items()}


__all__ = ["WeightSyncServicer", "SERVICE_NAME"]
