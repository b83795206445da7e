"""The parts of one update (BeginUpdate.part): what each part declares, checked together, and the
join's outcomes, as pure functions.

Several trainer processes may each send a part of one version (weight_sync_service.proto,
UpdatePart): whole tensors and boxes of tensors (TensorBox: an offset and a size per dimension).
The server is their rendezvous. Each function here takes plain values (a part's identity, the
declarations, what the plans send, what the store holds) and returns the decision: what was
accepted, or the refusal every part gets (a WeightSyncError: its status code, its ErrorInfo reason
and metadata). Nothing here reads or changes a server's state, so the rules are tested by tables
(tests/unit/test_parts.py); docs/data-plane.md lists every reason.

The rules, in the order they are checked:
  - a part's own identity, at its begin: its update key, rank, world and join timeout
    (PART_KEY_INVALID, PART_RANK_INVALID, PART_WORLD_INVALID, PART_JOIN_TIMEOUT_INVALID);
  - its join among the parts already in under that key: a rank once, the same terms as the
    first part (PART_DUPLICATE, PART_MISMATCH), or, for a key whose update already ended,
    that update's outcome (PARTS_MISSING, PART_FAILED, PART_KEY_USED); a part refused before it
    joined (but PART_DUPLICATE: its rank is in) fails every part under its key at once with its
    own reason (key_refused);
  - once every part joined, the union of their declarations, before anything is allocated:
    names (TENSOR_OWNED_TWICE, TENSOR_WHOLE_AND_BOXED), what each plan sends
    (PART_SENDS_UNOWNED), dtypes and shapes (PART_TENSOR_MISMATCH, PART_TENSOR_UNKNOWN), and the
    boxes of each tensor: inside it, disjoint, covering it (BOX_OUT_OF_SHAPE, BOXES_OVERLAP,
    BOXES_INCOMPLETE), and every box sent of a tensor new to the store (BOX_NOT_SENT);
  - the join's end: the parts still missing at the deadline (PARTS_MISSING), and what the
    other parts learn when one fails (PART_FAILED).
A stream without a part is the whole update (the case of one part): none of this applies to it, and it
sends no box (boxes_refused, at begin, with the transports and encodings a box may not use).
"""

from __future__ import annotations

import datetime
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from weightsync.common.errors import (
    Aborted,
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    Unimplemented,
    WeightSyncError,
)
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

Refusal = WeightSyncError
"""A refused part or union: its code, ErrorInfo reason, message and metadata are what the parts get."""

Shape = tuple[int, ...]

UPDATE_KEY_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
DEFAULT_JOIN_TIMEOUT = datetime.timedelta(seconds=60)
MAX_JOIN_TIMEOUT = datetime.timedelta(hours=1)
MAX_WORLD = 65536
"""The most parts one update may have: bounds what a server keeps per key before they all joined."""
LISTED = 20
"""Metadata lists at most this many ranks or names (the message says how many there are)."""


# -- values ------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, order=True)
class Box:
    """A box of a tensor (TensorBox): the indices offsets[d] <= i < offsets[d] + sizes[d] in each dimension d."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @classmethod
    def of(cls, box: tensor_pb2.TensorBox) -> Box:
        return cls(tuple(box.offsets), tuple(box.sizes))

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def end(self, dim: int) -> int:
        return self.offsets[dim] + self.sizes[dim]

    def __str__(self) -> str:
        """`[0:4, 2:6]`: the box as Python slices, the form its refusals' metadata use."""
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes, strict=False)) + "]"


@dataclass(frozen=True, slots=True)
class Declaration:
    """What one part says it owns (UpdatePart.whole_tensors and boxed_tensors), sent this time or not."""

    rank: int
    whole: tuple[str, ...] = ()
    boxed: tuple[tuple[str, tuple[Box, ...]], ...] = ()
    """(tensor name, its boxes) in the order the part listed them; a name may repeat (a refusal)."""

    @classmethod
    def of(cls, part: pb.UpdatePart) -> Declaration:
        return cls(part.rank, tuple(part.whole_tensors),
                   tuple((b.name, tuple(Box.of(x) for x in b.boxes)) for b in part.boxed_tensors))


