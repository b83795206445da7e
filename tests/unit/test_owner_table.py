"""Bucket owners against a table written out by hand, not against the function itself.

The rule (common/ownership.py, docs/data-plane.md "Who receives what"): every worker starts at 0
bytes; bucket 0, 1, 2, ... in plan order goes to the worker holding the fewest bytes so far, the
lowest index among equals, which then holds that bucket's size more; a bucket the node does not
store has no owner (-1) and adds to nobody. Trainers in other languages compute the same, so the
expected owners below are worked by hand from that rule (the loads after each bucket in comments).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from weightsync.common.ownership import NO_OWNER, bucket_owners

DOCS = Path(__file__).resolve().parents[2] / "docs" / "data-plane.md"
KIB, MIB = 1 << 10, 1 << 20

TABLE = [
    # (sizes in bytes, workers, not stored, expected owners)
    pytest.param([300, 100, 100, 50], 2, (), [0, 1, 1, 1],
                 id="docs-example"),  # 300/0, 300/100, 300/200, 300/250
    pytest.param([10, 10, 10, 10, 10], 3, (), [0, 1, 2, 0, 1],
                 id="equal-round-robin"),  # 10/0/0, 10/10/0, 10/10/10, 20/10/10, 20/20/10
    pytest.param([500, 100, 100, 100, 100, 100, 10], 2, (), [0, 1, 1, 1, 1, 1, 0],
                 id="uneven-one-big"),  # 500/0, 500/100 ... 500/500, then the tie: 510/500
    pytest.param([4 * MIB, MIB, 3 * MIB, 2 * MIB], 2, (), [0, 1, 1, 0],
                 id="uneven-mib"),  # 4/0, 4/1, 4/4, tie: 6/4
    pytest.param([KIB, 64 * KIB, KIB, KIB, KIB], 2, (), [0, 1, 0, 0, 0],
                 id="small-after-large"),  # 1/0, 1/64, 2/64, 3/64, 4/64
    pytest.param([7, 7], 4, (), [0, 1],
                 id="more-workers-than-buckets"),  # workers 2 and 3 own nothing
    pytest.param([1, 2, 3], 5, (), [0, 1, 2],
                 id="more-workers-uneven"),
    pytest.param([5, 1, 9, 2], 1, (), [0, 0, 0, 0],
                 id="one-worker"),
    pytest.param([100, 100, 50, 50], 2, (), [0, 1, 0, 1],
                 id="ties-lowest-index"),  # 100/0, 100/100 tie, 150/100, 150/150
    pytest.param([30, 10, 20, 10, 5], 3, (), [0, 1, 2, 1, 1],
                 id="tie-between-later-workers"),  # 30/0/0, 30/10/0, 30/10/20, 30/20/20, tie w1: 30/25/20
    pytest.param([], 3, (), [],
                 id="no-buckets"),
    pytest.param([300, 100, 100, 50], 2, (1,), [0, NO_OWNER, 1, 1],
                 id="not-stored-adds-to-nobody"),  # 300/0, skip, 300/100, 300/150
    pytest.param([64, 128, 64], 2, (0,), [NO_OWNER, 0, 1],
                 id="first-not-stored"),  # skip, 128/0, 128/64
    pytest.param([5, 5], 2, (0, 1), [NO_OWNER, NO_OWNER],
                 id="none-stored"),
]


@pytest.mark.parametrize(("sizes", "workers", "not_stored", "expected"), TABLE)
def test_owners_follow_the_documented_rule(sizes, workers, not_stored, expected):
    assert bucket_owners(sizes, workers, not_stored) == expected


def test_a_node_without_workers_is_refused():
    with pytest.raises(ValueError, match="at least one worker"):
        bucket_owners([1], 0)


def test_the_worked_example_in_the_docs_is_the_table_s():
    """docs/data-plane.md works one example for trainers in other languages: its owners and
    bucket_owner_ranks (rank_offset 1 + owner) must be the table's, not another reading of the rule."""
    text = " ".join(DOCS.read_text().split())
    example = re.search(r"buckets of ([\d, and]+) bytes: owners ([\d, ]+) \(.*?\), so `bucket_owner_ranks` is "
                        r"`\[([\d, ]+)\]`", text)
    assert example, "docs/data-plane.md no longer works the owners example"
    sizes = [int(n) for n in re.findall(r"\d+", example.group(1))]
    owners = [int(n) for n in re.findall(r"\d+", example.group(2))]
    ranks = [int(n) for n in re.findall(r"\d+", example.group(3))]
    assert (sizes, owners, ranks) == ([300, 100, 100, 50], [0, 1, 1, 1], [1, 2, 2, 2])
