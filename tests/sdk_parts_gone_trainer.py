"""One trainer rank of tests/system/test_sdk_parts_gone.py: parts whose peer is gone, or whose create_group is refused.

    python sdk_parts_gone_trainer.py RANK WORLD PORT SERVERS(comma-separated) OUT_DIR SCENARIO [GROUP_ID]

Scenarios: "push" (both ranks push v1, then rank 1 is killed and rank 0 pushes v2), "create_group" (rank 1 is
killed before create_group), "refused" (both ranks call create_group(group_id=GROUP_ID), a name another client
holds, then both create a group of their own and push over it), "mismatch" (the ranks push different versions
under one key, then the same one). Rank 0 writes OUT_DIR/rank0.json (rank 1 too where it lives): the typed
error's fields, the servers' generations around it, the next push and its verify.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import torch
import torch.distributed as dist
from trainer_rank import join_group, verify_record

LONG_TIMEOUT = 600.0
"""The refused create_group's group timeout, and every part's join timeout: far past the test's bound on the
whole script, so a call (or a thread it left) that waits one out fails the test."""


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(64, 32, generator=g), "b": torch.randn(900, generator=g)}


def own(rank: int, seed: int) -> dict[str, torch.Tensor]:
    name = ("a", "b")[rank]
    return {name: model(seed)[name]}


def generations(client) -> list[int]:
    return [info.current_version.generation for info in client.server_info()]


def rendezvous_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("rendezvous-"))


def group_failed(error) -> dict:
    cause = error.__cause__
    return {"type": type(error).__name__, "rank": error.rank, "world": error.world, "during": error.during,
            "peer": error.peer, "timed_out": error.timed_out, "message": str(error),
            "cause": type(cause).__name__ if cause is not None else None}


def killed() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def next_push_alone(servers: list[str], seed: int) -> dict:
    """The next normal operation once the parts' group is gone: the whole model from this process."""
    from weightsync.client import WeightSyncClient

    with WeightSyncClient(servers) as client:
        before = generations(client)
        client.push(model(seed), version=f"alone-{seed}", transport="inline", allow_new_tensors=True)
        return {"before": before, "after": generations(client), "verify": verify_record(client, model(seed))}


def push_scenario(client, rank: int, servers: list[str]) -> dict:
    from weightsync.client import PartGroupFailed

    out: dict = {}
    push = dict(mode="staged", transport="inline", allow_new_tensors=True)
    client.push(own(rank, 1), version="v1", **push)
    out["after_v1"] = generations(client)
    dist.barrier()  # both committed v1
    if rank == 1:
        killed()
    try:
        client.push(own(rank, 2), version="v2", **push)
        out["v2"] = "pushed"
    except PartGroupFailed as error:
        out["v2"] = group_failed(error)
    out["after_v2"] = generations(client)
    out["next"] = next_push_alone(servers, 3)
    return out


def create_group_scenario(client, rank: int, servers: list[str]) -> dict:
    from weightsync.client import PartGroupFailed

    out: dict = {"before": generations(client)}
    if rank == 1:
        killed()
    try:
        client.create_group(timeout=30)
        out["create_group"] = "created"
    except PartGroupFailed as error:
        out["create_group"] = group_failed(error)
    out["threads"] = rendezvous_threads()
    out["groups"] = {address: [g.group_id for g in groups] for address, groups in client.list_groups().items()}
    out["next"] = next_push_alone(servers, 4)
    return out


def refused_scenario(client, rank: int, servers: list[str], taken: str) -> dict:
    from weightsync.client import WeightSyncClientError, WeightSyncRpcError

    out: dict = {}
    try:
        client.create_group(group_id=taken, timeout=LONG_TIMEOUT)
        out["refused"] = "created"
    except WeightSyncRpcError as error:
        out["refused"] = {"type": "WeightSyncRpcError", "reason": error.reason, "code": error.code.name}
    except WeightSyncClientError as error:
        out["refused"] = {"type": type(error).__name__, "message": str(error),
                          "cause": type(error.__cause__).__name__ if error.__cause__ is not None else None}
    out["threads"] = rendezvous_threads()
    client.create_group(timeout=60)  # the next normal operation: a group of their own, a push over it
    client.push(own(rank, 5), version="v5", mode="staged", transport="collective", allow_new_tensors=True)
    out["verify"] = verify_record(client, own(rank, 5))
    client.delete_group()
    return out


def mismatch_scenario(client, rank: int) -> dict:
    """The ranks state different versions under one key: a server refuses whichever joins second (PART_MISMATCH)
    and fails the other with the same reason at once, naming it; then both push the same version."""
    from weightsync.client import PartUpdateFailed

    out: dict = {"before": generations(client)}
    push = dict(mode="staged", transport="inline", allow_new_tensors=True)
    try:
        client.push(own(rank, 6), version=f"v6-rank{rank}", **push)
        out["mismatch"] = "pushed"
    except PartUpdateFailed as error:
        out["mismatch"] = {"reason": error.reason, "code": error.code.name, "rank": error.rank,
                           "failed_part": error.failed_part}
    out["after_mismatch"] = generations(client)
    client.push(own(rank, 7), version="v7", **push)
    out["after_v7"] = generations(client)
    out["verify"] = verify_record(client, own(rank, 7))
    return out


def main() -> None:
    me = join_group()
    rank, world, servers, out_dir, scenario = me.rank, me.world, me.servers, me.out_dir, me.extra[0]
    from weightsync.client import Part, WeightSyncClient

    part = Part(rank=rank, world=world, group=dist.group.WORLD, join_timeout=LONG_TIMEOUT)
    with WeightSyncClient(servers, part=part) as client:
        if scenario == "push":
            result = push_scenario(client, rank, servers)
        elif scenario == "create_group":
            result = create_group_scenario(client, rank, servers)
        elif scenario == "mismatch":
            result = mismatch_scenario(client, rank)
        else:
            result = refused_scenario(client, rank, servers, me.extra[1])
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    if scenario in ("push", "create_group"):
        os._exit(0)  # the parts' Gloo group has a dead peer: no teardown
    dist.destroy_process_group()  # and the interpreter's own exit: nothing the refused call started is left


if __name__ == "__main__":
    main()
