"""Read leases on the node's store: engines (and the server's own checksum reads) never see a torn version.

An engine maps the store and copies from it while the trainer may already be
pushing the next version. A lease pins the bytes of one committed generation
until released (or the engine's connection closes):
  - an IN_PLACE update writes the live bytes: it waits for every lease to go;
  - a STAGED update writes the shadows, which hold no committed generation but
    the previous one's bytes where the last commit swapped: it waits only for
    leases on an older generation;
  - while an IN_PLACE update writes, no lease is granted;
  - while a commit publishes (the store's new layout and its new version become the server's
    view), no lease is granted: a lease pairs one version with that version's bytes, never the
    old label with the new locations.
Waits are bounded (--engine-lease-timeout); an engine copies for well under a
second, so a wait that long means a stuck engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from weightsync.common.errors import Unavailable
from weightsync.server.store.version import PublishedVersion


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: int
    version: PublishedVersion
    """The committed version it pins."""
    owner: int
    """The connection holding it: closing it releases its leases."""

    @property
    def generation(self) -> int:
        return self.version.generation


class LeaseTable:
    def __init__(self) -> None:
        self.leases: dict[int, Lease] = {}
        self._ids = itertools.count(1)
        self._changed = asyncio.Condition()
        self.writing_live = False
        """An update writes the live bytes (IN_PLACE, or a STAGED patch at commit): no new lease until it ends."""
        self.publishing = False
        """A commit is being published: no new lease until the new version and its layout are both in place."""

    async def _wait(self, ready: Callable[[], bool], timeout: float, reason: str, message: str) -> None:
        """Return once `ready()` holds, checked in the caller's own task: nothing runs between that check
        and the caller's next statement (asyncio.wait_for would run the check in another task and resume
        the caller a loop iteration later, when a commit may have begun: a lease on the old label with the
        new layout)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        async with self._changed:
            while not ready():
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise Unavailable(reason, message)
                try:
                    async with asyncio.timeout(remaining):
                        await self._changed.wait()
                except TimeoutError:
                    pass

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def grant(self, version_now: Callable[[], PublishedVersion], owner: int, timeout: float) -> Lease:
        """A lease on the current version (read after any IN_PLACE write finished)."""
        await self._wait(lambda: not self.writing_live and not self.publishing, timeout, "STORE_UPDATING",
                         f"an update kept writing or publishing the store for {timeout:g} s")
        lease = Lease(next(self._ids), version_now(), owner)
        self.leases[lease.lease_id] = lease
        return lease

    async def release(self, lease_id: int, owner: int) -> Lease | None:
        lease = self.leases.get(lease_id)
        if lease is None or lease.owner != owner:
            return None
        del self.leases[lease_id]
        await self._notify()
        return lease

    def held_by(self, owner: int) -> list[Lease]:
        return [lease for lease in self.leases.values() if lease.owner == owner]

    async def release_owner(self, owner: int) -> None:
        for lease_id in [i for i, lease in self.leases.items() if lease.owner == owner]:
            del self.leases[lease_id]
        await self._notify()

    async def before_write(self, *, staged: bool, generation: int, timeout: float) -> None:
        """Wait until an update of this mode may write (see the module docstring)."""
        def clear() -> bool:
            return not any(not staged or lease.generation < generation for lease in self.leases.values())

        await self._wait(clear, timeout, "ENGINE_READING",
                         f"an engine kept reading the store for {timeout:g} s (its lease was not released)")
        if not staged:
            self.writing_live = True

    @contextlib.asynccontextmanager
    async def publishing_commit(self) -> AsyncIterator[None]:
        """No lease is granted inside: the commit's answers change the layout before its version is published."""
        self.publishing = True
        try:
            yield
        finally:
            self.publishing = False
            await self._notify()

    async def write_done(self) -> None:
        if self.writing_live:
            self.writing_live = False
            await self._notify()
