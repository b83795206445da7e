"""The README and the proto comments tell the truth.

And docs/data-plane.md lists every error reason a trainer can meet, with the codes the
source raises it with: a reason added to the server without a row in its table fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

from weightsync.common import errors
from weightsync.common.collective import RENDEZVOUS_PREFIX
from weightsync.common.data_plane import DATA_PLANE_REVISION

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_readme_points_only_into_the_repo():
    assert "../shared" not in README
    for target in re.findall(r"\]\(([^)#]+)", README):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links to {target}, which is not in the repo"
    assert "docs/architecture.md" in README


def _linked_pages(page: Path) -> set[Path]:
    """The repository's markdown pages a page links to (relative links, anchors dropped)."""
    targets = re.findall(r"\]\(([^)#\s]+)", page.read_text())
    return {(page.parent / t).resolve() for t in targets if "://" not in t and t.endswith(".md")}


def test_the_readme_is_a_front_door_that_reaches_every_doc():
    """At most 300 lines, and every page under docs/ (and bench/results/README.md, where the benchmark tables
    went) reachable from it by a chain of links: a page the README sheds must stay findable."""
    assert len(README.splitlines()) <= 300, len(README.splitlines())
    seen, todo = set(), [ROOT / "README.md"]
    while todo:
        page = todo.pop()
        if page in seen or not page.exists():
            continue
        seen.add(page)
        todo.extend(_linked_pages(page) - seen)
    pages = {p.resolve() for p in (ROOT / "docs").rglob("*.md")} | {(ROOT / "bench/results/README.md").resolve()}
    unreachable = sorted(str(p.relative_to(ROOT)) for p in pages - seen)
    assert not unreachable, f"not reachable from README.md by links: {unreachable}"


def test_readme_says_where_the_commands_are():
    assert ".venv/bin/weightsync" in README and "source .venv/bin/activate" in README


def test_readme_shows_the_cpu_form_of_serve_first():
    serves = [line for line in README.splitlines() if line.startswith("weightsync serve")]
    assert serves and "--device cpu" in serves[0] and "cuda" not in serves[0].split("#")[0]


def test_the_proto_names_the_real_rendezvous_prefix():
    proto = (ROOT / "protos/weightsync/v1/weight_sync_service.proto").read_text()
    start = proto.index("message CreateTransferGroupRequest")
    comment = proto[start : proto.index("string group_id = 1;", start)]
    assert f'PrefixStore("{RENDEZVOUS_PREFIX}<group_id>"' in comment
    assert "not init_process_group" in comment


# -- docs/data-plane.md: every error reason ------------------------------------------------
DATA_PLANE = (ROOT / "docs/data-plane.md").read_text()
SOURCE_DIRS = ("server", "gpu_worker", "common")

# Raised in the source but never reaching a trainer; none of these may sit in the tables.
INTERNAL_ONLY = {
    "ABORTED",  # only a metrics label for an update that ended without a recorded failure
    "BUCKET_NOT_EXPECTED",  # a worker re-checking what the server refused first (BUCKET_OUT_OF_ORDER, ...)
    "COMMAND_UNKNOWN",  # a server-to-worker command the worker does not know (mismatched builds)
    "INGRESS_MISSING",  # a worker checking the server's ingress commands
    "INGRESS_OUT_OF_RANGE",  # the same
    "SERVER_STOPPING",  # pending worker commands failed after the gRPC server stopped: no caller left
    "UPDATE_NOT_PREPARED",  # a worker asked about an update it did not prepare (a server bug)
    "ARENA_NOT_MAPPED",  # a worker told to write where the server never mapped it (a server bug)
    "FD_CHANNEL_MISSING",  # a worker started without its fd channel (a server bug)
}
# Met only by engines (acquire_version / release_version): in the doc's Engines table instead.
ENGINE_ONLY = {"LEASE_NOT_FOUND", "VERSION_GONE", "VERSION_NOT_COMMITTED", "STORE_INCONSISTENT", "ENGINE_ANSWER_MALFORMED", "ENGINE_CALL_FAILED", "ENGINE_REFUSED",
               "ENGINE_UNREACHABLE"}
# Reasons an engine answers with that the server only reads (server/engines/driver.py retries a vLLM apply
# on NOT_PREPARED): documented with the engine that raises them, in the doc's vLLM backend table.
READ_FROM_ENGINES = {"NOT_PREPARED"}
# UPPER_SNAKE_CASE string literals in the source that are no ErrorInfo reason.
NOT_REASONS = {
    "LOCAL_ALLOW_UID",  # the WEIGHTSYNC_LOCAL_ALLOW_UID environment variable
    "WEIGHTSYNC_BYTE_PASSES",  # an environment variable: count the bytes each stage copies (common/byte_passes.py)
    "NCCL_SOCKET_IFNAME",  # an environment variable NCCL reads
    "NUMBA_CACHE_DIR",  # numba's cache folder (common/numba_cache.py)
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",  # environment variables torch's NCCL groups read
    "TORCH_NCCL_NONBLOCKING_TIMEOUT",
    "TORCH_NCCL_BLOCKING_WAIT",
    "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "TORCH_NCCL_ENABLE_MONITORING",
    "SERVICE_NAME",  # a Python name in __all__
}

