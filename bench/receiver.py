"""A baseline receiver: one process, like one inference worker, for raw/concat/per_tensor.

    python -m bench.receiver --store-host H --store-port P --group G --rank R --world-size W

Joins a plain ProcessGroupGloo (PrefixStore over the trainer's TCPStore), opens
a control socket and publishes its port in the store, then serves requests of
the trainer (bench/baselines.py), one at a time:

  setup       allocate the workload's parameters (one tensor each, zero-filled so
              touched) and/or one preallocated, touched raw buffer;
  raw         answer "armed", receive every bucket into its slice of the raw
              buffer (one broadcast after another), answer "done";
  p2p         the same with point-to-point recv from rank 0 (tag = bucket index),
              the raw limit of a Gloo node that receives each bucket once;
  bucket      (concat) fresh torch.empty buffer, receive, unpack by slicing and
              copy_ into the parameters, then answer;
  tensor      (per_tensor) fresh torch.empty of the tensor's shape, receive,
              copy_ into the parameter, then answer;
  digest      (untimed) WS64 of the parameters and of the raw buffer, to check
              every mode delivered the bytes;
  free, quit.

Threads: one torch intra-op thread by default (--threads). With torch's default
(one per core) every copy_ of more than 32K elements wakes an OpenMP team; on
this 2-core machine, shared with the trainer and the other receiver, that wake-up
costs several ms per copy and would make concat/per_tensor look slower than the
patterns are. One thread per receiver keeps the baselines at their best.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import socket
import sys

import torch
from torch.distributed import BroadcastOptions, PrefixStore, ProcessGroupGloo, TCPStore

from bench import control

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "uint8": torch.uint8}


def make_group(store: TCPStore, group: str, rank: int, world_size: int, timeout: datetime.timedelta) -> ProcessGroupGloo:
    options = ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return ProcessGroupGloo(PrefixStore(f"bench/{group}", store), rank, world_size, options)


def broadcast(pg: ProcessGroupGloo, tensor: torch.Tensor, timeout: datetime.timedelta) -> None:
    options = BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    options.timeout = timeout
    pg.broadcast([tensor], options).wait(timeout)


class Receiver:
    def __init__(self, pg: ProcessGroupGloo, timeout: datetime.timedelta) -> None:
        self.pg = pg
        self.timeout = timeout
        self.params: dict[str, torch.Tensor] = {}
        self.raw: torch.Tensor | None = None

    def handle(self, message: dict, conn: socket.socket) -> bool:
        op = message["op"]
        if op == "setup":
            self.params = {}
            self.raw = None
            dtype = DTYPES[message.get("dtype", "bfloat16")]
            for name, shape in message.get("tensors", []):
                self.params[name] = torch.zeros(shape, dtype=dtype)  # zero-filled: pages touched
            if message.get("raw_bytes"):
                self.raw = torch.zeros(message["raw_bytes"], dtype=torch.uint8)
            control.send(conn, {"ok": True, "pid": os.getpid()})
        elif op == "raw":
            assert self.raw is not None, "setup raw_bytes first"
            control.send(conn, {"armed": True})
            for offset, size in message["buckets"]:
                broadcast(self.pg, self.raw[offset : offset + size], self.timeout)
            control.send(conn, {"done": True})
        elif op == "p2p":
            assert self.raw is not None, "setup raw_bytes first"
            control.send(conn, {"armed": True})
            for tag, (offset, size) in enumerate(message["buckets"]):
                self.pg.recv([self.raw[offset : offset + size]], 0, tag).wait(self.timeout)
            control.send(conn, {"done": True})
        elif op == "bucket":
            # The pattern under test: a fresh receive buffer per bucket, unpack by slicing.
            dtype = DTYPES[message["dtype"]]
            shapes = message["shapes"]
            numels = [math.prod(s) for s in shapes]
            buffer = torch.empty(sum(numels), dtype=dtype)
            broadcast(self.pg, buffer, self.timeout)
            offset = 0
            for name, shape, n in zip(message["names"], shapes, numels, strict=True):
                self.params[name].copy_(buffer[offset : offset + n].view(shape))
                offset += n
            del buffer
            control.send(conn, {"ok": True})
        elif op == "tensor":
            buffer = torch.empty(message["shape"], dtype=DTYPES[message["dtype"]])
            broadcast(self.pg, buffer, self.timeout)
            self.params[message["name"]].copy_(buffer)
            control.send(conn, {"ok": True})
        elif op == "digest":
            # Untimed check that the modes really delivered the bytes: WS64 of every
            # parameter, summed, and WS64 of the raw buffer's first raw_bytes.
            from weightsync.common.checksum import ws64

            params = sum(ws64(t) for t in self.params.values()) % (1 << 64)
            raw = ws64(self.raw[: message["raw_bytes"]]) if self.raw is not None and message.get("raw_bytes") else None
            control.send(conn, {"params": str(params), "raw": None if raw is None else str(raw)})
        elif op == "free":
            self.params = {}
            self.raw = None
            control.send(conn, {"ok": True})
        elif op == "quit":
            control.send(conn, {"ok": True})
            return False
        else:
            control.send(conn, {"error": f"unknown op {op!r}"})
        return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.receiver")
    parser.add_argument("--store-host", default="127.0.0.1")
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    timeout = datetime.timedelta(seconds=args.timeout)
    store = TCPStore(args.store_host, args.store_port, None, False, timeout, wait_for_workers=False)
    listener = socket.create_server(("127.0.0.1", 0))
    store.set(f"bench/{args.group}/control/{args.rank}", str(listener.getsockname()[1]))
    pg = make_group(store, args.group, args.rank, args.world_size, timeout)
    listener.settimeout(args.timeout)
    conn, _ = listener.accept()
    listener.close()
    conn.settimeout(None)
    control.tune(conn)
    receiver = Receiver(pg, timeout)
    try:
        while receiver.handle(control.recv(conn), conn):
            pass
    except ConnectionError:
        return 1
    finally:
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
