"""Push(delta=...): only what changed moves, on every transport, bit-exact after every
step; a server that does not hold the base gets the update dense, alone (INLINE) or with the whole
group (COLLECTIVE). Every failure is followed by the next push and a verify."""

from __future__ import annotations

import threading

import pytest
import torch

from weightsync.client import UpdateFailed, WeightSyncClient
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import (
    error_reason,
    local_checksums,
    plan_buckets,
    server_checksums,
    start_server,
    start_servers,
)

pytestmark = pytest.mark.timeout(300)


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(2048, 128, generator=g).to(torch.bfloat16),
        "layers.0.w": torch.randn(256, 256, generator=g).to(torch.bfloat16),
        "layers.0.b": torch.randn(256, generator=g),
        "norm": torch.ones(128, dtype=torch.bfloat16),
        "step": torch.zeros(1, dtype=torch.int64),
    }


def sparse_step(named: dict[str, torch.Tensor], seed: int, fraction: float = 0.002) -> dict[str, torch.Tensor]:
    """A new model: `fraction` of the elements of the weight matrices changed, the rest bit-identical
    (well below where delta="auto" stops comparing host tensors: client/delta/policy.py)."""
    g = torch.Generator().manual_seed(seed)
    new = {n: t.clone() for n, t in named.items()}
    for name in ("embed", "layers.0.w"):
        flat = new[name].view(-1)
        picks = torch.randperm(flat.numel(), generator=g)[: max(1, int(flat.numel() * fraction))]
        flat[picks] = torch.randn(picks.numel(), generator=g).to(flat.dtype)
    new["step"] += 1
    return new


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory):
    """Two servers shared by the tests that push model()'s tensors: each test's client is new (no kept
    base: its first push goes dense and allows new tensors), so an earlier test's versions change
    nothing a later one checks; each test ends on a verified push."""
    servers = start_servers([tmp_path_factory.mktemp("a"), tmp_path_factory.mktemp("b")], workers=1)
    yield servers
    for server in servers:
        assert server.stop() == 0, server.log()[-2000:]


@pytest.fixture
def fresh_servers(tmp_path):
    """Two servers of a test's own, for tests whose tensors are not model()'s: the store would keep
    the other tests' tensors beside them."""
    servers = start_servers([tmp_path / "a", tmp_path / "b"], workers=1)
    yield servers
    for server in servers:
        assert server.stop() == 0, server.log()[-2000:]


