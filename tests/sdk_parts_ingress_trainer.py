"""One trainer rank of tests/system/test_sdk_parts_ingress.py: a process in a Gloo group pushing its part through one
server's ingress slots: over SHM (on the server's host, into its own run of the slots) or INLINE.

    python sdk_parts_ingress_trainer.py RANK WORLD PORT SERVER OUT_DIR TRANSPORT

Writes OUT_DIR/rank{RANK}.json: each step's generation and bucket count, the run of slots UpdateReady gave
(SHM), and verify's mismatches. Exits 0 when it ran to its end.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from trainer_rank import join_group

BUCKET_BYTES = 4096
"""Each rank's tensors fill several 4 KiB buckets, more than its run of slots: every slot is written again
after the server applied what it held, and a rank writing outside its run would overwrite the other's."""


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"p0": torch.randn(4000, generator=g), "p1": torch.randn(70, 50, generator=g).to(torch.bfloat16),
            "q0": torch.randn(3500, generator=g), "q1": torch.arange(2500, dtype=torch.int32) * seed,
            "s0": torch.randn(3000, generator=g), "rows": torch.randn(9, 130, generator=g)}


OWNS = (("p0", "p1"), ("q0", "q1"), ("s0",))
"""Whole tensors per rank (a world of 2 or 3); every rank also sends its rows of "rows" (Shard(0))."""


def run_of_slots(client) -> list[int]:
    """The run of ingress slots the server gave this rank's last SHM push (client internals: the SHM sink)."""
    return list(client._fleet.shm_sink(client._loop)._run)


def main() -> None:
    me = join_group()
    rank, world, server, out_dir, transport = me.rank, me.world, me.servers[0], me.out_dir, me.extra[0]
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
            tensors["rows"] = distribute_tensor(full["rows"], mesh, [Shard(0)])  # 5 rows and 4, or 3 each
            result = client.push(tensors, version=step, mode="staged", transport=transport, allow_new_tensors=True,
                                 bucket_size_bytes=BUCKET_BYTES)
            out[step] = [s.generation for s in result.servers]
            out[f"{step}_buckets"] = result.bucket_count
            if transport == "shm":
                out[f"{step}_run"] = run_of_slots(client)
            own = {name: full[name] for name in OWNS[rank]}
            own["rows"] = full["rows"]
            out[f"{step}_mismatches"] = [m.name for m in client.verify(own).mismatches]
    (out_dir / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
