"""Sending only what changed: the trainer's copy of what it last committed, and the per-tensor
choice between the whole tensor and a patch.

The SDK keeps, per WeightSyncClient, one copy of every tensor it last committed, with the WS64 of
each: memory equal to the pushed tensors' size, in host memory (CUDA tensors' in pinned host
memory: none on the trainer's GPU unless WeightSyncClient(delta_host_copy=False) asks for it
there), except that a view which reads some elements more than once (expand(), a stride of 0)
costs only the storage it reads (policy.kept_copy; DeltaBase.memory_bytes says what the
copy holds). The next push compares raw bits against that copy, per tensor:
  - a sample of its elements first: a tensor whose patch would plainly not pay goes dense without
    paying for a full comparison (so a push where most of the model changed costs about what
    dense costs);
  - otherwise every element, and the patch is sent when it is small enough (Worth).
Host tensors are compared by the compiled kernels (common.patch_kernels): one pass over both
copies writes a PATCH_XOR patch (gap varints, XOR byte planes) and the WS64 change, on as many
threads as torch may use. CUDA tensors are compared with torch ops on their device (the
overwriting encodings: positions, gaps or a bitmask, whichever is smallest); a copy in host memory
is brought over HOST_COMPARE_CHUNK_BYTES at a time (the sample: its elements only), never whole.
A view that repeats elements is compared by the storage it reads: unchanged, or dense.
Each patch carries the WS64 of the whole new tensor: the copy's WS64 plus the change, O(changed).
A kept host tensor is brought up to date by the comparison itself (the kernel writes each changed
element into the copy as it finds it: no pass of its own); the others are refreshed while a push's
bytes move. Once compared, the copy is no server's base until every server committed (it claims
that commit then: `claims`; the generation each server committed it at is in that server's
record, client/servers/records.py): a push that fails after the comparison leaves a copy that
claims nothing, and the next push goes dense. What one push sends per tensor (DeltaChoice,
TensorPatch) is in client/delta/choice.py; the link's measured throughput, that auto's thresholds
follow, in client/delta/link_timings.py.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Literal

import torch

from weightsync.client.delta.choice import (
    DeltaChoice,
    TensorPatch,
    read_span,
    read_storage,
    repeats_elements,
)
from weightsync.client.delta.policy import (
    EVERY_SMALLER,
    LOOPBACK_BYTES_PER_SECOND,
    Worth,
    auto_dense_above,
    auto_worth,
    kept_copy,
)
from weightsync.client.intra_op import one_intra_op_thread
from weightsync.common import patch_kernels
from weightsync.common.checksum import ws64
from weightsync.common.host_pinning import pinned_host_empty
from weightsync.common.logging import get_logger
from weightsync.common.patches import (
    XOR,
    Changes,
    DecodedPatch,
    PatchChoice,
    SampleLayout,
    apply_patch,
    bits_of,
    changes_between,
    encode_patch,
    gaps_of,
    sample_layout,
    smallest_encoding,
    ws64_after_patch,
)
from weightsync.common.threads import CallAbandoned, ThreadCall

log = get_logger("weightsync.client.delta")
_TAKE_TIMEOUT = 3600.0
"""A copy of the model in memory: it ends; the bound only keeps a broken device from hanging a push."""

Delta = Literal["auto"] | bool
_MASK64 = (1 << 64) - 1


def _on_host(base: torch.Tensor, new: torch.Tensor) -> bool:
    return base.device.type == "cpu" and new.device.type == "cpu" and base.is_contiguous()


HOST_COMPARE_CHUNK_BYTES = 64 << 20
"""A CUDA tensor whose copy lives in host memory is compared against it this many bytes at a time,
each piece copied to the device into one staging buffer: the comparison costs that much device
memory, not a second copy of the tensor."""


DENSE_RUN_DROPS_COPY = 1
"""delta="auto": a tensor that went dense this many pushes in a row is no longer kept whole: its
copy costs a memcpy per push (~15% of a dense push on the benchmark machine, twice that into fresh
pages) and its memory. Only its sample is kept (SAMPLE_ELEMENTS raw values): when a later push's
sample says the update would go as patches again, the tensor is copied whole once more (that push
goes dense), and patched from the push after. One: a dense phase costs no copy at all; a single
dense step between sparse ones costs one more dense push."""

REKEEP_BELOW = 0.5
"""A tensor kept only as a sample is copied whole again when its sample predicts a patch below
this fraction of compare_below: near the crossover it would be copied, compared, found not worth
it and dropped again, push after push (0.65-0.8x dense in the fine-tune bench)."""
SAMPLE_ELEMENTS = 4096
"""Elements compared before the full comparison (in runs spread over the tensor:
common.patches.sample_layout); a tensor whose sample says 'dense' skips it."""


def _sample(numel: int) -> SampleLayout:
    return sample_layout(numel, SAMPLE_ELEMENTS)


MIN_PATCH_ELEMENTS = 1024
"""Smaller tensors always go dense: their patch saves less than its bookkeeping costs."""


def _changes_across(base: torch.Tensor, new: torch.Tensor) -> Changes:
    """changes_between a copy in host memory and a tensor on a device, on the device: the copy is
    brought over HOST_COMPARE_CHUNK_BYTES at a time into one staging buffer (never whole). Positions
    and values are on new's device; the WS64 change is left to ws64_after_patch (O(changed))."""
    ours, theirs = bits_of(new), bits_of(base)
    step = max(8, HOST_COMPARE_CHUNK_BYTES // ours.element_size())  # a multiple of 8 elements: words stay whole
    staging = torch.empty(min(step, ours.numel()), dtype=ours.dtype, device=ours.device)
    stream = torch.cuda.current_stream(ours.device) if ours.is_cuda else None
    positions, values = [], []
    try:
        for start in range(0, ours.numel(), step):
            end = min(start + step, ours.numel())
            piece = staging[: end - start]
            # Queued on the current stream, before the comparison that reads it and before the next
            # piece overwrites the staging buffer (stream order); from pinned memory, asynchronously.
            piece.copy_(theirs[start:end], non_blocking=True)
            found = changes_between(piece, ours[start:end])
            positions.append(found.positions.add_(start))
            values.append(found.values)
    finally:
        if stream is not None:
            # The host copy must not change (nor go, a failed comparison's) while a copy out of it is queued: every
            # piece has been read before this returns (changes_between's nonzero waits too; this does not rely on it).
            stream.synchronize()
    if not positions:
        return Changes(torch.empty(0, dtype=torch.int64, device=ours.device),
                       torch.empty(0, dtype=torch.uint8, device=ours.device), None)
    return Changes(torch.cat(positions), torch.cat(values), None)


@dataclass(frozen=True, slots=True)
class _Home:
    """Where one kept copy is allocated (policy.kept_copy). Pinned host memory of the copy's own size,
    given back when the copy goes (common/host_pinning.pinned_host_empty), not torch's pin_memory=True, which
    rounds every allocation up to a power of two and keeps it for the process's life."""

    device: torch.device
    pinned: bool

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        if not self.pinned:
            return torch.empty(shape, dtype=dtype, device=self.device)
        numel = math.prod(shape)
        return pinned_host_empty(numel * dtype.itemsize).view(dtype).view(shape)


def _drain(devices: set[torch.device]) -> None:
    """Wait for what this thread's current stream of each device has queued (a failed device: as far as it goes)."""
    for device in devices:
        with contextlib.suppress(RuntimeError):  # a sticky error: nothing of it runs any more
            torch.cuda.current_stream(device).synchronize()


def _layout(named: list[tuple[str, torch.Tensor]]) -> tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]:
    return tuple((name, t.dtype, tuple(t.shape)) for name, t in named)


