"""One trainer rank of tests/system/test_sdk_parts_faults.py: a real process in a Gloo group, pushing its part with the
SDK while a part fails (killed, a corrupt bucket) or to a node that holds a subset.

    python sdk_parts_fault_trainer.py RANK WORLD PORT SERVERS(comma-separated) OUT_DIR SCENARIO SEEDS(comma-separated)

Writes OUT_DIR/rank{RANK}.json: what each step gave (generations per server, the typed errors' fields,
verify's mismatches). Exits 0 when the scenario ran to its end, whatever it recorded; rank 1 of "kill"
never does (it SIGKILLs itself mid-push, having written OUT_DIR/killed.json).
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from sdk_parts_trainer import current, generations, mismatches
from trainer_rank import dies_at

GLOO_TIMEOUT = datetime.timedelta(seconds=60)
"""Bounds the parts' one collective per push (their agreement)."""
JOIN_TIMEOUT = 30.0
"""Part.join_timeout: how long a server waits for the other part's Begin."""
OWNS = (["emb", "l0.w", "l0.b"], ["l1.w", "l1.b", "head"])
"""Rank 0 pushes emb, l0.w and l0.b whole (49 KiB), rank 1 l1.w, l1.b and head (35 KiB)."""
BUCKET = 8192
"""Several buckets per part: rank 1's are 4 at least, so one it stops after is not its last."""
KILL_AFTER = 1
"""Rank 1 of "kill" SIGKILLs itself once its bucket 1 is on its way (the progress callback after it):
the update runs on every server (Ready came: both parts joined), and buckets of rank 1 are still to come."""
CORRUPT = 1
"""Rank 1 of "corrupt" announces bucket 1 with the checksum of other bytes (its bucket 0 goes through)."""
HOLD_TIMEOUT = datetime.timedelta(seconds=90)
"""How long rank 0 waits at the barrier that ends rank 1's hold ("held": rank 1 holds its streams open in its
progress callback until rank 0's push ended). Rank 1's side of a monitored_barrier is bounded by the group's
timeout (GLOO_TIMEOUT, 60 s) whatever this says, and the servers' idle bound is 60 s too: only the abort
fan-out (UpdateAborting) ends rank 0's push well before either, and the test checks that it did (PART_FAILED
naming part 1). Rank 0 may hear it while sending or after it asked to commit (a loaded machine: it had sent
every bucket before rank 1's bad one failed); a commit wait that looked only for Committed and the stream's
end sat out the 60 s, and rank 1's barrier gave up first."""
PUSH = dict(mode="staged", transport="inline", allow_new_tensors=True, bucket_size_bytes=BUCKET, checksums=True)


def model(seed: int) -> dict[str, torch.Tensor]:
    """The whole model of version `seed`: four dtypes, tensors larger than a bucket and smaller."""
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(64, 256, generator=g).to(torch.bfloat16), "l0.w": torch.randn(4096, generator=g),
            "l0.b": torch.randn(100, generator=g), "l1.w": torch.randn(4096, generator=g),
            "l1.b": torch.arange(333, dtype=torch.int64) * seed, "head": torch.randn(32, 128, generator=g)}


def own(rank: int, seed: int) -> dict[str, torch.Tensor]:
    tensors = model(seed)
    return {name: tensors[name] for name in OWNS[rank]}


def failure(error: Exception) -> dict:
    """A failed push's fields as the test checks them (PartUpdateFailed; its server's metadata)."""
    from weightsync.client import PartUpdateFailed

    if not isinstance(error, PartUpdateFailed):
        return {"type": type(error).__name__, "message": str(error)}
    metadata = dict(getattr(error.cause, "metadata", {}) or {})
    return {"type": "PartUpdateFailed", "reason": error.reason, "code": error.code.name,
            "failed_part": error.failed_part, "rank": error.rank, "server": error.server,
            "part_reason": metadata.get("part_reason"), "part_code": metadata.get("part_code"),
            "at": time.monotonic()}


