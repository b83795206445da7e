import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from weightsync.v1 import local_pb2 as _local_pb2
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
    __slots__ = ("group_id", "store_host", "store_port", "world_size", "rank", "backend", "timeout")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    store_host: str
    store_port: int
    world_size: int
    rank: int
    backend: _weight_sync_service_pb2.Backend
    timeout: _duration_pb2.Duration
    def __init__(self, group_id: _Optional[str] = ..., store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., world_size: _Optional[int] = ..., rank: _Optional[int] = ..., backend: _Optional[_Union[_weight_sync_service_pb2.Backend, str]] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class LeaveGroupCommand(_message.Message):
    __slots__ = ("group_id",)
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    def __init__(self, group_id: _Optional[str] = ...) -> None: ...

class PrepareUpdateCommand(_message.Message):
    __slots__ = ("update_id", "group_id", "plan", "mode", "allow_new_tensors", "plan_id")
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    ALLOW_NEW_TENSORS_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    group_id: str
    plan: _tensor_pb2.WeightPlan
    mode: _weight_sync_service_pb2.UpdateMode
    allow_new_tensors: bool
    plan_id: str
    def __init__(self, update_id: _Optional[str] = ..., group_id: _Optional[str] = ..., plan: _Optional[_Union[_tensor_pb2.WeightPlan, _Mapping]] = ..., mode: _Optional[_Union[_weight_sync_service_pb2.UpdateMode, str]] = ..., allow_new_tensors: _Optional[bool] = ..., plan_id: _Optional[str] = ...) -> None: ...

class AllocateUpdateCommand(_message.Message):
    __slots__ = ("update_id",)
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    def __init__(self, update_id: _Optional[str] = ...) -> None: ...

class ReceiveBucketCommand(_message.Message):
    __slots__ = ("update_id", "sequence", "checksum", "discard", "size_bytes", "from_ingress", "ingress_offset_bytes", "piece_offset_bytes", "piece_size_bytes", "last_piece", "tail")
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
    def __init__(self, update_id: _Optional[str] = ..., sequence: _Optional[int] = ..., checksum: _Optional[_Union[_tensor_pb2.Checksum, _Mapping]] = ..., discard: _Optional[bool] = ..., size_bytes: _Optional[int] = ..., from_ingress: _Optional[bool] = ..., ingress_offset_bytes: _Optional[int] = ..., piece_offset_bytes: _Optional[int] = ..., piece_size_bytes: _Optional[int] = ..., last_piece: _Optional[bool] = ..., tail: _Optional[bytes] = ...) -> None: ...

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

class ComputeChecksumsCommand(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...

class ShutdownCommand(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExportStoreCommand(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StoreExported(_message.Message):
    __slots__ = ("arenas", "device_uuid")
    ARENAS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    arenas: _containers.RepeatedCompositeFieldContainer[_local_pb2.ArenaHandle]
    device_uuid: str
    def __init__(self, arenas: _Optional[_Iterable[_Union[_local_pb2.ArenaHandle, _Mapping]]] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class ArenaFd(_message.Message):
    __slots__ = ("arena_id", "fd")
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    arena_id: int
    fd: int
    def __init__(self, arena_id: _Optional[int] = ..., fd: _Optional[int] = ...) -> None: ...

class RestoreStoreCommand(_message.Message):
    __slots__ = ("manifest", "arenas", "dirty")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    ARENAS_FIELD_NUMBER: _ClassVar[int]
    DIRTY_FIELD_NUMBER: _ClassVar[int]
    manifest: StoreManifest
    arenas: _containers.RepeatedCompositeFieldContainer[ArenaFd]
    dirty: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, manifest: _Optional[_Union[StoreManifest, _Mapping]] = ..., arenas: _Optional[_Iterable[_Union[ArenaFd, _Mapping]]] = ..., dirty: _Optional[_Iterable[str]] = ...) -> None: ...

class Region(_message.Message):
    __slots__ = ("arena_id", "offset_bytes")
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    arena_id: int
    offset_bytes: int
    def __init__(self, arena_id: _Optional[int] = ..., offset_bytes: _Optional[int] = ...) -> None: ...

class ArenaSpec(_message.Message):
    __slots__ = ("arena_id", "size_bytes")
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    arena_id: int
    size_bytes: int
    def __init__(self, arena_id: _Optional[int] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class SegmentSpec(_message.Message):
    __slots__ = ("size_bytes", "live", "shadow", "signature")
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    SHADOW_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    size_bytes: int
    live: Region
    shadow: Region
    signature: bytes
    def __init__(self, size_bytes: _Optional[int] = ..., live: _Optional[_Union[Region, _Mapping]] = ..., shadow: _Optional[_Union[Region, _Mapping]] = ..., signature: _Optional[bytes] = ...) -> None: ...

class StoredTensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "segment", "offset_bytes", "size_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: _tensor_pb2.Dtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    segment: int
    offset_bytes: int
    size_bytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[_tensor_pb2.Dtype, str]] = ..., shape: _Optional[_Iterable[int]] = ..., segment: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class StoreManifest(_message.Message):
    __slots__ = ("arenas", "segments", "tensors", "tensors_included", "dirty", "layout_version")
    ARENAS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_INCLUDED_FIELD_NUMBER: _ClassVar[int]
    DIRTY_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    arenas: _containers.RepeatedCompositeFieldContainer[ArenaSpec]
    segments: _containers.RepeatedCompositeFieldContainer[SegmentSpec]
    tensors: _containers.RepeatedCompositeFieldContainer[StoredTensorSpec]
    tensors_included: bool
    dirty: _containers.RepeatedScalarFieldContainer[str]
    layout_version: int
    def __init__(self, arenas: _Optional[_Iterable[_Union[ArenaSpec, _Mapping]]] = ..., segments: _Optional[_Iterable[_Union[SegmentSpec, _Mapping]]] = ..., tensors: _Optional[_Iterable[_Union[StoredTensorSpec, _Mapping]]] = ..., tensors_included: _Optional[bool] = ..., dirty: _Optional[_Iterable[str]] = ..., layout_version: _Optional[int] = ...) -> None: ...

class WorkerCommand(_message.Message):
    __slots__ = ("command_id", "join_group", "leave_group", "prepare_update", "receive_bucket", "commit_update", "abort_update", "compute_checksums", "shutdown", "allocate_update", "restore_store", "export_store")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    JOIN_GROUP_FIELD_NUMBER: _ClassVar[int]
    LEAVE_GROUP_FIELD_NUMBER: _ClassVar[int]
    PREPARE_UPDATE_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_BUCKET_FIELD_NUMBER: _ClassVar[int]
    COMMIT_UPDATE_FIELD_NUMBER: _ClassVar[int]
    ABORT_UPDATE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    ALLOCATE_UPDATE_FIELD_NUMBER: _ClassVar[int]
    RESTORE_STORE_FIELD_NUMBER: _ClassVar[int]
    EXPORT_STORE_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    join_group: JoinGroupCommand
    leave_group: LeaveGroupCommand
    prepare_update: PrepareUpdateCommand
    receive_bucket: ReceiveBucketCommand
    commit_update: CommitUpdateCommand
    abort_update: AbortUpdateCommand
    compute_checksums: ComputeChecksumsCommand
    shutdown: ShutdownCommand
    allocate_update: AllocateUpdateCommand
    restore_store: RestoreStoreCommand
    export_store: ExportStoreCommand
    def __init__(self, command_id: _Optional[int] = ..., join_group: _Optional[_Union[JoinGroupCommand, _Mapping]] = ..., leave_group: _Optional[_Union[LeaveGroupCommand, _Mapping]] = ..., prepare_update: _Optional[_Union[PrepareUpdateCommand, _Mapping]] = ..., receive_bucket: _Optional[_Union[ReceiveBucketCommand, _Mapping]] = ..., commit_update: _Optional[_Union[CommitUpdateCommand, _Mapping]] = ..., abort_update: _Optional[_Union[AbortUpdateCommand, _Mapping]] = ..., compute_checksums: _Optional[_Union[ComputeChecksumsCommand, _Mapping]] = ..., shutdown: _Optional[_Union[ShutdownCommand, _Mapping]] = ..., allocate_update: _Optional[_Union[AllocateUpdateCommand, _Mapping]] = ..., restore_store: _Optional[_Union[RestoreStoreCommand, _Mapping]] = ..., export_store: _Optional[_Union[ExportStoreCommand, _Mapping]] = ...) -> None: ...

class StoreStatus(_message.Message):
    __slots__ = ("state", "tensor_count", "store_bytes")
    STATE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    STORE_BYTES_FIELD_NUMBER: _ClassVar[int]
    state: _weight_sync_service_pb2.StoreState
    tensor_count: int
    store_bytes: int
    def __init__(self, state: _Optional[_Union[_weight_sync_service_pb2.StoreState, str]] = ..., tensor_count: _Optional[int] = ..., store_bytes: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("update_id", "fast_path_bucket_count", "needed_bytes", "device_available_bytes", "held_bytes")
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    FAST_PATH_BUCKET_COUNT_FIELD_NUMBER: _ClassVar[int]
    NEEDED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    fast_path_bucket_count: int
    needed_bytes: int
    device_available_bytes: int
    held_bytes: int
    def __init__(self, update_id: _Optional[str] = ..., fast_path_bucket_count: _Optional[int] = ..., needed_bytes: _Optional[int] = ..., device_available_bytes: _Optional[int] = ..., held_bytes: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("update_id", "manifest", "sent_arena_ids")
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    SENT_ARENA_IDS_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    manifest: StoreManifest
    sent_arena_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, update_id: _Optional[str] = ..., manifest: _Optional[_Union[StoreManifest, _Mapping]] = ..., sent_arena_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class UpdateAborted(_message.Message):
    __slots__ = ("update_id", "manifest", "sent_arena_ids")
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    SENT_ARENA_IDS_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    manifest: StoreManifest
    sent_arena_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, update_id: _Optional[str] = ..., manifest: _Optional[_Union[StoreManifest, _Mapping]] = ..., sent_arena_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StoreRestored(_message.Message):
    __slots__ = ("tensor_count",)
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    tensor_count: int
    def __init__(self, tensor_count: _Optional[int] = ...) -> None: ...

class ChecksumsComputed(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[_weight_sync_service_pb2.TensorChecksum]
    def __init__(self, tensors: _Optional[_Iterable[_Union[_weight_sync_service_pb2.TensorChecksum, _Mapping]]] = ...) -> None: ...

class CommandFailed(_message.Message):
    __slots__ = ("code", "reason", "message", "metadata", "broken_group_id")
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
    code: int
    reason: str
    message: str
    metadata: _containers.ScalarMap[str, str]
    broken_group_id: str
    def __init__(self, code: _Optional[int] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., broken_group_id: _Optional[str] = ...) -> None: ...

class WorkerEvent(_message.Message):
    __slots__ = ("command_id", "store", "started", "group_joined", "group_left", "update_prepared", "bucket_received", "update_committed", "update_aborted", "checksums_computed", "command_failed", "store_restored", "store_exported")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    GROUP_JOINED_FIELD_NUMBER: _ClassVar[int]
    GROUP_LEFT_FIELD_NUMBER: _ClassVar[int]
    UPDATE_PREPARED_FIELD_NUMBER: _ClassVar[int]
    BUCKET_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    UPDATE_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ABORTED_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FAILED_FIELD_NUMBER: _ClassVar[int]
    STORE_RESTORED_FIELD_NUMBER: _ClassVar[int]
    STORE_EXPORTED_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    store: StoreStatus
    started: WorkerStarted
    group_joined: GroupJoined
    group_left: GroupLeft
    update_prepared: UpdatePrepared
    bucket_received: BucketReceived
    update_committed: UpdateCommitted
    update_aborted: UpdateAborted
    checksums_computed: ChecksumsComputed
    command_failed: CommandFailed
    store_restored: StoreRestored
    store_exported: StoreExported
    def __init__(self, command_id: _Optional[int] = ..., store: _Optional[_Union[StoreStatus, _Mapping]] = ..., started: _Optional[_Union[WorkerStarted, _Mapping]] = ..., group_joined: _Optional[_Union[GroupJoined, _Mapping]] = ..., group_left: _Optional[_Union[GroupLeft, _Mapping]] = ..., update_prepared: _Optional[_Union[UpdatePrepared, _Mapping]] = ..., bucket_received: _Optional[_Union[BucketReceived, _Mapping]] = ..., update_committed: _Optional[_Union[UpdateCommitted, _Mapping]] = ..., update_aborted: _Optional[_Union[UpdateAborted, _Mapping]] = ..., checksums_computed: _Optional[_Union[ChecksumsComputed, _Mapping]] = ..., command_failed: _Optional[_Union[CommandFailed, _Mapping]] = ..., store_restored: _Optional[_Union[StoreRestored, _Mapping]] = ..., store_exported: _Optional[_Union[StoreExported, _Mapping]] = ...) -> None: ...
