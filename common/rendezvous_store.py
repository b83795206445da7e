"""The rendezvous's store and the address peers reach this process at (a transfer group's rendezvous, both sides)."""

from __future__ import annotations

import datetime
import socket
import time

from torch.distributed import TCPStore


class RendezvousTimeout(RuntimeError):
    """Not every rank joined before the deadline."""


def local_address_towards(host: str, port: int) -> str:
    """The local IP address that routes to host: the one peers can reach us at."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))  # UDP connect sends nothing
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds an IPv4 address (None if none does)."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _index, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(probe.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def connect_store(host: str, port: int, timeout: datetime.timedelta) -> TCPStore:
    """Connect to the trainer's TCPStore as a client, within timeout.

    torch's TCPStore client retries a refused connection for its whole timeout,
    then backs off and tries again: an unreachable store took 2-3x the timeout.
    Waiting for the port with plain sockets first keeps the whole connect
    inside the deadline.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    last: OSError | None = None
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            with socket.create_connection((host, port), timeout=min(1.0, remaining)):
                break
        except OSError as error:
            last = error
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
    else:
        raise RendezvousTimeout(f"could not reach the TCPStore at {host}:{port}: {last}")
    remaining = datetime.timedelta(seconds=max(1.0, deadline - time.monotonic()))
    try:
        return TCPStore(host, port, None, False, remaining, wait_for_workers=False)
    except (RuntimeError, ValueError) as error:  # DistNetworkError is a RuntimeError
        raise RendezvousTimeout(f"could not connect to the TCPStore at {host}:{port}: {error}") from error


def host_store(host: str, timeout: datetime.timedelta, port: int = 0) -> TCPStore:
    """Open a TCPStore server (the trainer's side) on `port`, or a free one."""
    return TCPStore(host, port, None, True, timeout, wait_for_workers=False)