@dataclass(frozen=True, slots=True)
class DtypeShape:
    """A tensor's dtype (tensor_pb2.Dtype) and shape: as a plan sends it, or as the store holds it."""

    dtype: int
    shape: Shape

    def __str__(self) -> str:
        dtype = tensor_pb2.Dtype.Name(self.dtype) if self.dtype in tensor_pb2.Dtype.values() else str(self.dtype)
        return f"{dtype} {list(self.shape)}"


@dataclass(frozen=True, slots=True)
class Sent:
    """One tensor, or one box of a tensor, that a part's plan sends (its pieces are one Sent)."""

    name: str
    box: Box | None
    meta: DtypeShape
    bucket: int
    """The first bucket that holds it."""


@dataclass(frozen=True, slots=True)
class Terms:
    """What every part of one update states alike (BeginUpdate's fields besides the plan and the part)."""

    world: int
    version: str
    mode: int
    transport: int
    group_id: str
    allow_new_tensors: bool
    base_generation: int
    base_store_epoch: int

    @classmethod
    def of(cls, begin: pb.BeginUpdate) -> Terms:
        return cls(begin.part.world, begin.version, begin.mode, begin.transport, begin.group_id,
                   begin.allow_new_tensors, begin.base_generation, begin.base_store_epoch)


@dataclass(frozen=True, slots=True)
class Owners:
    """The checked union: who owns each declared tensor, whole or box by box."""

    whole: Mapping[str, int]
    """Tensor name -> the rank that owns it whole."""
    boxed: Mapping[str, tuple[tuple[int, Box], ...]]
    """Tensor name -> (rank, box) for every box, sorted; together they tile the tensor."""


def _ranks(ranks: Iterable[int]) -> str:
    listed = sorted(ranks)
    return ",".join(map(str, listed[:LISTED])) + (",..." if len(listed) > LISTED else "")


# -- what a part is ---------------------------------------------------------------------------------
def boxes_refused(begin: pb.BeginUpdate, plan: tensor_pb2.WeightPlan) -> Refusal | None:
    """A plan with a box (TensorSpec.box), at begin: a box travels only in the plan of a part
    (BOX_WITHOUT_PART), over a transport this server runs parts over (PART_TRANSPORTS; else PARTS_UNAVAILABLE),
    dense or as a patch of the box (its positions row-major in the box), but never among a deferred bucket's
    candidates (BOX_PATCH_UNAVAILABLE: its layout is routed without boxes). None for a plan without a box, or
    with boxes this server places. `plan`: the begin's plan, or the one its plan_id names."""
    for index, bucket in enumerate(plan.buckets):
        for spec in bucket.tensors:
            if not spec.HasField("box"):
                continue
            name = spec.name[:64]
            if not begin.HasField("part"):
                return InvalidArgument("BOX_WITHOUT_PART", f"tensor {spec.name!r} is sent as a box, but the stream "
                                       "is no part of an update (BeginUpdate.part unset): a box travels only in a "
                                       "part's plan, which declares it", bucket=index, tensor=name)
            if begin.transport not in PART_TRANSPORTS:
                return Unimplemented("PARTS_UNAVAILABLE", f"tensor {spec.name!r} is sent as a box over "
                                     f"{pb.Transport.Name(begin.transport)}: this server places boxes sent over "
                                     "INLINE, SHM or COLLECTIVE only", bucket=index, tensor=name)
            if bucket.deferred:
                return Unimplemented("BOX_PATCH_UNAVAILABLE", f"tensor {spec.name!r} is a box among a deferred "
                                     "bucket's candidates: this server places a box dense or as a patch in a bucket "
                                     "of the plan, not in a deferred one; send the box in a plain bucket",
                                     bucket=index, tensor=name)
    return None


