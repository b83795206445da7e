"""How every worker of one verl sync learns how it went: the outcome store actor rank 0 hosts.

Actor rank 0 (verl's is_master, SENDER_RANK) hosts a small TCPStore for the life of its engine;
every other actor rank and every rollout worker connects to it (its address reaches them through
verl's build_topology). Each sync has an id rank 0 draws at `prepare` (`sync_id`: a run token drawn
once per engine, and the count of its syncs) and hands every worker with the topology, so that a
worker built later (a restarted rollout replica, elastic scale-up) or a resumed run (verl's
global_steps back at 0, or a checkpoint's step) reads this sync's keys and no other's:

    weightsync/<sync>/outcome/<rank>   one sending rank's outcome, JSON: ok, its metrics and the
                                       commits (each server's store epoch and generation), or why not
    weightsync/<sync>/published        how many outcomes are there (one read per poll)
    weightsync/<sync>/beats            each sending rank adds 1 about once a second while it sends

`wait` returns every sender's outcome. It raises at once what a failed sender published
(PUSH_FAILED naming the rank at fault, or LORA_UNSUPPORTED), SENDER_LOST when the store goes away
(rank 0 died), and SENDER_LOST naming a sender that never said when no sender has shown a sign of
life (an outcome or a beat) for timeout_s: a push that takes long (the first delta push compiles
the SDK's kernels: a minute on a loaded machine) is waited for as long as its senders work on it,
and one whose senders died is given up timeout_s after their last beat.

No verl import here.
"""

from __future__ import annotations

import datetime
import json
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch.distributed import TCPStore

from weightsync.common.address import Address, parse_address
from weightsync.common.logging import get_logger
from weightsync.integrations.verl.errors import WeightSyncVerlError

log = get_logger("weightsync.integrations.verl")

SENDER_RANK = 0
"""The actor rank that hosts the outcome store and draws each sync's id (verl's is_master); with
senders "one", the only rank that pushes."""
POLL_S = 0.02
"""How often a waiting worker reads the count of published outcomes."""
BEAT_S = 1.0
"""How often a sending rank beats while it sends (at most a quarter of timeout_s)."""
BEAT_READ_S = 0.25
"""How often a waiting worker reads the beats."""
LORA_UNSUPPORTED = "LORA_UNSUPPORTED"


def sync_id(run: str, count: int) -> str:
    """The id of rank 0's `count`-th sync in run `run`: [A-Za-z0-9-] only, so that it can also be the
    parts' update key (the SDK's part_key)."""
    return f"{run}-{count}"


def _key(sync: str, *parts: object) -> str:
    return "/".join(("weightsync", sync, *(str(p) for p in parts)))


def outcome_host_problem(host: str, *, here: bool) -> str | None:
    """Why rank 0's outcome store cannot listen at `host` (here: this host's, rank 0) or be reached there
    (the others); None when it can. Found at once, where TCPStore would retry its connection for the
    whole timeout."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as error:
        return f"outcome_host {host!r} does not resolve ({error})"
    if not here:
        return None
    addresses = sorted({info[4][0] for info in found})
    for family, _, _, _, address in found:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((address[0], 0))
            return None
        except OSError:
            continue
    return (f"outcome_host {host!r} ({', '.join(addresses)}) is not an address of actor rank 0's host, where the "
            "outcome store listens: name this host as the other actor ranks and the rollout workers reach it")


class StoreGone(Exception):
    """Rank 0's outcome store did not answer (it died, or its host cannot be reached)."""


