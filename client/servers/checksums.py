"""Each server's checksums of its committed tensors, as verify() and adopt_base() read them.

A server answers for its one store. A name it lacks is left out of its answer (verify reports
it as a mismatch) rather than failing the call, and a name outside its `--tensors` subset is
in `not_stored` (not its to hold: neither a mismatch nor a reason to refuse its base), unless
the server vouches for nothing (not_its_to_hold: the one rule, for verify() of a whole process's
tensors and of a part rank's, client/parts/verify.py). A server that a push of ours gave up on
may still be aborting that update when it is asked (STORE_UPDATING): that is waited out, within
the client's timeout (settled_checksums).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Collection

from weightsync.client.channels.server_set import ServerSet
from weightsync.client.errors import WeightSyncRpcError
from weightsync.client.servers.records import UNSETTLED_RETRY_SECONDS, ServerState
from weightsync.client.types import TensorMismatch
from weightsync.v1 import weight_sync_service_pb2 as pb


async def fetch_checksums(servers: ServerSet, server: ServerState,
                          request: pb.GetTensorChecksumsRequest) -> pb.GetTensorChecksumsResponse:
    """The server's checksums of the named tensors (see the module docstring)."""
    try:
        return await settled_checksums(servers, server, request)
    except WeightSyncRpcError as error:
        if error.reason != "TENSOR_NOT_FOUND":
            raise
    answer = await settled_checksums(servers, server, pb.GetTensorChecksumsRequest())
    held = {t.name for t in answer.tensors}
    wanted = set(request.names)
    kept = [t for t in answer.tensors if t.name in wanted]
    del answer.tensors[:]
    answer.tensors.extend(kept)
    # The refusal named only some absent names: those outside its subset are not missing.
    answer.not_stored[:] = await _outside_subset(servers, server, [n for n in request.names if n not in held])
    return answer


def not_its_to_hold(answer: pb.GetTensorChecksumsResponse, asked: Collection[str], *, share: bool) -> frozenset[str]:
    """The names of `asked` that this server does not hold by design, so neither missing nor mismatched
    there: those its answer lists in not_stored (outside its --tensors subset). None when it vouches for
    nothing: it stores none of `asked` (a non-empty set) and either `asked` is what a whole process holds
    (share False: its pattern matches none of the model's names) or its store holds nothing at all
    (share True, a part rank's share, which may lie wholly outside a node's subset, as a pipeline stage
    does; a node that holds nothing holds none of its subset either). Every name not returned is checked
    there, remote None where the server has no checksum of it."""
    not_stored = frozenset(answer.not_stored) & frozenset(asked)
    if asked and len(not_stored) == len(set(asked)) and (
            not share or answer.store_state == pb.STORE_STATE_EMPTY):
        return frozenset()
    return not_stored


def mismatches(server: ServerState, answer: pb.GetTensorChecksumsResponse, local: dict[str, int]) -> list[TensorMismatch]:
    """What the server's answer does not confirm of a whole process's `local` checksums (not_its_to_hold)."""
    remote = {t.name: t.checksum.value for t in answer.tensors}
    outside = not_its_to_hold(answer, local.keys(), share=False)
    return [TensorMismatch(server.address, name, value, remote.get(name))
            for name, value in local.items() if name not in outside and remote.get(name) != value]


def holds(answer: pb.GetTensorChecksumsResponse, local: dict[str, int]) -> bool:
    """The server's committed store, CONSISTENT, holds exactly these tensors (its part of them)."""
    if answer.store_state != pb.STORE_STATE_CONSISTENT:
        return False
    not_stored = set(answer.not_stored)
    return {t.name: t.checksum.value for t in answer.tensors} == {
        name: value for name, value in local.items() if name not in not_stored}


async def _outside_subset(servers: ServerSet, server: ServerState, absent: list[str]) -> list[str]:
    """Which of these names (none in the server's store) are outside its --tensors subset."""
    info = await servers.unary(server.server, "GetServerInfo", pb.GetServerInfoRequest(), servers.timeout)
    if not info.store.tensor_filter:
        return []
    subset = re.compile(info.store.tensor_filter)
    return sorted(n for n in absent if subset.search(n) is None)


async def settled_checksums(servers: ServerSet, server: ServerState,
                            request: pb.GetTensorChecksumsRequest) -> pb.GetTensorChecksumsResponse:
    """The server's answer to `request`, a STORE_UPDATING refusal waited out while a push of ours it
    may still be aborting is unsettled there (within the client's timeout)."""
    timeout = max(servers.timeout, 300)
    deadline = time.monotonic() + servers.timeout
    while True:
        try:
            answer = await servers.unary(server.server, "GetTensorChecksums", request, timeout)
        except WeightSyncRpcError as error:
            if error.reason != "STORE_UPDATING" or not server.unsettled or time.monotonic() > deadline:
                raise
            await asyncio.sleep(UNSETTLED_RETRY_SECONDS)
            continue
        server.settled()  # it answered a read with no update running: nothing of ours is left there
        return answer


__all__ = ["fetch_checksums", "holds", "mismatches", "not_its_to_hold", "settled_checksums"]
