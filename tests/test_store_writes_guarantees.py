"""SHM at the copy limit (issue 45) keeps every guarantee the slots gave: a trainer on the server's host writes
its buckets straight into the node store (client/transports/store_writes.py), and

- a trainer process SIGKILLed halfway through writing a tensor into the store leaves the committed version
  bit for bit under STAGED (it wrote the shadows), and under IN_PLACE the store INCONSISTENT, as
  docs/data-plane.md says, even when no bucket was announced yet (every placed bucket counts as written from
  Ready on);
- a second trainer process on the node is refused (UPDATE_IN_PROGRESS) while the first writes the store, and
  pushes once the first committed;
- a byte that changes in the store after the trainer summed it (a small tensor's group, a segment's padding)
  fails the owner's check before commit (DATA_LOSS BUCKET_CHECKSUM_MISMATCH);
- the trainer copies each byte once and reads back only what it copied in small groups (its checksum is
  summed in the copy), and the owner's check of a large piece runs over threads.

Each failure is followed by the next push and a verify. (tests/test_shm_writes.py has the placement rules,
the counted passes in every process, and the in-process variants of these failures.)
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from store_writes_trainer import BUCKET_BYTES, model

from weightsync.client import UpdateFailed, WeightSyncClient
from weightsync.client.buckets.planning import build_plan
from weightsync.client.transports import store_writes
from weightsync.client.transports.store_writes import SMALL_TENSOR_BYTES, gaps
from weightsync.common import ws64_host
from weightsync.common.checksum import to_proto
from weightsync.common.errors import DataLoss
from weightsync.gpu_worker import bucket_checks
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import local_checksums, server_checksums, start_server, wait_for

pytestmark = pytest.mark.timeout(300)
TRAINER = Path(__file__).with_name("store_writes_trainer.py")
SLOT = 16 << 20
MASK = (1 << 64) - 1
PUSH_SECONDS = 120
"""What one push of model() and a trainer process's start may take on a loaded host, at most."""


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("store-writes"), "--ingress-slot-bytes", str(SLOT), workers=1)
    yield server
    assert server.stop() == 0, server.log()[-3000:]


@pytest.fixture(scope="module")
def client(node):
    with WeightSyncClient(node.address) as client:
        yield client


def push(client: WeightSyncClient, seed: int, mode: str = "in_place", **options):
    return client.push(model(seed), version=f"v{seed}", transport="shm", mode=mode, delta=False,
                       bucket_size_bytes=BUCKET_BYTES, **options)


def committed(client: WeightSyncClient, seed: int) -> dict[str, torch.Tensor]:
    """model(seed) committed STAGED, allowed to define the store: every later push of model() is placed in it."""
    push(client, seed, "staged", allow_new_tensors=True)
    return model(seed)


def store_state(node) -> int:
    return node.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=30).store_state


def holds(node, tensors: dict[str, torch.Tensor]) -> None:
    """The store is CONSISTENT and holds `tensors` bit for bit."""
    assert pb.StoreState.Name(store_state(node)) == "STORE_STATE_CONSISTENT"
    assert server_checksums(node, sorted(tensors)) == [local_checksums(tensors)]


def next_push_verifies(node, client: WeightSyncClient, seed: int, mode: str) -> None:
    result = push(client, seed, mode)
    assert result.bucket_count == bucket_count()
    assert client.verify(model(seed)).ok
    holds(node, model(seed))


def bucket_count() -> int:
    return len(build_plan(list(model(0).items()), BUCKET_BYTES, zero_copy_min_bytes=0))


def read_line(process: subprocess.Popen, timeout: float) -> str:
    """The next line the trainer process prints, waiting at most `timeout` (it must be alive to print it)."""
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    assert ready, f"the trainer printed nothing in {timeout:g} s"
    return process.stdout.readline().strip()


