"""A small multi-host network on one machine: network namespaces, veth pairs, one bridge.

    with Mesh() as mesh:                      # trainer 10.231.0.1, node-a .2, node-b .3
        mesh.popen(mesh.host("node-a"), [...])  # a process inside node-a's namespace
        mesh.impair(delay_ms=5, loss_pct=0.1) # tc netem on every link (or the userspace fallback)
        mesh.clear_impairment()
        mesh.cut("node-b"); mesh.restore("node-b")

Layout (nothing is created in, or sent to, the root namespace):

    <tag>-tr  eth0 10.231.0.1/24 --veth-- p-trainer --+
    <tag>-a   eth0 10.231.0.2/24 --veth-- p-node-a  --+-- br0   (all in <tag>-sw)
    <tag>-b   eth0 10.231.0.3/24 --veth-- p-node-b  --+

Each endpoint also has a decoy interface, eth1 10.231.1.N/24 (a veth whose peer stays in the
same namespace: it leads nowhere), so that "which address does the collective bind" has wrong
answers to avoid. (Where the machine's hostname resolves to 127.0.0.1, as in many images'
/etc/hosts, binding by hostname is the other wrong answer: no other host can reach loopback.)

Every veth is created inside a namespace of ours (`ip -n NS link add ... peer ... netns SW`),
so the host's interfaces, routes and addresses are never touched. Interface names are local to
a namespace, so they are short and fixed; only namespace names are global: `<tag>` is
`wsmh<pid>x<n>`, and a namespace whose owner pid is gone (a crashed run) is removed, with the
processes left in it, before a new mesh is built.

Impairment: `tc qdisc ... netem` on every endpoint's eth0 when the kernel has sch_netem. Where
it does not (CONFIG_NET_SCH_NETEM unset: `tc` answers "Specified qdisc kind is unknown"), the
same impairment is applied by linkemu.py, a userspace switch that takes the bridge's place for
as long as the impairment lasts (see there). `Mesh.impairment_method` says which one ran.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "wsmh"
SUBNET = "10.231.0"
DECOY_SUBNET = "10.231.1"
PREFIX_LEN = 24
IFNAME = "eth0"
BRIDGE = "br0"
LINKEMU = Path(__file__).with_name("linkemu.py")
_counter = itertools.count()
_NAME = re.compile(rf"^{PREFIX}(\d+)x\d+-")


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not root, no CAP_NET_ADMIN, no `ip`)."""


@dataclass(frozen=True)
class Host:
    """One endpoint of the mesh: a namespace with one interface on the shared subnet."""

    role: str
    netns: str
    ip: str
    port: str
    """Its veth peer's name on the switch (inside the switch namespace)."""
    ifname: str = IFNAME


def _run(argv: Sequence[str], *, check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess:
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} -> {result.returncode}: {result.stderr.strip() or result.stdout.strip()}")
    return result


