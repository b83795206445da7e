"""What weightsync sets in the environment for the NCCL groups it creates, and only for those.

torch's ProcessGroupNCCL reads most TORCH_NCCL_* variables in each group's constructor, so a
value present while the constructor runs applies to that group alone. Ours get:

  TORCH_NCCL_BLOCKING_WAIT=1         no watchdog thread and no heartbeat monitor for the group.
                                     Without this, any failed or timed-out collective of the group
                                     sets a process-wide dump flag that the process's *first* NCCL
                                     group's monitor (the trainer's, or vLLM's) answers by killing
                                     the process ~8 minutes later, and our own watchdog aborts the
                                     process 60 s after a timeout unless told otherwise. weightsync's
                                     own waits (CollectiveGroup.wait) decide instead.
  TORCH_NCCL_ASYNC_ERROR_HANDLING=0  belt and braces: no teardown from torch's side.
  TORCH_NCCL_DUMP_ON_TIMEOUT=0,      the monitor settings, for the case our group is the process's
  TORCH_NCCL_ENABLE_MONITORING=0     first (they are read only on that one).

Two settings are read once per process, not per group, so they cannot be scoped:
  TORCH_NCCL_NONBLOCKING_TIMEOUT     bounds every spin on a non-blocking communicator (ours are): its
                                     init, which torch waits for inside our group's first broadcast
                                     (nccl_connect.connect), and a pair's connect at its first transfer,
                                     which torch waits for in a point-to-point batch's end (a parts'
                                     group does all of them in open_group: nccl_connect.connect_pairs).
                                     Lowered to what ends within the group's timeout
                                     (collective.nonblocking_timeout_seconds, at most 120 s; an
                                     operator's lower value stays) and left set. torch reads it once,
                                     at the process's first NCCL collective, whatever its group
                                     (kept_nonblocking_timeout): a trainer that ran one of its own
                                     before (FSDP, DDP) keeps its value, 30 min unless exported (it logs
                                     nccl_nonblocking_timeout_frozen), a worker its first group's. Both
                                     ways it matters: above a group's timeout it is how long an
                                     abandoned init or connect lingers in the background after our
                                     deadline gave up on it; below, it ends the group's connects before
                                     the group's timeout does (open_group logs nccl_connect_cut_short).
                                     Export it (to about the group timeout) before the trainer's first
                                     NCCL call.
  NCCL_SOCKET_IFNAME                 NCCL reads it at the process's first communicator and keeps it:
                                     set (as an exact match) only while our group is built, and only
                                     when nobody set it. If that group is the process's first NCCL
                                     communicator, the process's later communicators keep its
                                     interface: a trainer with NCCL groups of its own should create
                                     them first, or set NCCL_SOCKET_IFNAME itself (the trainer logs a
                                     warning, nccl_interface_pinned, when it sets it).

A trainer sets these from the thread that starts the rendezvous, before the rendezvous thread
exists, and puts them back only once that rendezvous's join no longer reads them (setenv from one
thread while another reads is the risk): from the caller's thread when the join had ended by the
time the caller let go of it, else from the join's thread as it ends (client/transports/rendezvous.py).
Rendezvous may overlap (an abandoned join still running when the next group is created): the
settings are held, not set and reset per rendezvous; what the environment held before the first
holder is remembered once and comes back when the last holder lets go (hold_trainer_settings).
A worker process sets them once, at start, for its whole life: it builds no other groups.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator, Mapping, MutableMapping

from weightsync.common.logging import get_logger

log = get_logger("weightsync.nccl_env")

BLOCKING_WAIT = "TORCH_NCCL_BLOCKING_WAIT"
ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
DUMP_ON_TIMEOUT = "TORCH_NCCL_DUMP_ON_TIMEOUT"
ENABLE_MONITORING = "TORCH_NCCL_ENABLE_MONITORING"
NONBLOCKING_TIMEOUT = "TORCH_NCCL_NONBLOCKING_TIMEOUT"
SOCKET_IFNAME = "NCCL_SOCKET_IFNAME"

OUR_GROUPS = {BLOCKING_WAIT: "1", ERROR_HANDLING: "0", DUMP_ON_TIMEOUT: "0", ENABLE_MONITORING: "0"}
"""Read in each ProcessGroupNCCL's constructor: set while ours is built."""
NONBLOCKING_TIMEOUT_SECONDS = 120
"""How long a non-blocking communicator may take to become ready at its first use (torch: 30 min)."""
TORCH_NONBLOCKING_DEFAULT_SECONDS = 1800
"""torch's TORCH_NCCL_NONBLOCKING_TIMEOUT when the variable is not set."""

