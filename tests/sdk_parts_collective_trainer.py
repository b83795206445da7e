"""One trainer rank of tests/system/test_sdk_parts_collective.py: a process in a Gloo group pushing its part over
COLLECTIVE, in one transfer group of both parts' ranks and the servers' workers (create_group on every rank).

    python sdk_parts_collective_trainer.py RANK WORLD PORT SERVERS(comma-separated) OUT_DIR SCENARIO SEEDS

Writes OUT_DIR/rank{RANK}.json: the group (id, this rank's group rank, world size), each step's generations
per server and bucket count, verify's mismatches, a failure's fields. Exits 0 when the scenario ran to its
end; rank 1 of "kill" never does (it SIGKILLs itself mid-push, having written OUT_DIR/killed.json).
"""

from __future__ import annotations

import json
import time

import torch
import torch.distributed as dist
from trainer_rank import dies_at, join_group

BUCKET_BYTES = 4096
"""Every part fills several buckets, more than the two a sink keeps in flight, on two servers' owners each."""
GROUP_TIMEOUT = 30.0
"""The transfer group's timeout: every transfer's bound."""
KILL_AFTER = 1
"""Rank 1 of "kill" SIGKILLs itself once its bucket 1 is on its way (buckets of it are still to come)."""
PUSH = dict(mode="staged", transport="collective", allow_new_tensors=True, bucket_size_bytes=BUCKET_BYTES,
            checksums=True)


def model(seed: int) -> dict[str, torch.Tensor]:
    """The whole model of version `seed`: whole tensors of four dtypes, and two sharded ones (rows of "rows",
    a box larger than a bucket; rows of "emb")."""
    if seed >= PATCHED:
        return patched(model(seed - PATCHED))
    g = torch.Generator().manual_seed(seed)
    return {"p0": torch.randn(3000, generator=g), "p1": torch.randn(70, 50, generator=g).to(torch.bfloat16),
            "q0": torch.randn(2600, generator=g), "q1": torch.arange(2500, dtype=torch.int32) * seed,
            "rows": torch.randn(9, 300, generator=g), "emb": torch.randn(5, 16, generator=g).to(torch.float16)}


PATCHED = 1000
"""Version PATCHED + s is version s with every 97th element of each tensor changed (a patch is far cheaper)."""


def patched(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in tensors.items():
        t = tensor.clone()
        t.view(-1)[3::97] += 1
        out[name] = t
    return out


OWNS = (("p0", "p1"), ("q0", "q1"))
"""Whole tensors per rank; both ranks send their rows of "rows" and "emb" (Shard(0))."""
SHARDED = ("rows", "emb")


def mine(rank: int, seed: int, mesh) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import Shard, distribute_tensor

    full = model(seed)
    tensors = {name: full[name] for name in OWNS[rank]}
    for name in SHARDED:
        tensors[name] = distribute_tensor(full[name], mesh, [Shard(0)])  # 5 rows and 4; 3 and 2
    return tensors


def checked(rank: int, seed: int) -> dict[str, torch.Tensor]:
    """What this rank verifies: its whole tensors, and its rows of the sharded ones (verify checks its boxes)."""
    full = model(seed)
    return {name: full[name] for name in (*OWNS[rank], *SHARDED)}


def generations(result) -> dict[str, int]:
    return {o.server: o.generation for o in result.servers}


def failure(error: Exception) -> dict:
    from weightsync.client import PartUpdateFailed

    if not isinstance(error, PartUpdateFailed):
        return {"type": type(error).__name__, "message": str(error)[:2000], "at": time.monotonic()}
    metadata = dict(getattr(error.cause, "metadata", {}) or {})
    return {"type": "PartUpdateFailed", "reason": error.reason, "code": error.code.name,
            "failed_part": error.failed_part, "rank": error.rank, "server": error.server,
            "part_reason": metadata.get("part_reason"), "at": time.monotonic()}


def pushes(client, rank: int, seeds: list[int], mesh, out: dict) -> None:
    """Each seed's version pushed over the group in turn, each verified by this rank."""
    for seed in seeds:
        delta = {"delta": True} if seed >= PATCHED else {}  # patches of the whole tensors and of the boxes
        result = client.push(mine(rank, seed, mesh), version=f"v{seed}", **PUSH, **delta)
        out[f"v{seed}"] = generations(result)
        out[f"v{seed}_sent"] = [result.bytes_sent, result.dense_bytes]
        out[f"v{seed}_buckets"] = result.bucket_count
        out[f"v{seed}_mismatches"] = [f"{m.server}:{m.name}" for m in client.verify(checked(rank, seed)).mismatches]


def kill(client, rank: int, seeds: list[int], mesh, out: dict, out_dir) -> None:
    """seeds[0] pushed; then rank 1 dies (SIGKILL) mid-way through the push of seeds[1]."""
    before, during = seeds
    pushes(client, rank, [before], mesh, out)

    die = dies_at(KILL_AFTER, out_dir)

    try:
        client.push(mine(rank, during, mesh), version=f"v{during}", progress=die if rank == 1 else None, **PUSH)
        out["killed"] = "pushed"
    except Exception as error:  # noqa: BLE001 (recorded, the test checks what it was)
        out["killed"] = failure(error)
    out["after"] = [info.current_version.generation for info in client.server_info()]
    out["after_mismatches"] = [f"{m.server}:{m.name}" for m in client.verify(checked(rank, before)).mismatches]


def main() -> None:
    me = join_group()
    rank, world, out_dir = me.rank, me.world, me.out_dir
    scenario, seeds = me.extra[0], [int(s) for s in me.extra[1].split(",")]
    from torch.distributed.device_mesh import init_device_mesh

    from weightsync.client import Part, WeightSyncClient

    mesh = init_device_mesh("cpu", (world,))
    out: dict = {}
    part = Part(rank=rank, world=world, group=dist.group.WORLD, join_timeout=60)
    client = WeightSyncClient(me.servers, part=part, timeout=60)
    try:
        out["group_id"] = client.create_group(backend="gloo", timeout=GROUP_TIMEOUT)
        group = client._group  # the SDK's record of it: this rank's place
        out["group"] = {"rank": group.rank, "world_size": group.world_size, "trainer_ranks": group.trainer_ranks}
        if scenario == "kill":
            kill(client, rank, seeds, mesh, out, out_dir)
        else:
            pushes(client, rank, seeds, mesh, out)
    finally:
        try:
            client.close()  # part 0 deletes the group on the servers, each part leaves it
        except Exception as error:  # noqa: BLE001 (recorded: a group still aborting may refuse its deletion)
            out["close"] = failure(error)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(out))
    if scenario != "kill":  # its peer is gone: nothing to tear down together
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