def parts_not_run(update_key: str, world: int, why: str = "") -> Refusal:
    """What every part of a world > 1 gets once they all joined and their union passed, where this server does
    not run such a world (over SHM more parts than ingress slots; over COLLECTIVE a group without one trainer
    rank per part): `why`. Nothing was allocated."""
    return Unimplemented("PARTS_UNAVAILABLE", f"all {world} parts of update {update_key!r} joined and their "
                         f"declarations agree, but {why or 'this server does not run them'}",
                         update_key=update_key, world=world)


PART_TRANSPORTS = frozenset({pb.TRANSPORT_INLINE, pb.TRANSPORT_SHM, pb.TRANSPORT_COLLECTIVE})
"""The transports this server runs parts over: INLINE and SHM through its ingress, where each part gets a run
of slots of its own (update.streams.ingress_shares); COLLECTIVE over a group holding every part's rank, each
part sending point-to-point to each owner (common/receive_order.py)."""


def join_timeout(part: pb.UpdatePart) -> datetime.timedelta:
    """How long the parts of an update wait for each other (checked by check_identity)."""
    return part.join_timeout.ToTimedelta() if part.HasField("join_timeout") else DEFAULT_JOIN_TIMEOUT


def check_identity(part: pb.UpdatePart) -> Refusal | None:
    """A part's own fields, before it joins anything: its key, world, rank and join timeout."""
    if not UPDATE_KEY_PATTERN.match(part.update_key):
        return InvalidArgument("PART_KEY_INVALID", "update_key must be 1 to 128 characters of [A-Za-z0-9._-]",
                               update_key=part.update_key[:128])
    if not 1 <= part.world <= MAX_WORLD:
        return InvalidArgument("PART_WORLD_INVALID", f"world {part.world} is not 1 to {MAX_WORLD}: the number of "
                               "parts of the update", update_key=part.update_key, world=part.world)
    if not 0 <= part.rank < part.world:
        return InvalidArgument("PART_RANK_INVALID", f"rank {part.rank} is not 0 to {part.world - 1} (world "
                               f"{part.world})", update_key=part.update_key, rank=part.rank, world=part.world)
    if part.HasField("join_timeout"):  # in nanoseconds: a timedelta would round 1 h + 1 ns down to 1 h
        nanos = part.join_timeout.seconds * 10**9 + part.join_timeout.nanos
        if not 0 < nanos <= MAX_JOIN_TIMEOUT // datetime.timedelta(microseconds=1) * 1000:
            return InvalidArgument("PART_JOIN_TIMEOUT_INVALID", f"join_timeout must be in (0, 3600] s, got "
                                   f"{nanos / 1e9:g}", update_key=part.update_key)
    return None


# -- the join ---------------------------------------------------------------------------------------
def check_join(first: Terms, joined: frozenset[int], rank: int, terms: Terms, *, update_key: str) -> Refusal | None:
    """A part joining an update whose first part stated `first` and whose ranks `joined` are in:
    None when it may join, or why not (it alone is refused; the others keep waiting)."""
    if rank in joined:
        return AlreadyExists("PART_DUPLICATE", f"rank {rank} already joined update {update_key!r}: each rank "
                             "joins once", update_key=update_key, rank=rank)
    for field in Terms.__slots__:
        expected, got = getattr(first, field), getattr(terms, field)
        if expected != got:
            return InvalidArgument("PART_MISMATCH", f"rank {rank} states {field} {got!r}; the update's first part "
                                   f"stated {expected!r}: every part states the same", update_key=update_key,
                                   rank=rank, field=field, expected=str(expected)[:128], got=str(got)[:128])
    return None


def missing(world: int, joined: Iterable[int]) -> tuple[int, ...]:
    """The ranks of a world of `world` parts that have not joined, ascending."""
    return tuple(sorted(set(range(world)) - set(joined)))


