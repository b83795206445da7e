"""The raw INLINE limit: the bytes of a model as one plain gRPC client stream into a preallocated buffer.

    python -m bench.raw_grpc PORT_FILE BYTES [--aio]     (the sink; RawInline starts it)

The sender cuts a preallocated buffer into messages of at most `chunk` bytes, each an 8-byte
offset and the bytes (one copy into each message, as the SDK's encode_bucket_chunk makes), on a
grpcio channel; the sink, a process of its own, copies each message into its preallocated,
touched buffer. The sink is grpcio's sync server (a thread pool), or with --aio a grpc.aio server
(weightsync's server is one): bench/node_store.py times both. A call with no message answers the
WS64 of the sink's buffer (the untimed check).
"""

from __future__ import annotations

import argparse
import os
import struct
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import torch

from bench.servers import REPO

_RAW_METHOD = "/bench.RawSink/Push"
_LIMIT = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


def _sink_main(port_file: str, size: int, aio: bool) -> int:
    """The sink: grpcio's sync server (threads), or grpc.aio (weightsync's server is an aio one)."""
    import asyncio

    import grpc

    buffer = torch.zeros(size, dtype=torch.uint8)  # preallocated, touched
    view = memoryview(buffer.numpy())

    def take(message: bytes) -> int:
        offset = struct.unpack_from("<Q", message)[0]
        view[offset : offset + len(message) - 8] = memoryview(message)[8:]
        return len(message) - 8

    def answer(received: int) -> bytes:
        if received == 0:  # the digest call, untimed
            from weightsync.common.checksum import ws64
            return str(ws64(buffer)).encode()
        return str(received).encode()

    def push(requests, context) -> bytes:  # noqa: ARG001
        return answer(sum(take(message) for message in requests))

    async def push_aio(requests, context) -> bytes:  # noqa: ARG001
        return answer(sum([take(message) async for message in requests]))

    handler = grpc.method_handlers_generic_handler("bench.RawSink", {
        "Push": grpc.stream_unary_rpc_method_handler(push_aio if aio else push)})

    async def serve() -> None:
        server = grpc.aio.server(options=_LIMIT, handlers=[handler])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        Path(port_file).write_text(str(port))
        await server.wait_for_termination()

    if aio:
        asyncio.run(serve())
        return 0
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=_LIMIT, handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    Path(port_file).write_text(str(port))
    server.wait_for_termination()
    return 0


class RawInline:
    """The sink process and a channel to it."""

    def __init__(self, workdir: Path, size: int, aio: bool = False) -> None:
        import grpc

        port_file = workdir / f"raw-sink-{os.getpid()}-{time.monotonic_ns()}.port"
        self.process = subprocess.Popen([sys.executable, "-m", "bench.raw_grpc", str(port_file), str(size),
                                         *(["--aio"] if aio else [])], cwd=REPO)
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the raw gRPC sink did not start")
            time.sleep(0.05)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{int(port_file.read_text())}", options=_LIMIT)
        self.call = self.channel.stream_unary(_RAW_METHOD)

    def push(self, source: torch.Tensor, sizes: list[int], chunk: int) -> float:
        view = memoryview(source.numpy())

        def messages():
            base = 0
            for size in sizes:
                for offset in range(0, size, chunk):
                    end = min(size, offset + chunk)
                    yield b"".join((struct.pack("<Q", base + offset), view[base + offset : base + end]))
                base += size

        started = time.perf_counter()
        received = int(self.call(messages(), timeout=600))
        elapsed = time.perf_counter() - started
        if received != sum(sizes):
            raise RuntimeError(f"raw inline: the sink took {received} of {sum(sizes)} bytes")
        return elapsed

    def digest(self) -> int:
        return int(self.call(iter(()), timeout=600))

    def close(self) -> None:
        self.channel.close()
        self.process.terminate()
        self.process.wait(30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.raw_grpc", description=__doc__.splitlines()[0])
    parser.add_argument("port_file")
    parser.add_argument("bytes", type=int)
    parser.add_argument("--aio", action="store_true")
    args = parser.parse_args(argv)
    return _sink_main(args.port_file, args.bytes, args.aio)


if __name__ == "__main__":
    sys.exit(main())
