"""A trainer that dies in the middle of writing a bucket into the node store (tests/test_shm_writes.py).

    python tests/shm_writes_trainer.py ADDRESS MODE SEED DIE_AT

Pushes test_shm_writes.model(SEED) over SHM in MODE (in_place or staged), its buckets written straight into
the store, and exits with status 3 (os._exit: no abort, no stream closed cleanly) halfway through the
DIE_AT-th tensor it copies there. Exits 0 only if the push somehow committed.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_shm_writes import BUCKET_BYTES, model  # noqa: E402

from weightsync.client import WeightSyncClient  # noqa: E402
from weightsync.client.transports import store_writes  # noqa: E402


def main() -> None:
    address, mode, seed, die_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    real = store_writes.copy_ws64_terms
    calls = 0

    def dying(dst, src, first_word=0):
        nonlocal calls
        calls += 1
        if calls == die_at:
            half = src.size // 2
            dst[:half] = src[:half]  # half a tensor written into the store, then gone
            os._exit(3)
        return real(dst, src, first_word)

    store_writes.copy_ws64_terms = dying
    with WeightSyncClient(address) as client:
        client.push(model(seed), version=f"dies-{seed}", transport="shm", mode=mode, delta=False,
                    bucket_size_bytes=BUCKET_BYTES)
    os._exit(0)


if __name__ == "__main__":
    main()