def parts_missing(update_key: str, world: int, joined: Iterable[int], timeout: datetime.timedelta) -> Refusal:
    """What every joined part gets when the join deadline passes first: the ranks that never came."""
    absent = missing(world, joined)
    return DeadlineExceeded("PARTS_MISSING", f"{len(absent)} of {world} parts did not join update {update_key!r} "
                            f"within {timeout.total_seconds():g} s (ranks {_ranks(absent)}); nothing was "
                            "allocated and the store is untouched", update_key=update_key, world=world,
                            missing=_ranks(absent))


def client_idle(idle_seconds: float, silent: Sequence[int] = ()) -> Refusal:
    """What every stream of an update gets when no message came from any of them within the idle bound; with
    parts, `silent` names the ones still owing a message (neither committed nor ended: the part that stalled;
    the others wait for it), in the message and in metadata `silent`."""
    if not silent:
        return DeadlineExceeded("CLIENT_IDLE", f"no message from the client for {idle_seconds:g} s")
    return DeadlineExceeded("CLIENT_IDLE", f"no message from any part for {idle_seconds:g} s: part(s) "
                            f"{_ranks(silent)} had not sent their commit (the others waited for them)",
                            silent=_ranks(silent))


def part_failed(update_key: str, rank: int, failure: WeightSyncError) -> Refusal:
    """What every other part gets when part `rank` fails with `failure`: the update is aborted on this server."""
    return Aborted("PART_FAILED", f"part {rank} of update {update_key!r} failed ({failure.code.name} "
                   f"{failure.reason}: {failure.message}); the whole update was aborted on this server",
                   update_key=update_key, part=rank, part_reason=failure.reason, part_code=failure.code.name)


def key_refused(update_key: str, rank: int, refusal: Refusal) -> Refusal:
    """What every other part under `update_key` gets when part `rank` was refused before it joined (its begin:
    a mode, a box in a deferred bucket, ...; its identity; other terms than the first part's): the refusal's own
    code and reason, at once, naming the part (metadata `part`), instead of waiting out the join timeout for a
    part that will not come. Nothing was allocated."""
    return type(refusal)(refusal.reason, f"part {rank} of update {update_key!r} was refused before it joined "
                         f"({refusal.message}); every part of the update fails with its reason, nothing was "
                         "allocated", **{**refusal.metadata, "update_key": update_key, "part": rank})


def late_part(update_key: str, *, committed_generation: int | None = None,
              failure: WeightSyncError | None = None) -> Refusal:
    """What a part gets when it comes under a key whose update already ended: the failure the other parts
    got (PARTS_MISSING, PART_FAILED, ...), or PART_KEY_USED when it committed. Nothing new starts."""
    if failure is not None:
        return failure
    return FailedPrecondition("PART_KEY_USED", f"update {update_key!r} already committed (generation "
                              f"{committed_generation}): every update draws a new key",
                              update_key=update_key, generation=committed_generation)


# -- what the plans send ----------------------------------------------------------------------------
def sent_by(plan: tensor_pb2.WeightPlan) -> tuple[Sent, ...]:
    """Each tensor or box a plan sends, once (a split one's pieces are one), in plan order; a deferred
    bucket's candidates count as sent (each may be)."""
    seen: dict[tuple[str, Box | None], Sent] = {}
    for index, bucket in enumerate(plan.buckets):
        for spec in bucket.tensors:
            box = Box.of(spec.box) if spec.HasField("box") else None
            seen.setdefault((spec.name, box), Sent(spec.name, box, DtypeShape(spec.dtype, tuple(spec.shape)), index))
    return tuple(seen.values())


