"""Raw UpdateWeights streams for the parts suites (no SDK): a whole INLINE update, a stream's refusal, the
server's current generation."""

from __future__ import annotations

import grpc
import pytest
import torch

from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import UpdateStream, error_info, local_checksums, pack, plan_buckets, server_checksums


def generation(server) -> int:
    return server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).current_version.generation


def commit_buckets(stream: UpdateStream, plan, tensors: dict[str, torch.Tensor]) -> pb.UpdateWeightsResponse:
    """After ready: every bucket INLINE in one chunk, each applied, then commit; the committed response."""
    for k in range(len(plan.buckets)):
        data = pack(plan, tensors, k).numpy().tobytes()
        stream.send(bucket_start=pb.BucketStart(sequence=k, size_bytes=len(data)))
        stream.send(bucket_chunk=pb.BucketChunk(sequence=k, offset_bytes=0, data=data))
        assert stream.recv().WhichOneof("message") == "bucket_applied"
    stream.send(commit=pb.CommitUpdate())
    committed = stream.recv()
    stream.close()
    assert committed.WhichOneof("message") == "committed", committed
    return committed


def push_whole(server, tensors: dict[str, torch.Tensor], version: str) -> int:
    """One whole update (no part), STAGED, verified against the store's checksums: its generation."""
    plan = plan_buckets(list(tensors.items()), 1 << 20)
    stream = UpdateStream(server.stub())
    stream.send(begin=pb.BeginUpdate(version=version, plan=plan, mode=pb.UPDATE_MODE_STAGED,
                                     transport=pb.TRANSPORT_INLINE, allow_new_tensors=True))
    assert stream.recv().WhichOneof("message") == "ready"
    committed = commit_buckets(stream, plan, tensors)
    assert server_checksums(server) == [local_checksums(tensors)]
    return committed.committed.version.generation


def refused(stream: UpdateStream) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    """How the stream ended: its status code, ErrorInfo reason and metadata."""
    with pytest.raises(grpc.RpcError) as caught:
        response = stream.recv()
        pytest.fail(f"expected the stream to end with a refusal, got {response}")
    stream.close()
    info = error_info(caught.value)
    return caught.value.code(), info.reason, dict(info.metadata)


def refused_past_keepalives(stream: UpdateStream) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    """How the stream ended (its status code, ErrorInfo reason and metadata), past its keepalives and its
    `aborting` (answered with an abort: the status follows)."""
    try:
        while (answer := stream.recv()).WhichOneof("message") == "waiting":
            pass
    except grpc.RpcError as error:
        stream.close()
        info = error_info(error)
        return error.code(), info.reason, dict(info.metadata)
    assert answer.WhichOneof("message") == "aborting", answer
    stream.send(abort=pb.AbortUpdate(reason="told it is aborting"))
    return refused(stream)
