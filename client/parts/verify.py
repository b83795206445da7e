"""verify() of DTensors, one rank at a time: each rank checks what it holds of a tensor, without gathering it.

    client.verify(model.state_dict())   # on every rank, no collective: each checks its own local shards

What a rank checks of each tensor (checked_here):
  - a plain torch.Tensor: the whole tensor (as verify() of a client without DTensors);
  - a DTensor: its local shard, as the box of the whole tensor that a push of this rank declares
    (part.local_box: Shard(d) is torch.chunk's split, uneven and empty shards included; Partial and
    strided shards are refused with ValueError naming the tensor). A Replicate placement is checked by
    EVERY rank that holds the replica, not only by the one at mesh coordinate 0 that pushes it: each
    rank's copy is compared with what the servers hold, so a replica that drifted on one rank shows
    there. A shard that is the whole tensor is checked whole; an empty shard checks nothing; a rank
    outside the tensor's mesh checks nothing of it.

The server answers a box with the WS64 of the box's elements in row-major order
(GetTensorChecksumsRequest.boxes), the checksum of the local shard's contiguous bytes here.
A box's mismatch names the tensor followed by the box as Python slices (`w[2:4, 0:8]`). A tensor the
server should hold and does not is reported with remote None. What a `--tensors` subset node should hold
is decided as for a whole process's verify() (servers.checksums.not_its_to_hold, share=True): a name
outside its subset is not its to hold, neither missing nor mismatched there, even when ALL of a rank's
checks lie outside it (a pipeline stage's rank and the node of another stage: nothing to check there);
only a node whose store holds nothing at all vouches for nothing (every check reported missing there).
A name inside the subset that the node lacks or holds with other bytes is reported as on any node.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weightsync.client.channels.server_set import ServerSet
from weightsync.client.errors import WeightSyncClientError, WeightSyncRpcError
from weightsync.client.parts.part import Box, is_dtensor, local_box, shard_of
from weightsync.client.servers.checksums import not_its_to_hold, settled_checksums
from weightsync.client.servers.records import ServerState
from weightsync.client.types import TensorMismatch, VerifyResult
from weightsync.common.checksum import ws64
from weightsync.v1 import weight_sync_service_pb2 as pb


@dataclass(frozen=True, slots=True)
class Checked:
    """One thing this rank compares with every server: a whole tensor (box None) or one box of it."""

    name: str
    box: Box | None
    local: int
    """WS64 of this rank's bytes of it (the local shard's, row-major over the box)."""

    @property
    def label(self) -> str:
        """How a mismatch names it: the tensor's name, then the box as Python slices if any."""
        if self.box is None:
            return self.name
        return self.name + "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.box.offsets, self.box.sizes,
                                                                            strict=True)) + "]"


def held_box(placements: Sequence[object], coordinate: Sequence[int], mesh_shape: Sequence[int],
             shape: Sequence[int]) -> Box | str | None:
    """What a rank at `coordinate` holds of a DTensor, in local_box's terms (WHOLE, a Box, or None for
    nothing): the box its push declares, where every rank holding a replica holds what the replica's
    sender (coordinate 0 of that mesh dim) declares."""
    as_sender = [0 if type(p).__name__ == "Replicate" else c for p, c in zip(placements, coordinate, strict=False)]
    return local_box(placements, as_sender, mesh_shape, shape)


def checked_here(items: Sequence[tuple[str, torch.Tensor]]) -> list[Checked]:
    """What this rank checks of each (checked) tensor, with its local WS64 (module docstring). ValueError
    naming the tensor for a placement that cannot be checked or a local shard that is not its box."""
    out: list[Checked] = []
    for name, tensor in items:
        if not is_dtensor(tensor):
            out.append(Checked(name, None, ws64(tensor.detach())))
            continue
        held = shard_of(name, tensor, held_box)
        if held is not None:
            box, local = held
            out.append(Checked(name, box, ws64(local.contiguous())))
    return out


def checksums_request(checked: Sequence[Checked], missing: frozenset[str] = frozenset()) -> pb.GetTensorChecksumsRequest:
    """One request for all of them (whole names sorted, boxes in order), leaving out the `missing` names."""
    request = pb.GetTensorChecksumsRequest(names=sorted({c.name for c in checked
                                                         if c.box is None and c.name not in missing}))
    for c in checked:
        if c.box is not None and c.name not in missing:
            request.boxes.add(name=c.name, box=c.box.proto())
    return request


async def fetch_part_checksums(servers: ServerSet, server: ServerState,
                               checked: Sequence[Checked]) -> tuple[pb.GetTensorChecksumsResponse, frozenset[str]]:
    """The server's answer for what it holds of `checked`, and the names it should hold and lacks: a
    TENSOR_NOT_FOUND refusal names them (up to 20 at a time), and the request is asked again without
    them, so each round drops at least one name."""
    missing: frozenset[str] = frozenset()
    names = {c.name for c in checked}
    while True:
        try:
            return await settled_checksums(servers, server, checksums_request(checked, missing)), missing
        except WeightSyncRpcError as error:
            if error.reason != "TENSOR_NOT_FOUND":
                raise
            listed = frozenset(error.metadata.get("tensors", "").split(",")) & (names - missing)
            if not listed:
                raise
            missing |= listed


def part_mismatches(address: str, answer: pb.GetTensorChecksumsResponse, checked: Sequence[Checked],
                    missing: frozenset[str], *, share: bool) -> list[TensorMismatch]:
    """Each check the server's answer does not confirm (remote None where it holds no answer for it),
    leaving out what is not its to hold (servers.checksums.not_its_to_hold; `share`: `checked` is a part
    rank's share, not what a whole process holds)."""
    outside = not_its_to_hold(answer, {c.name for c in checked}, share=share)
    not_stored = set(answer.not_stored)
    wholes = {t.name: t.checksum.value for t in answer.tensors}
    boxes = {(b.name, tuple(b.box.offsets), tuple(b.box.sizes)): b.checksum.value for b in answer.boxes}
    found = []
    for c in checked:
        if c.name in outside:
            continue
        if c.name in missing or c.name in not_stored:  # not_stored and checked: it vouches for nothing
            remote = None
        elif c.box is None:
            remote = wholes.get(c.name)
        else:
            remote = boxes.get((c.name, c.box.offsets, c.box.sizes))
            if remote is None:
                raise WeightSyncClientError(f"{address} did not answer box {c.label} (a server older than "
                                            "GetTensorChecksumsRequest.boxes?)")
        if remote != c.local:
            found.append(TensorMismatch(address, c.label, c.local, remote))
    return found


async def verify_parts(servers: ServerSet, states: Sequence[ServerState], checked: Sequence[Checked], *,
                       share: bool) -> VerifyResult:
    """Compare `checked` (checked_here) with every server's store, all servers at once (`share`: they are a
    part rank's share of the model, part_mismatches)."""
    answers = await asyncio.gather(*(fetch_part_checksums(servers, s, checked) for s in states))
    found: list[TensorMismatch] = []
    for state, (answer, missing) in zip(states, answers, strict=True):
        found.extend(part_mismatches(state.address, answer, checked, missing, share=share))
    return VerifyResult(len(checked), tuple(found))


__all__ = ["Checked", "checked_here", "held_box", "checksums_request", "fetch_part_checksums", "part_mismatches",
           "verify_parts"]