# -- a trainer killed while it writes the store --------------------------------------------------------
@pytest.mark.parametrize("mode", ["staged", "in_place"])
@pytest.mark.parametrize("at", ["first", "last"])
def test_a_trainer_sigkilled_while_writing_the_store(node, client, mode, at):
    """SIGKILLed halfway through a tensor in the first bucket (nothing announced yet) or the last one (the others
    announced and applied). STAGED: the committed version bit for bit. IN_PLACE: INCONSISTENT either way, the
    store's live bytes may hold any of it. Then a full push, verified."""
    kept = committed(client, 10)
    bucket = 0 if at == "first" else bucket_count() - 1
    trainer = subprocess.Popen([sys.executable, str(TRAINER), "stall", node.address, mode, "11", str(bucket)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        said = read_line(trainer, PUSH_SECONDS).split()
        assert said[0] == "writing" and all(int(arena) > 0 for arena in said[1:]), said  # the store, not a slot
        os.kill(trainer.pid, signal.SIGKILL)
        assert trainer.wait(timeout=PUSH_SECONDS) == -signal.SIGKILL
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    wait_for(lambda: store_state(node) != pb.STORE_STATE_UPDATING, timeout=PUSH_SECONDS)
    if mode == "staged":
        holds(node, kept)
    else:
        assert pb.StoreState.Name(store_state(node)) == "STORE_STATE_INCONSISTENT"
    next_push_verifies(node, client, 12, mode)


# -- a second trainer on the node ----------------------------------------------------------------------
def test_a_second_trainer_process_is_refused_while_the_first_writes_the_store(node, client):
    """Another process on the host pushes while this one is between its buckets, which it writes into the store:
    refused, FAILED_PRECONDITION UPDATE_IN_PROGRESS; this one commits what it wrote; the other then pushes."""
    committed(client, 30)
    second = subprocess.Popen([sys.executable, str(TRAINER), "serve", node.address], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    answers: list[str] = []
    wrote_store: list[bool] = []
    real_write = store_writes.StoreWriter.write

    def write(self, sequence, spec, source, regions):
        wrote_store.append(all(r.arena_id != store_writes.INGRESS for r in regions))
        return real_write(self, sequence, spec, source, regions)

    def progress(report) -> None:
        if report.bucket == 1 and not answers:
            second.stdin.write("32\n")
            second.stdin.flush()
            answers.append(read_line(second, PUSH_SECONDS))

    try:
        assert read_line(second, PUSH_SECONDS) == "ready"
        store_writes.StoreWriter.write = write
        try:
            push(client, 31, progress=progress)
        finally:
            store_writes.StoreWriter.write = real_write
        assert answers == ["refused FAILED_PRECONDITION UPDATE_IN_PROGRESS"]
        assert wrote_store and all(wrote_store), "the first trainer wrote a bucket into a slot"
        holds(node, model(31))
        second.stdin.write("33\n")
        second.stdin.flush()
        assert read_line(second, PUSH_SECONDS) == "committed"
        second.stdin.close()
        assert second.wait(timeout=PUSH_SECONDS) == 0
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()
    assert client.verify(model(33)).ok
    holds(node, model(33))


# -- a byte changed after the trainer summed it ------------------------------------------------------
def flip_in_a_small_group(monkeypatch) -> list[int]:
    """The first group of small tensors written into the store (summed from its place right after one call
    copied it) gets a byte changed right after its sum."""
    real_terms, real_write = store_writes.ws64_terms, store_writes.StoreWriter.write
    in_store: list[bool] = []
    flipped: list[int] = []

    def write(self, sequence, spec, source, regions):
        in_store[:] = [all(r.arena_id != store_writes.INGRESS for r in regions)]
        return real_write(self, sequence, spec, source, regions)

    def summed(data, first_word=0):
        terms = real_terms(data, first_word)
        if not flipped and in_store == [True] and data.size:
            data[data.size // 2] ^= 0x40
            flipped.append(data.size)
        return terms

    monkeypatch.setattr(store_writes.StoreWriter, "write", write)
    monkeypatch.setattr(store_writes, "ws64_terms", summed)
    return flipped


def flip_in_the_padding(monkeypatch) -> list[int]:
    """The first bucket with padding between its tensors (written as zeros, summed as zeros) gets a padding byte
    set once the bucket was written, before it is announced."""
    real = store_writes.StoreWriter.write
    flipped: list[int] = []

    def write(self, sequence, spec, source, regions):
        done = real(self, sequence, spec, source, regions)
        padding = gaps(regions, [(t.offset_bytes, t.size_bytes) for t in spec.tensors])
        if not flipped and padding and all(r.arena_id != store_writes.INGRESS for r in regions):
            start, length = padding[0]
            self.mappings.place(regions, start + length // 2, 1)[0][0] = 0x5A
            flipped.append(sequence)
        return done

    monkeypatch.setattr(store_writes.StoreWriter, "write", write)
    return flipped


@pytest.mark.parametrize("mode", ["staged", "in_place"])
@pytest.mark.parametrize("flip", [flip_in_a_small_group, flip_in_the_padding], ids=["small-group", "padding"])
def test_a_byte_changed_in_the_store_after_it_was_summed_fails_the_owners_check(node, client, monkeypatch,
                                                                                  mode, flip):
    kept = committed(client, 20)
    flipped = flip(monkeypatch)
    with pytest.raises(UpdateFailed) as caught:
        push(client, 21, mode)
    monkeypatch.undo()
    assert flipped, "nothing was changed: the push wrote no such bytes"
    assert (caught.value.code, caught.value.reason) == (grpc.StatusCode.DATA_LOSS, "BUCKET_CHECKSUM_MISMATCH")
    if mode == "staged":
        holds(node, kept)
    else:
        assert pb.StoreState.Name(store_state(node)) == "STORE_STATE_INCONSISTENT"
    next_push_verifies(node, client, 22, mode)


# -- one pass over each byte in the trainer, the owner's check over threads -----------------------------
def test_the_trainer_copies_each_byte_once_and_reads_back_only_its_small_groups(node, client, monkeypatch):
    """Counted at the trainer's kernels: each tensor byte goes through exactly one copy, every tensor of at
    least SMALL_TENSOR_BYTES through the copy that sums it as it goes (common/ws64_host.copy_ws64_terms);
    the only bytes read back are those of small tensors copied by groups (and their padding)."""
    committed(client, 40)
    counted = {"fused": 0, "grouped": 0, "read": 0}
    real_fused, real_terms, real_foreach = store_writes.copy_ws64_terms, store_writes.ws64_terms, torch._foreach_copy_

    def fused(dst, src, first_word=0):
        counted["fused"] += src.nbytes
        return real_fused(dst, src, first_word)

    def terms(data, first_word=0):
        counted["read"] += data.nbytes
        return real_terms(data, first_word)

    def grouped(dst, src):
        counted["grouped"] += sum(t.numel() * t.element_size() for t in src)
        return real_foreach(dst, src)

    monkeypatch.setattr(store_writes, "copy_ws64_terms", fused)
    monkeypatch.setattr(store_writes, "ws64_terms", terms)
    monkeypatch.setattr(torch, "_foreach_copy_", grouped)
    tensors = model(41)
    push(client, 41)
    monkeypatch.undo()
    tensor_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    planned = build_plan(list(tensors.items()), BUCKET_BYTES, zero_copy_min_bytes=0)
    large = sum(t.size_bytes for b in planned for t in b.spec.tensors if t.size_bytes >= SMALL_TENSOR_BYTES)
    bucket_bytes = sum(b.spec.size_bytes for b in planned)
    assert counted["fused"] + counted["grouped"] == tensor_bytes
    assert counted["fused"] >= large > tensor_bytes * 0.9
    assert 0 < counted["read"] <= bucket_bytes - large
    assert client.verify(tensors).ok
    holds(node, tensors)


def test_the_owners_check_of_a_large_piece_runs_over_threads(monkeypatch):
    """A piece of at least two SPLIT_BYTES is summed in chunks by the check's thread pool, and the sum is the
    bucket's WS64: a good piece passes, the same piece with one byte changed in its last chunk does not."""
    monkeypatch.setattr(bucket_checks, "CHECK_THREADS", 4)
    size = 4 * ws64_host.SPLIT_BYTES + 13
    data = torch.from_numpy(np.random.default_rng(45).integers(0, 256, size, dtype=np.uint8))
    checksum = to_proto((size + ws64_host.ws64_terms(data.numpy(), 0)) & MASK)
    threads: list[str] = []
    real_split = ws64_host.ws64_terms_split

    def split(array, first_word, run, chunk_bytes=ws64_host.SPLIT_BYTES):
        def recorded(fn, chunks, firsts):
            def one(chunk, first):
                threads.append(threading.current_thread().name)
                return fn(chunk, first)
            return run(one, chunks, firsts)
        return real_split(array, first_word, recorded, chunk_bytes)

    monkeypatch.setattr(ws64_host, "ws64_terms_split", split)
    bucket_checks.verify_in_store(0, [], [(0, data)], size, checksum)
    assert len(threads) >= 4 and not any(name == threading.main_thread().name for name in threads), threads
    data[size - 3] ^= 1
    with pytest.raises(DataLoss) as caught:
        bucket_checks.verify_in_store(0, [], [(0, data)], size, checksum)
    assert caught.value.reason == "BUCKET_CHECKSUM_MISMATCH"
