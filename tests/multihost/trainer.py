"""The trainer of the multi-host tests: the SDK, driven one JSON command per stdin line.

Runs inside the trainer's namespace (meshkit.Trainer starts it with `ip netns exec`), so every
address it uses is a routable mesh address. Each command gets exactly one JSON answer line on
stdout (plus "paused" events during a push with pause_at):

  {"op": "info"}                                      -> {"event": "info", "servers": [...]}
  {"op": "create_group", "timeout": 10}               -> {"event": "group", "store_host": ..., ...}
  {"op": "push", "seed": 1, "version": "v1", "mode": "staged", "mb": 4, "transport": "collective",
   "bucket_bytes": 1048576, "pause_at": 2}            -> {"event": "pushed", ...} | {"event": "push_failed", ...}
      transport: "collective" (the group from create_group) or "inline" (inside the gRPC stream).
      rpc_timeout: push from a client of its own with this timeout (INLINE), closed afterwards.
      pause_at=k: after bucket k is on its way, print {"event": "paused"} and wait for a
      {"op": "continue"} line (the test cuts a link meanwhile).
      "pushed" carries bucket_sizes (each bucket's bytes, from the progress callback) and, for
      COLLECTIVE, sent_to: per bucket, the group ranks the SDK sent it to (Gloo: one per server).
  {"op": "verify", "seed": 1, "mb": 4}                -> {"event": "verified", "ok": ..., ...}
  {"op": "checksums"}                                 -> {"event": "checksums", "servers": [...]}
      every server's GetTensorChecksums of its whole store, as it answered (outside the SDK)
  {"op": "delete_group"}                              -> {"event": "deleted"}
  {"op": "delete_group_id", "group_id": "g"}          -> {"event": "deleted_id", "codes": {server: "OK" | code}}
      (a plain DeleteTransferGroup on every server, outside the SDK: cleans up a leftover group)
  {"op": "rtt", "count": 5}                           -> {"event": "rtt", "ms": {server: median ms}}
  {"op": "probe_without_client_cert"}                 -> {"event": "probe", "refused": ..., "code": ...}
  {"op": "quit"}                                      -> {"event": "bye"}, exit 0

A command that raises answers {"event": "error", ...} and the trainer stays up. It dies with
its parent (PR_SET_PDEATHSIG), and exits on end of input.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import signal
import socket
import statistics
import sys
import time
import traceback

import grpc
import torch

from weightsync.client import TlsConfig, WeightSyncClient
from weightsync.client.errors import UpdateFailed, WeightSyncRpcError
from weightsync.client.transports import collective as sinks
from weightsync.common.address import parse_address
from weightsync.common.logging import configure_logging
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.v1 import weight_sync_service_pb2_grpc as pb_grpc

MB = 1 << 20


def emit(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def model(seed: int, mb: float) -> dict[str, torch.Tensor]:
    """About `mb` MB of float32 layers (1 MB each), plus small tensors of other dtypes."""
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {
        "embed.weight": torch.randn(512, 64, generator=g).to(torch.bfloat16),
        "norm.weight": torch.randn(64, generator=g).to(torch.float16),
        "step": torch.tensor(seed, dtype=torch.int64),
    }
    for index in range(max(1, round(mb))):
        tensors[f"layers.{index}.weight"] = torch.randn(512, 512, generator=g)
    return tensors


def server_summary(address: str, info: pb.GetServerInfoResponse) -> dict:
    store = info.store
    return {
        "address": address,
        "store_state": pb.StoreState.Name(info.store_state),
        "version": info.current_version.version,
        "generation": info.current_version.generation,
        "store": {"present": info.HasField("store"), "state": pb.StoreState.Name(store.state),
                  "tensor_count": store.tensor_count, "live_bytes": store.live_bytes, "held_bytes": store.held_bytes},
        "workers": [{"index": w.index, "state": pb.WorkerState.Name(w.state),
                     "store_state": pb.StoreState.Name(w.store_state), "tensors": w.tensor_count,
                     "received_bytes": w.received_bytes, "staging_bytes": w.staging_bytes,
                     "staging_on_device": w.staging_on_device, "restart_count": w.restart_count, "pid": w.pid}
                    for w in info.workers],
        "backends": [pb.Backend.Name(b) for b in info.backends],
        "transports": [pb.Transport.Name(t) for t in info.transports],
        "local_socket": info.local_socket,
    }


class SentTo:
    """Spy on the SDK's choice of receivers (transports/collective.py owner_ranks, what a Gloo push sends each bucket to):
    records, per bucket of the current push, the ranks it was sent to. Behaviour is unchanged."""

    def __init__(self) -> None:
        self.ranks: dict[int, list[int]] = {}
        self._owner_ranks = sinks.owner_ranks
        sinks.owner_ranks = self._record

    def _record(self, streams, index: int) -> list[int]:
        ranks = self._owner_ranks(streams, index)
        self.ranks[index] = list(ranks)
        return ranks

    def take(self) -> list[list[int]]:
        ranks, self.ranks = self.ranks, {}
        return [ranks[k] for k in sorted(ranks)]


def failure_fields(error: BaseException) -> dict:
    code = getattr(error, "code", None)
    return {
        "type": type(error).__name__,
        "code": code.name if isinstance(code, grpc.StatusCode) else str(code),
        "reason": getattr(error, "reason", ""),
        "server": getattr(error, "server", ""),
        "message": str(error)[:2000],
    }


def median_connect_ms(address: str, count: int) -> float:
    """TCP connect time (one round trip: SYN, SYN-ACK) to a server's gRPC port, median of count."""
    target = parse_address(address)
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        with socket.create_connection((target.host, target.port), timeout=5):
            samples.append((time.perf_counter() - started) * 1000)
    return round(statistics.median(samples), 3)


