"""A trainer in its own process, for tests that kill it (run by faultkit.TrainerProcess).

It creates a group with one server, commits version "v1" (model seed 1), begins
"v2" (seed 2), broadcasts bucket 0, and then stops where --stop says, printing one
JSON line per step on stdout:

  --stop mid-bucket     announces bucket 1 and never broadcasts it: the workers
                        sit inside the broadcast when the test kills us.
  --stop before-commit  broadcasts every bucket and never commits: the
                        collective is idle, only the UpdateWeights stream is open.

Then it sleeps until killed.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import queue
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: helpers, models

from weightsync.common.checksum import tensor_checksum  # noqa: E402
from weightsync.common.collective import bucket_tail  # noqa: E402
from weightsync.v1 import weight_sync_service_pb2 as pb  # noqa: E402

from helpers import PlainTrainer, ServerProcess, pack, plan_buckets  # noqa: E402
from models import mixed_model  # noqa: E402

MODES = {"staged": pb.UPDATE_MODE_STAGED, "in_place": pb.UPDATE_MODE_IN_PLACE}
BUCKET_BYTES = 1 << 20


class Stream:
    """helpers.UpdateStream, plus: it knows when gRPC has written a message.

    gRPC asks the request iterator for message k+1 only once message k's send
    completed (it is on the socket), so the test can kill us knowing the server
    has the bucket_start, and the workers are (about to be) inside the broadcast.
    """

    def __init__(self, stub) -> None:
        self._requests: queue.Queue = queue.Queue()
        self._written = 0
        self._condition = threading.Condition()
        self._responses = stub.UpdateWeights(self._iterate(), timeout=600)

    def _iterate(self):
        while (request := self._requests.get()) is not None:
            yield request
            with self._condition:  # resumed: the previous message was written
                self._written += 1
                self._condition.notify_all()

    def send(self, **kwargs) -> None:
        self._requests.put(pb.UpdateWeightsRequest(**kwargs))

    def wait_written(self, count: int, timeout: float = 30.0) -> None:
        with self._condition:
            if not self._condition.wait_for(lambda: self._written >= count, timeout):
                raise TimeoutError(f"gRPC wrote {self._written} of {count} messages")

    def recv(self) -> pb.UpdateWeightsResponse:
        return next(self._responses)


def emit(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--group-id", required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--mode", choices=sorted(MODES), required=True)
    parser.add_argument("--stop", choices=("mid-bucket", "before-commit"), required=True)
    parser.add_argument("--seeds", default="1,2")
    args = parser.parse_args()
    try:  # die with the test process, never outlive it
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)
    except OSError:
        pass

    host, _, port = args.address.rpartition(":")
    server = ServerProcess(process=None, port=int(port), log_path=Path("/dev/null"))  # only .stub() is used
    workers = len(server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=30).workers)
    trainer = PlainTrainer([server], group_id=args.group_id, timeout=args.timeout)
    trainer.create_group(workers_per_server=workers)
    emit("group", group_id=args.group_id)

    mode = MODES[args.mode]
    seed1, seed2 = (int(s) for s in args.seeds.split(","))
    committed = trainer.push(mixed_model(seed1), "v1", mode=mode, bucket_bytes=BUCKET_BYTES)
    emit("committed", version=committed.version.version, generation=committed.version.generation)

    v2 = mixed_model(seed2)
    plan = plan_buckets(list(v2.items()), BUCKET_BYTES)
    stream = Stream(server.stub())
    stream.send(begin=pb.BeginUpdate(group_id=args.group_id, version="v2", plan=plan, mode=mode,
                                     transport=pb.TRANSPORT_COLLECTIVE))
    ready = stream.recv().ready
    trainer.expect(ready)
    emit("ready", update_id=ready.update_id, buckets=len(plan.buckets))
    last = 1 if args.stop == "mid-bucket" else len(plan.buckets)
    for index in range(last):
        buf = pack(plan, v2, index)
        stream.send(bucket_start=pb.BucketStart(sequence=index, checksum=tensor_checksum(buf), tail=bucket_tail(buf)))
        trainer.send_bucket(buf, index)
        response = stream.recv()
        assert response.WhichOneof("message") == "bucket_applied", response
        emit("applied", sequence=index, tensors=[t.name for t in plan.buckets[index].tensors])
    if args.stop == "mid-bucket":
        stream.send(bucket_start=pb.BucketStart(sequence=1, tail=bucket_tail(pack(plan, v2, 1))))
        stream.wait_written(3)  # begin, bucket_start 0, bucket_start 1
        emit("announced", sequence=1)
    else:
        emit("all_applied")
    while True:  # until SIGKILL
        time.sleep(60)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as error:  # noqa: BLE001 - reported to the test, which fails on it
        emit("error", error=f"{type(error).__name__}: {error}")
        raise