# -- the union --------------------------------------------------------------------------------------
def check_union(declarations: Sequence[Declaration], sent: Mapping[int, Sequence[Sent]],
                stored: Mapping[str, DtypeShape], stores: Callable[[str], bool] = lambda name: True) -> Owners | Refusal:
    """The declarations of every part of an update (one per rank) and what each part's plan sends
    (`sent`, by rank), checked together before anything is allocated: the owners, or the refusal
    every part gets. `stored` is what the store holds; a tensor this server does not store
    (`stores`, its --tensors filter) is checked by name only."""
    whole: dict[str, int] = {}
    boxed: dict[str, list[tuple[int, Box]]] = {}
    for part in sorted(declarations, key=lambda d: d.rank):
        boxed_here: set[str] = set()
        for name in part.whole:
            if name in whole:
                return _owned_twice(name, whole[name], part.rank)
            whole[name] = part.rank
        for name, boxes in part.boxed:
            if name in boxed_here:
                return _owned_twice(name, part.rank, part.rank)
            boxed_here.add(name)
            boxed.setdefault(name, []).extend((part.rank, box) for box in boxes)
    for name, owners in boxed.items():
        if name in whole:
            return InvalidArgument("TENSOR_WHOLE_AND_BOXED", f"tensor {name!r} is owned whole by part {whole[name]} "
                                   f"and in boxes by part {owners[0][0]}: a tensor is owned one way",
                                   tensor=name[:64], whole_part=whole[name], boxed_part=owners[0][0])
    refusal = _check_sends(declarations, sent)
    if refusal is not None:
        return refusal
    metas = _metas(sent, stored)
    if isinstance(metas, WeightSyncError):
        return metas
    for part in sorted(declarations, key=lambda d: d.rank):
        for name in (*part.whole, *(n for n, _ in part.boxed)):
            if stores(name) and name not in metas:
                return InvalidArgument("PART_TENSOR_UNKNOWN", f"part {part.rank} owns tensor {name!r}, which no "
                                       "part's plan sends and the store does not hold: send it (its dtype and "
                                       "shape) once before declaring it unchanged", tensor=name[:64], part=part.rank)
    for name, owners in boxed.items():
        if stores(name):
            refusal = check_tiling(name, metas[name].shape, owners)
            if refusal is not None:
                return refusal
    refusal = _check_new_boxes_sent(boxed, sent, stored, stores)
    if refusal is not None:
        return refusal
    return Owners(whole, {name: tuple(sorted(owners)) for name, owners in boxed.items()})


def _check_new_boxes_sent(boxed: Mapping[str, Sequence[tuple[int, Box]]], sent: Mapping[int, Sequence[Sent]],
                          stored: Mapping[str, DtypeShape], stores: Callable[[str], bool]) -> Refusal | None:
    """A boxed tensor the store does not hold arrives whole: every box of it is sent, by its part."""
    sent_boxes = {(rank, item.name, item.box) for rank, items in sent.items() for item in items}
    for name, owners in boxed.items():
        if name in stored or not stores(name):
            continue
        for rank, box in owners:
            if (rank, name, box) not in sent_boxes:
                return InvalidArgument("BOX_NOT_SENT", f"tensor {name!r} is new to the store, but part {rank} does "
                                       f"not send its box {box}: a tensor new to the store arrives whole, every box "
                                       "of it sent", tensor=name[:64], part=rank, box=str(box)[:128])
    return None


def _owned_twice(name: str, first: int, second: int) -> Refusal:
    return InvalidArgument("TENSOR_OWNED_TWICE", f"tensor {name!r} is declared by part {first} and again by part "
                           f"{second}: whole tensors have one owner, and a part lists a tensor once",
                           tensor=name[:64], parts=f"{first},{second}")


def _check_sends(declarations: Sequence[Declaration], sent: Mapping[int, Sequence[Sent]]) -> Refusal | None:
    """Each part's plan sends only what that part declares: a whole tensor it owns whole, a box it owns."""
    for part in sorted(declarations, key=lambda d: d.rank):
        whole = set(part.whole)
        boxes = {(name, box) for name, bs in part.boxed for box in bs}
        for item in sent.get(part.rank, ()):
            if item.box is None and item.name in whole or item.box is not None and (item.name, item.box) in boxes:
                continue
            what = f"tensor {item.name!r}" if item.box is None else f"box {item.box} of tensor {item.name!r}"
            return InvalidArgument("PART_SENDS_UNOWNED", f"part {part.rank}'s plan sends {what} (bucket "
                                   f"{item.bucket}), which the part does not declare: declare every tensor and "
                                   "box it sends", tensor=item.name[:64], part=part.rank, bucket=item.bucket,
                                   box=str(item.box) if item.box is not None else "")
    return None


