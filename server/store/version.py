"""The published version's record, and the store's epoch it counts in."""

from __future__ import annotations

import datetime
import secrets
from dataclasses import dataclass

from google.protobuf import timestamp_pb2

from weightsync.v1 import weight_sync_service_pb2 as pb


def new_store_epoch() -> int:
    """A store's epoch: positive, random, so two stores (a server before and after a restart) differ."""
    return secrets.randbits(62) + 1


@dataclass(slots=True)
class PublishedVersion:
    """What was last committed on every worker."""

    store_epoch: int
    """The store this generation counts in (WeightVersion.store_epoch)."""
    version: str = ""
    generation: int = 0
    commit_time: datetime.datetime | None = None

    def to_proto(self) -> pb.WeightVersion:
        message = pb.WeightVersion(version=self.version, generation=self.generation, store_epoch=self.store_epoch)
        if self.commit_time is not None:
            stamp = timestamp_pb2.Timestamp()
            stamp.FromDatetime(self.commit_time)
            message.commit_time.CopyFrom(stamp)
        return message