_CODE_OF_CLASS = {
    cls.__name__: cls.code.name
    for cls in vars(errors).values()
    if isinstance(cls, type) and issubclass(cls, errors.WeightSyncError)
}
# `SomeError("REASON"`, over line breaks: the reason and the code it is raised with.
_RAISED = re.compile(r"\b(" + "|".join(_CODE_OF_CLASS) + r')\(\s*"([A-Z][A-Z0-9_]*)"')
# Any literal that looks like a reason: catches reasons passed through a variable
# (e.g. `kind(reason, ...)`, `self._wait(..., "ENGINE_READING", ...)`).
_LITERAL = re.compile(r'"([A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+)"')
_ROW = re.compile(r"^\| `([A-Z][A-Z0-9_]*)` \| ([A-Z_]+) \|", re.MULTILINE)


def _source() -> str:
    return "\n".join(p.read_text() for d in SOURCE_DIRS for p in sorted((ROOT / d).rglob("*.py")))


def _raised_with_codes() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for cls, reason in _RAISED.findall(_source()):
        found.setdefault(reason, set()).add(_CODE_OF_CLASS[cls])
    return found


def _raised() -> set[str]:
    return (set(_raised_with_codes()) | set(_LITERAL.findall(_source()))) - NOT_REASONS


def _section(heading: str) -> str:
    start = DATA_PLANE.index(f"\n## {heading}")
    end = DATA_PLANE.find("\n## ", start + 1)
    return DATA_PLANE[start : end if end >= 0 else None]


def _table(heading: str) -> dict[str, set[str]]:
    rows: dict[str, set[str]] = {}
    for reason, code in _ROW.findall(_section(heading)):
        rows.setdefault(reason, set()).add(code)
    return rows


TRAINER = _table("Error reasons")
ENGINES = _table("Engines")


def test_the_scan_finds_the_reasons():
    raised = _raised_with_codes()
    assert len(raised) > 80 and raised["PLAN_NOT_FOUND"] == {"NOT_FOUND"}, sorted(raised)
    assert {"ENGINE_READING", "COLLECTIVE_TIMEOUT", "WORKER_TIMEOUT"} <= _raised() - set(raised)  # via variables
    assert len(TRAINER) > 80 and len(ENGINES) >= 6


def test_every_reason_a_trainer_can_meet_is_in_the_data_plane_table():
    raised = _raised()
    missing = raised - INTERNAL_ONLY - ENGINE_ONLY - READ_FROM_ENGINES - set(TRAINER)
    assert not missing, f"reasons raised in {SOURCE_DIRS} but not in docs/data-plane.md's table: {sorted(missing)}"
    assert not ENGINE_ONLY - set(ENGINES), sorted(ENGINE_ONLY - set(ENGINES))
    vllm_backend = set(re.findall(r"^\| `([A-Z][A-Z0-9_]*)` \|", _section("Engines"), re.MULTILINE))
    assert READ_FROM_ENGINES <= vllm_backend, sorted(READ_FROM_ENGINES - vllm_backend)


def test_the_tables_list_only_reasons_the_source_raises():
    raised = _raised()
    assert not (set(TRAINER) | set(ENGINES)) - raised, sorted((set(TRAINER) | set(ENGINES)) - raised)
    assert INTERNAL_ONLY | ENGINE_ONLY <= raised, "an exclusion names a reason the source no longer raises"
    assert not INTERNAL_ONLY & (set(TRAINER) | set(ENGINES)), "an internal reason is documented: drop it from INTERNAL_ONLY"


def test_the_tables_give_each_reason_the_code_it_is_raised_with():
    documented = {r: TRAINER.get(r, set()) | ENGINES.get(r, set()) for r in set(TRAINER) | set(ENGINES)}
    wrong = {r: (codes, documented[r]) for r, codes in _raised_with_codes().items()
             if r in documented and not codes <= documented[r]}
    assert not wrong, f"reason: (raised with, documented): {wrong}"


# -- docs/data-plane.md: the data-plane revisions ---------------------------------------------------
def test_the_revisions_table_ends_at_the_revision_the_server_speaks():
    """A revision bumped in common/data_plane.py without its row (or a row without the bump) fails here:
    the table lists 1, 2, ... up to DATA_PLANE_REVISION, and the page says which one it describes."""
    section = _section("Revisions")
    listed = [int(n) for n in re.findall(r"^\| (\d+) \| ", section, re.MULTILINE)]
    assert listed == list(range(1, DATA_PLANE_REVISION + 1)), listed
    assert f"this page describes revision **{DATA_PLANE_REVISION}**" in section
    assert f"The Python SDK speaks revision {DATA_PLANE_REVISION} only" in section
    proto = (ROOT / "protos/weightsync/v1/weight_sync_service.proto").read_text()
    assert "int32 data_plane_revision = 14;" in proto and "0 (unset): a server older than this field" in proto
