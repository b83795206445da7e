"""The rendezvous of the parts of an update (BeginUpdate.part): the parts under one update key are
gathered within a join deadline, and their declarations checked together, before anything is
allocated or the update gate is asked for.

    ticket = joins.enter(begin)          this part alone refused: its identity (rules.check_identity),
                                         a rank twice (PART_DUPLICATE), other terms than the first
                                         part's (PART_MISMATCH), a key whose update ended (its outcome)
    joins.declare(ticket, plan, ...)     its plan checked and declared; the last part to declare checks
                                         the union (rules.check_union) for every part
    async for keepalive in joins.wait(ticket): ...
                                         PartsWaiting at once and every KEEPALIVE_SECONDS until the
                                         outcome; then the owners, or every part's refusal
    joins.fail(ticket, error)            this part failed before the outcome: every other part gets
                                         PART_FAILED naming it
    joins.committed(key, generation)     a later part under the key gets PART_KEY_USED
    joins.refused(part, error)           this part was refused before it joined (its begin, its identity,
                                         its terms): every part under its key gets that refusal's reason
                                         at once (rules.key_refused), and so does a later one

When the join deadline passes first, every part that entered gets PARTS_MISSING naming the ranks that
did not (nothing was allocated), and so does a part that comes later under that key. Everything runs
on the server's event loop: no locks. The rules themselves are server/parts/rules.py's.
"""

from __future__ import annotations

import asyncio
import datetime
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field

from weightsync.common.errors import WeightSyncError
from weightsync.common.logging import get_logger
from weightsync.server.parts.rules import (
    UPDATE_KEY_PATTERN,
    Declaration,
    DtypeShape,
    Owners,
    Sent,
    Terms,
    check_identity,
    check_join,
    check_union,
    join_timeout,
    key_refused,
    late_part,
    missing,
    part_failed,
    parts_missing,
    sent_by,
)
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

log = get_logger("weightsync.parts")

KEEPALIVE_SECONDS = 10.0
"""A waiting part gets PartsWaiting at least this often (weight_sync_service.proto, UpdateWeightsResponse.waiting)."""
REMEMBERED_KEYS = 1024
"""Ended keys kept, so that a late part gets its update's outcome instead of opening a new join."""


@dataclass(slots=True)
class Rendezvous:
    """The parts of one update key, while they join."""

    key: str
    first: Terms
    entered: set[int] = field(default_factory=set)
    declared: dict[int, tuple[Declaration, tuple[Sent, ...]]] = field(default_factory=dict)
    outcome: asyncio.Future[Owners] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    deadline: asyncio.TimerHandle | None = None

    @property
    def world(self) -> int:
        return self.first.world


@dataclass(frozen=True, slots=True)
class Ticket:
    """One part in one rendezvous."""

    rendezvous: Rendezvous
    rank: int


