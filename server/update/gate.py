"""The update gate: one update at a time on the node's store.

    require_idle()      FAILED_PRECONDITION UPDATE_IN_PROGRESS while an update runs (one that
                        already committed or aborted and only finishes its clean-up is not
                        refused: the next one waits for the gate instead)
    async with running(session):  the session holds the gate to the end of its clean-up
    await wait_idle()   until no update holds it (drain at shutdown)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Protocol

from weightsync.common.errors import FailedPrecondition


class GatedSession(Protocol):
    update_id: str

    @property
    def finished(self) -> bool:
        """Committed or aborted (its clean-up may still run)."""


class UpdateGate:
    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._idle = asyncio.Event()
        self._idle.set()
        self.active: GatedSession | None = None

    def running_update(self) -> GatedSession | None:
        """The update that runs now (not one only finishing its clean-up)."""
        active = self.active
        return active if active is not None and not active.finished else None

    def require_idle(self) -> None:
        active = self.running_update()
        if active is not None:
            raise FailedPrecondition(
                "UPDATE_IN_PROGRESS",
                "another update is running on this server's store; retry after it commits or aborts",
                update_id=active.update_id,
            )

    @contextlib.asynccontextmanager
    async def running(self, session: GatedSession) -> AsyncIterator[None]:
        async with self._lock:
            self.active = session
            self._idle.clear()
            try:
                yield
            finally:
                self.active = None
                self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()