class OutcomeStore:
    """One worker's connection to rank 0's outcome store (rank 0's own hosts it)."""

    def __init__(self, store: TCPStore, address: Address, timeout_s: float) -> None:
        self._store = store
        self.address = address
        self.timeout_s = timeout_s

    @classmethod
    def host(cls, host: str, timeout_s: float) -> OutcomeStore:
        """Rank 0's store, on a free port of `host`; CONFIG_INVALID when `host` is not this host's."""
        problem = outcome_host_problem(host, here=True)
        if problem is not None:
            raise WeightSyncVerlError("CONFIG_INVALID", f"engine_kwargs.weightsync.{problem}")
        store = TCPStore(host, 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))
        return cls(store, Address(host, store.port), timeout_s)

    @classmethod
    def connect(cls, address: str, timeout_s: float, *, who: str) -> OutcomeStore:
        """A connection to rank 0's store at `address` (host:port); CONFIG_INVALID when its host does not
        resolve, SENDER_LOST naming rank 0 when it does not answer within timeout_s."""
        try:
            parsed = parse_address(address, what="the outcome store's address")
        except ValueError as error:
            raise WeightSyncVerlError("NOT_INITIALIZED", f"{who}: {error} (build_topology gives it)") from None
        problem = outcome_host_problem(parsed.host, here=False)
        if problem is not None:
            raise WeightSyncVerlError("CONFIG_INVALID", f"{who}: engine_kwargs.weightsync.{problem}")
        try:
            store = TCPStore(parsed.host, parsed.port, is_master=False,
                             timeout=datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError) as error:
            raise WeightSyncVerlError("SENDER_LOST", f"{who} cannot reach the sending rank's outcome store "
                                      f"{address!r}: {error}", rank=SENDER_RANK) from None
        return cls(store, parsed, timeout_s)

    def _op(self, operation, *args):
        try:
            return operation(*args)
        except RuntimeError as error:  # torch's DistStoreError / DistNetworkError: the store is gone
            raise StoreGone(str(error)) from None

    # -- the sending ranks ---------------------------------------------------------------------
    def publish(self, sync: str, rank: int, outcome: dict[str, Any]) -> None:
        """This sender's outcome of `sync`; the store gone is logged (no one is left to read it)."""
        try:
            self._op(self._store.set, _key(sync, "outcome", rank), json.dumps(outcome))
            self._op(self._store.add, _key(sync, "published"), 1)
        except StoreGone as error:
            log.warning("verl outcome not published", sync=sync, rank=rank, error=str(error))

    @contextmanager
    def beating(self, sync: str) -> Iterator[None]:
        """Beats for `sync` (its own connection, on a thread) while the block runs: the waiting workers
        give up only timeout_s after the last beat of every sender."""
        every = min(BEAT_S, self.timeout_s / 4)
        stop = threading.Event()

        def beat() -> None:
            try:
                store = TCPStore(self.address.host, self.address.port, is_master=False,
                                 timeout=datetime.timedelta(seconds=self.timeout_s))
                while True:
                    store.add(_key(sync, "beats"), 1)
                    if stop.wait(every):
                        return
            except RuntimeError as error:  # the store is gone: the waiters learn it themselves
                log.warning("verl sync beat stopped", sync=sync, error=str(error))

        thread = threading.Thread(target=beat, name=f"verl-beat-{sync}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(self.timeout_s)

    # -- every worker --------------------------------------------------------------------------
    def wait(self, sync: str, senders: Sequence[int], *, version: str, who: str) -> dict[int, dict[str, Any]]:
        """Every sender's outcome of `sync` (the module's docstring says how long it waits); raises
        PUSH_FAILED / LORA_UNSUPPORTED at once when one failed, SENDER_LOST otherwise."""
        outcomes: dict[int, dict[str, Any]] = {}
        pending = list(senders)
        published = beats = -1
        alive_at = time.monotonic()
        read_beats_at = 0.0
        try:
            while True:
                now = time.monotonic()
                count = self._op(self._store.add, _key(sync, "published"), 0)
                if count != published:
                    published, alive_at = count, now
                    for rank in list(pending):
                        if self._op(self._store.check, [_key(sync, "outcome", rank)]):
                            outcomes[rank] = json.loads(self._op(self._store.get, _key(sync, "outcome", rank)))
                            pending.remove(rank)
                    blamed = {r: o for r, o in outcomes.items() if not o["ok"] and not o.get("peer_lost")}
                    if blamed:  # one failed: that explains the others (one that lost a peer names no one)
                        raise_failed(blamed, version)
                    if not pending:
                        lost = {r: o for r, o in outcomes.items() if not o["ok"]}
                        if lost:  # every sender said, some only that they lost a peer
                            raise_failed(lost, version)
                        return outcomes
                if now >= read_beats_at:
                    read_beats_at = now + BEAT_READ_S
                    beat = self._op(self._store.add, _key(sync, "beats"), 0)
                    if beat != beats:
                        beats, alive_at = beat, now
                if now - alive_at >= self.timeout_s:
                    raise WeightSyncVerlError(
                        "SENDER_LOST", f"{who}: no outcome of version {version} from sending rank {pending[0]} "
                        f"(of {', '.join(map(str, pending))}), and no sign of life from any sender for "
                        f"{self.timeout_s:g} s", rank=pending[0], version=version)
                time.sleep(POLL_S)
        except StoreGone as error:
            raise WeightSyncVerlError("SENDER_LOST", f"{who}: the sending rank's outcome store is gone while "
                                      f"waiting for version {version}: {error}", rank=SENDER_RANK,
                                      version=version) from None


def commits_of(outcomes: dict[int, dict[str, Any]]) -> dict[int, int]:
    """store epoch -> the generation this sync committed in it, from the senders' outcomes (every part
    of one version reports the same commits)."""
    return {int(epoch): int(generation) for o in outcomes.values() for epoch, generation in o.get("commits", ())}


def blamed_rank(failed: dict[int, dict[str, Any]]) -> int:
    """The rank to name among the senders that failed a sync (their published outcomes, by rank):
    the lowest part a server named (failed_part: the part whose failure aborted the version, or whose
    declaration the union refused); else the lowest rank a server said never joined (missing); else
    the lowest sender that failed."""
    named = [int(o["failed_part"]) for o in failed.values() if o.get("failed_part") is not None]
    missing = [int(r) for o in failed.values() for r in o.get("missing", ())]
    return min(named or missing or failed)


def raise_failed(failed: dict[int, dict[str, Any]], version: str) -> None:
    """PUSH_FAILED naming the rank at fault (blamed_rank), with its own outcome when it published one;
    LORA_UNSUPPORTED (no rank) when a sender refused the step's LoRA adapter."""
    refused = [o for o in failed.values() if o.get("reason") == LORA_UNSUPPORTED]
    if refused:  # nothing was pushed, no rank at fault: verl handed over a LoRA adapter
        raise WeightSyncVerlError(LORA_UNSUPPORTED, refused[0]["message"].removeprefix(f"{LORA_UNSUPPORTED}: "),
                                  version=version)
    rank = blamed_rank(failed)
    reporter = rank if rank in failed else min(failed)
    outcome = failed[reporter]
    told = "" if reporter == rank else f" (as rank {reporter} reports)"
    raise WeightSyncVerlError(
        "PUSH_FAILED", f"actor rank {rank} failed to push version {version}{told} "
        f"({outcome['cause_reason']}): {outcome['message']}",
        rank=rank, version=version, cause_reason=outcome["cause_reason"])