class PartJoins:
    def __init__(self, keepalive_seconds: float = KEEPALIVE_SECONDS) -> None:
        self.keepalive_seconds = keepalive_seconds
        self._open: dict[str, Rendezvous] = {}
        self._ended: OrderedDict[str, WeightSyncError | int | Rendezvous] = OrderedDict()
        """A key whose join ended: the refusal its parts got, the generation it committed, or (its update
        running) the rendezvous every rank of which joined."""

    def enter(self, begin: pb.BeginUpdate) -> Ticket:
        """A part's begin: its ticket in the key's rendezvous (the first part opens it), or this part's refusal."""
        part = begin.part
        refusal = check_identity(part)
        if refusal is not None:
            raise refusal
        key = part.update_key
        terms = Terms.of(begin)
        ended = self._ended.get(key)
        if isinstance(ended, Rendezvous):  # joined and running: every rank entered, so a rank twice or other terms
            refusal = check_join(ended.first, frozenset(ended.entered), part.rank, terms, update_key=key)
            if refusal is not None:
                raise refusal
        if isinstance(ended, WeightSyncError):
            raise late_part(key, failure=ended)
        if ended is not None:
            raise late_part(key, committed_generation=ended)
        rendezvous = self._open.get(key)
        if rendezvous is None:
            rendezvous = Rendezvous(key, terms)
            timeout = join_timeout(part)
            rendezvous.deadline = asyncio.get_running_loop().call_later(
                timeout.total_seconds(), self._expire, rendezvous, timeout)
            self._open[key] = rendezvous
            log.info("parts_join_opened", update_key=key, world=part.world, join_timeout_s=timeout.total_seconds())
        refusal = check_join(rendezvous.first, frozenset(rendezvous.entered), part.rank, terms, update_key=key)
        if refusal is not None:
            raise refusal
        rendezvous.entered.add(part.rank)
        log.info("part_entered", update_key=key, rank=part.rank, world=rendezvous.world)
        return Ticket(rendezvous, part.rank)

    def declare(self, ticket: Ticket, part: pb.UpdatePart, plan: tensor_pb2.WeightPlan, *,
                stored: Callable[[], Mapping[str, DtypeShape]], stores: Callable[[str], bool]) -> None:
        """The part's checked plan and its declaration; the last one checks the union for every part."""
        rendezvous = ticket.rendezvous
        if rendezvous.outcome.done():
            return
        rendezvous.declared[ticket.rank] = (Declaration.of(part), sent_by(plan))
        if len(rendezvous.declared) < rendezvous.world:
            return
        declarations = [declaration for declaration, _ in rendezvous.declared.values()]
        sent = {rank: items for rank, (_, items) in rendezvous.declared.items()}
        owners = check_union(declarations, sent, stored(), stores)
        if isinstance(owners, WeightSyncError):
            self._end(rendezvous, owners)
        else:
            log.info("parts_joined", update_key=rendezvous.key, world=rendezvous.world)
            self._close(rendezvous)
            self._remember(rendezvous.key, rendezvous)
            rendezvous.outcome.set_result(owners)

    async def wait(self, ticket: Ticket) -> AsyncIterator[pb.UpdateWeightsResponse]:
        """PartsWaiting keepalives until every part joined and the union was checked (then it ends), or the
        refusal every part gets (raised)."""
        outcome = ticket.rendezvous.outcome
        while not outcome.done():
            yield pb.UpdateWeightsResponse(waiting=pb.PartsWaiting(
                joining=missing(ticket.rendezvous.world, ticket.rendezvous.declared)))
            try:
                await asyncio.wait_for(asyncio.shield(outcome), self.keepalive_seconds)
            except TimeoutError:
                continue
            except WeightSyncError:
                break
        outcome.result()  # the refusal, raised

    def fail(self, ticket: Ticket, error: WeightSyncError) -> None:
        """This part failed before the outcome: every other part learns which, and why."""
        rendezvous = ticket.rendezvous
        if not rendezvous.outcome.done():
            self._end(rendezvous, part_failed(rendezvous.key, ticket.rank, error))

    def refused(self, part: pb.UpdatePart, refusal: WeightSyncError) -> None:
        """Part `part` was refused before it joined: its key fails at once for every part (key_refused), the ones
        waiting and the ones to come, rather than at the join deadline as "never joined". Left alone: a key that
        cannot be one, a rank already in (PART_DUPLICATE: the update it joined goes on), and a key whose join
        ended (running, committed or failed: the refusal was the late part's own)."""
        key = part.update_key
        if refusal.reason == "PART_DUPLICATE" or not UPDATE_KEY_PATTERN.match(key) or key in self._ended:
            return
        failure = key_refused(key, part.rank, refusal)
        rendezvous = self._open.get(key)
        if rendezvous is not None:
            self._end(rendezvous, failure)
        else:
            log.info("parts_join_failed", update_key=key, reason=refusal.reason, details=failure.metadata)
            self._remember(key, failure)

    def committed(self, key: str, generation: int) -> None:
        self._remember(key, generation)

    def ended(self, key: str, error: WeightSyncError) -> None:
        """The key's update failed after its parts joined: a later part gets this."""
        self._remember(key, error)

    def _expire(self, rendezvous: Rendezvous, timeout: datetime.timedelta) -> None:
        if not rendezvous.outcome.done():
            self._end(rendezvous, parts_missing(rendezvous.key, rendezvous.world, rendezvous.declared, timeout))

    def _end(self, rendezvous: Rendezvous, refusal: WeightSyncError) -> None:
        log.info("parts_join_failed", update_key=rendezvous.key, reason=refusal.reason, details=refusal.metadata)
        self._close(rendezvous)
        self._remember(rendezvous.key, refusal)
        rendezvous.outcome.set_exception(refusal)
        rendezvous.outcome.exception()  # retrieved: a rendezvous nobody waits on any more logs nothing

    def _close(self, rendezvous: Rendezvous) -> None:
        if rendezvous.deadline is not None:
            rendezvous.deadline.cancel()
        if self._open.get(rendezvous.key) is rendezvous:
            del self._open[rendezvous.key]

    def _remember(self, key: str, outcome: WeightSyncError | int | Rendezvous) -> None:
        self._ended[key] = outcome
        self._ended.move_to_end(key)
        while len(self._ended) > REMEMBERED_KEYS:
            self._ended.popitem(last=False)