def ns_argv(netns: str, argv: Sequence[str]) -> list[str]:
    """argv run inside a namespace (`ip netns exec` execs it: the pid is the command's own)."""
    return ["ip", "netns", "exec", netns, *argv]


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """preexec_fn: the child gets `sig` when the thread that started it dies (kept across exec)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def list_netns() -> list[str]:
    result = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def netns_pids(netns: str) -> list[int]:
    result = _run(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in result.stdout.split() if p.isdigit()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_netns_processes(netns: str, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL, every process in one of our namespaces (each by its pid)."""
    pids = netns_pids(netns)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + (timeout if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline and (pids := [p for p in netns_pids(netns) if _alive(p)]):
            time.sleep(0.05)
        if not pids:
            return


def remove_stale() -> list[str]:
    """Remove meshes whose creator process is gone (a crashed or killed earlier run).

    Only namespaces named by this module are considered, and a live creator's are left alone
    (another session on this machine may be running the suite right now)."""
    removed = []
    for name in list_netns():
        match = _NAME.match(name)
        if match is None or _alive(int(match.group(1))):
            continue
        kill_netns_processes(name, timeout=5.0)
        _run(["ip", "netns", "del", name], check=False)
        removed.append(name)
    return removed


def check_available() -> None:
    """Raise NetnsUnavailable (with the reason) unless a namespace can be created and removed."""
    if sys.platform != "linux":
        raise NetnsUnavailable(f"network namespaces are Linux only (this is {sys.platform})")
    probe = f"{PREFIX}{os.getpid()}x{next(_counter)}-probe"
    try:
        result = _run(["ip", "netns", "add", probe], check=False)
    except FileNotFoundError:
        raise NetnsUnavailable("the `ip` command (iproute2) is not installed") from None
    if result.returncode != 0:
        raise NetnsUnavailable(
            f"`ip netns add` failed ({result.stderr.strip()}): needs root or CAP_NET_ADMIN + CAP_SYS_ADMIN"
        )
    try:
        veth = _run(["ip", "-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1"], check=False)
        if veth.returncode != 0:
            raise NetnsUnavailable(f"cannot create a veth pair in a namespace: {veth.stderr.strip()}")
    finally:
        _run(["ip", "netns", "del", probe], check=False)


def parse_proc_net_tcp(text: str) -> list[tuple[str, int, str, int, str]]:
    """(local ip, local port, remote ip, remote port, state) of each socket in /proc/net/tcp or
    tcp6; IPv6 addresses are shown only when IPv4-mapped (as the IPv4 address), else as "v6"."""
    states = {"01": "ESTABLISHED", "0A": "LISTEN", "06": "TIME_WAIT", "08": "CLOSE_WAIT", "02": "SYN_SENT"}

    def address(field_: str) -> tuple[str, int]:
        host, port = field_.split(":")
        words = [bytes.fromhex(host[i:i + 8])[::-1] for i in range(0, len(host), 8)]  # host-order u32s
        raw = b"".join(words)
        if len(raw) == 16:
            raw = raw[12:] if raw[:12] == bytes(10) + b"\xff\xff" else b""
        return (".".join(str(b) for b in raw) if raw else "v6"), int(port, 16)

    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 4 or not parts[0].endswith(":"):  # a header line
            continue
        (lip, lport), (rip, rport) = address(parts[1]), address(parts[2])
        out.append((lip, lport, rip, rport, states.get(parts[3], parts[3])))
    return out


@dataclass
class Mesh:
    """Three namespaces on one bridge: `trainer`, `node-a`, `node-b` (roles)."""

    roles: tuple[str, ...] = ("trainer", "node-a", "node-b")
    subnet: str = SUBNET
    decoy_subnet: str | None = DECOY_SUBNET
    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}x{next(_counter)}")
    hosts: dict[str, Host] = field(default_factory=dict)
    impairment_method: str = ""
    """"" (none), "tc-netem" or "userspace" (linkemu.py)."""
    emulator_stats: dict = field(default_factory=dict)
    """linkemu.py's counters when it last stopped (frames received, dropped, forwarded)."""
    _created: list[str] = field(default_factory=list)
    _emulator: subprocess.Popen | None = None
    _emulator_log: Path | None = None
    _processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def switch(self) -> str:
        return f"{self.tag}-sw"

    def host(self, role: str) -> Host:
        return self.hosts[role]

    # -- build and tear down --------------------------------------------------------------
    def __enter__(self) -> Mesh:
        remove_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_netns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._created.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])
        # IPv4 only: no router solicitations or DAD chatter on the emulated links.
        for key in ("all", "default"):
            _run(ns_argv(name, ["sysctl", "-qw", f"net.ipv6.conf.{key}.disable_ipv6=1"]), check=False)

    def _build(self) -> None:
        self._add_netns(self.switch)
        _run(["ip", "-n", self.switch, "link", "add", BRIDGE, "type", "bridge", "stp_state", "0", "forward_delay", "0"])
        _run(["ip", "-n", self.switch, "link", "set", BRIDGE, "up"])
        for index, role in enumerate(self.roles, start=1):
            short = "tr" if role == "trainer" else role.removeprefix("node-")
            host = Host(role=role, netns=f"{self.tag}-{short}", ip=f"{self.subnet}.{index}", port=f"p-{role}"[:15])
            self._add_netns(host.netns)
            _run(["ip", "-n", host.netns, "link", "add", host.ifname, "type", "veth",
                  "peer", "name", host.port, "netns", self.switch])
            _run(["ip", "-n", self.switch, "link", "set", host.port, "master", BRIDGE, "up"])
            _run(["ip", "-n", host.netns, "addr", "add", f"{host.ip}/{PREFIX_LEN}", "dev", host.ifname])
            _run(["ip", "-n", host.netns, "link", "set", host.ifname, "up"])
            if self.decoy_subnet:
                _run(["ip", "-n", host.netns, "link", "add", "eth1", "type", "veth", "peer", "name", "eth1p"])
                _run(["ip", "-n", host.netns, "addr", "add", f"{self.decoy_subnet}.{index}/{PREFIX_LEN}", "dev", "eth1"])
                for name in ("eth1", "eth1p"):
                    _run(["ip", "-n", host.netns, "link", "set", name, "up"])
            self.hosts[role] = host

    def close(self) -> None:
        """Kill what runs in the namespaces, remove them (veths and bridge go with them). Idempotent."""
        self._stop_emulator()
        for process in self._processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
        self._processes.clear()
        for name in reversed(self._created):
            kill_netns_processes(name)
            _run(["ip", "netns", "del", name], check=False)
        self._created.clear()

    # -- processes ---------------------------------------------------------------------------
    def popen(self, host: Host | str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start argv inside host's namespace; it is killed by close() and if this process dies."""
        netns = host if isinstance(host, str) else host.netns
        kwargs.setdefault("preexec_fn", die_with_parent)
        process = subprocess.Popen(ns_argv(netns, argv), **kwargs)
        self._processes.append(process)
        return process

    def run(self, host: Host | str, argv: Sequence[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
        netns = host if isinstance(host, str) else host.netns
        return _run(ns_argv(netns, argv), timeout=timeout)

    def tcp_sockets(self, role: str) -> list[tuple[str, int, str, int, str]]:
        """Every TCP socket in a host's namespace (IPv4, and IPv4-mapped IPv6)."""
        text = self.run(self.host(role), ["cat", "/proc/net/tcp", "/proc/net/tcp6"]).stdout
        return [s for s in parse_proc_net_tcp(text) if s[0] != "v6"]

    def link_bytes(self, role: str) -> tuple[int, int]:
        """(rx_bytes, tx_bytes) of a host's mesh interface, as its kernel counts them (frames
        with their headers: a push's payload plus a few % of TCP/IP and TLS overhead)."""
        host = self.host(role)
        stats = f"/sys/class/net/{host.ifname}/statistics"
        text = self.run(host, ["cat", f"{stats}/rx_bytes", f"{stats}/tx_bytes"]).stdout.split()
        return int(text[0]), int(text[1])

    # -- links -------------------------------------------------------------------------------
    def cut(self, role: str) -> None:
        """Pull the cable at the switch: the host's port goes down, its eth0 loses carrier."""
        _run(["ip", "-n", self.switch, "link", "set", self.host(role).port, "down"])

    def restore(self, role: str) -> None:
        host = self.host(role)
        _run(["ip", "-n", self.switch, "link", "set", host.port, "up"])
        deadline = time.monotonic() + 10
        while "LOWER_UP" not in _run(["ip", "-n", host.netns, "-br", "link", "show", host.ifname]).stdout:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{role}: {host.ifname} has no carrier 10 s after restoring its link")
            time.sleep(0.05)

    def impair(self, *, delay_ms: float = 5.0, loss_pct: float = 0.1, method: str | None = None) -> str:
        """delay_ms one way and loss_pct % loss on every link, in both directions.

        method: "tc-netem", "userspace", or None (netem if the kernel has it, else userspace;
        the environment variable WS_MULTIHOST_IMPAIR overrides). Returns the method used."""
        if self.impairment_method:
            raise RuntimeError(f"already impaired ({self.impairment_method}); clear_impairment() first")
        method = method or os.environ.get("WS_MULTIHOST_IMPAIR") or None
        if method in (None, "tc-netem"):
            failure = self._netem(delay_ms, loss_pct)
            if failure is None:
                self.impairment_method = "tc-netem"
                return self.impairment_method
            if method == "tc-netem" or "unknown" not in failure.lower():
                raise RuntimeError(f"tc netem failed: {failure}")
        self._start_emulator(delay_ms, loss_pct)
        self.impairment_method = "userspace"
        return self.impairment_method

    def clear_impairment(self) -> None:
        method, self.impairment_method = self.impairment_method, ""
        if method == "tc-netem":
            for host in self.hosts.values():
                _run(["tc", "-n", host.netns, "qdisc", "del", "dev", host.ifname, "root"], check=False)
        elif method == "userspace":
            self._stop_emulator()

    def _netem(self, delay_ms: float, loss_pct: float) -> str | None:
        """Apply netem on every endpoint's eth0 (egress: so each direction gets it once)."""
        done = []
        for host in self.hosts.values():
            result = _run(["tc", "-n", host.netns, "qdisc", "replace", "dev", host.ifname, "root", "netem",
                           "delay", f"{delay_ms:g}ms", "loss", f"{loss_pct:g}%"], check=False)
            if result.returncode != 0:
                for applied in done:
                    _run(["tc", "-n", applied.netns, "qdisc", "del", "dev", applied.ifname, "root"], check=False)
                return result.stderr.strip() or f"tc exited {result.returncode}"
            done.append(host)
        return None

    def _start_emulator(self, delay_ms: float, loss_pct: float) -> None:
        ports = [h.port for h in self.hosts.values()]
        for port in ports:  # the bridge lets go of the ports; linkemu switches them from now on
            _run(["ip", "-n", self.switch, "link", "set", port, "nomaster"])
        self._emulator_log = Path(f"/tmp/{self.tag}-linkemu.log")
        argv = [sys.executable, str(LINKEMU), "--ports", ",".join(ports), "--delay-ms", str(delay_ms),
                "--loss-pct", str(loss_pct)]
        log = open(self._emulator_log, "wb")  # noqa: SIM115 - handed to the child
        try:
            self._emulator = subprocess.Popen(ns_argv(self.switch, argv), stdout=subprocess.PIPE, stderr=log,
                                              stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        finally:
            log.close()
        assert self._emulator.stdout is not None
        line = self._emulator.stdout.readline().decode()  # "ready" once every port is bound
        if not line.startswith("ready"):
            log_text = self.emulator_log()
            self._stop_emulator()
            raise RuntimeError(f"linkemu did not start: {line!r}\n{log_text}")

    def emulator_log(self) -> str:
        try:
            return self._emulator_log.read_text(errors="replace")[-3000:] if self._emulator_log else ""
        except OSError:
            return ""

    def _stop_emulator(self) -> None:
        emulator, self._emulator = self._emulator, None
        if emulator is None:
            return
        if emulator.poll() is None:
            emulator.send_signal(signal.SIGTERM)
            try:
                emulator.wait(5)
            except subprocess.TimeoutExpired:
                emulator.kill()
                emulator.wait(5)
        if emulator.stdout is not None:
            for line in emulator.stdout.read().decode(errors="replace").splitlines():
                if line.startswith("stats "):
                    self.emulator_stats = json.loads(line[len("stats "):])
            emulator.stdout.close()
        if self.switch in self._created:
            for host in self.hosts.values():
                _run(["ip", "-n", self.switch, "link", "set", host.port, "master", BRIDGE], check=False)
        if self._emulator_log is not None:
            with contextlib.suppress(OSError):
                self._emulator_log.unlink()
