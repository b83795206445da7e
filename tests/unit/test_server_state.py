"""What the SDK knows of each server (client/servers/records.py), and the rules over those records.

Literal tables: each row names a record's fields before, one transition, and every field after
(a transition that touches a field it should not fails its row too). The rules that span servers
(the stale rule of client/servers/fleet.py, which servers take patches, what a failed run teaches) and the
group's rank offsets are tables of the same kind. In-process, no server: fakes stand for channels,
leases and sinks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
import pytest

from weightsync.client.channels.revision import SPOKEN_REVISIONS
from weightsync.client.errors import UpdateFailed, WeightSyncRpcError
from weightsync.client.push.job import PushJob
from weightsync.client.push.patched import patch_targets
from weightsync.client.servers.fleet import Fleet
from weightsync.client.servers.records import PLAN_IDS_KEPT, ServerState, ShmIngress
from weightsync.client.transports.transfer_group import rank_offsets
from weightsync.client.types import StoreGeneration
from weightsync.common.collective import CollectiveError
from weightsync.v1 import weight_sync_service_pb2 as pb

REVISION = min(SPOKEN_REVISIONS)
INFO_A = pb.GetServerInfoResponse(server_version="a", data_plane_revision=REVISION)
INFO_B = pb.GetServerInfoResponse(server_version="b", data_plane_revision=REVISION)
G4, G5 = StoreGeneration(7, 4), StoreGeneration(7, 5)
EIGHT = {f"p{i}" for i in range(PLAN_IDS_KEPT)}
SEVEN = {f"p{i}" for i in range(PLAN_IDS_KEPT - 1)}


@dataclass
class FakeServer:
    address: str


def record(address: str = "s:1", **fields) -> ServerState:
    return ServerState(FakeServer(address), **fields)  # type: ignore[arg-type]


def fields_of(state: ServerState) -> dict:
    return {"info": state.info, "stale": state.stale, "unsettled": state.unsettled, "plan_ids": set(state.plan_ids),
            "generation": state.generation, "ingress": state.ingress}


NOTHING = {"info": None, "stale": False, "unsettled": False, "plan_ids": set(), "generation": None, "ingress": None}
"""A record nothing has been learnt of."""

TRANSITIONS = [
    # (row, fields before (over NOTHING), transition, arguments, fields after (over NOTHING))
    ("answered: its info, fresh", {}, "answered", (INFO_A,), {"info": INFO_A}),
    ("answered again: the new info, stale no more", {"info": INFO_A, "stale": True}, "answered", (INFO_B,),
     {"info": INFO_B}),
    ("answered leaves plans, base and unsettled", {"plan_ids": {"p1"}, "generation": G4, "unsettled": True},
     "answered", (INFO_A,), {"info": INFO_A, "plan_ids": {"p1"}, "generation": G4, "unsettled": True}),
    ("went stale: keeps its last answer", {"info": INFO_A}, "went_stale", (), {"info": INFO_A, "stale": True}),
    ("went stale leaves plans and base", {"plan_ids": {"p1"}, "generation": G4}, "went_stale", (),
     {"plan_ids": {"p1"}, "generation": G4, "stale": True}),
    ("gave up", {}, "gave_up", (), {"unsettled": True}),
    ("settled", {"unsettled": True}, "settled", (), {}),
    ("committed a dense plan: holds its id, at the generation", {"plan_ids": {"p1"}, "generation": G4},
     "committed", ("p2", G5), {"plan_ids": {"p1", "p2"}, "generation": G5}),
    ("committed a patched plan: no id, at the generation", {"plan_ids": {"p1"}, "generation": G4},
     "committed", (None, G5), {"plan_ids": {"p1"}, "generation": G5}),
    ("committed after a refused base: at the generation again", {}, "committed", ("p1", G4),
     {"plan_ids": {"p1"}, "generation": G4}),
    ("committed the 8th id: all eight kept", {"plan_ids": SEVEN}, "committed", ("p7", G4),
     {"plan_ids": SEVEN | {"p7"}, "generation": G4}),
    ("committed a 9th id: the older ones forgotten", {"plan_ids": EIGHT}, "committed", ("new", G4),
     {"plan_ids": {"new"}, "generation": G4}),
    ("committed leaves info and unsettled", {"info": INFO_A, "stale": True, "unsettled": True}, "committed",
     (None, G4), {"info": INFO_A, "stale": True, "unsettled": True, "generation": G4}),
    ("plan forgotten: that id only", {"plan_ids": {"p1", "p2"}}, "plan_forgotten", ("p1",), {"plan_ids": {"p2"}}),
    ("plan forgotten that it never held", {"plan_ids": {"p1"}}, "plan_forgotten", ("p9",), {"plan_ids": {"p1"}}),
    ("base refused: no generation, plans kept", {"plan_ids": {"p1"}, "generation": G4}, "base_refused", (),
     {"plan_ids": {"p1"}}),
]


@pytest.mark.parametrize(("before", "transition", "arguments", "after"), [row[1:] for row in TRANSITIONS],
                         ids=[row[0] for row in TRANSITIONS])
def test_each_transition_changes_its_fields_and_no_other(before, transition, arguments, after):
    state = record(**{**NOTHING, **{k: (set(v) if isinstance(v, set) else v) for k, v in before.items()}})
    getattr(state, transition)(*arguments)
    assert fields_of(state) == {**NOTHING, **after}


@pytest.mark.parametrize(("plan_ids", "plan_id", "held"), [
    (set(), "p1", False),
    ({"p1"}, "p1", True),
    ({"p1"}, "p2", False),
])
def test_a_plan_is_named_by_id_only_where_held(plan_ids, plan_id, held):
    assert record(plan_ids=set(plan_ids)).holds(plan_id) is held


class Lease:
    def __init__(self, log: list[str], hung_up: bool = False) -> None:
        self.log, self.connection = log, self
        self._hung_up = hung_up

    def hung_up(self) -> bool:
        return self._hung_up

    def close(self) -> None:
        self.log.append("lease closed")


class Sink:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def close(self) -> None:
        self.log.append("sink closed")


def ingress(log: list[str], hung_up: bool = False) -> ShmIngress:
    return ShmIngress(Lease(log, hung_up), Sink(log))  # type: ignore[arg-type]


def test_the_ingress_is_mapped_then_unmapped_sink_first_and_once():
    log: list[str] = []
    state, mapped = record(), ingress(log)
    assert not state.hung_up()
    state.mapped(mapped)
    assert state.ingress is mapped and log == []
    state.unmapped()
    assert state.ingress is None and log == ["sink closed", "lease closed"]
    state.unmapped()  # nothing mapped: nothing closed twice
    assert log == ["sink closed", "lease closed"]


@pytest.mark.parametrize(("mapped", "hung_up", "expected"), [(False, False, False), (True, False, False),
                                                             (True, True, True)])
def test_hung_up_only_with_a_mapped_ingress_whose_socket_closed(mapped, hung_up, expected):
    state = record()
    if mapped:
        state.mapped(ingress([], hung_up))
    assert state.hung_up() is expected


# -- the stale rule over every server (client/servers/fleet.py) -------------------------------------------
class FakeServerSet:
    def __init__(self, addresses: list[str], answers: list[pb.GetServerInfoResponse] | Exception) -> None:
        self.servers = [FakeServer(a) for a in addresses]
        self.addresses = addresses
        self.answers = answers
        self.asked = 0

    def each(self, method: str, request) -> list:
        assert method == "GetServerInfo"
        self.asked += 1
        if isinstance(self.answers, Exception):
            raise self.answers
        return self.answers


UNREACHABLE = WeightSyncRpcError("s:2", grpc.StatusCode.UNAVAILABLE, "SERVER_UNREACHABLE", "down", {})

STALE_RULE = [
    # (row, stale before, hung up (mapped server 0), answers, asked, stale after, infos after, unmapped)
    ("nothing stale: nothing asked", [False, False], None, [INFO_B, INFO_B], 0, [False, False], ["a", "a"], False),
    ("one stale: every server asked", [False, True], None, [INFO_B, INFO_B], 1, [False, False], ["b", "b"], True),
    ("its socket hung up: stale, asked", [False, False], True, [INFO_B, INFO_B], 1, [False, False], ["b", "b"], True),
    ("a socket that did not hang up", [False, False], False, [INFO_B, INFO_B], 0, [False, False], ["a", "a"], False),
    ("no answer: last answers kept, still stale", [True, False], None, UNREACHABLE, 1, [True, False], ["a", "a"],
     True),
]


@pytest.mark.parametrize(("stale", "hung_up", "answers", "asked", "stale_after", "infos_after", "unmapped"),
                         [row[1:] for row in STALE_RULE], ids=[row[0] for row in STALE_RULE])
def test_any_stale_server_asks_every_server_again_and_unmaps_the_ingress(stale, hung_up, answers, asked,
                                                                         stale_after, infos_after, unmapped):
    servers = FakeServerSet(["s:1", "s:2"], answers)
    fleet = Fleet(servers)  # type: ignore[arg-type]
    log: list[str] = []
    for state, was_stale in zip(fleet.states, stale, strict=True):
        state.answered(INFO_A)
        if was_stale:
            state.went_stale()
    if hung_up is not None:
        fleet.states[0].mapped(ingress(log, hung_up))
    fleet.ask_again_if_stale()
    assert servers.asked == asked
    assert [s.stale for s in fleet.states] == stale_after
    assert [s.info.server_version for s in fleet.states] == infos_after
    assert (fleet.states[0].ingress is None and log == ["sink closed", "lease closed"]) is (
        unmapped and hung_up is not None)


def test_infos_are_asked_once_until_a_server_went_stale():
    servers = FakeServerSet(["s:1", "s:2"], [INFO_A, INFO_B])
    fleet = Fleet(servers)  # type: ignore[arg-type]
    assert [i.server_version for i in fleet.infos()] == ["a", "b"] and servers.asked == 1
    assert [i.server_version for i in fleet.infos()] == ["a", "b"] and servers.asked == 1
    fleet.states[1].went_stale()
    assert fleet.infos() and servers.asked == 1  # infos() keeps them: ask_again_if_stale asks, once a push
    fleet.ask_again_if_stale()
    assert servers.asked == 2 and not any(s.stale for s in fleet.states)


# -- which servers take patches (client/push/patched.py) ------------------------------------------
PATCH_TARGETS = [
    # (row, claims, each server's generation, collective, the servers that take patches)
    ("the copy claims nothing", False, [G4, G4], False, []),
    ("INLINE: those at our commit", True, [G4, None], False, ["s:0"]),
    ("INLINE: none at our commit", True, [None, None], False, []),
    ("COLLECTIVE: one lacks it, the whole group dense", True, [G4, None], True, []),
    ("COLLECTIVE: all at our commit", True, [G4, G5], True, ["s:0", "s:1"]),
]


@pytest.mark.parametrize(("claims", "generations", "collective", "expected"), [row[1:] for row in PATCH_TARGETS],
                         ids=[row[0] for row in PATCH_TARGETS])
def test_patches_go_where_the_store_is_at_our_claimed_commit(claims, generations, collective, expected):
    states = [record(f"s:{i}", generation=g) for i, g in enumerate(generations)]
    assert [s.address for s in patch_targets(states, claims=claims, collective=collective)] == expected


# -- what a failed run teaches (client/push/job.py) ---------------------------------------------
@dataclass
class Delta:
    forgot: int = 0

    def forget(self) -> None:
        self.forgot += 1


@dataclass
class Collective:
    closed: int = 0

    def close(self) -> None:
        self.closed += 1


@dataclass
class Group:
    collective: Collective = field(default_factory=Collective)
    broken: bool = False


@dataclass
class BrokenSink:
    broken: bool


def failed(reason: str, cause: BaseException | None = None) -> UpdateFailed:
    return UpdateFailed(f"refused: {reason}", cause, "s:0", reason=reason)


FAILED_RUNS = [
    # (row, error, a group, the sink broke it, copy forgotten, group broken and closed)
    ("a server refused the base", failed("BASE_MISMATCH"), True, False, False, False),
    ("a server refused the update", failed("TENSOR_SHAPE_MISMATCH"), True, False, True, False),
    ("a broadcast timed out", failed("COLLECTIVE_TIMEOUT"), True, False, True, True),
    ("a broadcast failed", failed("COLLECTIVE_FAILED"), True, False, True, True),
    ("a collective error as the cause", failed("SERVER_UNRESPONSIVE", CollectiveError("x", timed_out=False)), True,
     False, True, True),
    ("the sink broke the group", RuntimeError("progress callback"), True, True, True, True),
    ("the caller's own error", RuntimeError("progress callback"), True, False, True, False),
    ("INLINE: no group to break", failed("COLLECTIVE_TIMEOUT"), False, False, True, False),
]


@pytest.mark.parametrize(("error", "grouped", "sink_broke", "forgot", "broke"), [row[1:] for row in FAILED_RUNS],
                         ids=[row[0] for row in FAILED_RUNS])
def test_a_failed_run_marks_its_servers_stale_and_forgets_the_copy_unless_only_its_base_was_refused(
        error, grouped, sink_broke, forgot, broke):
    delta, group = Delta(), Group() if grouped else None
    job = PushJob(loop=None, servers=None, group=group, sink=BrokenSink(sink_broke), delta=delta,  # type: ignore[arg-type]
                  version="v", mode=pb.UPDATE_MODE_STAGED, allow_new_tensors=False, checksums=None, progress=None,
                  show_progress=False, started=0.0)
    targets, bystander = [record("s:0"), record("s:1")], record("s:2")
    job._failed(error, targets)
    assert [s.stale for s in (*targets, bystander)] == [True, True, False]
    assert delta.forgot == int(forgot)
    if group is not None:
        assert (group.broken, group.collective.closed) == (broke, int(broke))


# -- the group's ranks (client/transports/transfer_group.py) -----------------------------------------------
@pytest.mark.parametrize(("workers", "offsets"), [
    ([], []),
    ([1], [1]),
    ([2, 2], [1, 3]),
    ([4, 1, 2], [1, 5, 6]),
    ([0, 3], [1, 1]),
])
def test_each_servers_workers_follow_the_trainers_rank_and_the_servers_before(workers, offsets):
    assert rank_offsets(workers) == offsets
