"""The lease table in-process: a lease pairs one version with that version's bytes."""

from __future__ import annotations

import asyncio

import pytest

from weightsync.common.errors import Unavailable
from weightsync.server.store.leases import LeaseTable
from weightsync.server.store.version import PublishedVersion


@pytest.mark.parametrize("steps", range(6))
def test_no_lease_is_granted_while_a_commit_publishes_whatever_the_scheduling(steps):
    """A grant that waited for one commit's publication must not slip into the next one's: the table
    checks its condition in the granting task itself, right before it reads the version."""

    async def scenario() -> list[bool]:
        table = LeaseTable()
        seen: list[bool] = []

        def version_now() -> PublishedVersion:
            seen.append(table.publishing)  # the invariant: never read while publishing
            return PublishedVersion(1, "v", 1)

        async with table.publishing_commit():
            grant = asyncio.ensure_future(table.grant(version_now, owner=1, timeout=5))
            await asyncio.sleep(0)
            assert not grant.done()
        for _ in range(steps):  # the first commit published: the waiter is woken ...
            await asyncio.sleep(0)
        table.publishing = True  # ... and the next commit begins before it resumed
        for _ in range(5):
            await asyncio.sleep(0)
        table.publishing = False
        await table._notify()
        await asyncio.wait_for(grant, 5)
        return seen

    assert asyncio.run(scenario()) == [False]


def test_a_grant_waits_its_timeout_then_says_why():
    async def scenario() -> None:
        table = LeaseTable()
        table.writing_live = True
        with pytest.raises(Unavailable) as caught:
            await table.grant(lambda: PublishedVersion(1), owner=1, timeout=0.2)
        assert caught.value.reason == "STORE_UPDATING"
        table.writing_live = False
        lease = await table.grant(lambda: PublishedVersion(1, "v", 3), owner=1, timeout=0.2)
        assert (lease.generation, list(table.leases)) == (3, [lease.lease_id])

    asyncio.run(scenario())