@pytest.fixture(autouse=True)
def _dirs(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()


def assert_held(servers, named) -> None:
    for server in servers:
        assert server_checksums(server) == [local_checksums(named)]


@pytest.mark.parametrize("transport", ["inline", "collective"])
def test_twenty_sparse_steps_on_two_servers_bit_exact_after_each(two_servers, transport):
    with WeightSyncClient([s.address for s in two_servers], timeout=60) as client:
        if transport == "collective":
            client.create_group(timeout=30)
        current = model()
        first = client.push(current, version="v0", transport=transport, allow_new_tensors=True, delta="auto")
        assert first.bytes_sent >= first.dense_bytes  # nothing to compare with: dense
        for step in range(1, 21):
            current = sparse_step(current, seed=step)
            mode = "staged" if step % 2 else "in_place"
            result = client.push(current, version=f"v{step}", transport=transport, mode=mode, delta="auto")
            assert result.bytes_sent < 0.1 * result.dense_bytes, (step, result.bytes_sent, result.dense_bytes)
            assert client.verify(current).ok
            assert_held(two_servers, current)


def test_a_server_without_the_base_gets_it_dense_while_the_other_gets_a_patch(two_servers):
    a, b = two_servers
    with WeightSyncClient([a.address, b.address], timeout=60) as client:
        current = model()
        client.push(current, version="v0", transport="inline", allow_new_tensors=True, delta="auto")
        # Someone else moves server b on: this client's base is no longer what b holds.
        with WeightSyncClient(b.address, timeout=60) as other:
            other.push(model(99), version="other", transport="inline", delta=False)
        current = sparse_step(current, seed=1)
        result = client.push(current, version="v1", transport="inline", delta="auto")
        by_server = {o.server: o for o in result.servers}
        dense = sum(t.numel() * t.element_size() for t in current.values())
        assert by_server[a.address].size_bytes < 0.1 * dense  # a: the patch
        assert by_server[b.address].size_bytes >= dense  # b refused the base (BASE_MISMATCH): dense
        assert client.verify(current).ok
        assert_held(two_servers, current)
        current = sparse_step(current, seed=2)  # both hold the base again: both get the patch
        result = client.push(current, version="v2", transport="inline", delta="auto")
        assert all(o.size_bytes < 0.1 * dense for o in result.servers)
        assert_held(two_servers, current)


def test_collective_sends_the_whole_group_dense_when_one_server_lacks_the_base(two_servers):
    a, b = two_servers
    with WeightSyncClient([a.address, b.address], timeout=60) as client:
        client.create_group(timeout=30)
        current = model()
        client.push(current, version="v0", allow_new_tensors=True, delta="auto")
        with WeightSyncClient(b.address, timeout=60) as other:
            other.push(model(98), version="other", transport="inline", delta=False)
        current = sparse_step(current, seed=3)
        result = client.push(current, version="v1", delta="auto")
        assert result.bytes_sent >= result.dense_bytes  # one plan for the whole group: dense
        assert_held(two_servers, current)
        current = sparse_step(current, seed=4)
        assert client.push(current, version="v2", delta="auto").bytes_sent < 0.1 * result.dense_bytes
        assert_held(two_servers, current)


def test_a_failed_patched_push_leaves_the_base_and_the_next_push_is_exact(two_servers):
    a, _ = two_servers
    with WeightSyncClient(a.address, timeout=60) as client:
        base = model()
        client.push(base, version="v0", transport="inline", allow_new_tensors=True, delta="auto")
        step = sparse_step(base, seed=5)

        def give_up(report) -> None:
            raise RuntimeError("trainer gives up")

        with pytest.raises(RuntimeError):
            client.push(step, version="aborted", transport="inline", mode="staged", progress=give_up, delta="auto")
        assert server_checksums(a) == [local_checksums(base)]  # STAGED: the base, bit for bit
        result = client.push(step, version="v1", transport="inline", delta="auto")
        assert result.bytes_sent >= result.dense_bytes  # the kept copy was dropped: dense once
        assert client.verify(step).ok
        nxt = sparse_step(step, seed=6)
        assert client.push(nxt, version="v2", transport="inline", delta="auto").bytes_sent < 0.1 * result.dense_bytes
        assert server_checksums(a) == [local_checksums(nxt)]


def test_raw_bits_count_and_unchanged_tensors_are_not_sent(two_servers):
    a, _ = two_servers
    with WeightSyncClient(a.address, timeout=60) as client:
        base = model()
        base["layers.0.b"][:] = 0.0
        client.push(base, version="v0", transport="inline", allow_new_tensors=True, delta="auto")
        signed = {n: t.clone() for n, t in base.items()}
        signed["layers.0.b"][:10] = -0.0  # equal as numbers, different bits
        result = client.push(signed, version="v1", transport="inline", delta=True)
        assert result.bytes_sent < 2048  # one small patch (or the one small tensor), nothing else
        assert server_checksums(a) == [local_checksums(signed)]
        info = client.server_info()[0]
        assert info.current_version.version == "v1"


def test_delta_false_and_auto_at_half_changed_send_dense(two_servers):
    a, _ = two_servers
    with WeightSyncClient(a.address, timeout=60) as client:
        current = model()
        client.push(current, version="v0", transport="inline", allow_new_tensors=True, delta="auto")
        current = sparse_step(current, seed=7)
        off = client.push(current, version="v1", transport="inline", delta=False)
        assert off.bytes_sent >= off.dense_bytes
        client.push(current, version="v1b", transport="inline", delta="auto")  # re-establish the kept copy
        half = sparse_step(current, seed=8, fraction=0.5)
        auto = client.push(half, version="v2", transport="inline", delta="auto")
        assert auto.bytes_sent >= 0.5 * auto.dense_bytes  # patches would not pay: dense where changed
        assert server_checksums(a) == [local_checksums(half)]


def test_a_refused_push_keeps_nothing_stale(two_servers):
    """UpdateFailed at Begin for another reason: the next push still verifies."""
    a, _ = two_servers
    with WeightSyncClient(a.address, timeout=60) as client:
        current = model()
        client.push(current, version="v0", transport="inline", allow_new_tensors=True, delta="auto")
        bigger = dict(current, extra=torch.ones(10))
        with pytest.raises(UpdateFailed) as caught:
            client.push(bigger, version="bad", transport="inline", delta="auto")  # a new name, not allowed
        assert caught.value.reason == "TENSOR_UNKNOWN"
        current = sparse_step(current, seed=9)
        client.push(current, version="v1", transport="inline", delta="auto")
        assert server_checksums(a) == [local_checksums(current)]
        assert a.stub().GetServerInfo(pb.GetServerInfoRequest()).current_version.version == "v1"


STRIDED_VIEWS = {
    "every_third": lambda big: big.view(-1)[::3],
    "every_other_column": lambda big: big[:, ::2],
    "expanded_row": lambda big: big[7:8].expand(64, 300),
    "transposed": lambda big: big.t(),
}


@pytest.mark.parametrize("view", sorted(STRIDED_VIEWS))
@pytest.mark.parametrize("delta", [True, "auto"])
def test_strided_and_expanded_tensors_go_as_a_patch_or_dense(fresh_servers, view, delta):
    """A model of views that cannot be read as 64-bit words in place (the SDK raised an untyped
    RuntimeError on the second push, and on every later one)."""
    a = fresh_servers[0]
    make = STRIDED_VIEWS[view]
    big = torch.randn(512, 300, generator=torch.Generator().manual_seed(3))
    with WeightSyncClient(a.address, timeout=60) as client:
        client.push({"w": make(big)}, version="v0", transport="inline", allow_new_tensors=True, delta=delta)
        for step in range(1, 4):
            big.view(-1)[torch.arange(step, big.numel(), 997)] += 1.0
            current = {"w": make(big)}
            result = client.push(current, version=f"v{step}", transport="inline", delta=delta)
            assert result.bytes_sent <= result.dense_bytes
            assert client.verify(current).ok
            assert server_checksums(a) == [local_checksums({"w": current["w"].contiguous()})]
        if delta is True and view != "expanded_row":
            assert result.bytes_sent < 0.5 * result.dense_bytes  # a patch, not the dense fallback


@pytest.mark.parametrize("mode", ["staged", "in_place"])
def test_a_base_from_before_a_server_restart_is_refused_before_any_byte_moves(tmp_path, mode):
    """Generations count again in a restarted server's new store: generation 1 there is not the
    generation 1 client A committed before. A's patch must be BASE_MISMATCH at Begin (the SDK then
    sends it dense), not a checksum failure at commit that leaves an IN_PLACE store torn."""
    (tmp_path / "c").mkdir()
    first = start_server(tmp_path / "a", workers=1)
    address = first.address
    with WeightSyncClient(address, timeout=60) as a:
        v0 = model(0)
        a.push(v0, version="a0", transport="inline", allow_new_tensors=True, delta=True)
        assert first.stop() == 0
        second = start_server(tmp_path / "c", "--listen", address, workers=1)
        try:
            with WeightSyncClient(address, timeout=60) as b:
                b.push(model(9), version="b0", transport="inline", allow_new_tensors=True)
                assert b.server_info()[0].current_version.generation == 1  # the number A's base names
            v1 = sparse_step(v0, seed=1)
            result = a.push(v1, version="a1", transport="inline", mode=mode, delta=True)
            assert result.bytes_sent >= result.dense_bytes  # refused as a base, sent dense
            info = a.server_info()[0]
            assert (info.store_state, info.current_version.version, info.current_version.generation) == (
                pb.STORE_STATE_CONSISTENT, "a1", 2)
            assert a.verify(v1).ok
            v2 = sparse_step(v1, seed=2)
            patched = a.push(v2, version="a2", transport="inline", mode=mode, delta=True)
            assert patched.bytes_sent < 0.1 * patched.dense_bytes  # the new store is a base now
            assert a.verify(v2).ok
        finally:
            assert second.stop() == 0, second.log()[-2000:]


def test_a_base_without_its_store_epoch_is_refused(two_servers):
    import grpc

    from weightsync.v1 import weight_sync_service_pb2_grpc as pb_grpc

    a = two_servers[0]
    with WeightSyncClient(a.address, timeout=60) as client:
        client.push(model(0), version="v0", transport="inline", allow_new_tensors=True)
        generation = client.server_info()[0].current_version.generation
    stub = pb_grpc.WeightSyncServiceStub(grpc.insecure_channel(a.address))
    plan = plan_buckets([("norm", model(0)["norm"])], 1 << 20)
    begin = pb.BeginUpdate(version="v1", mode=pb.UPDATE_MODE_STAGED, transport=pb.TRANSPORT_INLINE,
                           base_generation=generation, plan=plan)
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.UpdateWeights(iter([pb.UpdateWeightsRequest(begin=begin)]), timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_reason(refused.value) == "BASE_EPOCH_MISSING"
    with WeightSyncClient(a.address, timeout=60) as client:
        assert client.verify(model(0)).ok


def random_step(named: dict[str, torch.Tensor], seed: int) -> tuple[dict[str, torch.Tensor], float]:
    """1-5% of every weight's elements get new random values (all their bytes move)."""
    g = torch.Generator().manual_seed(seed)
    fraction = 0.01 + 0.04 * float(torch.rand(1, generator=g))
    new = {n: t.clone() for n, t in named.items()}
    for name in ("embed", "layers.0.w", "layers.0.b"):
        flat = new[name].view(-1)
        picks = torch.randperm(flat.numel(), generator=g)[: max(1, int(flat.numel() * fraction))]
        flat[picks] = torch.randn(picks.numel(), generator=g).to(flat.dtype)
    return new, fraction


@pytest.mark.parametrize("transport", ["inline", "collective"])
def test_twenty_random_steps_at_one_to_five_percent_on_two_servers_bit_exact_after_each(two_servers, transport):
    """Ten steps as patches wherever smaller (delta=True), then ten with the default (auto, which
    sends what pays), STAGED and IN_PLACE: after every step both servers hold the trainer's bits."""
    with WeightSyncClient([s.address for s in two_servers], timeout=60) as client:
        if transport == "collective":
            client.create_group(timeout=30)
        current = model()
        client.push(current, version="v0", transport=transport, allow_new_tensors=True, delta=True)
        for step in range(1, 21):
            current, fraction = random_step(current, seed=100 + step)
            options = {"delta": True} if step <= 10 else {}
            result = client.push(current, version=f"v{step}", transport=transport,
                                 mode="staged" if step % 3 else "in_place", **options)
            if step <= 10:
                assert result.bytes_sent < 0.5 * result.dense_bytes, (step, fraction)
            assert client.verify(current).ok
            assert_held(two_servers, current)


def test_two_trainers_alternating_on_one_server_never_patch_against_the_others_base(two_servers):
    """Each trainer's kept copy is its own last commit; the other's commit in between makes the
    server refuse that base (BASE_MISMATCH, before any byte moves) and the push goes dense. With
    the same model on both sides the bytes would line up by chance: the models differ."""
    a, _ = two_servers
    with WeightSyncClient(a.address, timeout=60) as first, WeightSyncClient(a.address, timeout=60) as second:
        lines = {"first": model(1), "second": model(2)}
        first.push(lines["first"], version="first-0", transport="inline", allow_new_tensors=True)
        second.push(lines["second"], version="second-0", transport="inline")
        for step in range(1, 7):
            for name, client in (("first", first), ("second", second)):
                lines[name] = sparse_step(lines[name], seed=10 * step + len(name))
                result = client.push(lines[name], version=f"{name}-{step}", transport="inline")
                assert result.bytes_sent >= result.dense_bytes, (name, step)  # never a patch: dense
                assert server_checksums(a) == [local_checksums(lines[name])]
                info = client.server_info()[0]
                assert info.current_version.version == f"{name}-{step}"
        # Once the other stops, the next push of the same trainer goes as patches again.
        lines["second"] = sparse_step(lines["second"], seed=99)
        second.push(lines["second"], version="second-again", transport="inline")
        lines["second"] = sparse_step(lines["second"], seed=100)
        result = second.push(lines["second"], version="second-patched", transport="inline")
        assert result.bytes_sent < 0.1 * result.dense_bytes
        assert server_checksums(a) == [local_checksums(lines["second"])]


def test_the_default_push_keeps_a_copy_and_sends_a_sparse_step_as_patches(two_servers):
    """delta="auto" is push()'s default; delta=False sends everything and drops the copy."""
    a, _ = two_servers
    with WeightSyncClient(a.address, timeout=60) as client:
        current = model()
        first = client.push(current, version="v0", transport="inline", allow_new_tensors=True)
        assert first.bytes_sent >= first.dense_bytes
        assert client._delta.memory_bytes == first.dense_bytes  # the kept copy: the model's size
        current = sparse_step(current, seed=21)
        result = client.push(current, version="v1", transport="inline")
        assert result.bytes_sent < 0.1 * result.dense_bytes
        current = sparse_step(current, seed=22)
        off = client.push(current, version="v2", transport="inline", delta=False)
        assert off.bytes_sent >= off.dense_bytes
        assert not client._delta.claims and client._delta.memory_bytes == 0  # the copy is freed
        current = sparse_step(current, seed=23)
        again = client.push(current, version="v3", transport="inline")
        assert again.bytes_sent >= again.dense_bytes
        assert server_checksums(a) == [local_checksums(current)]


def test_the_comparison_updates_the_copy_which_claims_the_base_only_once_committed(two_servers, monkeypatch):
    """Host tensors: the comparison itself writes the changes into the kept copy (no pass of its
    own: the refresh started once every server is ready XORs nothing in), and from then on the
    copy claims no server's base until the commit; the push after it patches against it, exactly."""
    from weightsync.client.delta import base as delta_module
    from weightsync.client.delta.base import DeltaBase
    from weightsync.client.push import run as push_module

    a, b = two_servers
    events: list[str] = []
    real_take, real_commit = DeltaBase.take_in_background, push_module.PushRun._commit

    def take(self, named, choice):
        events.append("take patches" if choice is not None and choice.patches else "take whole")
        events.append(f"claims {self.claims}")
        real_take(self, named, choice)
        events.append(f"then claims {self.claims}")

    async def commit(self, streams):
        events.append("commit")
        return await real_commit(self, streams)

    def xor_in(*args, **kwargs):
        if threading.current_thread().name == "weightsync-delta-copy":  # not the kernels' warm-up
            events.append("patch applied to the copy")
        return real_apply(*args, **kwargs)

    real_apply = delta_module.patch_kernels.apply_patch
    monkeypatch.setattr(DeltaBase, "take_in_background", take)
    monkeypatch.setattr(push_module.PushRun, "_commit", commit)
    monkeypatch.setattr(delta_module.patch_kernels, "apply_patch", xor_in)
    with WeightSyncClient([a.address, b.address], timeout=60) as client:
        current = model()
        client.push(current, version="v0", transport="inline", allow_new_tensors=True)
        assert events == ["take whole", "claims False", "then claims False", "commit"]
        events.clear()
        for step in range(3):
            current = sparse_step(current, seed=40 + step)
            result = client.push(current, version=f"v{step + 1}", transport="inline")
            assert result.bytes_sent < 0.1 * result.dense_bytes
            servers = sorted([a.address, b.address])
            assert events == ["take patches", "claims False", "then claims False", "commit"]
            kept = client._delta.tensors
            assert len(kept) >= 2 and all(torch.equal(kept[n], current[n]) for n in kept)
            assert client._delta.claims  # claimed again once committed, at each server's generation
            assert {s.address: s.generation for s in client._fleet.states} == {
                o.server: o.committed for o in result.servers} and sorted(o.server for o in result.servers) == servers
            events.clear()
            assert_held(two_servers, current)
        assert client.verify(current).ok


def test_expanded_views_cost_the_kept_copy_only_their_storage_and_land_bit_for_bit(fresh_servers):
    """delta="auto" (the default) kept a copy of an expand() view's full logical size: 12 GB of views
    over a few bytes got the trainer OOM-killed. The copy now holds what their storages hold: an
    unchanged view is left out, a changed one goes dense, and the servers hold every view's bytes."""
    a, _ = fresh_servers
    bucket = 1 << 20  # the views go as pieces: each piece's elements copied on their own (packing._elements)
    g = torch.Generator().manual_seed(31)
    w = torch.randn(256, 256, generator=g).to(torch.bfloat16)
    row = torch.randn(1, 512, generator=g).to(torch.bfloat16)

    def views(scale: float, w: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"scale": torch.tensor([scale]).expand(1 << 21),  # 8 MiB over 4 bytes
                "pos": row.clone().expand(2048, 512),  # 2 MiB over 1 KiB
                "w": w}

    def held(named: dict[str, torch.Tensor]) -> None:
        assert server_checksums(a) == [local_checksums({n: t.contiguous() for n, t in named.items()})]

    with WeightSyncClient(a.address, timeout=60) as client:
        current = views(1.5, w)
        first = client.push(current, version="v0", transport="inline", bucket_size_bytes=bucket, allow_new_tensors=True)
        assert first.dense_bytes == (1 << 21) * 4 + 2048 * 512 * 2 + w.numel() * 2
        assert client._delta.memory_bytes == 4 + 1024 + w.numel() * 2  # not 10 MiB more
        held(current)
        sparse = w.clone()
        sparse.view(-1)[::997] += 1  # ~0.1% of w
        current = views(1.5, sparse)  # new views over storages of the same bits
        step = client.push(current, version="v1", transport="inline", bucket_size_bytes=bucket)
        assert step.bytes_sent < w.numel() * 2  # w's patch; the views' 10 MiB stay where they are
        held(current)
        assert client.verify(current).ok
        current = views(-1.5, sparse)  # scale's storage changed: dense, the rest left out
        changed = client.push(current, version="v2", transport="inline", bucket_size_bytes=bucket)
        assert (1 << 21) * 4 <= changed.bytes_sent < (1 << 21) * 4 + 2048 * 512 * 2
        assert client._delta.memory_bytes == 4 + 1024 + w.numel() * 2
        held(current)
        sparse = sparse.clone()
        sparse.view(-1)[5::997] -= 1
        current = views(-1.5, sparse)
        client.push(current, version="v3", transport="inline", bucket_size_bytes=bucket)
        held(current)
        assert client.verify(current).ok


def test_a_view_that_repeats_elements_is_sent_in_pieces_each_copied_on_its_own():
    """A dense push made a split view contiguous whole before cutting its pieces: one view of 12 GB over
    a few bytes needed 12 GB on the trainer even with delta=False. Each piece is now its own elements
    (a copy of the piece's size), bit for bit the row-major bytes; other tensors are cut as before."""
    from weightsync.client.buckets import packing
    from weightsync.client.buckets.packing import TensorSource
    from weightsync.client.buckets.planning import piece_ranges
    from weightsync.v1 import tensor_pb2

    g = torch.Generator().manual_seed(32)
    views = {"row": torch.randn(1, 300, generator=g).expand(4096, 300),
             "inner": torch.randn(3, 1, 5, generator=g).to(torch.bfloat16).expand(3, 40000, 5),
             "flags": torch.tensor([True]).expand(1 << 20),
             "transposed_expand": torch.randn(64, 1, generator=g).expand(64, 1000).t()}
    for name, view in views.items():
        source, size = TensorSource({name: view}, None), view.numel() * view.element_size()
        pieces = []
        for start, end in piece_ranges(size, 64 << 10):
            spec = tensor_pb2.TensorSpec(name=name, size_bytes=end - start)
            spec.piece.offset_bytes = start
            piece = source.piece(spec)
            assert piece.untyped_storage().nbytes() == end - start, name  # not the view's logical size
            pieces.append(piece.clone())
        assert torch.equal(torch.cat(pieces), view.contiguous().reshape(-1).view(torch.uint8)), name
    ref = views["inner"].contiguous().reshape(-1)
    for start, end in [(0, 1), (4, 6), (4, 5 * 40000 + 7), (5 * 40000 - 1, 3 * 5 * 40000), (17, 18)]:
        assert torch.equal(packing._elements(views["inner"], start, end), ref[start:end])
    a = torch.randn(512, 300, generator=g)
    source = TensorSource({"t": a.t()}, None)  # not repeating: made contiguous once, its pieces views of that
    spec = tensor_pb2.TensorSpec(name="t", size_bytes=64 << 10)
    spec.piece.offset_bytes = 0
    assert source.piece(spec).untyped_storage().nbytes() == a.numel() * 4