class DeltaBase:
    """The tensors this client last committed, the generation they are at on each server, and
    their WS64s."""

    def __init__(self, *, host_copy: bool = True) -> None:
        self.host_copy = host_copy
        """Keep device tensors' copy in host memory (pinned for CUDA; the default: a second copy of
        the model on the trainer's GPU left it short for its optimizer and activations a few steps
        later); comparing then reads the kept copy across the bus. False: on the tensors' device
        (policy.kept_copy)."""
        self.tensors: dict[str, torch.Tensor] = {}
        """The whole copy of each kept tensor (contiguous)."""
        self.views: dict[str, torch.Tensor] = {}
        """Views that read some elements more than once (repeats_elements): the view's shape and
        strides over a copy of only the storage it reads."""
        self.checksums: dict[str, int] = {}
        """WS64 of a kept tensor, once a patch of it needed it (kept across patches)."""
        self.claims = False
        """The copy is, bit for bit, what the servers last committed: a push may send patches against
        it to each server whose record names that commit's generation (ServerState.generation)."""
        self.layout: tuple = ()
        self.dense_runs: dict[str, int] = {}
        """delta="auto": per tensor, the pushes in a row it went dense."""
        self.samples: dict[str, torch.Tensor] = {}
        """The sampled raw bits of a tensor no longer kept whole (DENSE_RUN_DROPS_COPY)."""
        self._rekeep: dict[str, bool] = {}
        """This push's verdicts on the tensors in `samples`: clearly sparse again (REKEEP_BELOW)."""
        self._sampled: dict[str, torch.Tensor] = {}
        """This push's samples of the tensors in `samples`: they replace those once committed."""
        self._taking: ThreadCall[None] | None = None
        self._abandoned: list[tuple[ThreadCall[None], list[dict[str, torch.Tensor]]]] = []
        """Background takes given up on (_TAKE_TIMEOUT) with the copies they were writing into: copies may still be
        queued into those tensors' pinned pages, which must stay mapped until the take's thread ended (it waits for
        its streams, done or failed)."""
        self._advanced: set[str] = set()
        """Kept tensors this push's comparison already made equal to the pushed ones (host tensors:
        the compare kernel writes the changes into the copy); the refresh leaves them as they are."""
        self._refresh_streams: dict[torch.device, torch.cuda.Stream] = {}
        """The background refresh's own stream per device: its copies out of the device do not queue ahead
        of the push's pack copies, checks and sends on the caller's stream (each waits for the writes)."""

    def went_dense(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """The push chose patches and then went whole-dense (they would move too much): every tensor
        went dense, whatever its comparison said."""
        for name, _ in named:
            self.dense_runs[name] = self.dense_runs.get(name, 0) + 1

    @property
    def memory_bytes(self) -> int:
        """The bytes the kept copies hold (their storages; the samples, SAMPLE_ELEMENTS a tensor,
        aside): the pushed tensors' size, but a repeating view's only the storage it reads."""
        return sum(t.untyped_storage().nbytes() for t in [*self.tensors.values(), *self.views.values()])

    def same_layout(self, named: list[tuple[str, torch.Tensor]]) -> bool:
        """Whether these tensors have the names, dtypes and shapes of the kept copy."""
        self._settle()
        return bool(self.tensors or self.samples or self.views) and _layout(named) == self.layout

    def choose(self, named: list[tuple[str, torch.Tensor]], *, link: float = LOOPBACK_BYTES_PER_SECOND,
               auto: bool = True, defer: bool = False) -> DeltaChoice:
        """Per tensor, unchanged, patch or dense: where the patch pays (auto) or wherever it is
        smaller than the tensor. Auto samples every tensor first: when the samples already say
        the update goes dense (AUTO_DENSE_ABOVE), no tensor is compared in full. defer: the kept
        host tensors worth comparing (but the smallest) are not compared here but listed in
        DeltaChoice.deferred, for compare_deferred while the push's bytes move; the copy of each is
        then the new tensor's as soon as that comparison ran. A view that repeats elements
        (repeats_elements) is unchanged when the storage it reads is, and dense otherwise."""
        self._settle()
        choice = DeltaChoice()
        self._sampled, self._rekeep, self._advanced = {}, {}, set()
        everything = named
        # A view that reads some elements more than once: its storage unchanged, or dense.
        views = {name: self._same_view(name, t) for name, t in named if repeats_elements(t)}
        named = [(name, t) for name, t in named if name not in views]
        worths = {name: auto_worth(tensor, link) if auto else EVERY_SMALLER
                  for name, tensor in named}
        # The kernels read flat host memory: a strided host tensor (a slice, a transpose) is copied once.
        named = [(name, t.detach().contiguous() if t.device.type == "cpu" else t.detach()) for name, t in named]
        compare = {name: self._worth_comparing(name, tensor, worths[name]) for name, tensor in named}
        if auto:
            dense = sum(t.numel() * t.element_size() for _, t in everything)
            expected = sum(t.numel() * t.element_size() for n, t in everything
                           if not (views[n] if n in views else compare[n]))
            if expected > auto_dense_above(link) * dense:
                for name, _ in named:  # all of them go dense
                    self.dense_runs[name] = self.dense_runs.get(name, 0) + 1
                return choice
        choice.unchanged.update(name for name, same in views.items() if same)
        on_host = [(name, tensor) for name, tensor in named
                   if compare[name] and name in self.tensors and _on_host(self.tensors[name], tensor)]
        if on_host:
            # The comparison writes the new bits into the copy: from here on it is no server's base
            # (the caller holds the bases this push's patches apply to) until committed() claims them.
            self.claims = False
        if defer:
            choice.deferred = [(n, t) for n, t in on_host if t.numel() >= MIN_PATCH_ELEMENTS]
            choice.patch_below = {n: worths[n].patch_below for n, _ in choice.deferred}
            self._advanced.update(choice.patch_below)  # the refresh leaves them to compare_deferred
            on_host = [(n, t) for n, t in on_host if n not in choice.patch_below]
        host_patches = self._host_patches(on_host, {n: self._limit(t, worths[n]) for n, t in on_host})
        for name, tensor in named:
            if not compare[name] or name in choice.patch_below:
                continue
            if name not in self.tensors:
                # Only its sample was kept, and it says clearly sparse again (REKEEP_BELOW): dense this
                # time, kept whole after.
                if self._rekeep.get(name, False):
                    self.dense_runs[name] = 0
                else:
                    self.dense_runs[name] = self.dense_runs.get(name, 0) + 1
                continue
            patch = host_patches[name] if name in host_patches else self._patch_of(name, tensor, worths[name])
            if patch == "unchanged":
                choice.unchanged.add(name)
            elif patch is not None:
                choice.patches[name] = patch
        if auto:
            for name, _ in named:
                if name in self.tensors:
                    sparse = name in choice.patches or name in choice.unchanged or name in choice.patch_below
                    self.dense_runs[name] = 0 if sparse else self.dense_runs.get(name, 0) + 1
                elif not compare[name]:
                    self.dense_runs[name] = self.dense_runs.get(name, 0) + 1
        else:
            self.dense_runs = {}
        return choice

    def _base_for(self, name: str, new: torch.Tensor) -> torch.Tensor | None:
        """The kept copy to compare `new` against, where it lives (never copied whole: a copy in host
        memory is read by the sample and by the chunked comparison, _changes_across); None when it
        is on another device than new's (the tensor moved: dense, and kept where it is now)."""
        base = self.tensors.get(name)
        if base is None or base.device == new.device or base.device.type == "cpu":
            return base
        return None

    def _same_view(self, name: str, new: torch.Tensor) -> bool:
        """Whether a repeating view reads the same storage bits, with the same strides, as its kept copy."""
        kept = self.views.get(name)
        if kept is None or kept.dtype != new.dtype or kept.shape != new.shape or kept.stride() != new.stride():
            return False
        now = read_storage(new)
        if now.device != kept.device:
            now = now.to(kept.device)  # the storage it reads: as small as its kept copy
        return torch.equal(read_storage(kept), now)

    def _worth_comparing(self, name: str, new: torch.Tensor, worth: Worth) -> bool:
        """Whether a sample of the tensor's elements predicts a patch under worth.compare_below
        (with a margin for the sample's noise); small tensors are always compared."""
        base = self._base_for(name, new)
        numel, itemsize = new.numel(), new.element_size()
        layout = _sample(numel)
        sample = self.samples.get(name)
        if base is None and sample is None:
            return False
        if numel < MIN_PATCH_ELEMENTS:
            return base is not None  # compared whole to find it unchanged; one not kept stays dense
        if base is None:
            if new.device.type == "cpu" and sample.device.type == "cpu":
                changed, fresh = patch_kernels.resample(new, layout, sample)  # 1.6x the torch ops' speed
            else:
                fresh = layout.of(bits_of(new)).clone()
                changed = int((fresh != sample.to(new.device)).sum().item())
            self._sampled[name] = fresh
            per_change = 1 + itemsize if new.device.type == "cpu" else 2 + itemsize
            sampled = changed / layout.size
            smallest = min(sampled * per_change, 1 / 8 + sampled * itemsize) * numel
            self._rekeep[name] = smallest <= REKEEP_BELOW * worth.compare_below * numel * itemsize
        elif _on_host(base, new):
            changed = patch_kernels.count_changed(base, new, layout)
            per_change = 1 + itemsize  # a one-byte gap and, at most, every XOR byte plane dense
        else:
            ours = layout.of(bits_of(new))
            if ours.device != base.device:
                ours = ours.to(base.device)  # a copy in host memory: only the sampled elements cross the bus
            changed = int((layout.of(bits_of(base)) != ours).sum().item())
            per_change = 2 + itemsize
        sampled = changed / layout.size
        smallest = min(sampled * per_change, 1 / 8 + sampled * itemsize) * numel
        return smallest <= 1.1 * worth.compare_below * numel * itemsize

    def _patch_of(self, name: str, new: torch.Tensor, worth: Worth) -> TensorPatch | Literal["unchanged"] | None:
        """A patch, "unchanged", or None (dense)."""
        base = self._base_for(name, new)
        if base is None:
            return None
        numel, itemsize = new.numel(), new.element_size()
        dense = numel * itemsize
        changes = changes_between(base, new) if base.device == new.device else _changes_across(base, new)
        positions = changes.positions
        if not positions.numel():
            return "unchanged"
        if numel < MIN_PATCH_ELEMENTS:
            return None
        gaps = gaps_of(positions)
        chosen: PatchChoice = smallest_encoding(positions, numel, itemsize, gaps=gaps)
        if chosen.size_bytes > worth.patch_below * dense:
            return None
        data = torch.empty(chosen.size_bytes, dtype=torch.uint8, device=new.device)
        encode_patch(new, positions, chosen.encoding, data, values=changes.values, gaps=gaps)
        kept = self._kept_checksum(name, base)
        if changes.ws64_delta is not None:
            checksum = (kept + changes.ws64_delta) & _MASK64
        else:
            checksum = ws64_after_patch(kept, base, DecodedPatch(positions, changes.values))
        return TensorPatch(data, chosen.encoding, positions.numel(), checksum, positions)

    @staticmethod
    def _limit(tensor: torch.Tensor, worth: Worth) -> int | None:
        """The most bytes its patch may take to be sent (None: too small to be worth one; compared only
        to leave it out when unchanged)."""
        numel, itemsize = tensor.numel(), tensor.element_size()
        return None if numel < MIN_PATCH_ELEMENTS else int(worth.patch_below * numel * itemsize)

    def compare_deferred(self, named: list[tuple[str, torch.Tensor]],
                         threads: int = 0) -> dict[str, TensorPatch | Literal["unchanged"] | None]:
        """Compare tensors choose(defer=True) listed, on `threads` threads (0: torch's): a patch wherever one
        is not larger than the tensor (None: larger), the copy brought up to date as by choose. Safe beside
        the copy's refresh thread: that one leaves these tensors alone."""
        return self._host_patches(named, {n: t.numel() * t.element_size() for n, t in named}, threads)

    def _host_patches(self, named: list[tuple[str, torch.Tensor]], limits: dict[str, int | None],
                      threads: int = 0) -> dict[str, TensorPatch | Literal["unchanged"] | None]:
        """PATCH_XOR from the compiled compare, for every kept host tensor at once: one pass over
        both copies each, the tensors shared out whole between the threads (compare_many), no bytes
        written for a patch that would be over worth.patch_below (or a tensor too small to be worth
        one: compared only to leave it out when unchanged). The same pass brings the copy of each
        up to date (advance_base): every one of them is then the pushed tensor, bit for bit, with
        its WS64 where it was known or a patch needs it. limits: see _limit."""
        found = patch_kernels.compare_many([(self.tensors[name], new, limits[name]) for name, new in named],
                                           threads or torch.get_num_threads(), advance_base=True)
        patches: dict[str, TensorPatch | Literal["unchanged"] | None] = {}
        for (name, _), patch in zip(named, found, strict=True):
            self._advanced.add(name)
            kept = self.checksums.pop(name, None)
            if patch is None:  # over its limit: dense (its WS64 is computed again if a patch needs it)
                patches[name] = None
                continue
            if kept is not None:
                self.checksums[name] = (kept + patch.ws64_delta) & _MASK64
            if patch.count and limits[name] is None:
                patches[name] = None
            elif not patch.count:
                patches[name] = "unchanged"
            else:
                # The copy is the new tensor now: its WS64 is the patched tensor's.
                checksum = self._kept_checksum(name, self.tensors[name])
                patches[name] = TensorPatch(patch.data, XOR, patch.count, checksum, None)
        return patches

    def _kept_checksum(self, name: str, base: torch.Tensor) -> int:
        """The kept tensor's WS64, computed when first needed (a dense push does not pay for it)."""
        kept = self.checksums.get(name)
        if kept is None:
            kept = self.checksums[name] = ws64(base)
        return kept

    # -- what was pushed becomes the copy ------------------------------------------------------
    def take_in_background(self, named: list[tuple[str, torch.Tensor]], choice: DeltaChoice | None) -> None:
        """Start refreshing the copy while the push's bytes move (a dense push's copy is a memcpy
        of the model: done after the push it added ~10% to it on the benchmark machine). The
        copy claims no server's generation until committed() (caches change on success only)."""
        self._settle()
        self.claims = False
        # The thread's copies run on its own current streams: they first wait for what the
        # caller's current streams had queued (the writes that made these tensors).
        written = {}
        for device in {t.device for _, t in named if t.is_cuda}:
            written[device] = torch.cuda.Event()
            written[device].record(torch.cuda.current_stream(device))
        for device in written:
            if device not in self._refresh_streams:
                self._refresh_streams[device] = torch.cuda.Stream(device)
        streams = {device: self._refresh_streams[device] for device in written}
        self._taking = ThreadCall(lambda: self._take(named, choice, written, streams), name="weightsync-delta-copy")

    def committed(self, named: list[tuple[str, torch.Tensor]], choice: DeltaChoice | None,
                  _unused: object = None) -> None:
        """Every server committed: the copy holds what they hold (taken now unless a background
        take of this push is under way) and claims that commit (`claims`; each server's record
        keeps the generation it committed at). The third argument is ignored (it once carried the
        generations, which the server records keep now)."""
        if self._taking is None:
            self.claims = False
            self._take(named, choice)
        elif not self._settle():
            return  # the copy failed: nothing is claimed, the next push goes dense
        self.claims = True

    def _settle(self) -> bool:
        """Wait for a background take; False (and an empty copy) if it failed. A take that raised waited for its
        queued copies first (_take); one given up on keeps the tensors it may still be copying into until its
        thread ends (_abandoned): pinned pages are unmapped with their last tensor, under a DMA otherwise."""
        self._abandoned = [(call, held) for call, held in self._abandoned if not call.done]
        taking, self._taking = self._taking, None
        if taking is None:
            return True
        try:
            taking.result(timeout=_TAKE_TIMEOUT)
            return True
        except Exception as error:  # noqa: BLE001 - the push itself succeeded; only the copy is lost
            log.warning("delta_copy_failed", error=repr(error))
            if isinstance(error, CallAbandoned):
                self._abandoned.append((taking, [self.tensors, self.views]))
            self.tensors, self.checksums, self.layout, self.claims = {}, {}, (), False
            self.views = {}
            return False

    def _take(self, named: list[tuple[str, torch.Tensor]], choice: DeltaChoice | None,
              written: dict[torch.device, torch.cuda.Event] | None = None,
              streams: dict[torch.device, torch.cuda.Stream] | None = None) -> None:
        """Tensors the comparison brought up to date are left alone, unchanged ones too; other patched
        tensors (CUDA) are patched in the copy (O(changed)), the rest copied whole. In the background
        (`streams`), every copy runs on the refresh's own stream of its device, after the writes (`written`)."""
        with contextlib.ExitStack() as on_streams:
            for stream in (streams or {}).values():
                on_streams.enter_context(torch.cuda.stream(stream))
            for device, event in (written or {}).items():
                torch.cuda.current_stream(device).wait_event(event)
            try:
                self._take_now(named, choice)
            except BaseException:
                # Copies into kept tensors (pinned host pages) may be queued on these streams, and the caller drops
                # the copy when this raises: its pages would be unmapped under the DMA. Wait for them first.
                _drain({*(streams or {}), *(t.device for _, t in named if t.is_cuda)})
                raise

    def _take_now(self, named: list[tuple[str, torch.Tensor]], choice: DeltaChoice | None) -> None:
        """_take on this thread's current streams."""
        with one_intra_op_thread():
            layout = _layout(named)
            if layout != self.layout:
                self.tensors, self.checksums, self.layout, self.dense_runs, self.samples = {}, {}, (), {}, {}
                self.views, self._sampled = {}, {}
            patches = choice.patches if choice is not None else {}
            unchanged = choice.unchanged if choice is not None else set()
            cuda_devices: set[torch.device] = set()
            for name, tensor in named:
                if repeats_elements(tensor):
                    for kept_whole in (self.tensors, self.checksums, self.samples, self.dense_runs):
                        kept_whole.pop(name, None)
                    if name not in unchanged or name not in self.views:
                        self._keep_view(name, tensor)
                    cuda_devices.update(t.device for t in (self.views[name], tensor) if t.is_cuda)
                    continue
                self.views.pop(name, None)
                if name in unchanged and name in self.tensors:
                    continue
                if name not in patches and self.dense_runs.get(name, 0) >= DENSE_RUN_DROPS_COPY:
                    # Dense push after dense push: keep a sample, not a copy (DENSE_RUN_DROPS_COPY).
                    self.tensors.pop(name, None)
                    self.checksums.pop(name, None)
                    fresh = self._sampled.get(name)
                    sample = fresh if fresh is not None else _sample(tensor.numel()).of(bits_of(tensor)).clone()
                    self.samples[name] = sample.to(self._home(tensor).device)  # a CUDA tensor's: on the host too
                    continue
                self.samples.pop(name, None)
                if name in self._advanced and name in self.tensors:
                    continue  # the comparison made it the pushed tensor already
                patch = patches.get(name)
                kept = self.tensors.get(name)
                if patch is not None and kept is not None:
                    if patch.encoding == XOR:  # made from a host copy: XOR it in, O(changed)
                        patch_kernels.apply_patch(patch.data, kept, patch.count, tensor=name)
                    else:
                        itemsize = tensor.element_size()
                        values = patch.data[patch.data.numel() - patch.count * itemsize:]
                        assert patch.positions is not None
                        apply_patch(kept, DecodedPatch(patch.positions.to(kept.device), values.to(kept.device)))
                    self.checksums[name] = patch.checksum
                else:
                    home = self._home(tensor)
                    if kept is None or kept.shape != tensor.shape or kept.device != home.device:
                        kept = self.tensors[name] = home.empty(tensor.shape, tensor.dtype)
                    # From the device into pinned memory: queued, and waited for below.
                    kept.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
                    self.checksums.pop(name, None)
                cuda_devices.update(t.device for t in (kept, tensor) if t.is_cuda)
            for device in cuda_devices:
                # The copies are asynchronous (into pinned host memory too): every one of them is done
                # before the copy is claimed, or read by the host (the next comparison, a patch's apply).
                torch.cuda.current_stream(device).synchronize()
            self.layout = layout
            self._sampled = {}
            self._advanced = set()

    def _home(self, tensor: torch.Tensor) -> _Home:
        place = kept_copy(tensor.device.type, tensor.numel() * tensor.element_size(),
                          read_span(tensor) * tensor.element_size(), host_copy=self.host_copy)
        return _Home(tensor.device if place.home == "device" else torch.device("cpu"), place.home == "pinned host")

    def _keep_view(self, name: str, tensor: torch.Tensor) -> None:
        """Keep a repeating view as the storage it reads (a copy of that much), with its strides."""
        home, kept = self._home(tensor), self.views.get(name)
        if (kept is None or kept.device != home.device or kept.dtype != tensor.dtype
                or read_span(kept) != read_span(tensor)):
            storage = home.empty((read_span(tensor),), tensor.dtype)
        else:
            storage = kept.as_strided((read_span(kept),), (1,), 0)  # its allocation, reused
        storage.copy_(tensor.detach().as_strided(storage.shape, (1,), tensor.storage_offset()),
                      non_blocking=tensor.is_cuda)  # waited for with the others (_take)
        self.views[name] = storage.as_strided(tensor.shape, tensor.stride(), 0)

    def drop(self) -> None:
        """No copy at all (delta=False, or an iterator that is never held whole): its memory is freed."""
        self._settle()
        self.tensors, self.checksums, self.layout, self.claims = {}, {}, (), False
        self.views = {}
        self.dense_runs, self.samples, self._sampled, self._rekeep = {}, {}, {}, {}
        self._advanced = set()

    def forget(self) -> None:
        """A push failed: whatever the servers hold now, the copy claims none of it (the next push
        goes dense and establishes it again)."""
        self._settle()
        self._sampled = {}
        self._advanced = set()
        self.claims = False

    def base_refused(self) -> None:
        """A server refused this push's base at Begin (its record forgets its generation): the copy
        still claims the others', but this push's fresh samples are not kept."""
        self._settle()
        self._sampled = {}
