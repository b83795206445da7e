"""One trainer rank of tests/system/test_part_verify_subset.py: a real process in a Gloo group that pushes its share of
a two-stage model as a part, to a whole node and a node holding stage 0 only (--tensors SUBSET), and
verify()s it at each step.

    python sdk_part_verify_subset_trainer.py RANK WORLD PORT SERVERS(comma-separated) OUT_DIR

Each rank holds `rows` (Shard(0)) and `norm` (Replicate), both outside the subset, and its stage's plain
tensors: rank 0 `stage0.w` and `stage0.b` (inside the subset), rank 1 `stage1.w` (outside it), so every one
of rank 1's checks lies outside the subset node's tensors. Writes OUT_DIR/rank{RANK}.json: verify()'s
checked count and mismatches (`server|name|remote is None`) at each step:

  - fresh: before any push (both stores hold nothing);
  - v1: after the first push; v1_plain: rank 1's plain tensor alone;
  - tampered: after rank 0 changed one element of stage0.w (inside the subset) and of stage1.w (outside it)
    on the servers with a plain client's push (the servers' copy, not the trainers');
  - v2: after the next normal push; absent: with one tensor no server holds added (stage0.absent on rank 0,
    inside the subset; stage1.absent on rank 1, outside it).
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from trainer_rank import join_group, verify_record

SUBSET = r"^stage0\."
TAMPERED = {"stage0.w": 7, "stage1.w": 3}
"""The element rank 0 changes on the servers, by tensor."""


def full_model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"rows": torch.randn(9, 5, generator=g), "norm": torch.randn(5, generator=g),
            "stage0.w": torch.randn(33, generator=g), "stage0.b": torch.randn(4, generator=g),
            "stage1.w": torch.randn(17, generator=g)}


def main() -> None:
    me = join_group()
    rank, world, servers, out_dir = me.rank, me.world, me.servers, me.out_dir
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from weightsync.client import Part, WeightSyncClient

    mesh = init_device_mesh("cpu", (world,))

    def share(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tensors = {"rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
                   "norm": distribute_tensor(full["norm"], mesh, [Replicate()])}
        return tensors | {n: t for n, t in full.items() if n.startswith(f"stage{rank}.")}

    out: dict = {}
    with WeightSyncClient(servers, part=Part(rank=rank, world=world, group=dist.group.WORLD, join_timeout=60)) as client:
        v1 = full_model(31)
        out["fresh"] = verify_record(client, share(v1))
        dist.barrier()  # every rank verified the empty stores before the first push
        client.push(share(v1), version="v1", mode="staged", transport="inline", allow_new_tensors=True)
        out["v1"] = verify_record(client, share(v1))
        if rank == 1:
            out["v1_plain"] = verify_record(client, {"stage1.w": v1["stage1.w"]})
        dist.barrier()  # every rank verified v1 before the change
        if rank == 0:
            with WeightSyncClient(servers) as plain:
                update = {}
                for name, index in TAMPERED.items():
                    update[name] = v1[name].clone()
                    update[name][index] += 1
                plain.push(update, version="tamper", mode="staged", transport="inline")
        dist.barrier()
        out["tampered"] = verify_record(client, share(v1))
        dist.barrier()  # every rank verified the change before the next push
        v2 = full_model(32)
        client.push(share(v2), version="v2", mode="staged", transport="inline")
        out["v2"] = verify_record(client, share(v2))
        out["absent"] = verify_record(client, share(v2) | {f"stage{rank}.absent": torch.ones(6)})
    (out_dir / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
