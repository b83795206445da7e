import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from weightsync.v1 import tensor_pb2 as _tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as _weight_sync_service_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerConfig(_message.Message):
    __slots__ = ("index", "device", "log_level", "queue_capacity_bytes", "parent_pid", "memory_limit_bytes", "fd_channel", "ingress_fd", "ingress_bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    LOG_LEVEL_FIELD_NUMBER: _ClassVar[int]
    QUEUE_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARENT_PID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    FD_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    INGRESS_FD_FIELD_NUMBER: _ClassVar[int]
    INGRESS_BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    device: str
    log_level: str
    queue_capacity_bytes: int
    parent_pid: int
    memory_limit_bytes: int
    fd_channel: int
    ingress_fd: int
    ingress_bytes: int
    def __init__(self, index: _Optional[int] = ..., device: _Optional[str] = ..., log_level: _Optional[str] = ..., queue_capacity_bytes: _Optional[int] = ..., parent_pid: _Optional[int] = ..., memory_limit_bytes: _Optional[int] = ..., fd_channel: _Optional[int] = ..., ingress_fd: _Optional[int] = ..., ingress_bytes: _Optional[int] = ...) -> None: ...

class JoinGroupCommand(_message.Message):
    __slots__ = ("group_id", "store_host", "store_port", "world_size", "rank", "backend", "timeout", "trainer_ranks")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    TRAINER_RANKS_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    store_host: str
    store_port: int
    world_size: int
    rank: int
    backend: _weight_sync_service_pb2.Backend
    timeout: _duration_pb2.Duration
    trainer_ranks: int
    def __init__(self, group_id: _Optional[str] = ..., store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., world_size: _Optional[int] = ..., rank: _Optional[int] = ..., backend: _Optional[_Union[_weight_sync_service_pb2.Backend, str]] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., trainer_ranks: _Optional[int] = ...) -> None: ...

class LeaveGroupCommand(_message.Message):
    __slots__ = ("group_id",)
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    def __init__(self, group_id: _Optional[str] = ...) -> None: ...

class ArenaSpec(_message.Message):
    __slots__ = ("arena_id", "size_bytes")
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    arena_id: int
    size_bytes: int
    def __init__(self, arena_id: _Optional[int] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class MapArenasCommand(_message.Message):
    __slots__ = ("arenas",)
    ARENAS_FIELD_NUMBER: _ClassVar[int]
    arenas: _containers.RepeatedCompositeFieldContainer[ArenaSpec]
    def __init__(self, arenas: _Optional[_Iterable[_Union[ArenaSpec, _Mapping]]] = ...) -> None: ...

class UnmapArenasCommand(_message.Message):
    __slots__ = ("arena_ids",)
    ARENA_IDS_FIELD_NUMBER: _ClassVar[int]
    arena_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, arena_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Region(_message.Message):
    __slots__ = ("arena_id", "offset_bytes")
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    arena_id: int
    offset_bytes: int
    def __init__(self, arena_id: _Optional[int] = ..., offset_bytes: _Optional[int] = ...) -> None: ...

class TensorCopy(_message.Message):
    __slots__ = ("src_offset_bytes", "size_bytes", "dst")
    SRC_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src_offset_bytes: int
    size_bytes: int
    dst: Region
    def __init__(self, src_offset_bytes: _Optional[int] = ..., size_bytes: _Optional[int] = ..., dst: _Optional[_Union[Region, _Mapping]] = ...) -> None: ...

class BoxCopy(_message.Message):
    __slots__ = ("name", "src_offset_bytes", "tensor", "dtype", "shape", "offsets", "sizes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SRC_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    name: str
    src_offset_bytes: int
    tensor: Region
    dtype: _tensor_pb2.Dtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., src_offset_bytes: _Optional[int] = ..., tensor: _Optional[_Union[Region, _Mapping]] = ..., dtype: _Optional[_Union[_tensor_pb2.Dtype, str]] = ..., shape: _Optional[_Iterable[int]] = ..., offsets: _Optional[_Iterable[int]] = ..., sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class TensorCheck(_message.Message):
    __slots__ = ("name", "offset_bytes", "size_bytes", "expected")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset_bytes: int
    size_bytes: int
    expected: int
    def __init__(self, name: _Optional[str] = ..., offset_bytes: _Optional[int] = ..., size_bytes: _Optional[int] = ..., expected: _Optional[int] = ...) -> None: ...

class PatchTarget(_message.Message):
    __slots__ = ("name", "src_offset_bytes", "size_bytes", "encoding", "count", "expected", "live", "dtype", "shape", "live_checksum", "destination", "scatter_at_commit", "box")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SRC_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    LIVE_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    SCATTER_AT_COMMIT_FIELD_NUMBER: _ClassVar[int]
    BOX_FIELD_NUMBER: _ClassVar[int]
    name: str
    src_offset_bytes: int
    size_bytes: int
    encoding: _tensor_pb2.TensorEncoding
    count: int
    expected: int
    live: Region
    dtype: _tensor_pb2.Dtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    live_checksum: int
    destination: Region
    scatter_at_commit: bool
    box: _tensor_pb2.TensorBox
    def __init__(self, name: _Optional[str] = ..., src_offset_bytes: _Optional[int] = ..., size_bytes: _Optional[int] = ..., encoding: _Optional[_Union[_tensor_pb2.TensorEncoding, str]] = ..., count: _Optional[int] = ..., expected: _Optional[int] = ..., live: _Optional[_Union[Region, _Mapping]] = ..., dtype: _Optional[_Union[_tensor_pb2.Dtype, str]] = ..., shape: _Optional[_Iterable[int]] = ..., live_checksum: _Optional[int] = ..., destination: _Optional[_Union[Region, _Mapping]] = ..., scatter_at_commit: _Optional[bool] = ..., box: _Optional[_Union[_tensor_pb2.TensorBox, _Mapping]] = ...) -> None: ...

class OwnedBucket(_message.Message):
    __slots__ = ("sequence", "size_bytes", "receive_into", "copies", "checks", "patches", "box_copies")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_INTO_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    CHECKS_FIELD_NUMBER: _ClassVar[int]
    PATCHES_FIELD_NUMBER: _ClassVar[int]
    BOX_COPIES_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    size_bytes: int
    receive_into: Region
    copies: _containers.RepeatedCompositeFieldContainer[TensorCopy]
    checks: _containers.RepeatedCompositeFieldContainer[TensorCheck]
    patches: _containers.RepeatedCompositeFieldContainer[PatchTarget]
    box_copies: _containers.RepeatedCompositeFieldContainer[BoxCopy]
    def __init__(self, sequence: _Optional[int] = ..., size_bytes: _Optional[int] = ..., receive_into: _Optional[_Union[Region, _Mapping]] = ..., copies: _Optional[_Iterable[_Union[TensorCopy, _Mapping]]] = ..., checks: _Optional[_Iterable[_Union[TensorCheck, _Mapping]]] = ..., patches: _Optional[_Iterable[_Union[PatchTarget, _Mapping]]] = ..., box_copies: _Optional[_Iterable[_Union[BoxCopy, _Mapping]]] = ...) -> None: ...

class ShadowCopy(_message.Message):
    __slots__ = ("source", "destination", "size_bytes")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    source: Region
    destination: Region
    size_bytes: int
    def __init__(self, source: _Optional[_Union[Region, _Mapping]] = ..., destination: _Optional[_Union[Region, _Mapping]] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class PrepareUpdateCommand(_message.Message):
    __slots__ = ("update_id", "group_id", "staged", "buckets", "shadow_copies", "largest_bucket_bytes", "lane_starts")
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    SHADOW_COPIES_FIELD_NUMBER: _ClassVar[int]
    LARGEST_BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    LANE_STARTS_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    group_id: str
    staged: bool
    buckets: _containers.RepeatedCompositeFieldContainer[OwnedBucket]
    shadow_copies: _containers.RepeatedCompositeFieldContainer[ShadowCopy]
    largest_bucket_bytes: int
    lane_starts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, update_id: _Optional[str] = ..., group_id: _Optional[str] = ..., staged: _Optional[bool] = ..., buckets: _Optional[_Iterable[_Union[OwnedBucket, _Mapping]]] = ..., shadow_copies: _Optional[_Iterable[_Union[ShadowCopy, _Mapping]]] = ..., largest_bucket_bytes: _Optional[int] = ..., lane_starts: _Optional[_Iterable[int]] = ...) -> None: ...

class ReceiveBucketCommand(_message.Message):
    __slots__ = ("update_id", "sequence", "checksum", "discard", "size_bytes", "from_ingress", "ingress_offset_bytes", "piece_offset_bytes", "piece_size_bytes", "last_piece", "tail", "compression", "layout", "source_rank", "source_sequence", "in_store")
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    DISCARD_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FROM_INGRESS_FIELD_NUMBER: _ClassVar[int]
    INGRESS_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    PIECE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    PIECE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_PIECE_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_RANK_FIELD_NUMBER: _ClassVar[int]
    SOURCE_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    IN_STORE_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    sequence: int
    checksum: _tensor_pb2.Checksum
    discard: bool
    size_bytes: int
    from_ingress: bool
    ingress_offset_bytes: int
    piece_offset_bytes: int
    piece_size_bytes: int
    last_piece: bool
    tail: bytes
    compression: _weight_sync_service_pb2.BucketCompression
    layout: OwnedBucket
    source_rank: int
    source_sequence: int
    in_store: bool
    def __init__(self, update_id: _Optional[str] = ..., sequence: _Optional[int] = ..., checksum: _Optional[_Union[_tensor_pb2.Checksum, _Mapping]] = ..., discard: _Optional[bool] = ..., size_bytes: _Optional[int] = ..., from_ingress: _Optional[bool] = ..., ingress_offset_bytes: _Optional[int] = ..., piece_offset_bytes: _Optional[int] = ..., piece_size_bytes: _Optional[int] = ..., last_piece: _Optional[bool] = ..., tail: _Optional[bytes] = ..., compression: _Optional[_Union[_weight_sync_service_pb2.BucketCompression, str]] = ..., layout: _Optional[_Union[OwnedBucket, _Mapping]] = ..., source_rank: _Optional[int] = ..., source_sequence: _Optional[int] = ..., in_store: _Optional[bool] = ...) -> None: ...

class CommitUpdateCommand(_message.Message):
    __slots__ = ("update_id",)
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    def __init__(self, update_id: _Optional[str] = ...) -> None: ...

class AbortUpdateCommand(_message.Message):
    __slots__ = ("update_id",)
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    def __init__(self, update_id: _Optional[str] = ...) -> None: ...

class ShutdownCommand(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerCommand(_message.Message):
    __slots__ = ("command_id", "sent_monotonic_ns", "join_group", "leave_group", "prepare_update", "receive_bucket", "commit_update", "abort_update", "shutdown", "map_arenas", "unmap_arenas")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    SENT_MONOTONIC_NS_FIELD_NUMBER: _ClassVar[int]
    JOIN_GROUP_FIELD_NUMBER: _ClassVar[int]
    LEAVE_GROUP_FIELD_NUMBER: _ClassVar[int]
    PREPARE_UPDATE_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_BUCKET_FIELD_NUMBER: _ClassVar[int]
    COMMIT_UPDATE_FIELD_NUMBER: _ClassVar[int]
    ABORT_UPDATE_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    MAP_ARENAS_FIELD_NUMBER: _ClassVar[int]
    UNMAP_ARENAS_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    sent_monotonic_ns: int
    join_group: JoinGroupCommand
    leave_group: LeaveGroupCommand
    prepare_update: PrepareUpdateCommand
    receive_bucket: ReceiveBucketCommand
    commit_update: CommitUpdateCommand
    abort_update: AbortUpdateCommand
    shutdown: ShutdownCommand
    map_arenas: MapArenasCommand
    unmap_arenas: UnmapArenasCommand
    def __init__(self, command_id: _Optional[int] = ..., sent_monotonic_ns: _Optional[int] = ..., join_group: _Optional[_Union[JoinGroupCommand, _Mapping]] = ..., leave_group: _Optional[_Union[LeaveGroupCommand, _Mapping]] = ..., prepare_update: _Optional[_Union[PrepareUpdateCommand, _Mapping]] = ..., receive_bucket: _Optional[_Union[ReceiveBucketCommand, _Mapping]] = ..., commit_update: _Optional[_Union[CommitUpdateCommand, _Mapping]] = ..., abort_update: _Optional[_Union[AbortUpdateCommand, _Mapping]] = ..., shutdown: _Optional[_Union[ShutdownCommand, _Mapping]] = ..., map_arenas: _Optional[_Union[MapArenasCommand, _Mapping]] = ..., unmap_arenas: _Optional[_Union[UnmapArenasCommand, _Mapping]] = ...) -> None: ...

class WorkerStarted(_message.Message):
    __slots__ = ("pid", "device", "backend", "device_uuid")
    PID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    pid: int
    device: str
    backend: _weight_sync_service_pb2.Backend
    device_uuid: str
    def __init__(self, pid: _Optional[int] = ..., device: _Optional[str] = ..., backend: _Optional[_Union[_weight_sync_service_pb2.Backend, str]] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class GroupJoined(_message.Message):
    __slots__ = ("group_id", "join_seconds")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    JOIN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    join_seconds: float
    def __init__(self, group_id: _Optional[str] = ..., join_seconds: _Optional[float] = ...) -> None: ...

class GroupLeft(_message.Message):
    __slots__ = ("group_id",)
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    def __init__(self, group_id: _Optional[str] = ...) -> None: ...

class UpdatePrepared(_message.Message):
    __slots__ = ("update_id", "staging_bytes", "staging_on_device")
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    STAGING_BYTES_FIELD_NUMBER: _ClassVar[int]
    STAGING_ON_DEVICE_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    staging_bytes: int
    staging_on_device: bool
    def __init__(self, update_id: _Optional[str] = ..., staging_bytes: _Optional[int] = ..., staging_on_device: _Optional[bool] = ...) -> None: ...

class BucketReceived(_message.Message):
    __slots__ = ("sequence", "size_bytes", "fast_path")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FAST_PATH_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    size_bytes: int
    fast_path: bool
    def __init__(self, sequence: _Optional[int] = ..., size_bytes: _Optional[int] = ..., fast_path: _Optional[bool] = ...) -> None: ...

class UpdateCommitted(_message.Message):
    __slots__ = ("update_id",)
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    def __init__(self, update_id: _Optional[str] = ...) -> None: ...

class UpdateAborted(_message.Message):
    __slots__ = ("update_id",)
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    def __init__(self, update_id: _Optional[str] = ...) -> None: ...

class ArenasMapped(_message.Message):
    __slots__ = ("arena_ids",)
    ARENA_IDS_FIELD_NUMBER: _ClassVar[int]
    arena_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, arena_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CommandFailed(_message.Message):
    __slots__ = ("code", "reason", "message", "metadata", "broken_group_id", "store_touched")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    BROKEN_GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_TOUCHED_FIELD_NUMBER: _ClassVar[int]
    code: int
    reason: str
    message: str
    metadata: _containers.ScalarMap[str, str]
    broken_group_id: str
    store_touched: bool
    def __init__(self, code: _Optional[int] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., broken_group_id: _Optional[str] = ..., store_touched: _Optional[bool] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("staging_bytes", "received_bytes", "device_available_bytes")
    STAGING_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    staging_bytes: int
    received_bytes: int
    device_available_bytes: int
    def __init__(self, staging_bytes: _Optional[int] = ..., received_bytes: _Optional[int] = ..., device_available_bytes: _Optional[int] = ...) -> None: ...

class WorkerEvent(_message.Message):
    __slots__ = ("command_id", "status", "started", "group_joined", "group_left", "update_prepared", "bucket_received", "update_committed", "update_aborted", "command_failed", "arenas_mapped")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    GROUP_JOINED_FIELD_NUMBER: _ClassVar[int]
    GROUP_LEFT_FIELD_NUMBER: _ClassVar[int]
    UPDATE_PREPARED_FIELD_NUMBER: _ClassVar[int]
    BUCKET_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    UPDATE_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ABORTED_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FAILED_FIELD_NUMBER: _ClassVar[int]
    ARENAS_MAPPED_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    status: WorkerStatus
    started: WorkerStarted
    group_joined: GroupJoined
    group_left: GroupLeft
    update_prepared: UpdatePrepared
    bucket_received: BucketReceived
    update_committed: UpdateCommitted
    update_aborted: UpdateAborted
    command_failed: CommandFailed
    arenas_mapped: ArenasMapped
    def __init__(self, command_id: _Optional[int] = ..., status: _Optional[_Union[WorkerStatus, _Mapping]] = ..., started: _Optional[_Union[WorkerStarted, _Mapping]] = ..., group_joined: _Optional[_Union[GroupJoined, _Mapping]] = ..., group_left: _Optional[_Union[GroupLeft, _Mapping]] = ..., update_prepared: _Optional[_Union[UpdatePrepared, _Mapping]] = ..., bucket_received: _Optional[_Union[BucketReceived, _Mapping]] = ..., update_committed: _Optional[_Union[UpdateCommitted, _Mapping]] = ..., update_aborted: _Optional[_Union[UpdateAborted, _Mapping]] = ..., command_failed: _Optional[_Union[CommandFailed, _Mapping]] = ..., arenas_mapped: _Optional[_Union[ArenasMapped, _Mapping]] = ...) -> None: ...