_lock = threading.Lock()
_kept: int | None = None
"""The TORCH_NCCL_NONBLOCKING_TIMEOUT torch read in this process, once known (note_nonblocking_read)."""


def lowered_nonblocking_timeout(current: str | None, group_timeout: float | None) -> str:
    """TORCH_NCCL_NONBLOCKING_TIMEOUT for a group of `group_timeout` seconds (None: not known yet): never
    higher than what ends within the group's timeout, nor than a lower value already set."""
    from weightsync.common.collective import nonblocking_timeout_seconds

    bound = NONBLOCKING_TIMEOUT_SECONDS if group_timeout is None else min(
        NONBLOCKING_TIMEOUT_SECONDS, nonblocking_timeout_seconds(group_timeout))
    try:
        return str(min(bound, int(current))) if current else str(bound)
    except ValueError:  # not a number: torch would fail on it; ours instead
        return str(bound)


def lower_nonblocking_timeout(group_timeout: float, environ: MutableMapping[str, str] | None = None) -> str:
    """A worker, before a group's join thread exists (from the command loop's thread): bound the wait for
    that group's communicator by its timeout, if torch has not read the value yet. Returns the value set."""
    import os

    env = os.environ if environ is None else environ
    with _lock:
        value = lowered_nonblocking_timeout(env.get(NONBLOCKING_TIMEOUT), group_timeout)
        env[NONBLOCKING_TIMEOUT] = value
        return value


def frozen_nonblocking_timeout(current: str | None, group_timeout: float | None, *, nccl_used: bool) -> int | None:
    """The TORCH_NCCL_NONBLOCKING_TIMEOUT torch most likely kept (it reads it once, at the process's first NCCL
    collective) when that exceeds what our group would set, in a process that already ran NCCL (`current`:
    the variable now, before ours); None when ours can still apply or nothing exceeds it."""
    if not nccl_used:
        return None
    try:
        kept = int(current) if current else TORCH_NONBLOCKING_DEFAULT_SECONDS
    except ValueError:
        return None
    return kept if kept > int(lowered_nonblocking_timeout(None, group_timeout)) else None


def nonblocking_seconds(value: str | None) -> int:
    """What torch makes of a TORCH_NCCL_NONBLOCKING_TIMEOUT value (unset: its 30 min)."""
    try:
        return int(value) if value else TORCH_NONBLOCKING_DEFAULT_SECONDS
    except ValueError:
        return TORCH_NONBLOCKING_DEFAULT_SECONDS


def note_nonblocking_read(value: str | None) -> None:
    """torch read TORCH_NCCL_NONBLOCKING_TIMEOUT as `value` now (the process's first NCCL collective: a trainer's own
    before our group, or our group's connect); a later note changes nothing, as a later read does not."""
    global _kept
    with _lock:
        if _kept is None:
            _kept = nonblocking_seconds(value)


def kept_nonblocking_timeout(environ: Mapping[str, str] | None = None) -> int:
    """The TORCH_NCCL_NONBLOCKING_TIMEOUT that bounds this process's NCCL connects: what torch read (noted), or, before
    any NCCL ran, what it will read at the next one (`environ`'s value now)."""
    import os

    with _lock:
        kept = _kept
    return kept if kept is not None else nonblocking_seconds((os.environ if environ is None else environ).get(
        NONBLOCKING_TIMEOUT))


def connects_cut_short(kept: int, group_timeout: float) -> bool:
    """Whether torch's value (`kept`) ends a group's connect waits (its communicator's init, its pairs') before the
    group's own timeout would: a rank that joins later than that fails the group at `kept`."""
    from weightsync.common.collective import nonblocking_timeout_seconds

    return kept < nonblocking_timeout_seconds(group_timeout)