def credentials(args: argparse.Namespace, *, client_cert: bool) -> grpc.ChannelCredentials:
    def read(path: str) -> bytes:
        with open(path, "rb") as handle:
            return handle.read()

    if not client_cert:
        return grpc.ssl_channel_credentials(root_certificates=read(args.ca))
    return grpc.ssl_channel_credentials(root_certificates=read(args.ca), private_key=read(args.key),
                                        certificate_chain=read(args.cert))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--servers", required=True, help="comma-separated host:port")
    parser.add_argument("--ca", required=True)
    parser.add_argument("--cert", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--rpc-timeout", type=float, default=15.0)
    args = parser.parse_args()
    try:  # die with the test process
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)
    except OSError:
        pass

    configure_logging("info", json=True)  # the SDK's logs: JSON lines on stderr (stdout is the protocol)
    servers = args.servers.split(",")
    tls = TlsConfig(ca_cert=args.ca, client_cert=args.cert, client_key=args.key)
    client = WeightSyncClient(servers, tls=tls, timeout=args.rpc_timeout)
    sent_to = SentTo()
    emit("started", servers=servers)

    def read_command() -> dict | None:
        line = sys.stdin.readline()
        return json.loads(line) if line else None

    while (command := read_command()) is not None:
        op = command.get("op")
        try:
            if op == "quit":
                client.close()
                emit("bye")
                return 0
            if op == "info":
                infos = client.server_info()
                emit("info", servers=[server_summary(a, i) for a, i in zip(servers, infos, strict=True)])
            elif op == "groups":
                emit("groups", groups={a: [{"group_id": g.group_id, "state": pb.GroupState.Name(g.state),
                                            "broken_reason": g.broken_reason, "rank_offset": g.rank_offset,
                                            "world_size": g.world_size} for g in gs]
                                       for a, gs in client.list_groups().items()})
            elif op == "create_group":
                started = time.perf_counter()
                group_id = client.create_group(timeout=float(command.get("timeout", 10)), backend="gloo")
                store = getattr(getattr(client, "_group", None), "store", None)  # what the SDK really opened
                emit("group", group_id=group_id, seconds=round(time.perf_counter() - started, 3),
                     store_host=getattr(store, "host", None), store_port=getattr(store, "port", None))
            elif op == "delete_group":
                client.delete_group()
                emit("deleted")
            elif op == "push":
                tensors = model(int(command["seed"]), float(command.get("mb", 4)))
                pause_at = command.get("pause_at")
                sent: list[int] = []  # bytes_sent after each bucket (cumulative)
                sent_to.take()

                def progress(p, pause_at=pause_at, sent=sent) -> None:
                    sent.append(p.bytes_sent)
                    if pause_at is not None and p.bucket == pause_at:
                        emit("paused", bucket=p.bucket, bucket_count=p.bucket_count, bytes_sent=p.bytes_sent)
                        answer = read_command()
                        if not answer or answer.get("op") != "continue":
                            raise RuntimeError(f"expected continue, got {answer}")

                # rpc_timeout: this push from a client of its own with that timeout (no group: INLINE).
                pusher = client
                if command.get("rpc_timeout") is not None:
                    pusher = WeightSyncClient(servers, tls=tls, timeout=float(command["rpc_timeout"]))
                started = time.perf_counter()
                try:
                    result = pusher.push(tensors, version=command["version"], mode=command.get("mode", "staged"),
                                         transport=command.get("transport", "collective"),
                                         bucket_size_bytes=int(command.get("bucket_bytes", MB)), progress=progress)
                except UpdateFailed as error:
                    emit("push_failed", seconds=round(time.perf_counter() - started, 3),
                         group_id=pusher.group_id, **failure_fields(error),
                         cause=failure_fields(error.cause) if error.cause else None)
                    continue
                finally:
                    if pusher is not client:
                        pusher.close()
                emit("pushed", version=result.version, seconds=round(result.seconds, 3), bytes=result.size_bytes,
                     group_id=client.group_id,
                     buckets=result.bucket_count, tensors=result.tensor_count,
                     bucket_sizes=[b - a for a, b in zip([0, *sent], sent, strict=False)], sent_to=sent_to.take(),
                     servers=[{"server": s.server, "version": s.version, "generation": s.generation,
                               "size_bytes": s.size_bytes} for s in result.servers])
            elif op == "verify":
                result = client.verify(model(int(command["seed"]), float(command.get("mb", 4))))
                emit("verified", ok=result.ok, checked=result.checked,
                     mismatches=[{"server": m.server, "name": m.name, "local": m.local, "remote": m.remote}
                                 for m in result.mismatches][:20])
            elif op == "checksums":
                answers = []
                for address in servers:
                    with grpc.secure_channel(address, credentials(args, client_cert=True)) as channel:
                        answer = pb_grpc.WeightSyncServiceStub(channel).GetTensorChecksums(
                            pb.GetTensorChecksumsRequest(), timeout=60)
                    answers.append({
                        "address": address, "version": answer.version.version,
                        "generation": answer.version.generation,
                        "store_state": pb.StoreState.Name(answer.store_state), "workers": len(answer.workers),
                        "tensors": [{"name": t.name, "dtype": tensor_pb2.Dtype.Name(t.dtype), "shape": list(t.shape),
                                     "algorithm": tensor_pb2.ChecksumAlgorithm.Name(t.checksum.algorithm),
                                     "value": t.checksum.value} for t in answer.tensors]})
                emit("checksums", servers=answers)
            elif op == "delete_group_id":
                codes = {}
                for address in servers:
                    with grpc.secure_channel(address, credentials(args, client_cert=True)) as channel:
                        try:
                            pb_grpc.WeightSyncServiceStub(channel).DeleteTransferGroup(
                                pb.DeleteTransferGroupRequest(group_id=command["group_id"]), timeout=10)
                            codes[address] = "OK"
                        except grpc.RpcError as error:
                            codes[address] = error.code().name
                emit("deleted_id", codes=codes)
            elif op == "rtt":
                count = int(command.get("count", 5))
                emit("rtt", ms={address: median_connect_ms(address, count) for address in servers})
            elif op == "probe_without_client_cert":
                results = {}
                for address in servers:  # the server CA is trusted, but no client certificate is sent
                    with grpc.secure_channel(address, credentials(args, client_cert=False)) as channel:
                        try:
                            pb_grpc.WeightSyncServiceStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
                            results[address] = "OK"
                        except grpc.RpcError as error:
                            results[address] = error.code().name
                emit("probe", codes=results)
            else:
                emit("error", op=op, type="ValueError", message=f"unknown op {op!r}")
        except (WeightSyncRpcError, Exception) as error:  # noqa: BLE001 - reported, the driver decides
            emit("error", op=op, **failure_fields(error), traceback=traceback.format_exc()[-2000:])
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
