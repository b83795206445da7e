"""One trainer rank of tests/system/test_sdk_parts_delta.py: a real process in a Gloo group, pushing its part of each
step with the SDK's default delta ("auto").

    python sdk_parts_delta_trainer.py RANK WORLD PORT SERVERS(comma-separated) OUT_DIR

Rank 0 owns `a` and `c` whole, rank 1 `b` and `d` whole (`d` never changes), and each rank a box of `rows`
(a DTensor, Shard(0): its half of the rows) and one of `cols` (Shard(1): its half of the columns, a box in
dimension 1). Every step after the first changes 0.5% of the elements of `a`, `b`, `c`, `rows` and `cols`. Steps 1 to 3 are pushed; then rank 0 pushes `d` once more, alone, to the second server
(the "intruder": that store moves on a generation, so the base the parts name there is refused), and steps 4
and 5 are pushed. Then rank 1's record of the first server forgets its generation (as if it had lost
that server's Committed): step 6 fails on both ranks (their bases differ there), both forget every base, and
steps 7 (dense) and 8 (patches) commit. Writes OUT_DIR/rank{RANK}.json: per step, what the push sent (PushResult), each server's
generation and received bytes (Committed.size_bytes), and verify()'s mismatches against the whole model.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from trainer_rank import join_group

OWNS = (("a", "c"), ("b", "d"))
BOXED = {"rows": 0, "cols": 1}
"""The DTensors (Shard(dim)), each rank holding its half along dim."""
CHANGING = ("a", "b", "c", "rows", "cols")
CHANGED_FRACTION = 200
"""Each step changes numel // CHANGED_FRACTION positions (0.5%, drawn with repetition) of each changing tensor."""
BUCKET_BYTES = 64 << 10
JOIN_TIMEOUT = 60
"""How long a server waits for the other part's Begin: the parts' Begins of every push follow their agreement's
all-gather, so they are never this far apart, even on a loaded host (step 6's refused part fails the other at
once: PART_MISMATCH on both)."""


def full(step: int) -> dict[str, torch.Tensor]:
    """The whole model after `step` (1: as initialised; each later step changes 0.5% of CHANGING)."""
    g = torch.Generator().manual_seed(7)
    tensors = {"a": torch.randn(256, 256, generator=g), "b": torch.randn(65536, generator=g),
               "c": torch.randn(300, 64, generator=g).to(torch.bfloat16), "d": torch.arange(4096, dtype=torch.int64),
               "rows": torch.randn(64, 128, generator=g), "cols": torch.randn(96, 80, generator=g)}
    for later in range(2, step + 1):
        for index, name in enumerate(CHANGING):
            flat = tensors[name].view(-1)
            where = torch.Generator().manual_seed(1000 * later + index)
            positions = torch.randint(0, flat.numel(), (flat.numel() // CHANGED_FRACTION,), generator=where)
            flat[positions] += 1
    return tensors


def own(rank: int, world: int, step: int, mesh) -> dict[str, torch.Tensor]:
    """This rank's part of step `step`: its whole tensors, and its rows and columns as DTensor shards (no
    collective)."""
    from torch.distributed.tensor import DTensor, Shard

    tensors = full(step)
    mine = {name: tensors[name] for name in OWNS[rank]}
    for name, dim in BOXED.items():
        local = tensors[name].chunk(world, dim=dim)[rank].contiguous()
        mine[name] = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False)
    return mine


def pushed(client, rank: int, world: int, step: int, mesh) -> dict:
    result = client.push(own(rank, world, step, mesh), version=f"step-{step}", transport="inline",
                         allow_new_tensors=True, bucket_size_bytes=BUCKET_BYTES)
    return {"bytes_sent": result.bytes_sent, "dense_bytes": result.dense_bytes,
            "generations": {o.server: o.generation for o in result.servers},
            "received": {o.server: o.size_bytes for o in result.servers},
            "mismatches": [f"{m.server}:{m.name}" for m in client.verify(full(step)).mismatches]}


def main() -> None:
    me = join_group()
    rank, world, servers, out_dir = me.rank, me.world, me.servers, me.out_dir
    from torch.distributed.device_mesh import init_device_mesh

    from weightsync.client import Part, PartUpdateFailed, WeightSyncClient

    mesh = init_device_mesh("cpu", (world,))
    out: dict = {}
    part = Part(rank=rank, world=world, group=dist.group.WORLD, join_timeout=JOIN_TIMEOUT)
    with WeightSyncClient(servers, part=part) as client:
        for step in (1, 2, 3):
            out[f"step{step}"] = pushed(client, rank, world, step, mesh)
        dist.barrier()  # between pushes, not inside one
        if rank == 0:
            with WeightSyncClient(servers[1]) as intruder:  # the second server's store moves on a generation
                result = intruder.push({"d": full(3)["d"]}, version="intruder", transport="inline")
                out["intruder"] = {o.server: o.generation for o in result.servers}
        dist.barrier()
        for step in (4, 5):
            out[f"step{step}"] = pushed(client, rank, world, step, mesh)
        if rank == 1:  # as if it had lost the first server's Committed of step 5: its record there is gone
            client._fleet.states[0].base_refused()
        try:
            pushed(client, rank, world, 6, mesh)
            out["step6"] = "pushed"
        except PartUpdateFailed as error:  # the parts name different bases there: both fail, both forget
            out["step6"] = {"reason": error.reason, "server": error.server}
        out["after6"] = [info.current_version.generation for info in client.server_info()]
        for step in (7, 8):
            out[f"step{step}"] = pushed(client, rank, world, step, mesh)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
