"""One trainer process's part of an update sent by several (BeginUpdate.part), and the rules of what it sends.

    part = Part(rank=dist.get_rank(), world=dist.get_world_size(), group=dist.group.WORLD)
    client = WeightSyncClient(servers, part=part)              # on every rank
    client.push(model.state_dict(), version=f"step-{step}")    # on every rank: one version, one generation

What a part declares and sends, tensor by tensor (declare()):
  - a plain torch.Tensor: the whole tensor (UpdatePart.whole_tensors); no two parts may send one name;
  - a DTensor (torch.distributed.tensor): its local shard as a box of the global tensor (local_box):
    Shard(d) narrows dimension d to this rank's chunk (torch.chunk's split: uneven shards, and empty
    ones, as DTensor lays them out; several mesh dims sharding one tensor dim split it in mesh order);
    Replicate is sent by the rank at coordinate 0 of that mesh dim only; Partial (pending sums) and
    strided shards are refused. A box that is the whole tensor is declared whole; an empty box
    declares nothing.

The dense retry after a refused base (push.py): every part derives the retry's key from the key
they share (dense_key) and reads a refusal the same way (base_refused).

These are pure functions over placements, mesh coordinates, shapes, keys and reasons;
tests/unit/test_sdk_parts_rules.py holds their tables (dense_key's and base_refused's:
tests/system/test_sdk_parts_delta.py). The collectives (the key, the inputs checked together) are
agreement.py; the push itself push.py.
"""

from __future__ import annotations

import datetime
import math
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

KEY_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,128}")
"""What the server takes as an update key (UpdatePart.update_key)."""
KEY_SUFFIX_CHARS = 12
"""Random hex characters after the version in a drawn key."""
MAX_JOIN_TIMEOUT_SECONDS = 3600.0
"""The server's upper bound on join_timeout (PART_JOIN_TIMEOUT_INVALID above it)."""


