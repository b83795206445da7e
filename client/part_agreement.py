"""What the parts of one push agree on over their process group (Part.group), before Begin.

One all-gather of a fixed-size uint8 record per rank (no pickle: nothing but bytes is exchanged):
  - whether the rank's own inputs passed its checks (tensors, dtypes, what it declares, the servers'
    transports and parts flag), and if not, a short message;
  - rank 0's update key (the version and a random suffix, or the key its caller gave).
Every rank reads every record: all agree on rank 0's key, or all raise PartInputsRefused naming the
ranks that failed, at once, instead of the ranks that passed waiting out the servers' join deadline.

The one collective is bounded by the group's own timeout (init_process_group(timeout=...), or
new_group(timeout=...)): a rank that never reaches it fails the others when it passes.
"""

from __future__ import annotations

from typing import Any

import torch

from weightsync.client.errors import PartInputsRefused
from weightsync.client.parts import Part, check_key

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
    every rank (chained to this rank's own failure, if it had one)."""
    import torch.distributed as dist

    device = _device(part.group)
    mine = encode(key, failure).to(device)
    records = [torch.empty_like(mine) for _ in range(part.world)]
    dist.all_gather(records, mine, group=part.group)  # bounded by the group's timeout
    try:
        return decide(records, part.rank)
    except PartInputsRefused as refused:
        raise refused from failure


def _device(group: Any) -> torch.device:
    """Where the group's collectives take tensors: CUDA for NCCL, host memory otherwise."""
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
