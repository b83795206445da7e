"""A trainer process on the server's host for tests/test_store_writes_guarantees.py: its buckets are written
straight into the node store (client/transports/store_writes.py).

    python tests/store_writes_trainer.py stall ADDRESS MODE SEED BUCKET
        Pushes model(SEED) over SHM in MODE (in_place or staged). Halfway through the first tensor it writes
        into the store in bucket BUCKET it prints "writing ARENA_IDS" (the arenas of that bucket's places)
        and blocks reading stdin, until the test SIGKILLs it (or closes stdin: exit 4).
    python tests/store_writes_trainer.py serve ADDRESS
        For each SEED line on stdin, pushes model(SEED) over SHM IN_PLACE and prints "committed" or
        "refused CODE REASON"; exits 0 at the end of stdin.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from weightsync.client import UpdateFailed, WeightSyncClient  # noqa: E402
from weightsync.client.transports import store_writes  # noqa: E402

from models import mixed_model  # noqa: E402

BUCKET_BYTES = 1 << 20


def model(seed: int) -> dict[str, torch.Tensor]:
    """mixed_model (every dtype, odd sizes, a tensor split in pieces) and eight 320 KiB tensors: 5 buckets of
    1 MiB, each with a tensor copied alone and some with small ones copied by groups."""
    g = torch.Generator().manual_seed(seed + 1)
    return mixed_model(seed) | {f"layers.{i}.mlp.weight": torch.randn(81920, generator=g) for i in range(8)}


def push(client: WeightSyncClient, seed: int, mode: str) -> None:
    client.push(model(seed), version=f"trainer-{seed}", transport="shm", mode=mode, delta=False,
                bucket_size_bytes=BUCKET_BYTES)


def stall(address: str, mode: str, seed: int, bucket: int) -> None:
    real_write, real_copy = store_writes.StoreWriter.write, store_writes.StoreWriter._copy_host
    current: dict[str, object] = {}

    def write(self, sequence, spec, source, regions):
        current.update(sequence=sequence, arenas=sorted({r.arena_id for r in regions}))
        return real_write(self, sequence, spec, source, regions)

    def copy_host(self, copies, regions):
        if current["sequence"] == bucket and copies:
            first = copies[0]
            half = first.size // 2
            first.place[:half].copy_(first.data[:half])  # half a tensor in the store, then killed
            print("writing", *current["arenas"], flush=True)
            sys.stdin.read()
            os._exit(4)
        return real_copy(self, copies, regions)

    store_writes.StoreWriter.write = write
    store_writes.StoreWriter._copy_host = copy_host
    with WeightSyncClient(address) as client:
        push(client, seed, mode)
    os._exit(0)  # committed: the test fails on it


def serve(address: str) -> None:
    with WeightSyncClient(address) as client:
        print("ready", flush=True)
        for line in sys.stdin:
            try:
                push(client, int(line), "in_place")
                print("committed", flush=True)
            except UpdateFailed as failed:
                print("refused", failed.code.name, failed.reason, flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "stall":
        stall(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        serve(sys.argv[2])
