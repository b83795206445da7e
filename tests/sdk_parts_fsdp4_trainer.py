"""One trainer rank of tests/system/test_sdk_parts_fsdp4.py: a real process of a 4-rank Gloo group whose model is
sharded with FSDP2's fully_shard over a CPU mesh, pushing its shards as a part with the SDK.

    python sdk_parts_fsdp4_trainer.py RANK WORLD GLOO_PORT STORE_PORT OUT_DIR

Once its model is sharded, the rank reads its phases from the test's store (STORE_PORT), posted as "phases"
once the servers are up (the ranks start meanwhile): [[TRANSPORT, [SERVER, ...]], ...]. Each phase is a client
of its own pushing two steps (a COLLECTIVE phase's client creates one Gloo transfer group first, posts its
id as group/{RANK}, pushes both steps through it and deletes it when it closes); the steps are numbered v1, v2, ... across the phases, the model carried on. Each step: the state dict's
full tensors (full_tensor(), a collective, before the push) are saved by rank 0 to OUT_DIR/full-{step}.pt; the
push's generation per server is posted to the test's store (STORE_PORT) as pushed/{step}/{rank}; then the rank
waits (bounded) for the test's read/{step}: "go" once an engine on each server read the committed store,
anything else ends the scenario. Between steps every shard changes. Writes OUT_DIR/rank{RANK}.json: per step,
the generations, the bucket count, the placements and the rank's local row count of each tensor.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

GLOO_TIMEOUT = datetime.timedelta(seconds=90)
"""Bounds FSDP's collectives (full_tensor) and the parts' agreement per push."""
READ_TIMEOUT = datetime.timedelta(seconds=90)
"""How long a rank waits for the test's engines to read a step."""
PHASES_TIMEOUT = datetime.timedelta(seconds=150)
"""How long a rank waits for the test's servers to start (the test posts [] when they did not)."""
GROUP_TIMEOUT = 60.0
"""The COLLECTIVE phase's transfer group's timeout: every point-to-point transfer's bound."""
STEPS_PER_PHASE = 2
BUCKET_BYTES = 64
"""Every rank's shards (up to 3 rows of 6 floats, 72 bytes) travel as several buckets: each part needs a slot
again and again within a push, so the 4 INLINE parts wait their turns at a server's 2 slots, and an SHM part
writes its one slot again after the server applied what it held."""


def build_model() -> torch.nn.Module:
    """Linear layers whose row counts do not divide by 4 (torch.chunk's shards over 4 ranks: 10 rows are 3, 3,
    3, 1; 5 rows 2, 2, 1, 0; 3 rows 1, 1, 1, 0: rank 3 holds empty shards), one layer in bfloat16."""
    torch.manual_seed(0)  # the same initial weights on every rank, then sharded
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 5),
                               torch.nn.Linear(5, 3, bias=False).to(torch.bfloat16), torch.nn.Linear(3, 7))


def main() -> None:
    rank, world, gloo_port, store_port = (int(a) for a in sys.argv[1:5])
    out_dir = Path(sys.argv[5])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank, world_size=world,
                            timeout=GLOO_TIMEOUT)
    store = dist.TCPStore("127.0.0.1", store_port, None, False, READ_TIMEOUT)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from weightsync.client import Part, WeightSyncClient

    model = build_model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    store.wait(["phases"], PHASES_TIMEOUT)
    phases = json.loads(store.get("phases"))
    out: dict = {}
    steps = iter(f"v{n}" for n in range(1, 1 + STEPS_PER_PHASE * len(phases)))
    go = True
    for transport, servers in phases:
        part = Part(rank=rank, world=world, group=dist.group.WORLD, join_timeout=60)
        with WeightSyncClient(servers, part=part) as client:  # closing it: part 0 deletes a group it created
            if transport == "collective":  # one transfer group for both steps: the 4 ranks, then the workers
                out["group_id"] = client.create_group(backend="gloo", timeout=GROUP_TIMEOUT)
                group = client._group  # the SDK's record of it: this rank's place
                out["group"] = {"rank": group.rank, "world_size": group.world_size,
                                "trainer_ranks": group.trainer_ranks}
                store.set(f"group/{rank}", out["group_id"])
            for step in (next(steps) for _ in range(STEPS_PER_PHASE)):
                go = go and push_step(client, model, store, step, transport, rank, out_dir, out)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def push_step(client, model: torch.nn.Module, store, step: str, transport: str, rank: int, out_dir: Path,
              out: dict) -> bool:
    """One step: full_tensor(), the push, the post, the wait for the test's read; then every shard changes.
    False when the test said stop (nothing more is pushed)."""
    state = model.state_dict()
    out[f"{step}_placements"] = sorted({str(t.placements) for t in state.values()})
    out[f"{step}_rows"] = {name: t.to_local().shape[0] for name, t in state.items()}
    full = {name: t.full_tensor() for name, t in state.items()}  # a collective: before the push
    if rank == 0:
        torch.save(full, out_dir / f"full-{step}.pt")
    result = client.push(state, version=step, mode="staged", transport=transport, allow_new_tensors=True,
                         bucket_size_bytes=BUCKET_BYTES)
    out[step] = {o.server: o.generation for o in result.servers}
    out[f"{step}_buckets"] = result.bucket_count
    store.set(f"pushed/{step}/{rank}", json.dumps(out[step]))
    store.wait([f"read/{step}"], READ_TIMEOUT)
    if store.get(f"read/{step}") != b"go":
        return False
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().mul_(2).add_(rank + 1)  # each rank's shard its own way
    return True


if __name__ == "__main__":
    main()