def kill(client, rank: int, seeds: list[int], out_dir: Path) -> dict:
    """Version seeds[0] pushed whole; then rank 1 dies (SIGKILL) mid-way through the push of seeds[1]."""
    before, during = seeds
    out: dict = {"v1": generations(client.push(own(rank, before), version=f"v{before}", **PUSH))}
    out["v1_mismatches"] = mismatches(client, own(rank, before))

    die = dies_at(KILL_AFTER, out_dir)

    try:
        client.push(own(rank, during), version=f"v{during}", progress=die if rank == 1 else None, **PUSH)
        out["killed"] = "pushed"
    except Exception as error:  # noqa: BLE001 (recorded, the test checks what it was)
        out["killed"] = failure(error)
    out["after"] = current(client)
    out["after_mismatches"] = mismatches(client, own(rank, before))
    return out


def corrupt(client, rank: int, seeds: list[int], out_dir: Path) -> dict:
    """seeds[0] pushed; rank 1 sends a bucket of the push of seeds[1] whose checksum is not its bytes' (both
    parts fail, nothing changes), twice: then at once ("corrupt"), and again holding its streams open after
    that bucket (in its progress callback) until rank 0's push ended ("held"): rank 0 can learn of that
    failure only from the servers' abort fan-out (UpdateAborting). Then seeds[2], pushed and verified."""
    import weightsync.client.push.run as push_module

    before, bad, after = seeds
    out: dict = {"v1": generations(client.push(own(rank, before), version=f"v{before}", **PUSH))}
    checksum = push_module.tensor_checksum

    def holding(progress) -> None:
        if progress.bucket == CORRUPT:
            dist.monitored_barrier(timeout=HOLD_TIMEOUT)  # rank 0 joins it once its push ended

    for step, hold in (("corrupt", False), ("held", True)):
        calls = []

        def corrupting(data: torch.Tensor, calls=calls):
            calls.append(None)
            return checksum(data if len(calls) - 1 != CORRUPT else data.clone().view(torch.uint8).add_(1))

        if rank == 1:
            push_module.tensor_checksum = corrupting
        try:
            client.push(own(rank, bad), version=f"v{bad}", progress=holding if hold and rank == 1 else None, **PUSH)
            out[step] = "pushed"
        except Exception as error:  # noqa: BLE001 (recorded, the test checks what it was)
            out[step] = failure(error)
        finally:
            push_module.tensor_checksum = checksum
        if hold and rank == 0:
            dist.monitored_barrier(timeout=HOLD_TIMEOUT)
        out[f"{step}_calls"] = len(calls)
        out[f"{step}_after"] = current(client)
        out[f"{step}_after_mismatches"] = mismatches(client, own(rank, before))
    out["v2"] = generations(client.push(own(rank, after), version=f"v{after}", **PUSH))
    out["v2_mismatches"] = mismatches(client, own(rank, after))
    return out


def pushes(client, rank: int, seeds: list[int], out_dir: Path) -> dict:
    """Each seed's version pushed in turn, each verified."""
    out: dict = {}
    for seed in seeds:
        out[f"v{seed}"] = generations(client.push(own(rank, seed), version=f"v{seed}", **PUSH))
        out[f"v{seed}_mismatches"] = mismatches(client, own(rank, seed))
    return out


SCENARIOS = {"kill": kill, "corrupt": corrupt, "push": pushes}


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    servers, out_dir, scenario = sys.argv[4].split(","), Path(sys.argv[5]), sys.argv[6]
    seeds = [int(s) for s in sys.argv[7].split(",")]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=GLOO_TIMEOUT)
    from weightsync.client import Part, WeightSyncClient

    part = Part(rank=rank, world=world, group=dist.group.WORLD, join_timeout=JOIN_TIMEOUT)
    with WeightSyncClient(servers, part=part, timeout=60) as client:
        result = SCENARIOS[scenario](client, rank, seeds, out_dir)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    if scenario != "kill":  # its peer is gone: nothing to tear down together
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
