"""What every trainer-rank script of the parts tests starts with (tests/sdk_parts*_trainer.py, run by
helpers.run_ranks): its place from the command line, and its Gloo group.

    python SCRIPT RANK WORLD PORT SERVERS(comma-separated) OUT_DIR [EXTRA...]
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

GLOO_TIMEOUT = datetime.timedelta(seconds=90)
"""Bounds the parts' one collective per push (their agreement), and any barrier of a script."""


@dataclass(frozen=True, slots=True)
class TrainerRank:
    rank: int
    world: int
    servers: list[str]
    out_dir: Path
    extra: list[str]
    """The script's own arguments after OUT_DIR."""


def join_group() -> TrainerRank:
    """This process's place (sys.argv), once it joined the world's Gloo group on 127.0.0.1:PORT."""
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=GLOO_TIMEOUT)
    return TrainerRank(rank, world, sys.argv[4].split(","), Path(sys.argv[5]), sys.argv[6:])


def dies_at(bucket: int, out_dir: Path) -> Callable:
    """A push's progress callback that SIGKILLs this process once bucket `bucket` was sent, having written
    OUT_DIR/killed.json (when, and at which of how many buckets) for the test to time the others from."""
    def die(progress) -> None:
        if progress.bucket == bucket:
            (out_dir / "killed.json").write_text(json.dumps(
                {"at": time.monotonic(), "bucket": progress.bucket, "buckets": progress.bucket_count}))
            os.kill(os.getpid(), signal.SIGKILL)
    return die


def verify_record(client, tensors) -> dict:
    """client.verify(tensors) as the tests read it: how many checks, and each mismatch as server|name|missing."""
    result = client.verify(tensors)
    return {"checked": result.checked,
            "mismatches": sorted(f"{m.server}|{m.name}|{m.remote is None}" for m in result.mismatches)}
