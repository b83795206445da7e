"""How many bytes each stage of a push copies or reads, counted where it happens: for the benchmark.

Every stage of the host path that copies a bucket's bytes or reads them whole (a checksum) calls
`copied` or `read` with the bytes it handled. Nothing is counted unless the process was started with
WEIGHTSYNC_BYTE_PASSES naming a folder: then each process (trainer, server, worker) keeps its totals
and writes them to FOLDER/<pid>.json after each count (a file per process, replaced whole), so a
benchmark that pushes N bytes can read the copies and read passes per byte of every process of the
push (bench/host_path.py) without estimating them. Off, a call costs one comparison.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

ENV = "WEIGHTSYNC_BYTE_PASSES"
COPY = "copy"
READ = "read"

_folder = os.environ.get(ENV) or None
_counts: Counter[str] = Counter()


def copied(stage: str, nbytes: int) -> None:
    """`stage` copied `nbytes` bytes of bucket data (one write of each, and the read that feeds it)."""
    if _folder is not None:
        _count(f"{COPY} {stage}", nbytes)


def read(stage: str, nbytes: int) -> None:
    """`stage` read `nbytes` bytes of bucket data without copying them (a checksum)."""
    if _folder is not None:
        _count(f"{READ} {stage}", nbytes)


def totals() -> dict[str, int]:
    """This process's counts so far ("copy STAGE" / "read STAGE" -> bytes)."""
    return dict(_counts)


def _count(key: str, nbytes: int) -> None:
    _counts[key] += nbytes
    assert _folder is not None
    path = Path(_folder) / f"{os.getpid()}.json"
    partial = path.with_suffix(".part")
    partial.write_text(json.dumps(dict(_counts)))
    os.replace(partial, path)


def collect(folder: Path) -> dict[str, int]:
    """Every process's counts in `folder`, added up."""
    total: Counter[str] = Counter()
    for path in sorted(folder.glob("*.json")):
        total.update(json.loads(path.read_text()))
    return dict(total)
