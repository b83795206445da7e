"""One trainer rank of tests/system/test_sdk_parts.py: a real process in a Gloo group, pushing its part with the SDK.

    python sdk_parts_trainer.py RANK WORLD PORT SERVERS(comma-separated) OUT_DIR SCENARIO

Writes OUT_DIR/rank{RANK}.json: what each step of the scenario gave (generations per server, the typed
errors' fields, verify's mismatches). Exits 0 when the scenario ran to its end, whatever it recorded.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from trainer_rank import join_group

OWNS = (["a", "c"], ["b", "d", "e"])
"""Rank 0 pushes a and c whole, rank 1 b, d and e."""
BUCKETS = (8192, 8192)
"""Both ranks' plans are several 8 KiB buckets (rank 0's a and c, 37 KiB; rank 1's b, d and e, 22 KiB), so
each worker owns buckets of both parts and their streams' buckets and pieces reach it interleaved, however
the parts race: a worker takes them in order within each part's lane (PrepareUpdateCommand.lane_starts),
each lane with its own staging (before lanes: BUCKET_NOT_EXPECTED, or one part's pieces in the other's
staging)."""


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(128, 64, generator=g), "b": torch.randn(1000, generator=g),
            "c": torch.randn(300, 8, generator=g).to(torch.bfloat16), "d": torch.arange(777) * seed,
            "e": torch.randn(3000, generator=g)}


def dtensor_model(seed: int) -> dict[str, torch.Tensor]:
    """The full tensors of the DTensor scenario: rows and columns that do not divide evenly by 2."""
    g = torch.Generator().manual_seed(seed)
    return {"rows": torch.randn(9, 5, generator=g), "cols": torch.randn(6, 9, generator=g).to(torch.bfloat16),
            "norm": torch.randn(5, generator=g), "plain0": torch.randn(33, generator=g)}


def own(rank: int, seed: int) -> dict[str, torch.Tensor]:
    tensors = model(seed)
    return {name: tensors[name] for name in OWNS[rank]}


def generations(result) -> dict[str, int]:
    return {o.server: o.generation for o in result.servers}


def current(client) -> list[int]:
    return [info.current_version.generation for info in client.server_info()]


def mismatches(client, tensors) -> list[str]:
    return [f"{m.server}:{m.name}" for m in client.verify(tensors).mismatches]


def whole(client, rank: int) -> dict:
    """Halves of two versions, a bad input on rank 1 in between, and a rank 1 that fails mid-way."""
    from weightsync.client import PartInputsRefused, PartUpdateFailed

    out: dict = {}
    push = dict(mode="staged", transport="inline", allow_new_tensors=True, bucket_size_bytes=BUCKETS[rank])
    out["v1"] = generations(client.push(own(rank, 1), version="v1", **push))
    out["v1_mismatches"] = mismatches(client, own(rank, 1))

    bad: dict = own(rank, 2)
    if rank == 1:
        bad["b"] = "not a tensor"
    try:
        client.push(bad, version="v-bad", **push)
        out["bad"] = "pushed"
    except PartInputsRefused as error:
        out["bad"] = {"ranks": list(error.ranks), "messages": {str(r): m for r, m in error.messages.items()},
                      "cause": type(error.__cause__).__name__ if error.__cause__ is not None else None}
    out["after_bad"] = current(client)
    out["after_bad_mismatches"] = mismatches(client, own(rank, 1))

    def stop_after_first_bucket(progress) -> None:
        raise RuntimeError("rank 1 stops after its first bucket")

    try:
        client.push(own(rank, 3), version="v-midway", progress=stop_after_first_bucket if rank == 1 else None, **push)
        out["midway"] = "pushed"
    except PartUpdateFailed as error:
        out["midway"] = {"type": "PartUpdateFailed", "reason": error.reason, "code": error.code.name,
                         "failed_part": error.failed_part, "rank": error.rank, "server": error.server}
    except RuntimeError as error:
        out["midway"] = {"type": type(error).__name__, "message": str(error)}
    out["after_midway"] = current(client)
    out["after_midway_mismatches"] = mismatches(client, own(rank, 1))

    out["v2"] = generations(client.push(own(rank, 4), version="v2", **push))
    out["v2_mismatches"] = mismatches(client, own(rank, 4))
    return out


def dtensors(client, rank: int, world: int) -> dict:
    """A 1-D mesh on CPU: Shard(0) and Shard(1) params (uneven), a replicated one, a plain tensor on rank 0."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    out: dict = {}
    for step, seed in (("v1", 11), ("v2", 12)):
        full = dtensor_model(seed)
        tensors = {"rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
                   "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]),
                   "norm": distribute_tensor(full["norm"], mesh, [Replicate()])}
        out[f"{step}_full_equal"] = all(torch.equal(tensors[n].full_tensor(), full[n]) for n in tensors)
        if rank == 0:
            tensors["plain0"] = full["plain0"]
        # Rank 0's one bucket (312 bytes) outweighs all of rank 1's (see BUCKETS); rank 1's rows box (4x5
        # floats, 80 bytes) travels as two pieces of a 64-byte bucket.
        result = client.push(tensors, version=step, mode="staged", transport="inline", allow_new_tensors=True,
                             bucket_size_bytes=4096 if rank == 0 else 64)
        out[step] = generations(result)
        out[f"{step}_mismatches"] = mismatches(client, full)
    return out


def fsdp(client, rank: int, world: int) -> dict:
    """FSDP2's fully_shard on a small model (CPU, Gloo): its state dict's DTensors (Shard(0), uneven rows)
    pushed as they are, checked against full_tensor(); then a step that changes every shard, pushed again."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # the same initial weights on both ranks, then sharded
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    out: dict = {}
    for step in ("v1", "v2"):
        state = model.state_dict()
        out[f"{step}_placements"] = sorted({str(t.placements) for t in state.values()})
        full = {name: t.full_tensor() for name, t in state.items()}  # a collective: before the push, not in it
        out[step] = generations(client.push(state, version=step, mode="staged", transport="inline",
                                            allow_new_tensors=True))
        out[f"{step}_mismatches"] = mismatches(client, full)
        out[f"{step}_full"] = {name: t.flatten().tolist() for name, t in full.items()}
        with torch.no_grad():
            for param in model.parameters():
                param.to_local().mul_(2).add_(rank + 1)  # each rank's shard its own way
    return out


SCENARIOS = {"whole": lambda client, rank, world: whole(client, rank), "dtensors": dtensors, "fsdp": fsdp}


def main() -> None:
    me = join_group()
    rank, world, servers, out_dir, scenario = me.rank, me.world, me.servers, me.out_dir, me.extra[0]
    from weightsync.client import Part, WeightSyncClient

    with WeightSyncClient(servers, part=Part(rank=rank, world=world, group=dist.group.WORLD, join_timeout=60)) as client:
        result = SCENARIOS[scenario](client, rank, world)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