def process_used_nccl() -> bool:
    """Whether this process's default process group runs NCCL (FSDP, DDP...): it ran NCCL collectives first."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        return "nccl" in str(dist.get_backend()).lower()
    except (RuntimeError, ValueError):
        return False


def worker_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """What a worker process sets at start, before any group exists (its groups are all ours)."""
    settings = dict(OUR_GROUPS)
    if not environ.get(NONBLOCKING_TIMEOUT):
        settings[NONBLOCKING_TIMEOUT] = str(NONBLOCKING_TIMEOUT_SECONDS)
    return settings


def ifname_setting(current: str | None, interface: str | None) -> str | None:
    """The NCCL_SOCKET_IFNAME to set, or None to leave the environment alone: a value already
    there is the operator's (or NCCL read it already); a bare name is a prefix match (eth1 also
    matches eth10), "=" makes it exact."""
    if current or not interface:
        return None
    return f"={interface}"


@dataclasses.dataclass(slots=True)
class _Held:
    """The settings weightsync holds in one environment, for as many rendezvous as still need them."""

    environ: MutableMapping[str, str]
    originals: dict[str, str | None]
    """Each variable we set, as it was before the first holder set it (None: absent)."""
    holders: int


_held: dict[int, _Held] = {}
"""By id() of the environment mapping (os.environ, or a test's dict), under _lock."""


class TrainerSettings:
    """Our settings held in an environment for one rendezvous; `release` (once, idempotent) lets go."""

    def __init__(self, environ: MutableMapping[str, str], settings: dict[str, str]) -> None:
        self.settings = settings
        """What this holder set (a variable an earlier holder already set is not repeated)."""
        self._environ = environ
        self._released = False

    def release(self) -> None:
        """Let go; the last holder puts back every variable as it was before the first (absent stays absent),
        but TORCH_NCCL_NONBLOCKING_TIMEOUT (read once per process: left lowered)."""
        with _lock:
            if self._released:
                return
            self._released = True
            held = _held[id(self._environ)]
            held.holders -= 1
            if held.holders:
                return
            del _held[id(self._environ)]
            for key, value in held.originals.items():
                if value is None:
                    self._environ.pop(key, None)
                else:
                    self._environ[key] = value


def hold_trainer_settings(interface: str | None, environ: MutableMapping[str, str] | None = None, *,
                          group_timeout: float | None = None) -> TrainerSettings:
    """Our group's settings (see the module docstring), held until the returned holder's release()."""
    import os

    env = os.environ if environ is None else environ
    with _lock:
        settings = dict(OUR_GROUPS)
        # A value an earlier holder pinned is ours, not the operator's: ifname_setting leaves it, as NCCL would.
        ifname = ifname_setting(env.get(SOCKET_IFNAME), interface)
        if ifname is not None:
            settings[SOCKET_IFNAME] = ifname
        current = env.get(NONBLOCKING_TIMEOUT)
        nccl_used = process_used_nccl()
        frozen = frozen_nonblocking_timeout(current, group_timeout, nccl_used=nccl_used)
        if not current or group_timeout is not None:
            env[NONBLOCKING_TIMEOUT] = lowered_nonblocking_timeout(current, group_timeout)
        held = _held.setdefault(id(env), _Held(environ=env, originals={}, holders=0))
        for key in settings:
            held.originals.setdefault(key, env.get(key))
        held.holders += 1
        env.update(settings)
    if nccl_used and environ is None:
        note_nonblocking_read(current)  # what torch read at the trainer's own first NCCL collective (most likely)
    if frozen is not None:
        log.warning("nccl_nonblocking_timeout_frozen", seconds=frozen,
                    why="this process ran NCCL before: torch keeps the TORCH_NCCL_NONBLOCKING_TIMEOUT it read then, so "
                        "a group that never connects lingers that long in the background after weightsync gave up "
                        "on it; export TORCH_NCCL_NONBLOCKING_TIMEOUT (about the group timeout) before the first "
                        "NCCL call")
    if ifname is not None:
        log.warning("nccl_interface_pinned", interface=ifname,
                    why="NCCL keeps the first NCCL_SOCKET_IFNAME it reads: if this group is this process's first "
                        "NCCL communicator, the trainer's own later ones use this interface too; set "
                        "NCCL_SOCKET_IFNAME yourself, or create your NCCL groups first, to choose otherwise")
    return TrainerSettings(env, settings)


@contextlib.contextmanager
def trainer_group_environment(interface: str | None, environ: MutableMapping[str, str] | None = None, *,
                              group_timeout: float | None = None) -> Iterator[dict[str, str]]:
    """Our group's settings while the block runs (hold_trainer_settings); yields what was set."""
    holder = hold_trainer_settings(interface, environ, group_timeout=group_timeout)
    try:
        yield holder.settings
    finally:
        holder.release()


def pin_worker_interface(interface: str | None, environ: MutableMapping[str, str] | None = None) -> str | None:
    """A worker: pin NCCL to the interface that routes to the trainer, for the process (NCCL reads it
    at the first communicator; a worker builds no others). From the command loop's thread, before any
    join thread exists. Returns the value NCCL will use (None: NCCL picks)."""
    import os

    env = os.environ if environ is None else environ
    with _lock:
        current = env.get(SOCKET_IFNAME)
        setting = ifname_setting(current, interface)
        if setting is None:
            return current
        env[SOCKET_IFNAME] = setting
        return setting
