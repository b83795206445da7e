"""A userspace Ethernet switch that delays and drops frames: netem for kernels without sch_netem.

Run inside the switch namespace (netns.Mesh does it) with the ports the bridge let go of:

    python linkemu.py --ports p-trainer,p-node-a,p-node-b --delay-ms 5 --loss-pct 0.1

Each port is read with an AF_PACKET socket. A frame arriving on a port is dropped with
probability loss-pct %, else held for delay-ms and then sent out of the port its destination
MAC was learnt on (flooded to the other ports while unknown, and for broadcast/multicast). So
every frame crosses one impaired hop: one-way delay delay-ms, round trip 2 x delay-ms, as with
`tc qdisc add dev eth0 root netem delay 5ms loss 0.1%` on every endpoint.

Like netem, it works on whole frames: a TSO/GSO super-frame (the veths keep their offloads) is
received, delayed, dropped or forwarded as one, carried with its virtio-net header
(PACKET_VNET_HDR) so the kernel segments and checksums it on the far side.

A port that is down (a cut link) makes sends fail: those frames are dropped. Prints "ready"
once every port is bound; on SIGTERM prints "stats {json}" and exits 0. Only frames that arrive
on the named ports are ever sent, and only out of those ports.
"""

from __future__ import annotations

import argparse
import errno
import heapq
import json
import random
import select
import signal
import socket
import sys
import time

ETH_P_ALL = 0x0003
PACKET_VNET_HDR = 15
PACKET_OUTGOING = 4
VNET_HDR_LEN = 10
SOL_PACKET = 263
MAX_FRAME = 1 << 18  # 64 KiB GSO frames, with room to spare
SOCKET_BUFFER = 32 << 20
DRAIN_PER_WAKEUP = 256


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ports", required=True)
    parser.add_argument("--delay-ms", type=float, default=5.0)
    parser.add_argument("--loss-pct", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    delay = args.delay_ms / 1000.0
    loss = args.loss_pct / 100.0
    rng = random.Random(args.seed)

    ports = [p for p in args.ports.split(",") if p]
    sockets: list[socket.socket] = []
    for port in ports:
        sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
        for option in (33, 32):  # SO_RCVBUFFORCE, SO_SNDBUFFORCE (root): no drops at the socket
            try:
                sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
            except OSError:
                pass
        sock.bind((port, ETH_P_ALL))
        sockets.append(sock)
    index_of = {sock.fileno(): i for i, sock in enumerate(sockets)}

    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    stats = {"received": 0, "dropped_loss": 0, "forwarded": 0, "flooded": 0, "send_failed": 0, "bytes": 0}
    learned: dict[bytes, int] = {}
    pending: list[tuple[float, int, int, bytes]] = []  # (due, sequence, in-port, vnet header + frame)
    sequence = 0
    buffer = bytearray(MAX_FRAME)
    view = memoryview(buffer)
    poller = select.poll()
    for sock in sockets:
        poller.register(sock.fileno(), select.POLLIN)
    print("ready", flush=True)

    def send(out: int, frame: bytes) -> None:
        try:
            sockets[out].send(frame)
            stats["forwarded"] += 1
        except OSError as error:  # ENETDOWN/ENXIO: the port is down (a cut link)
            stats["send_failed"] += 1
            if error.errno not in (errno.ENETDOWN, errno.ENXIO, errno.ENOBUFS, errno.EAGAIN, errno.EMSGSIZE):
                raise

    while not stopping:
        now = time.monotonic()
        wait_ms = 200 if not pending else max(0, int((pending[0][0] - now) * 1000))
        try:
            events = poller.poll(wait_ms)
        except InterruptedError:
            continue
        for fd, _ in events:
            sock = sockets[index_of[fd]]
            for _ in range(DRAIN_PER_WAKEUP):
                try:
                    size, address = sock.recvfrom_into(buffer, 0, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                except OSError as error:
                    if error.errno in (errno.ENETDOWN, errno.ENXIO):
                        break
                    raise
                if address[2] == PACKET_OUTGOING:  # our own sends, seen again
                    continue
                stats["received"] += 1
                if size < VNET_HDR_LEN + 14:
                    continue
                if rng.random() < loss:
                    stats["dropped_loss"] += 1
                    continue
                sequence += 1
                heapq.heappush(pending, (time.monotonic() + delay, sequence, index_of[fd], bytes(view[:size])))
        now = time.monotonic()
        while pending and pending[0][0] <= now:
            _, _, source, frame = heapq.heappop(pending)
            stats["bytes"] += len(frame) - VNET_HDR_LEN
            destination = frame[VNET_HDR_LEN:VNET_HDR_LEN + 6]
            learned[frame[VNET_HDR_LEN + 6:VNET_HDR_LEN + 12]] = source
            out = None if destination[0] & 1 else learned.get(destination)
            if out is None:
                stats["flooded"] += 1
                for other in range(len(sockets)):
                    if other != source:
                        send(other, frame)
            elif out != source:
                send(out, frame)
    for sock in sockets:
        sock.close()
    print("stats " + json.dumps(stats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
