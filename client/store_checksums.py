"""Each server's checksums of its committed tensors, as verify() and adopt_base() read them.

A server answers for its one store. A name it lacks is left out of its answer (verify reports
it as a mismatch) rather than failing the call, and a name outside its `--tensors` subset is
in `not_stored` (not its to hold: neither a mismatch nor a reason to refuse its base). A
server that a push of ours gave up on may still be aborting that update when it is asked
(STORE_UPDATING): that is waited out, within the client's timeout.
"""

from __future__ import annotations

import asyncio
import re
import time

from weightsync.client.errors import WeightSyncRpcError
from weightsync.client.push import UNSETTLED_RETRY_SECONDS
from weightsync.client.server_state import ServerState
from weightsync.client.servers import ServerSet
from weightsync.client.types import TensorMismatch
from weightsync.v1 import weight_sync_service_pb2 as pb


async def fetch_checksums(servers: ServerSet, server: ServerState,
                          request: pb.GetTensorChecksumsRequest) -> pb.GetTensorChecksumsResponse:
    """The server's checksums of the named tensors (see the module docstring)."""
    try:
        return await _settled(servers, server, request)
    except WeightSyncRpcError as error:
        if error.reason != "TENSOR_NOT_FOUND":
            raise
    answer = await _settled(servers, server, pb.GetTensorChecksumsRequest())
    held = {t.name for t in answer.tensors}
    wanted = set(request.names)
    kept = [t for t in answer.tensors if t.name in wanted]
    del answer.tensors[:]
    answer.tensors.extend(kept)
    # The refusal named only some absent names: those outside its subset are not missing.
    answer.not_stored[:] = await _outside_subset(servers, server, [n for n in request.names if n not in held])
    return answer


def mismatches(server: ServerState, answer: pb.GetTensorChecksumsResponse, local: dict[str, int]) -> list[TensorMismatch]:
    remote = {t.name: t.checksum.value for t in answer.tensors}
    not_stored = set(answer.not_stored)
    return [TensorMismatch(server.address, name, value, remote.get(name))
            for name, value in local.items() if name not in not_stored and remote.get(name) != value]


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


async def _settled(servers: ServerSet, server: ServerState,
                   request: pb.GetTensorChecksumsRequest) -> pb.GetTensorChecksumsResponse:
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
