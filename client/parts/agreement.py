"""What the parts of one push agree on over their process group (Part.group), before Begin.

One all-gather of a fixed-size uint8 record per rank (no pickle: nothing but bytes is exchanged):
  - whether the rank's own inputs passed its checks (tensors, dtypes, what it declares, the servers'
    transports and parts flag), and if not, a short message;
  - rank 0's update key (the version and a random suffix, or the key its caller gave).
Every rank reads every record: all agree on rank 0's key, or all raise PartInputsRefused naming the
ranks that failed, at once, instead of the ranks that passed waiting out the servers' join deadline.

The one collective is bounded by the group's own timeout (init_process_group(timeout=...), or
new_group(timeout=...)): a rank that never reaches it fails the others when it passes, and a rank that is
gone (its process ended) fails them at once. Either way every rank that saw it raises PartGroupFailed
(gather(), also create_group's all-gathers in client/transports/transfer_group.py), nothing sent, chained to the
backend's own error, naming the peer where the backend says which.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from weightsync.client.errors import PartGroupFailed, PartInputsRefused
from weightsync.client.parts.part import Part, check_key
from weightsync.common.nccl_groups import process_group_device

RECORD_BYTES = 512
_OK, _KEY_LEN, _KEY = 0, 1, 2
_MESSAGE_LEN = _KEY + 128  # two bytes, little-endian
_MESSAGE = _MESSAGE_LEN + 2
MESSAGE_BYTES = RECORD_BYTES - _MESSAGE
PASSED, FAILED = 1, 2


def check_group(part: Part) -> None:
    """The group's rank and size are the part's (ValueError otherwise): the group is these processes."""
    if part.group is None:
        return
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ValueError("Part.group is set but torch.distributed is not initialized")
    rank, size = dist.get_rank(part.group), dist.get_world_size(part.group)
    if (rank, size) != (part.rank, part.world):
        raise ValueError(f"Part(rank={part.rank}, world={part.world}) but its group says rank {rank} of {size}: "
                         "the group must be exactly the pushing processes, rank for rank")


def encode(key: str, failure: BaseException | None) -> torch.Tensor:
    """This rank's record: passed (with the key, rank 0's matters) or failed (with a short message)."""
    record = torch.zeros(RECORD_BYTES, dtype=torch.uint8)
    record[_OK] = PASSED if failure is None else FAILED
    raw_key = key.encode("ascii")
    record[_KEY_LEN] = len(raw_key)
    record[_KEY : _KEY + len(raw_key)] = torch.tensor(list(raw_key), dtype=torch.uint8)
    if failure is not None:
        message = f"{type(failure).__name__}: {failure}".encode()[:MESSAGE_BYTES]
        record[_MESSAGE_LEN] = len(message) & 0xFF
        record[_MESSAGE_LEN + 1] = len(message) >> 8
        record[_MESSAGE : _MESSAGE + len(message)] = torch.tensor(list(message), dtype=torch.uint8)
    return record


def decide(records: list[torch.Tensor], rank: int) -> str:
    """Every rank's record -> rank 0's key, or PartInputsRefused naming every failing rank."""
    failed: dict[int, str] = {}
    for r, record in enumerate(records):
        data = bytes(record.cpu().tolist())
        if data[_OK] != PASSED:
            length = data[_MESSAGE_LEN] | data[_MESSAGE_LEN + 1] << 8
            failed[r] = data[_MESSAGE : _MESSAGE + length].decode("utf-8", errors="replace") or "no record"
    if failed:
        ranks = tuple(sorted(failed))
        said = "; ".join(f"rank {r}: {failed[r]}" for r in ranks)
        raise PartInputsRefused(f"part {rank}: the push was refused before Begin, nothing sent: ranks "
                                f"{list(ranks)} failed their checks ({said})", ranks, failed)
    head = bytes(records[0].cpu().tolist())
    return check_key(head[_KEY : _KEY + head[_KEY_LEN]].decode("ascii"))


def agree(part: Part, key: str, failure: BaseException | None) -> str:
    """The one all-gather over part.group (module docstring): rank 0's key, or PartInputsRefused on
    every rank (chained to this rank's own failure, if it had one); PartGroupFailed if the group failed."""
    records = gather(part.group, encode(key, failure), rank=part.rank, world=part.world, during="push")
    try:
        return decide(records, part.rank)
    except PartInputsRefused as refused:
        raise refused from failure


def gather(group: Any, record: torch.Tensor, *, rank: int, world: int, during: str) -> list[torch.Tensor]:
    """Every rank's `record` (one all-gather over the parts' group, bounded by its timeout), or
    PartGroupFailed (group_failed) when the backend fails it."""
    import torch.distributed as dist

    mine = record.to(process_group_device(group))
    records = [torch.empty_like(mine) for _ in range(world)]
    try:
        dist.all_gather(records, mine, group=group)
    except RuntimeError as error:  # what Gloo and NCCL raise (torch's DistError kinds among them)
        raise group_failed(str(error), rank=rank, world=world, during=during) from error
    return records


GLOO_PEER = re.compile(r"(\[[0-9A-Za-z.:%-]+\]:\d+)")
"""The peer's address in Gloo's errors ("Connection closed by peer [10.0.0.2]:41234", "Read error
[10.0.0.2]:41234: Connection reset by peer"): the rank that went (its source location, "[/path/pair.cc:553]",
has no port after it)."""
PEER_RANK = re.compile(r"\b(?:peer|remote) rank (\d+)\b", re.IGNORECASE)


def named_peer(message: str) -> str | None:
    """The peer a backend's error names: "rank N" where it names the peer's (remote) rank, else Gloo's address of
    the peer, else None (a timeout names nobody)."""
    if (rank := PEER_RANK.search(message)) is not None:
        return f"rank {rank.group(1)}"
    if (address := GLOO_PEER.search(message)) is not None:
        return address.group(1)
    return None


def group_failed(message: str, *, rank: int, world: int, during: str) -> PartGroupFailed:
    """PartGroupFailed for the backend's error `message` on part `rank` of `world`, during a push's agreement
    ("push") or create_group's ("create_group")."""
    peer = named_peer(message)
    timed_out = "timed out" in message.lower() or "timeout" in message.lower()
    what = ("did not answer within the group's timeout" if timed_out
            else f"is gone (the connection to {peer} closed)" if peer is not None else "is gone")
    said = message.strip().splitlines()[0][:300] if message.strip() else "no message"
    return PartGroupFailed(f"part {rank} of {world}: {during} failed before anything was sent: a part of the "
                           f"parts' group (Part.group) {what}; the backend said: {said}", rank=rank,
                           world=world, during=during, peer=peer, timed_out=timed_out)
