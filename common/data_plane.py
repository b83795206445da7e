"""The data-plane revision: what a trainer must do on the wire beyond what GetServerInfo's fields say.

GetServerInfoResponse.data_plane_revision carries it; docs/data-plane.md ("Revisions") says what
changed at each. It goes up when a trainer that follows the previous revision can fail against the
server (a new or changed obligation: since revision 3 a Gloo trainer sends each bucket to its owner
instead of broadcasting it). A feature a trainer may use or ignore, advertised by a field of its own
(bucket_compressions, deferred_buckets), comes within a revision.
"""

from __future__ import annotations

DATA_PLANE_REVISION = 4
"""The revision this tree's server speaks (server/node.py sets it in GetServerInfo) and its SDK
speaks (client/channels/revision.py)."""
