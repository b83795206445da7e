"""One trainer rank of tests/system/test_part_verify.py: a real process in a Gloo group that pushes its DTensors as a
part and verify()s them as they are (its own shards, no gather).

    python sdk_part_verify_trainer.py RANK WORLD PORT SERVERS(comma-separated) OUT_DIR

Writes OUT_DIR/rank{RANK}.json: verify()'s checked count and mismatches after each step. Between steps,
rank 0 changes one element of one stored tensor with a plain client's whole push (the servers' copy, not
the trainers'; the element it changed the step before set back), and the ranks wait for it at a barrier (the script's own collective, never inside verify).
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from trainer_rank import join_group, verify_record

TAMPERED = (("rows", (7, 2)), ("cols", (0, 1)), ("norm", (3,)))
"""The element rank 0 changes on the servers at each tamper step: rows[7, 2] lies in rank 1's Shard(0) box
(rows 5:9 of 9), cols[0, 1] in rank 0's Shard(1) box (columns 0:5 of 9), norm is replicated."""


def full_model(seed: int) -> dict[str, torch.Tensor]:
    """The whole tensors: 9 rows and 9 columns, which do not divide evenly by 2."""
    g = torch.Generator().manual_seed(seed)
    return {"rows": torch.randn(9, 5, generator=g), "cols": torch.randn(6, 9, generator=g).to(torch.bfloat16),
            "norm": torch.randn(5, generator=g), "plain0": torch.randn(33, generator=g)}


def tampered(full: torch.Tensor, index: tuple[int, ...]) -> torch.Tensor:
    changed = full.clone()
    changed[index] += 1
    return changed


def main() -> None:
    me = join_group()
    rank, world, servers, out_dir = me.rank, me.world, me.servers, me.out_dir
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from weightsync.client import Part, WeightSyncClient

    mesh = init_device_mesh("cpu", (world,))
    out: dict = {}
    with WeightSyncClient(servers, part=Part(rank=rank, world=world, group=dist.group.WORLD, join_timeout=60)) as client:
        for step, seed in (("v1", 21), ("v2", 22)):
            full = full_model(seed)
            tensors = {"rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
                       "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]),
                       "norm": distribute_tensor(full["norm"], mesh, [Replicate()])}
            if rank == 0:
                tensors["plain0"] = full["plain0"]
            out[f"{step}_boxes"] = {n: list((t.to_local() if isinstance(t, DTensor) else t).shape)
                                    for n, t in tensors.items()}
            client.push(tensors, version=step, mode="staged", transport="inline", allow_new_tensors=True)
            out[step] = verify_record(client, tensors)
            if step == "v2":
                # A tensor no server holds, built from this rank's shard alone (no collective): its box is
                # reported missing (remote None) on every server, the rest still checked.
                rows = 5 if rank == 0 else 4
                absent = DTensor.from_local(torch.ones(rows, 2), mesh, [Shard(0)], run_check=False,
                                            shape=torch.Size([9, 2]), stride=(2, 1))
                out["absent"] = verify_record(client, tensors | {"absent": absent})
                break
            for name, index in TAMPERED:  # each: one element changed on the servers, then every rank verifies
                if rank == 0:
                    with WeightSyncClient(servers) as plain:
                        # The others as v1 has them (the last step's change undone), this one changed.
                        update = {n: full[n] for n, _ in TAMPERED} | {name: tampered(full[name], index)}
                        plain.push(update, version=f"tamper-{name}", mode="staged", transport="inline")
                dist.barrier()
                out[f"tamper_{name}"] = verify_record(client, tensors)
                dist.barrier()  # every rank verified before the next change
    (out_dir / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