@dataclass(frozen=True, slots=True)
class Part:
    """This process's part of every push of a WeightSyncClient.

    rank, world: this part's rank (0 to world - 1) among the `world` trainer processes that push
        together; each sends its own tensors, and the servers commit once all did.
    group: a torch.distributed ProcessGroup of exactly these processes, rank for rank (Gloo or NCCL:
        the trainer's own). With it, rank 0 draws each push's update key and shares it, and the
        parts check their inputs together before Begin (agreement.py); every collective is
        bounded by the group's own timeout (init_process_group(timeout=...)). None: the caller
        passes the same key to push(part_key=...) on every rank, and each rank checks its own.
    join_timeout: seconds a server waits, from the first part's Begin, for the others (at most 1 h);
        then every part fails DEADLINE_EXCEEDED PARTS_MISSING naming the ranks that never came.
    """

    rank: int
    world: int
    group: Any = None
    join_timeout: float = 60.0

    def __post_init__(self) -> None:
        if isinstance(self.world, bool) or not isinstance(self.world, int) or self.world < 1:
            raise ValueError(f"Part.world must be an int >= 1, got {self.world!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world:
            raise ValueError(f"Part.rank must be an int in [0, {self.world}), got {self.rank!r}")
        if not isinstance(self.join_timeout, int | float) or not 0 < self.join_timeout <= MAX_JOIN_TIMEOUT_SECONDS:
            raise ValueError(f"Part.join_timeout must be seconds in (0, {MAX_JOIN_TIMEOUT_SECONDS:g}], "
                             f"got {self.join_timeout!r}")

    def proto(self, key: str, declared: Sequence[Declared]) -> pb.UpdatePart:
        """The BeginUpdate.part of one push: this part's key, rank, world and everything it declares."""
        part = pb.UpdatePart(update_key=key, rank=self.rank, world=self.world,
                             whole_tensors=[d.name for d in declared if d.box is None])
        part.join_timeout.FromTimedelta(datetime.timedelta(seconds=self.join_timeout))
        for d in declared:
            if d.box is not None:
                part.boxed_tensors.add(name=d.name, boxes=[d.box.proto()])
        return part


@dataclass(frozen=True, slots=True)
class Box:
    """A box of a tensor (tensor.proto, TensorBox): offsets and sizes per dimension of the whole tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def proto(self) -> tensor_pb2.TensorBox:
        return tensor_pb2.TensorBox(offsets=list(self.offsets), sizes=list(self.sizes))


@dataclass(frozen=True, slots=True)
class Declared:
    """One tensor a part sends: whole (box None) or one box, and the bytes to send (contiguous for a box)."""

    name: str
    tensor: torch.Tensor
    """The whole tensor, or the box's elements (the local shard, contiguous), row-major over the box."""
    shape: tuple[int, ...]
    """The whole tensor's shape (what the plan's spec and the server's store say)."""
    box: Box | None


WHOLE = "whole"
"""local_box's answer for a tensor this rank sends whole."""


def local_box(placements: Sequence[object], coordinate: Sequence[int], mesh_shape: Sequence[int],
              shape: Sequence[int]) -> Box | str | None:
    """What this rank sends of a DTensor of global `shape` laid out by `placements` over a mesh of
    `mesh_shape`, this rank at `coordinate`: WHOLE, a Box, or None (nothing: an empty shard, or a
    replica another rank sends). ValueError for a placement that cannot be sent (Partial, strided)."""
    if not (len(placements) == len(coordinate) == len(mesh_shape)):
        raise ValueError(f"{len(placements)} placements for a mesh of {len(mesh_shape)} dims "
                         f"(coordinate {list(coordinate)})")
    if math.prod(shape) == 0:  # no box has an element: the whole (empty) tensor, from one rank
        return WHOLE if all(c == 0 for c in coordinate) else None
    offsets, sizes = [0] * len(shape), list(shape)
    for mesh_dim, placement in enumerate(placements):
        kind = type(placement).__name__
        count, at = mesh_shape[mesh_dim], coordinate[mesh_dim]
        if kind == "_StridedShard":
            raise ValueError(f"a strided shard ({placement}) cannot be sent as a box yet; redistribute to Shard")
        if kind == "Shard":
            dim = placement.dim % len(shape) if shape else 0  # type: ignore[attr-defined]
            if not shape:
                raise ValueError(f"{placement} of a 0-d tensor")
            chunk = -(-sizes[dim] // count)  # torch.chunk: ceil, the last chunks shorter or empty
            start = min(at * chunk, sizes[dim])
            offsets[dim] += start
            sizes[dim] = min(start + chunk, sizes[dim]) - start
        elif kind == "Replicate":
            if at != 0:
                return None  # the rank at coordinate 0 of this mesh dim sends it
        elif kind in ("Partial", "_Partial", "_NormPartial", "MaskPartial"):
            raise ValueError(f"a {placement} placement holds pending sums, not values; "
                             "redistribute it (e.g. to Replicate or Shard) before pushing")
        else:
            raise ValueError(f"unknown placement {placement!r}")
    if any(s == 0 for s in sizes):
        return None
    if list(sizes) == list(shape):
        return WHOLE
    return Box(tuple(offsets), tuple(sizes))


def declare(items: Sequence[tuple[str, torch.Tensor]]) -> list[Declared]:
    """What this part sends of each (checked) tensor: a plain tensor whole, a DTensor as local_box says
    (its local shard checked against the box: ValueError naming the tensor when they differ)."""
    out: list[Declared] = []
    for name, tensor in items:
        if not is_dtensor(tensor):
            out.append(Declared(name, tensor, tuple(tensor.shape), None))
            continue
        held = shard_of(name, tensor, local_box)
        if held is not None:
            box, local = held
            out.append(Declared(name, local if box is None else local.contiguous(), tuple(tensor.shape), box))
    return out


BoxRule = Callable[[Sequence[object], Sequence[int], Sequence[int], Sequence[int]], "Box | str | None"]
"""What a rank holds of a DTensor from its placements, mesh coordinate, mesh shape and shape: local_box (what
it sends), or verify.held_box (what it checks)."""


def shard_of(name: str, tensor: torch.Tensor, rule: BoxRule) -> tuple[Box | None, torch.Tensor] | None:
    """This rank's piece of DTensor `tensor` as `rule` says: (its box, None for the whole tensor; the local
    shard, checked against it), or None where this rank holds none of it. ValueError naming the tensor for
    a placement the rule refuses, or a local shard that is not the box (a layout other than torch.chunk's)."""
    mesh = tensor.device_mesh  # type: ignore[attr-defined]
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None  # this rank is not in the tensor's mesh: it holds none of it
    shape = tuple(tensor.shape)
    try:
        what = rule(tensor.placements, coordinate, tuple(mesh.shape), shape)  # type: ignore[attr-defined]
    except ValueError as error:
        raise ValueError(f"tensor {name!r}: {error}") from None
    if what is None:
        return None
    local = tensor.to_local().detach()  # type: ignore[attr-defined]
    box = None if what == WHOLE else what
    expected = shape if box is None else box.sizes  # type: ignore[union-attr]
    if tuple(local.shape) != tuple(expected):
        raise ValueError(f"tensor {name!r}: its local shard is {list(local.shape)}, but its placements "
                         f"{list(tensor.placements)} at mesh coordinate {coordinate} give "  # type: ignore[attr-defined]
                         f"{list(expected)}; weightsync reads DTensor's default (torch.chunk) layout")
    return box, local  # type: ignore[return-value]


def check_key(key: object) -> str:
    """A caller's update key, checked as the server will (PART_KEY_INVALID): ValueError if not."""
    if not isinstance(key, str) or KEY_PATTERN.fullmatch(key) is None:
        raise ValueError(f"part_key must be 1 to 128 characters of [A-Za-z0-9._-], got {key!r}")
    return key


def draw_key(version: str) -> str:
    """A fresh update key for `version`: its key-safe characters (shortened) and a random suffix."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", version)[: 128 - KEY_SUFFIX_CHARS - 1]
    return f"{safe}-{secrets.token_hex(KEY_SUFFIX_CHARS // 2)}"


DENSE_KEY_SUFFIXES = (".dense", ".DENSE")
"""What dense_key appends (the second only where the first would give the key back)."""


def dense_key(key: str) -> str:
    """The update key of the dense retry of the update under `key`, after a server refused its base: every
    part derives it alone from the key they share (no collective), so they all join the retry under one new
    key. The key with DENSE_KEY_SUFFIXES[0] appended (its end cut to stay within 128 characters), never the
    key itself: a valid key (check_key) that differs from `key`."""
    for suffix in DENSE_KEY_SUFFIXES:
        derived = key[: 128 - len(suffix)] + suffix
        if derived != key:
            return check_key(derived)
    raise AssertionError("unreachable: the two suffixes differ, so at most one gives the key back")


BASE_REFUSED = "BASE_MISMATCH"
"""The reason a server refuses the generation an update's patches apply to (send it dense)."""


def base_refused(reason: str, metadata: Mapping[str, str]) -> bool:
    """Whether a part's failed update was a refused base, as this part hears it: its own begin refused
    (BASE_MISMATCH), or another part's (PART_FAILED whose part_reason is BASE_MISMATCH, also what a part
    that comes later under the key gets). Every part names the same base to a server, so every part hears one
    of the two from it, and each then retries dense under dense_key on its own."""
    return reason == BASE_REFUSED or (reason == "PART_FAILED" and metadata.get("part_reason") == BASE_REFUSED)


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a DTensor (False where torch has no torch.distributed.tensor)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed has no DTensor
        return False
    return isinstance(tensor, DTensor)
