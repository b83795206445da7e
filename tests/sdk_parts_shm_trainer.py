"""One trainer rank of tests/test_sdk_parts_shm.py: a process on the server's host, in a Gloo group, pushing
its part over SHM (into its own run of the server's ingress slots).

    python sdk_parts_shm_trainer.py RANK WORLD PORT SERVER OUT_DIR

Writes OUT_DIR/rank{RANK}.json: each step's generation, the run of slots UpdateReady gave, verify's
mismatches, and a DTensor step's. Exits 0 when it ran to its end.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

GLOO_TIMEOUT = datetime.timedelta(seconds=90)
BUCKET_BYTES = 4096
"""Each rank's tensors fill several 4 KiB buckets, more than its run of slots: every slot is written again
after the server applied what it held, and a rank writing outside its run would overwrite the other's."""


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"p0": torch.randn(4000, generator=g), "p1": torch.randn(70, 50, generator=g).to(torch.bfloat16),
            "q0": torch.randn(3500, generator=g), "q1": torch.arange(2500, dtype=torch.int32) * seed,
            "rows": torch.randn(9, 130, generator=g)}


OWNS = (("p0", "p1"), ("q0", "q1"))


def runs(client) -> list[list[int]]:
    """The run of ingress slots each server gave this rank's last push (client internals: the SHM sink)."""
    sink = client._fleet.shm_sink(client._loop)
    return [list(sink._run)]


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    server, out_dir = sys.argv[4], Path(sys.argv[5])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=GLOO_TIMEOUT)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from weightsync.client import Part, WeightSyncClient

    mesh = init_device_mesh("cpu", (world,))
    out: dict = {}
    part = Part(rank=rank, world=world, group=dist.group.WORLD, join_timeout=60)
    with WeightSyncClient([server], part=part) as client:
        for step, seed in (("v1", 1), ("v2", 2)):
            full = model(seed)
            tensors = {name: full[name] for name in OWNS[rank]}
            tensors["rows"] = distribute_tensor(full["rows"], mesh, [Shard(0)])  # 5 rows here, 4 there
            result = client.push(tensors, version=step, mode="staged", transport="shm", allow_new_tensors=True,
                                 bucket_size_bytes=BUCKET_BYTES)
            out[step] = [s.generation for s in result.servers]
            out[f"{step}_buckets"] = result.bucket_count
            out[f"{step}_run"] = runs(client)
            own = {name: full[name] for name in OWNS[rank]}
            own["rows"] = full["rows"]
            out[f"{step}_mismatches"] = [m.name for m in client.verify(own).mismatches]
    (out_dir / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
