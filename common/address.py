"""host:port, parsed in one place for the server, the SDK, the CLI and the worker."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Address:
    """A TCP endpoint. `host` is a name, an IPv4 address or a bracket-less IPv6 address."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_address(text: str, *, allow_port_zero: bool = False, what: str = "address") -> Address:
    """Parse "host:port" or "[v6]:port"; ValueError says what is wrong and how to write it."""
    raw = text.strip()
    if "://" in raw:
        scheme = raw.split("://", 1)[0]
        raise ValueError(f"{what} {text!r} has a scheme ({scheme}://): drop it and write host:port")
    host, sep, port = raw.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{what} must be host:port, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"{what} {text!r}: write an IPv6 address in brackets, e.g. [::1]:50051")
    number = int(port)
    if not (0 if allow_port_zero else 1) <= number <= 65535:
        raise ValueError(f"{what} {text!r}: port must be 1..65535")
    return Address(host, number)
