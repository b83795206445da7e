"""The trainer's kept copy (client/delta/base.py): when auto compares and patches, and how the
copy is refreshed in the background while a push's bytes move, claiming nothing until committed."""

from __future__ import annotations

import pytest
import torch

from weightsync.client.delta import base as delta_module
from weightsync.client.delta import policy as delta_policy
from weightsync.client.delta.base import DeltaBase
from weightsync.client.delta.link_timings import LinkTimings
from weightsync.common import patch_format
from weightsync.common.checksum import ws64
from weightsync.common.patches import XOR


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(512, 256, generator=g).to(torch.bfloat16),
            "b": torch.randn(128, 256, generator=g).to(torch.bfloat16)}


def changed(named: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in named.items():
        new = tensor.clone()
        flat = new.view(-1).view(torch.int16)
        flat[torch.randperm(flat.numel(), generator=g)[: int(flat.numel() * fraction)]] ^= 1
        out[name] = new
    return out


def kept_base(named: dict[str, torch.Tensor]) -> DeltaBase:
    base = DeltaBase()
    base.committed(list(named.items()), None)
    return base


def test_auto_patches_host_tensors_only_where_it_pays_and_skips_the_comparison_elsewhere(monkeypatch):
    before = weights()
    base = kept_base(before)
    compared = []
    real = delta_module.patch_kernels.compare_and_encode
    monkeypatch.setattr(delta_module.patch_kernels, "compare_and_encode",
                        lambda a, b, *args, **kw: compared.append(a.numel()) or real(a, b, *args, **kw))

    sparse = base.choose(list(changed(before, 0.002, seed=1).items()))
    assert set(sparse.patches) == {"a", "b"} and len(compared) == 2

    compared.clear()
    busy = base.choose(list(changed(before, 0.04, seed=2).items()))
    assert not busy.patches and not busy.unchanged
    assert compared == []  # the sample said dense: neither copy was read whole

    compared.clear()
    forced = base.choose(list(changed(before, 0.04, seed=2).items()), auto=False)
    assert set(forced.patches) == {"a", "b"} and len(compared) == 2


def test_auto_keeps_only_a_sample_of_a_tensor_that_goes_dense_push_after_push_until_it_turns_sparse():
    """A tensor auto sent dense (DENSE_RUN_DROPS_COPY pushes in a row) is no longer copied (a memcpy
    per push and its memory, for nothing): only a sample of it is kept. When a push's samples say
    the update would go as patches again, it goes dense once more and is kept whole, and the push
    after sends it as a patch. delta=True keeps every tensor whole."""
    assert delta_module.DENSE_RUN_DROPS_COPY == 1
    current = weights()
    base = kept_base(current)
    kept_after = []
    for push in range(1, 6):
        current = changed(current, 0.3, seed=push)
        named = list(current.items())
        choice = base.choose(named)
        assert not choice.patches
        base.committed(named, choice)
        kept_after.append(sorted(base.tensors))
    assert kept_after == [[], [], [], [], []]  # dense on push 1: not copied, from then on
    assert base.memory_bytes == 0 and sorted(base.samples) == ["a", "b"]
    assert all(s.numel() == delta_module.SAMPLE_ELEMENTS for s in base.samples.values())
    assert base.same_layout(list(current.items()))

    sparse = changed(current, 0.002, seed=98)  # the samples say sparse: dense this time, kept after
    choice = base.choose(list(sparse.items()))
    assert not choice.patches and not choice.unchanged
    base.committed(list(sparse.items()), choice)
    assert sorted(base.tensors) == ["a", "b"] and base.samples == {}
    assert all(torch.equal(base.tensors[n].view(torch.int16), sparse[n].view(torch.int16)) for n in sparse)

    again = changed(sparse, 0.002, seed=99)
    choice = base.choose(list(again.items()))
    assert set(choice.patches) == {"a", "b"}
    assert all(p.checksum == ws64(again[n]) for n, p in choice.patches.items())
    base.committed(list(again.items()), choice)
    assert all(torch.equal(base.tensors[n].view(torch.int16), again[n].view(torch.int16)) for n in again)
    assert base.dense_runs == {"a": 0, "b": 0}

    forced = kept_base(weights())
    current = weights()
    for push in range(1, 4):
        current = changed(current, 0.3, seed=push)
        named = list(current.items())
        forced.committed(named, forced.choose(named, auto=False))
        assert sorted(forced.tensors) == ["a", "b"]


def test_a_patch_carries_the_whole_new_tensors_ws64():
    before = weights()
    base = kept_base(before)
    after = changed(before, 0.002, seed=3)
    choice = base.choose(list(after.items()))
    assert {n: p.checksum for n, p in choice.patches.items()} == {n: ws64(t) for n, t in after.items()}


def test_a_background_take_claims_the_commit_only_once_committed():
    before = weights()
    base = kept_base(before)
    after = changed(before, 0.3, seed=4)
    base.take_in_background(list(after.items()), None)
    assert not base.claims  # while the copy changes it claims no commit
    base.committed(list(after.items()), None)
    assert base.claims
    assert all(torch.equal(base.tensors[n].view(torch.int16), t.view(torch.int16)) for n, t in after.items())


def test_a_push_that_fails_during_a_background_take_leaves_no_claim_and_the_next_push_works():
    before = weights()
    base = kept_base(before)
    base.take_in_background(list(changed(before, 0.3, seed=5).items()), None)
    base.forget()  # what push() does when a run fails: wait for the copy, claim nothing
    assert not base.claims
    after = changed(before, 0.3, seed=6)
    base.committed(list(after.items()), None)
    assert base.claims
    nxt = changed(after, 0.002, seed=7)
    choice = base.choose(list(nxt.items()))
    assert {n: p.checksum for n, p in choice.patches.items()} == {n: ws64(t) for n, t in nxt.items()}


def test_a_failed_background_copy_is_dropped_and_the_next_push_starts_over(monkeypatch):
    before = weights()
    base = kept_base(before)

    def broken(named, choice, written=None):
        raise RuntimeError("out of memory")

    with monkeypatch.context() as patched:
        patched.setattr(base, "_take", broken)
        base.take_in_background(list(before.items()), None)
        base.committed(list(before.items()), None)
    assert not base.claims and base.tensors == {}  # nothing claimed: the next push goes dense
    assert not base.same_layout(list(before.items()))
    base.committed(list(before.items()), None)  # that dense push, committed
    assert base.claims and base.same_layout(list(before.items()))
    nxt = changed(before, 0.002, seed=8)
    assert set(base.choose(list(nxt.items())).patches) == {"a", "b"}


@pytest.mark.parametrize("auto", [True, False])
def test_unchanged_tensors_are_left_out(auto):
    before = weights()
    base = kept_base(before)
    after = dict(before)
    after["b"] = changed({"b": before["b"]}, 0.002, seed=9)["b"]
    choice = base.choose(list(after.items()), auto=auto)
    assert choice.unchanged == {"a"} and set(choice.patches) == {"b"}


def test_auto_sends_the_whole_update_dense_when_the_samples_say_so_comparing_nothing(monkeypatch):
    g = torch.Generator().manual_seed(11)
    before = {"big": torch.randn(1024, 256, generator=g).to(torch.bfloat16),
              "small": torch.randn(128, 256, generator=g).to(torch.bfloat16)}
    base = kept_base(before)
    compared = []
    real = delta_module.patch_kernels.compare_and_encode
    monkeypatch.setattr(delta_module.patch_kernels, "compare_and_encode",
                        lambda a, b, *args, **kw: compared.append(a.numel()) or real(a, b, *args, **kw))
    after = {"big": changed({"big": before["big"]}, 0.04, seed=12)["big"],  # 89% of the bytes: dense
             "small": changed({"small": before["small"]}, 0.002, seed=13)["small"]}
    choice = base.choose(list(after.items()))
    assert not choice.patches and not choice.unchanged and compared == []
    monkeypatch.undo()
    assert set(base.choose(list(after.items()), auto=False).patches) == {"big", "small"}


def test_host_tensors_go_as_patch_xor_byte_for_byte_the_reference():
    """Host tensors are compared by the kernels: the patch is PATCH_XOR, the exact bytes the reference
    encoder writes, about 2.3 bytes per one-ulp change (gaps of one byte, one XOR plane), and its
    checksum is the new tensor's; the kept copy then takes the patch and equals the new tensor."""
    before = weights()
    base = kept_base(before)
    after = changed(before, 0.01, seed=7)
    named = list(after.items())
    choice = base.choose(named, auto=False)
    assert set(choice.patches) == {"a", "b"}
    for name, patch in choice.patches.items():
        reference, count, _ = patch_format.encode(before[name], after[name])
        assert patch.encoding == XOR and patch.count == count
        assert bytes(patch.data.numpy()) == reference
        assert patch.checksum == ws64(after[name])
        assert patch.data.numel() < 2.4 * count
    base.committed(named, choice)
    assert all(torch.equal(base.tensors[n].view(torch.int16), after[n].view(torch.int16)) for n in after)


def test_auto_compares_more_on_a_slower_link_and_never_below_the_loopback_thresholds():
    """The thresholds follow the client's best recent dense push over the push's transport: on
    this machine's loopback (~3.4 GB/s) patches pay below ~2.3% changed, at 1 Gbit/s below ~50%: a
    4% step is dense on the first and patched on the second. Until a transport is timed its
    benchmark-machine figure is assumed; where dense moves faster than ~6.5 GB/s no host patch
    pays, and over SHM auto does not try (LinkTimings.cannot_pay). A dense push smaller than
    DENSE_TIMING_MIN_BYTES times nothing."""
    assert delta_policy.host_worth(None) == delta_policy.host_worth(3.4e9)
    assert 0.021 < delta_policy.host_crossover(None) < 0.024
    assert delta_policy.host_crossover(1.25e8) > 0.5 and delta_policy.auto_dense_above(1.25e8) == 0.8
    assert 0.013 < delta_policy.host_crossover(4.2e9) < 0.015
    assert delta_policy.host_crossover(6.5e9) == 0.0
    before = weights()
    step = changed(before, 0.04, seed=21)
    base, links = kept_base(before), LinkTimings()
    assert links.bytes_per_second("collective") == 3.4e9
    links.dense_push_timed("collective", 1 << 20, 1.0)  # too small to time the link
    assert links.bytes_per_second("collective") == 3.4e9
    assert not base.choose(list(step.items()), link=links.bytes_per_second("collective")).patches  # loopback: dense
    base = kept_base(before)
    links.dense_push_timed("collective", 1 << 30, 8.6)  # 1 GiB in 8.6 s: a 1 Gbit/s link
    assert set(base.choose(list(step.items()), link=links.bytes_per_second("collective")).patches) == {"a", "b"}
    links.dense_push_timed("shm", 1 << 30, 2.0)  # another transport: its own figure, never below the assumed one
    assert links.bytes_per_second("shm") == 4.2e9
    assert not base.choose(list(step.items()), link=links.bytes_per_second("shm")).patches
    assert links.cannot_pay(list(step.items()), "shm")  # over SHM push() neither samples nor keeps a copy
    assert not links.cannot_pay(list(step.items()), "inline")
    links.dense_push_timed("inline", 1 << 30, 0.125)  # 8.6 GB/s: faster than the host's passes over memory
    assert links.cannot_pay(list(step.items()), "inline")
    links.dense_push_timed("collective", 1 << 30, 0.3)  # then a fast one: the best of the recent pushes counts
    assert not base.choose(list(step.items()), link=links.bytes_per_second("collective")).patches


def test_a_patched_push_that_waited_on_a_slow_link_times_it():
    """A client that never timed a dense push learns a slow link from a push of patches that spent
    much of its time waiting on the transport; short waits, small pushes and rates near the
    transport's assumed one (a busy host on loopback) time nothing."""
    before = weights()
    step = changed(before, 0.04, seed=21)
    base, links = kept_base(before), LinkTimings()
    links.link_timed("collective", 12 << 20, 0.02, 0.2)  # waited 10% of the push: says nothing
    links.link_timed("collective", 512 << 10, 0.1, 0.2)  # too small
    links.link_timed("collective", 64 << 20, 0.035, 0.07)  # 1.9 GB/s: not clearly slower than loopback
    assert links.bytes_per_second("collective") == 3.4e9
    assert not base.choose(list(step.items()), link=links.bytes_per_second("collective")).patches
    links.link_timed("collective", 12 << 20, 0.1, 0.15)  # 126 MB/s, most of the push: a 1 Gbit/s link
    assert links.bytes_per_second("collective") == (12 << 20) / 0.1
    assert set(base.choose(list(step.items()), link=links.bytes_per_second("collective")).patches) == {"a", "b"}
    links.link_timed("inline", 12 << 20, 0.1, 0.15)  # another transport's figure is its own
    assert links.bytes_per_second("collective") == (12 << 20) / 0.1
    assert links.dense_throughputs["inline"] == [(12 << 20) / 0.1]


def test_a_tensor_kept_as_a_sample_is_copied_again_only_once_clearly_sparse():
    """Near the crossover a tensor would be copied, compared, found not worth a patch and dropped,
    push after push: it is copied again only when its sample predicts under half the threshold."""
    current = weights()
    base = kept_base(current)
    current = changed(current, 0.3, seed=1)
    base.committed(list(current.items()), base.choose(list(current.items())))
    assert base.tensors == {} and sorted(base.samples) == ["a", "b"]
    near = changed(current, 0.012, seed=2)  # sampled ~1.8% of the bytes: under compare_below, not under half
    choice = base.choose(list(near.items()))
    base.committed(list(near.items()), choice)
    assert base.tensors == {} and base.dense_runs == {"a": 2, "b": 2}
    sparse = changed(near, 0.002, seed=3)
    base.committed(list(sparse.items()), base.choose(list(sparse.items())))
    assert sorted(base.tensors) == ["a", "b"] and base.dense_runs == {"a": 0, "b": 0}


GIB = 1 << 30
KEPT_COPY_TABLE = [
    # device, logical bytes, bytes of storage read, delta_host_copy -> where, storage only, bytes held
    ("cpu", 4096, 4096, True, "host", False, 4096),
    ("cpu", 4096, 4096, False, "host", False, 4096),  # a host tensor's copy is in host memory either way
    ("cpu", 4096, 12288, True, "host", False, 4096),  # a strided slice reads past its elements: kept whole
    ("cpu", 2 * GIB, 4, True, "host", True, 4),  # 2 GiB of expand() over one float32: 4 bytes
    ("cpu", 4096, 4094, True, "host", True, 4094),  # any repeated element: the storage is smaller
    ("cpu", 0, 0, True, "host", False, 0),
    ("cuda", 4096, 4096, True, "pinned host", False, 4096),  # the default: nothing on the trainer's GPU
    ("cuda", 12 * GIB, 12 * GIB, True, "pinned host", False, 12 * GIB),
    ("cuda", 4096, 4096, False, "device", False, 4096),
    ("cuda", 12 * GIB, 4, True, "pinned host", True, 4),
    ("cuda", 12 * GIB, 4, False, "device", True, 4),
    ("xpu", 4096, 4096, True, "host", False, 4096),  # host memory, pinned only where CUDA pins it
    ("xpu", 4096, 4096, False, "device", False, 4096),
]


@pytest.mark.parametrize(("device", "logical", "read", "host_copy", "home", "storage_only", "held"), KEPT_COPY_TABLE)
def test_where_the_kept_copy_lives_and_what_it_holds(device, logical, read, host_copy, home, storage_only, held):
    assert delta_policy.kept_copy(device, logical, read, host_copy=host_copy) == delta_policy.KeptCopy(
        home, storage_only, held)


def test_the_copy_of_device_tensors_is_kept_in_host_memory_by_default():
    import inspect

    from weightsync.client import WeightSyncClient

    assert DeltaBase().host_copy is True
    assert inspect.signature(WeightSyncClient.__init__).parameters["delta_host_copy"].default is True


def test_the_storage_a_view_reads():
    big = torch.zeros(64, 300)
    spans = {
        "contiguous": (big, 64 * 300),
        "expanded scalar": (torch.zeros(1).expand(1 << 20), 1),
        "expanded row": (big[7:8].expand(4096, 300), 300),
        "expanded column": (big[:, 3:4].expand(64, 50), 63 * 300 + 1),
        "transposed": (big.t(), 64 * 300),
        "every third": (big.view(-1)[::3], (64 * 300 - 1) // 3 * 3 + 1),
        "overlapping windows": (big.view(-1).unfold(0, 8, 1), 64 * 300),
        "empty": (big[:0], 0),
    }
    assert {name: delta_module.read_span(t) for name, (t, _) in spans.items()} == {
        name: span for name, (_, span) in spans.items()}
    assert {name for name, (t, _) in spans.items() if delta_module.repeats_elements(t)} == {
        "expanded scalar", "expanded row", "overlapping windows"}


def test_an_expanded_view_keeps_only_the_storage_it_reads_and_goes_unchanged_or_dense():
    """delta="auto" kept a copy of an expand() view's full logical size (2 GiB of views over 4 bytes
    took the trainer from 293 MiB to ~3 GiB; 12 GB of them OOM-killed it). Kept now: the storage it
    reads, with its strides; the next push leaves it out when that storage holds the same bits and
    sends it dense otherwise."""
    big = torch.randn(64, 300, generator=torch.Generator().manual_seed(21))
    w = weights()["a"]
    first = {"bias": torch.tensor([1.5]).expand(1 << 22),  # 16 MiB over 4 bytes
             "row": big[7:8].expand(4096, 300),  # 4.7 MiB over one row (1200 bytes) of a 76.8 KB matrix
             "w": w}
    base = kept_base(first)
    assert base.memory_bytes == 4 + 1200 + w.numel() * 2  # not 21 MiB
    assert {n: t.untyped_storage().nbytes() for n, t in base.views.items()} == {"bias": 4, "row": 1200}
    assert base.views["bias"].stride() == (0,) and base.views["row"].stride() == (0, 1)
    assert all(torch.equal(base.views[n], first[n]) for n in ("bias", "row")) and sorted(base.tensors) == ["w"]

    # Other tensors over storages of the same bits: left out; w sparse: a patch.
    second = {"bias": torch.tensor([1.5]).expand(1 << 22), "row": big.clone()[7:8].expand(4096, 300),
              "w": changed({"w": w}, 0.002, seed=22)["w"]}
    choice = base.choose(list(second.items()))
    assert choice.unchanged == {"bias", "row"} and set(choice.patches) == {"w"}
    base.committed(list(second.items()), choice)

    # -0.0 against 0.0 (raw bits), and the same value over a storage read with other strides: dense.
    zero = {"bias": torch.tensor([0.0]).expand(1 << 22), "row": big[7:8].expand(4096, 300), "w": second["w"]}
    base.committed(list(zero.items()), None)
    third = {"bias": torch.tensor([-0.0]).expand(1 << 22),
             "row": big[7].clone().expand(4096, 300),  # the same bits, strides (0, 1) as before: unchanged
             "w": second["w"]}
    choice = base.choose(list(third.items()), auto=False)
    assert choice.unchanged == {"row", "w"} and not choice.patches  # bias goes dense
    base.committed(list(third.items()), choice)
    assert torch.equal(base.views["bias"].view(torch.int32), third["bias"].view(torch.int32))
    assert base.views["bias"].untyped_storage().nbytes() == 4

    # One element read everywhere: strides (0, 0), its storage 4 bytes; dense (other strides).
    fourth = dict(third, row=torch.full((300,), float(big[7, 0])).as_strided((4096, 300), (0, 0)))
    choice = base.choose(list(fourth.items()), auto=False)
    assert choice.unchanged == {"bias", "w"}
    base.committed(list(fourth.items()), choice)
    assert base.views["row"].stride() == (0, 0) and base.views["row"].untyped_storage().nbytes() == 4
    assert base.memory_bytes == 4 + 4 + w.numel() * 2
    assert torch.equal(base.views["row"], fourth["row"])

    # A view that becomes a whole tensor of the same layout (and back): kept as what it is now.
    fifth = dict(fourth, bias=torch.full((1 << 22,), -0.0))
    base.committed(list(fifth.items()), base.choose(list(fifth.items()), auto=False))
    assert "bias" in base.tensors and "bias" not in base.views
    assert base.memory_bytes == (1 << 22) * 4 + 4 + w.numel() * 2
    choice = base.choose(list(fourth.items()), auto=False)
    assert "bias" not in choice.unchanged and "bias" not in choice.patches  # dense, though the bits match
    base.committed(list(fourth.items()), choice)
    assert "bias" in base.views and "bias" not in base.tensors and base.memory_bytes == 4 + 4 + w.numel() * 2


def test_a_comparison_against_a_copy_on_another_device_goes_in_chunks(monkeypatch):
    """A CUDA tensor whose copy is in host memory is compared against it a piece at a time through one
    staging buffer (shown here with host tensors on both sides): the same changes as one comparison of
    both whole, positions across every piece boundary, and the patch's WS64 that of the new tensor."""
    from weightsync.common.patches import changes_between

    monkeypatch.setattr(delta_module, "HOST_COMPARE_CHUNK_BYTES", 4096)
    before = weights()["a"]  # 256 KiB: 64 pieces
    after = changed({"a": before}, 0.01, seed=23)["a"]
    flat = after.view(-1).view(torch.int16)
    for edge in (0, 2047, 2048, 4095, 4096, flat.numel() - 1):  # either side of piece boundaries
        flat[edge] ^= 4
    whole, pieces = changes_between(before, after), delta_module._changes_across(before, after)
    assert pieces.ws64_delta is None
    assert torch.equal(pieces.positions, whole.positions) and torch.equal(pieces.values, whole.values)
    assert {0, 2047, 2048, 4095, 4096, flat.numel() - 1} <= set(pieces.positions.tolist())
    same = delta_module._changes_across(before, before.clone())
    assert same.positions.numel() == 0 and same.values.numel() == 0
