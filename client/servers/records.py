"""What the trainer SDK knows of each server: one record per server, one method per transition.

A WeightSyncClient keeps one ServerState per server, in the order it was given them; nothing
else in the SDK keeps a fact about one server. Every change is one of these transitions:

    answered(info)           GetServerInfo answered: its limits, workers and transports, fresh
    went_stale()             a push to it failed, or its SHM local socket hung up: what it said
                             of itself, and its ingress, may be those of a server that restarted
                             since; the next push asks again and maps its ingress again
    settled()                it took a push's Begin, or answered a read with no update running:
                             no update of ours still winds down there
    gave_up()                a push gave up on its stream (it stopped answering, or its connection
                             was lost): it may still be aborting that update when it answers
                             again, so the next Begin waits out its UPDATE_IN_PROGRESS (client/push/run.py)
    committed(plan_id, at)   it committed a push: it holds that plan by id (none: a patched plan,
                             never cached) and its store is at generation `at`
    plan_forgotten(plan_id)  it answered PLAN_NOT_FOUND (restarted, or it evicted the plan)
    base_refused()           it refused the generation a push's patches applied to (BASE_MISMATCH)
    mapped(ingress) / unmapped()   the SHM ingress this process maps from it

`generation` is where this client's last commit left its store. It is a push's base only while
the client's kept copy is that commit (DeltaBase.claims): the copy, not the server, knows when it
has changed since.

The group's ranks are not here: a server's rank offset is its place in one transfer group
(transports.transfer_group.TransferGroup.rank_offsets).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from weightsync.client.channels.server_set import Server
from weightsync.client.transports.shm import ShmSink
from weightsync.client.transports.shm_lease import IngressLease
from weightsync.client.types import StoreGeneration
from weightsync.v1 import weight_sync_service_pb2 as pb

UNSETTLED_RETRY_SECONDS = 0.25
"""Between Begins (or reads) to a server that a push gave up on, while it still winds that update down
(ServerState.unsettled): the push loop (client/push/run.py) and the checksum reads wait this long."""
PLAN_IDS_KEPT = 8
"""Plan ids remembered per server: servers keep a few plans, so older ones may be gone anyway (a
server that evicted one answers PLAN_NOT_FOUND and gets the plan in full)."""


@dataclass(frozen=True, slots=True)
class ShmIngress:
    """A server's SHM ingress as this process maps it: the lease (its local connection) and the sink
    that writes buckets into its slots."""

    lease: IngressLease
    sink: ShmSink

    def close(self) -> None:
        self.sink.close()
        self.lease.close()


@dataclass(slots=True, eq=False)
class ServerState:
    """What this client knows of one server (see the module docstring for its transitions)."""

    server: Server
    """Its channel."""
    info: pb.GetServerInfoResponse | None = None
    """Its last GetServerInfo answer (None: never asked)."""
    stale: bool = False
    """`info` and `ingress` may be a restarted server's: the next push asks again (went_stale)."""
    unsettled: bool = False
    """A push gave up on its stream and it has not taken a Begin since (gave_up)."""
    plan_ids: set[str] = field(default_factory=set)
    """Plan ids it committed (at most PLAN_IDS_KEPT): the next Begin names the plan by id."""
    generation: StoreGeneration | None = None
    """Where this client's last commit left its store (None: unknown, or it refused it as a base)."""
    ingress: ShmIngress | None = None
    """Its SHM ingress, mapped by the first SHM push (None: not mapped)."""

    @property
    def address(self) -> str:
        return self.server.address

    # -- transitions ----------------------------------------------------------------------------
    def answered(self, info: pb.GetServerInfoResponse) -> None:
        self.info = info
        self.stale = False

    def went_stale(self) -> None:
        self.stale = True

    def settled(self) -> None:
        self.unsettled = False

    def gave_up(self) -> None:
        self.unsettled = True

    def committed(self, plan_id: str | None, at: StoreGeneration) -> None:
        if plan_id is not None:
            if len(self.plan_ids) >= PLAN_IDS_KEPT:
                self.plan_ids.clear()
            self.plan_ids.add(plan_id)
        self.generation = at

    def plan_forgotten(self, plan_id: str) -> None:
        self.plan_ids.discard(plan_id)

    def base_refused(self) -> None:
        self.generation = None

    def mapped(self, ingress: ShmIngress) -> None:
        self.ingress = ingress

    def unmapped(self) -> None:
        """Unmap the ingress (if mapped) and leave the local socket: the next SHM push maps it again."""
        ingress, self.ingress = self.ingress, None
        if ingress is not None:
            ingress.close()

    # -- queries ----------------------------------------------------------------------------------
    def holds(self, plan_id: str) -> bool:
        return plan_id in self.plan_ids

    def hung_up(self) -> bool:
        """Whether the server whose ingress is mapped closed its local socket (it exited)."""
        return self.ingress is not None and self.ingress.lease.connection.hung_up()
