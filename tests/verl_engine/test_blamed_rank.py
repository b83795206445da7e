"""blamed_rank: which actor rank a failed sync names, from the senders' published outcomes (a table)."""

from __future__ import annotations

import pytest

pytest.importorskip("verl.checkpoint_engine", reason="verl is not installed here: run make test-verl")

from weightsync.integrations.verl.engine import blamed_rank  # noqa: E402


def failed(cause: str, failed_part: int | None = None, missing: tuple[int, ...] = ()) -> dict:
    return {"ok": False, "cause_reason": cause, "message": "", "failed_part": failed_part, "missing": list(missing)}


@pytest.mark.parametrize(("outcomes", "expected"), [
    # one sender failed alone, no part named: that sender
    ({0: failed("TENSOR_SHAPE_MISMATCH")}, 0),
    ({1: failed("TypeError")}, 1),
    # the server named the part at fault: rank 0 heard PART_FAILED about rank 2, rank 2 its own refusal
    ({0: failed("PART_FAILED", failed_part=2), 2: failed("BUCKET_CHECKSUM_MISMATCH", failed_part=2)}, 2),
    # a union refusal names the part in every part's answer
    ({0: failed("PART_SENDS_UNOWNED", failed_part=1), 1: failed("PART_SENDS_UNOWNED", failed_part=1)}, 1),
    # only the ranks that came heard PARTS_MISSING: the missing rank is named
    ({0: failed("PARTS_MISSING", missing=(1, 3)), 2: failed("PARTS_MISSING", missing=(1, 3))}, 1),
    # a part named beats a missing one; the lowest named wins
    ({0: failed("PART_FAILED", failed_part=3), 1: failed("PARTS_MISSING", missing=(2,))}, 3),
    # outcomes published before this field existed (no failed_part / missing keys)
    ({2: {"ok": False, "cause_reason": "X", "message": ""}, 1: {"ok": False, "cause_reason": "Y", "message": ""}}, 1),
])
def test_blamed_rank(outcomes: dict[int, dict], expected: int) -> None:
    assert blamed_rank(outcomes) == expected
