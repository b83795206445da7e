"""The data-plane revisions this SDK speaks, and the check that refuses any other server early.

A server says which revision it speaks in GetServerInfo.data_plane_revision (docs/data-plane.md,
"Revisions"). The SDK asks before it creates a group or sends a byte, and refuses a server whose
revision it does not speak, 0 included (a server older than the field cannot say which it speaks):
otherwise a Gloo trainer and a server of different revisions would wait each other out until the
group's timeout, or fail later on a field one of them does not know.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import grpc

from weightsync.client.errors import WeightSyncClientError
from weightsync.common.data_plane import DATA_PLANE_REVISION
from weightsync.v1 import weight_sync_service_pb2 as pb

SPOKEN_REVISIONS = frozenset({DATA_PLANE_REVISION})
"""The revisions this SDK speaks: the one its own server speaks."""


class DataPlaneRevisionUnsupported(WeightSyncClientError):
    """A server speaks a data-plane revision this SDK does not (nothing was sent to it).

    Attributes: server (address), revision (what it reported; 0 when it reported none)."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "DATA_PLANE_REVISION_UNSUPPORTED"

    def __init__(self, server: str, revision: int) -> None:
        said = (f"data-plane revision {revision}" if revision else
                "no data-plane revision (GetServerInfo.data_plane_revision unset: a server older than it)")
        super().__init__(f"{server} speaks {said}; this SDK speaks {sorted(SPOKEN_REVISIONS)} "
                         "(docs/data-plane.md, \"Revisions\"): run a server and an SDK of the same release")
        self.server = server
        self.revision = revision


def spoken(addresses: Sequence[str], infos: Iterable[pb.GetServerInfoResponse]
           ) -> list[tuple[str, pb.GetServerInfoResponse]]:
    """The (address, info) pairs, once every server speaks a revision of SPOKEN_REVISIONS; raises
    DataPlaneRevisionUnsupported naming the first that does not."""
    pairs = list(zip(addresses, infos, strict=True))
    for address, info in pairs:
        if info.data_plane_revision not in SPOKEN_REVISIONS:
            raise DataPlaneRevisionUnsupported(address, info.data_plane_revision)
    return pairs