def _metas(sent: Mapping[int, Sequence[Sent]], stored: Mapping[str, DtypeShape]) -> dict[str, DtypeShape] | Refusal:
    """Each tensor's dtype and shape: as the plans send it (they agree), else as the store holds it."""
    metas: dict[str, tuple[DtypeShape, int]] = {}
    for rank in sorted(sent):
        for item in sent[rank]:
            known = metas.setdefault(item.name, (item.meta, rank))
            if known[0] != item.meta:
                return InvalidArgument(
                    "PART_TENSOR_MISMATCH", f"tensor {item.name!r} is sent by part {known[1]} as {known[0]} and "
                    f"by part {rank} as {item.meta}: every part sends the whole tensor's dtype and shape",
                    tensor=item.name[:64], parts=f"{known[1]},{rank}")
    return {**stored, **{name: meta for name, (meta, _) in metas.items()}}


def check_tiling(name: str, shape: Shape, owners: Sequence[tuple[int, Box]]) -> Refusal | None:
    """The boxes of one tensor, (rank, box) over every part: each inside the shape, no element in two,
    none in no box. Inside and disjoint, they cover every element exactly once when their sizes add up to
    the tensor's."""
    for rank, box in owners:
        if (len(box.offsets) != len(shape) or len(box.sizes) != len(shape)
                or any(o < 0 or s < 1 or o + s > d for o, s, d in zip(box.offsets, box.sizes, shape, strict=True))):
            return InvalidArgument("BOX_OUT_OF_SHAPE", f"part {rank}'s box {box} of tensor {name!r} does not lie "
                                   f"inside its shape {list(shape)} (one offset and one size >= 1 per dimension)",
                                   tensor=name[:64], part=rank, box=str(box)[:128], shape=str(list(shape)))
    overlap = _overlap(owners, len(shape))
    if overlap is not None:
        (a, box_a), (b, box_b) = overlap
        return InvalidArgument("BOXES_OVERLAP", f"boxes {box_a} (part {a}) and {box_b} (part {b}) of tensor "
                               f"{name!r} share elements: each element has one owner", tensor=name[:64],
                               parts=f"{a},{b}", boxes=f"{box_a} {box_b}"[:256])
    covered, numel = sum(box.numel for _, box in owners), math.prod(shape)
    if covered != numel:
        return InvalidArgument("BOXES_INCOMPLETE", f"the boxes of tensor {name!r} cover {covered} of its {numel} "
                               "elements: every element needs an owner, sent this time or not", tensor=name[:64],
                               covered=covered, numel=numel)
    return None


def _intersect(a: Box, b: Box) -> bool:
    return all(a.offsets[d] < b.end(d) and b.offsets[d] < a.end(d) for d in range(len(a.offsets)))


def _overlap(owners: Sequence[tuple[int, Box]], rank: int) -> tuple[tuple[int, Box], tuple[int, Box]] | None:
    """Two boxes (inside one shape) that share an element, or None: a sweep along the dimension where the
    boxes start at the most places (dim 0 for row ranges, dim 1 for column ranges), comparing each box only
    with those still open there."""
    if rank == 0:
        return (owners[0], owners[1]) if len(owners) > 1 else None
    dim = max(range(rank), key=lambda d: len({box.offsets[d] for _, box in owners}))
    ordered = sorted(owners, key=lambda o: (o[1].offsets[dim], o[0], o[1]))
    open_: list[tuple[int, Box]] = []
    for owner in ordered:
        start = owner[1].offsets[dim]
        open_ = [o for o in open_ if o[1].end(dim) > start]
        for other in open_:
            if _intersect(other[1], owner[1]):
                return other, owner
        open_.append(owner)
    return None
