"""Parts whose peer is gone, and a refused create_group, over real trainer processes
(tests/sdk_parts_gone_trainer.py, two ranks in one Gloo group) and two real servers.

A part killed before a push, or before create_group, fails the other at once with PartGroupFailed (chained
to Gloo's own error, naming the peer's address as Gloo gives it), nothing sent; the survivor's next push
(the whole model, alone) commits and verifies. A create_group the servers refuse ends on both parts at once
(part 0 closes its rendezvous store), no rendezvous thread is left on either, both exit 0, and a group of
their own then carries their next push. Ranks that state different versions both fail at once with
PART_MISMATCH (not at the join timeout), and their next push commits."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from sdk_parts_gone_trainer import LONG_TIMEOUT

from weightsync.client import WeightSyncClient

from helpers import free_port, ranks_exit_codes, run_ranks, start_servers

pytestmark = pytest.mark.timeout(600)

TRAINER = Path(__file__).resolve().parents[1] / "sdk_parts_gone_trainer.py"
TRAINERS_TIMEOUT = 300
"""Bounds each scenario's processes; below LONG_TIMEOUT, so a refused create_group that waits out its group's
timeout, or a part that waits out its join timeout, fails the test."""
assert TRAINERS_TIMEOUT < LONG_TIMEOUT
GLOO_PEER = re.compile(r"^\[127\.0\.0\.1\]:\d+$")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    started = start_servers([tmp_path_factory.mktemp(f"sdk-parts-gone-{k}") for k in range(2)], workers=1)
    yield started
    for server in started:
        assert server.stop() == 0, server.log()[-3000:]


def argv(servers, out: Path, scenario: str, *extra: str) -> list[str]:
    return [str(TRAINER), "{rank}", "2", str(free_port()), ",".join(s.address for s in servers), str(out), scenario,
            *extra]


def rank0_with_rank1_killed(servers, out: Path, scenario: str) -> dict:
    import json

    codes = ranks_exit_codes(argv(servers, out, scenario), 2, out, TRAINERS_TIMEOUT)
    assert codes == [0, -9], (out / "rank0.log").read_text()[-4000:]
    return json.loads((out / "rank0.json").read_text())


def assert_gone(failed: dict, during: str) -> None:
    assert (failed["type"], failed["rank"], failed["world"], failed["during"], failed["timed_out"],
            failed["cause"]) == ("PartGroupFailed", 0, 2, during, False, "RuntimeError"), failed
    assert GLOO_PEER.match(failed["peer"]), failed
    assert failed["message"].startswith(f"part 0 of 2: {during} failed before anything was sent: a part of the "
                                        f"parts' group (Part.group) is gone (the connection to {failed['peer']} "
                                        "closed)"), failed["message"]


def assert_next_push_alone(record: dict) -> None:
    assert record["after"] == [g + 1 for g in record["before"]]
    assert record["verify"] == {"checked": 2, "mismatches": []}


def test_a_part_killed_before_a_push_fails_the_other_at_once_typed_and_nothing_is_sent(servers, tmp_path):
    zero = rank0_with_rank1_killed(servers, tmp_path, "push")
    assert_gone(zero["v2"], "push")
    assert zero["after_v2"] == zero["after_v1"]  # nothing sent: no server moved
    assert_next_push_alone(zero["next"])
    assert zero["next"]["before"] == zero["after_v1"]


def test_a_part_killed_before_create_group_fails_the_other_at_once_typed(servers, tmp_path):
    zero = rank0_with_rank1_killed(servers, tmp_path, "create_group")
    assert_gone(zero["create_group"], "create_group")
    assert zero["threads"] == [] and zero["groups"] == {s.address: [] for s in servers}
    assert_next_push_alone(zero["next"])
    assert zero["next"]["before"] == zero["before"]


def test_a_refused_create_group_ends_on_every_part_at_once_and_leaves_no_thread(servers, tmp_path):
    with WeightSyncClient([s.address for s in servers]) as owner:
        owner.create_group(group_id="taken-by-another", timeout=60)
        zero, one = run_ranks(argv(servers, tmp_path, "refused", "taken-by-another"), 2, tmp_path, TRAINERS_TIMEOUT)
        assert {a: [g.group_id for g in gs] for a, gs in owner.list_groups().items()} == {
            s.address: ["taken-by-another"] for s in servers}
        owner.delete_group()
    assert zero["refused"] == {"type": "WeightSyncRpcError", "reason": "GROUP_ALREADY_EXISTS", "code": "ALREADY_EXISTS"}
    assert (one["refused"]["type"], one["refused"]["cause"]) == ("WeightSyncClientError", "DistNetworkError")
    assert one["refused"]["message"].startswith("part 1 of 2: create_group failed in the group's rendezvous, nothing "
                                                "created: part 0 closed its store"), one["refused"]
    assert zero["threads"] == one["threads"] == []
    assert zero["verify"] == one["verify"] == {"checked": 1, "mismatches": []}


def test_ranks_that_disagree_on_the_version_both_fail_at_once_with_part_mismatch(servers, tmp_path):
    """Each server refuses whichever part joins second and fails the other with the same reason at once, naming
    it (join timeout 600 s, past the scenario's bound); nothing moves, and the same version then commits."""
    zero, one = run_ranks(argv(servers, tmp_path, "mismatch"), 2, tmp_path, TRAINERS_TIMEOUT)
    for record, other in ((zero, 1), (one, 0)):
        failed = record["mismatch"]
        assert (failed["reason"], failed["code"]) == ("PART_MISMATCH", "INVALID_ARGUMENT"), failed
        assert failed["failed_part"] in (None, other), failed  # the part refused first on the server it read
        assert record["after_mismatch"] == record["before"]
        assert record["after_v7"] == [g + 1 for g in record["before"]]
        assert record["verify"] == {"checked": 1, "mismatches": []}
