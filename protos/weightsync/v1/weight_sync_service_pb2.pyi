import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from weightsync.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Backend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BACKEND_UNSPECIFIED: _ClassVar[Backend]
    BACKEND_GLOO: _ClassVar[Backend]
    BACKEND_NCCL: _ClassVar[Backend]

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_UNSPECIFIED: _ClassVar[Transport]
    TRANSPORT_COLLECTIVE: _ClassVar[Transport]
    TRANSPORT_SHM: _ClassVar[Transport]
    TRANSPORT_INLINE: _ClassVar[Transport]

class UpdateMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UPDATE_MODE_UNSPECIFIED: _ClassVar[UpdateMode]
    UPDATE_MODE_IN_PLACE: _ClassVar[UpdateMode]
    UPDATE_MODE_STAGED: _ClassVar[UpdateMode]

class StoreState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STORE_STATE_UNSPECIFIED: _ClassVar[StoreState]
    STORE_STATE_EMPTY: _ClassVar[StoreState]
    STORE_STATE_CONSISTENT: _ClassVar[StoreState]
    STORE_STATE_UPDATING: _ClassVar[StoreState]
    STORE_STATE_INCONSISTENT: _ClassVar[StoreState]
    STORE_STATE_LOST: _ClassVar[StoreState]

class GroupState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GROUP_STATE_UNSPECIFIED: _ClassVar[GroupState]
    GROUP_STATE_JOINING: _ClassVar[GroupState]
    GROUP_STATE_READY: _ClassVar[GroupState]
    GROUP_STATE_BROKEN: _ClassVar[GroupState]

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_STARTING: _ClassVar[WorkerState]
    WORKER_STATE_RUNNING: _ClassVar[WorkerState]
    WORKER_STATE_RESTARTING: _ClassVar[WorkerState]
    WORKER_STATE_STOPPED: _ClassVar[WorkerState]
    WORKER_STATE_UNRESPONSIVE: _ClassVar[WorkerState]

class EngineState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_STATE_UNSPECIFIED: _ClassVar[EngineState]
    ENGINE_STATE_SERVING: _ClassVar[EngineState]
    ENGINE_STATE_APPLYING: _ClassVar[EngineState]
    ENGINE_STATE_FAILED: _ClassVar[EngineState]
    ENGINE_STATE_UNREACHABLE: _ClassVar[EngineState]

class BucketCompression(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BUCKET_COMPRESSION_UNSPECIFIED: _ClassVar[BucketCompression]
    BUCKET_COMPRESSION_ZSTD: _ClassVar[BucketCompression]
BACKEND_UNSPECIFIED: Backend
BACKEND_GLOO: Backend
BACKEND_NCCL: Backend
TRANSPORT_UNSPECIFIED: Transport
TRANSPORT_COLLECTIVE: Transport
TRANSPORT_SHM: Transport
TRANSPORT_INLINE: Transport
UPDATE_MODE_UNSPECIFIED: UpdateMode
UPDATE_MODE_IN_PLACE: UpdateMode
UPDATE_MODE_STAGED: UpdateMode
STORE_STATE_UNSPECIFIED: StoreState
STORE_STATE_EMPTY: StoreState
STORE_STATE_CONSISTENT: StoreState
STORE_STATE_UPDATING: StoreState
STORE_STATE_INCONSISTENT: StoreState
STORE_STATE_LOST: StoreState
GROUP_STATE_UNSPECIFIED: GroupState
GROUP_STATE_JOINING: GroupState
GROUP_STATE_READY: GroupState
GROUP_STATE_BROKEN: GroupState
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_STARTING: WorkerState
WORKER_STATE_RUNNING: WorkerState
WORKER_STATE_RESTARTING: WorkerState
WORKER_STATE_STOPPED: WorkerState
WORKER_STATE_UNRESPONSIVE: WorkerState
ENGINE_STATE_UNSPECIFIED: EngineState
ENGINE_STATE_SERVING: EngineState
ENGINE_STATE_APPLYING: EngineState
ENGINE_STATE_FAILED: EngineState
ENGINE_STATE_UNREACHABLE: EngineState
BUCKET_COMPRESSION_UNSPECIFIED: BucketCompression
BUCKET_COMPRESSION_ZSTD: BucketCompression

class WeightVersion(_message.Message):
    __slots__ = ("version", "generation", "commit_time", "store_epoch")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    COMMIT_TIME_FIELD_NUMBER: _ClassVar[int]
    STORE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    version: str
    generation: int
    commit_time: _timestamp_pb2.Timestamp
    store_epoch: int
    def __init__(self, version: _Optional[str] = ..., generation: _Optional[int] = ..., commit_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., store_epoch: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("index", "device", "backend", "state", "store_state", "tensor_count", "store_bytes", "pid", "restart_count", "device_uuid", "staging_bytes", "staging_on_device", "received_bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STORE_STATE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    STORE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    RESTART_COUNT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    STAGING_BYTES_FIELD_NUMBER: _ClassVar[int]
    STAGING_ON_DEVICE_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    device: str
    backend: Backend
    state: WorkerState
    store_state: StoreState
    tensor_count: int
    store_bytes: int
    pid: int
    restart_count: int
    device_uuid: str
    staging_bytes: int
    staging_on_device: bool
    received_bytes: int
    def __init__(self, index: _Optional[int] = ..., device: _Optional[str] = ..., backend: _Optional[_Union[Backend, str]] = ..., state: _Optional[_Union[WorkerState, str]] = ..., store_state: _Optional[_Union[StoreState, str]] = ..., tensor_count: _Optional[int] = ..., store_bytes: _Optional[int] = ..., pid: _Optional[int] = ..., restart_count: _Optional[int] = ..., device_uuid: _Optional[str] = ..., staging_bytes: _Optional[int] = ..., staging_on_device: _Optional[bool] = ..., received_bytes: _Optional[int] = ...) -> None: ...

class StoreInfo(_message.Message):
    __slots__ = ("state", "tensor_count", "live_bytes", "held_bytes", "tensor_filter")
    STATE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    LIVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FILTER_FIELD_NUMBER: _ClassVar[int]
    state: StoreState
    tensor_count: int
    live_bytes: int
    held_bytes: int
    tensor_filter: str
    def __init__(self, state: _Optional[_Union[StoreState, str]] = ..., tensor_count: _Optional[int] = ..., live_bytes: _Optional[int] = ..., held_bytes: _Optional[int] = ..., tensor_filter: _Optional[str] = ...) -> None: ...

class ServerLimits(_message.Message):
    __slots__ = ("max_tensors", "max_plan_bytes", "max_bucket_bytes", "max_message_bytes", "max_chunk_bytes", "ingress_slot_bytes", "ingress_slot_count")
    MAX_TENSORS_FIELD_NUMBER: _ClassVar[int]
    MAX_PLAN_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    INGRESS_SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    INGRESS_SLOT_COUNT_FIELD_NUMBER: _ClassVar[int]
    max_tensors: int
    max_plan_bytes: int
    max_bucket_bytes: int
    max_message_bytes: int
    max_chunk_bytes: int
    ingress_slot_bytes: int
    ingress_slot_count: int
    def __init__(self, max_tensors: _Optional[int] = ..., max_plan_bytes: _Optional[int] = ..., max_bucket_bytes: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ..., ingress_slot_bytes: _Optional[int] = ..., ingress_slot_count: _Optional[int] = ...) -> None: ...

class EngineStatus(_message.Message):
    __slots__ = ("name", "kind", "endpoint", "applied_version", "applied_time", "commit_to_serving", "state", "last_error")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    APPLIED_VERSION_FIELD_NUMBER: _ClassVar[int]
    APPLIED_TIME_FIELD_NUMBER: _ClassVar[int]
    COMMIT_TO_SERVING_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    endpoint: str
    applied_version: WeightVersion
    applied_time: _timestamp_pb2.Timestamp
    commit_to_serving: _duration_pb2.Duration
    state: EngineState
    last_error: str
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., endpoint: _Optional[str] = ..., applied_version: _Optional[_Union[WeightVersion, _Mapping]] = ..., applied_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., commit_to_serving: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., state: _Optional[_Union[EngineState, str]] = ..., last_error: _Optional[str] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetServerInfoResponse(_message.Message):
    __slots__ = ("server_version", "workers", "backends", "transports", "store_state", "current_version", "limits", "draining", "engines", "local_socket", "store", "bucket_compressions", "deferred_buckets", "data_plane_revision", "parts")
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    STORE_STATE_FIELD_NUMBER: _ClassVar[int]
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    BUCKET_COMPRESSIONS_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_REVISION_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    server_version: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    backends: _containers.RepeatedScalarFieldContainer[Backend]
    transports: _containers.RepeatedScalarFieldContainer[Transport]
    store_state: StoreState
    current_version: WeightVersion
    limits: ServerLimits
    draining: bool
    engines: _containers.RepeatedCompositeFieldContainer[EngineStatus]
    local_socket: str
    store: StoreInfo
    bucket_compressions: _containers.RepeatedScalarFieldContainer[BucketCompression]
    deferred_buckets: bool
    data_plane_revision: int
    parts: bool
    def __init__(self, server_version: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., backends: _Optional[_Iterable[_Union[Backend, str]]] = ..., transports: _Optional[_Iterable[_Union[Transport, str]]] = ..., store_state: _Optional[_Union[StoreState, str]] = ..., current_version: _Optional[_Union[WeightVersion, _Mapping]] = ..., limits: _Optional[_Union[ServerLimits, _Mapping]] = ..., draining: _Optional[bool] = ..., engines: _Optional[_Iterable[_Union[EngineStatus, _Mapping]]] = ..., local_socket: _Optional[str] = ..., store: _Optional[_Union[StoreInfo, _Mapping]] = ..., bucket_compressions: _Optional[_Iterable[_Union[BucketCompression, str]]] = ..., deferred_buckets: _Optional[bool] = ..., data_plane_revision: _Optional[int] = ..., parts: _Optional[bool] = ...) -> None: ...

class TransferGroup(_message.Message):
    __slots__ = ("group_id", "world_size", "rank_offset", "backend", "state", "timeout", "broken_reason", "trainer_ranks")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    BROKEN_REASON_FIELD_NUMBER: _ClassVar[int]
    TRAINER_RANKS_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    world_size: int
    rank_offset: int
    backend: Backend
    state: GroupState
    timeout: _duration_pb2.Duration
    broken_reason: str
    trainer_ranks: int
    def __init__(self, group_id: _Optional[str] = ..., world_size: _Optional[int] = ..., rank_offset: _Optional[int] = ..., backend: _Optional[_Union[Backend, str]] = ..., state: _Optional[_Union[GroupState, str]] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., broken_reason: _Optional[str] = ..., trainer_ranks: _Optional[int] = ...) -> None: ...

class CreateTransferGroupRequest(_message.Message):
    __slots__ = ("group_id", "store_host", "store_port", "world_size", "rank_offset", "backend", "timeout", "trainer_ranks")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    TRAINER_RANKS_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    store_host: str
    store_port: int
    world_size: int
    rank_offset: int
    backend: Backend
    timeout: _duration_pb2.Duration
    trainer_ranks: int
    def __init__(self, group_id: _Optional[str] = ..., store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., world_size: _Optional[int] = ..., rank_offset: _Optional[int] = ..., backend: _Optional[_Union[Backend, str]] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., trainer_ranks: _Optional[int] = ...) -> None: ...

class CreateTransferGroupResponse(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: TransferGroup
    def __init__(self, group: _Optional[_Union[TransferGroup, _Mapping]] = ...) -> None: ...

class DeleteTransferGroupRequest(_message.Message):
    __slots__ = ("group_id",)
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    def __init__(self, group_id: _Optional[str] = ...) -> None: ...

class DeleteTransferGroupResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTransferGroupsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTransferGroupsResponse(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[TransferGroup]
    def __init__(self, groups: _Optional[_Iterable[_Union[TransferGroup, _Mapping]]] = ...) -> None: ...

class BeginUpdate(_message.Message):
    __slots__ = ("group_id", "version", "plan", "plan_id", "mode", "transport", "allow_new_tensors", "base_generation", "base_store_epoch", "part", "store_writes")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ALLOW_NEW_TENSORS_FIELD_NUMBER: _ClassVar[int]
    BASE_GENERATION_FIELD_NUMBER: _ClassVar[int]
    BASE_STORE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    STORE_WRITES_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    version: str
    plan: _tensor_pb2.WeightPlan
    plan_id: str
    mode: UpdateMode
    transport: Transport
    allow_new_tensors: bool
    base_generation: int
    base_store_epoch: int
    part: UpdatePart
    store_writes: bool
    def __init__(self, group_id: _Optional[str] = ..., version: _Optional[str] = ..., plan: _Optional[_Union[_tensor_pb2.WeightPlan, _Mapping]] = ..., plan_id: _Optional[str] = ..., mode: _Optional[_Union[UpdateMode, str]] = ..., transport: _Optional[_Union[Transport, str]] = ..., allow_new_tensors: _Optional[bool] = ..., base_generation: _Optional[int] = ..., base_store_epoch: _Optional[int] = ..., part: _Optional[_Union[UpdatePart, _Mapping]] = ..., store_writes: _Optional[bool] = ...) -> None: ...

class UpdatePart(_message.Message):
    __slots__ = ("update_key", "rank", "world", "whole_tensors", "boxed_tensors", "join_timeout")
    UPDATE_KEY_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_FIELD_NUMBER: _ClassVar[int]
    WHOLE_TENSORS_FIELD_NUMBER: _ClassVar[int]
    BOXED_TENSORS_FIELD_NUMBER: _ClassVar[int]
    JOIN_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    update_key: str
    rank: int
    world: int
    whole_tensors: _containers.RepeatedScalarFieldContainer[str]
    boxed_tensors: _containers.RepeatedCompositeFieldContainer[PartBoxes]
    join_timeout: _duration_pb2.Duration
    def __init__(self, update_key: _Optional[str] = ..., rank: _Optional[int] = ..., world: _Optional[int] = ..., whole_tensors: _Optional[_Iterable[str]] = ..., boxed_tensors: _Optional[_Iterable[_Union[PartBoxes, _Mapping]]] = ..., join_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class PartBoxes(_message.Message):
    __slots__ = ("name", "boxes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BOXES_FIELD_NUMBER: _ClassVar[int]
    name: str
    boxes: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorBox]
    def __init__(self, name: _Optional[str] = ..., boxes: _Optional[_Iterable[_Union[_tensor_pb2.TensorBox, _Mapping]]] = ...) -> None: ...

class BucketStart(_message.Message):
    __slots__ = ("sequence", "checksum", "size_bytes", "tail", "compression", "layout")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    checksum: _tensor_pb2.Checksum
    size_bytes: int
    tail: bytes
    compression: BucketCompression
    layout: _tensor_pb2.BucketSpec
    def __init__(self, sequence: _Optional[int] = ..., checksum: _Optional[_Union[_tensor_pb2.Checksum, _Mapping]] = ..., size_bytes: _Optional[int] = ..., tail: _Optional[bytes] = ..., compression: _Optional[_Union[BucketCompression, str]] = ..., layout: _Optional[_Union[_tensor_pb2.BucketSpec, _Mapping]] = ...) -> None: ...

class BucketChunk(_message.Message):
    __slots__ = ("sequence", "offset_bytes", "data")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    offset_bytes: int
    data: bytes
    def __init__(self, sequence: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class CommitUpdate(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AbortUpdate(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("begin", "bucket_start", "commit", "abort", "bucket_chunk")
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    BUCKET_START_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    BUCKET_CHUNK_FIELD_NUMBER: _ClassVar[int]
    begin: BeginUpdate
    bucket_start: BucketStart
    commit: CommitUpdate
    abort: AbortUpdate
    bucket_chunk: BucketChunk
    def __init__(self, begin: _Optional[_Union[BeginUpdate, _Mapping]] = ..., bucket_start: _Optional[_Union[BucketStart, _Mapping]] = ..., commit: _Optional[_Union[CommitUpdate, _Mapping]] = ..., abort: _Optional[_Union[AbortUpdate, _Mapping]] = ..., bucket_chunk: _Optional[_Union[BucketChunk, _Mapping]] = ...) -> None: ...

class UpdateReady(_message.Message):
    __slots__ = ("update_id", "plan_id", "bucket_count", "fast_path_bucket_count", "bucket_owner_ranks", "not_stored_buckets", "ingress_slot_first", "ingress_slot_count", "store_places")
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    BUCKET_COUNT_FIELD_NUMBER: _ClassVar[int]
    FAST_PATH_BUCKET_COUNT_FIELD_NUMBER: _ClassVar[int]
    BUCKET_OWNER_RANKS_FIELD_NUMBER: _ClassVar[int]
    NOT_STORED_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    INGRESS_SLOT_FIRST_FIELD_NUMBER: _ClassVar[int]
    INGRESS_SLOT_COUNT_FIELD_NUMBER: _ClassVar[int]
    STORE_PLACES_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    plan_id: str
    bucket_count: int
    fast_path_bucket_count: int
    bucket_owner_ranks: _containers.RepeatedScalarFieldContainer[int]
    not_stored_buckets: _containers.RepeatedScalarFieldContainer[int]
    ingress_slot_first: int
    ingress_slot_count: int
    store_places: _containers.RepeatedCompositeFieldContainer[StorePlace]
    def __init__(self, update_id: _Optional[str] = ..., plan_id: _Optional[str] = ..., bucket_count: _Optional[int] = ..., fast_path_bucket_count: _Optional[int] = ..., bucket_owner_ranks: _Optional[_Iterable[int]] = ..., not_stored_buckets: _Optional[_Iterable[int]] = ..., ingress_slot_first: _Optional[int] = ..., ingress_slot_count: _Optional[int] = ..., store_places: _Optional[_Iterable[_Union[StorePlace, _Mapping]]] = ...) -> None: ...

class StorePlace(_message.Message):
    __slots__ = ("sequence", "regions")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    regions: _containers.RepeatedCompositeFieldContainer[StoreRegion]
    def __init__(self, sequence: _Optional[int] = ..., regions: _Optional[_Iterable[_Union[StoreRegion, _Mapping]]] = ...) -> None: ...

class StoreRegion(_message.Message):
    __slots__ = ("bucket_offset_bytes", "size_bytes", "arena_id", "offset_bytes")
    BUCKET_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    bucket_offset_bytes: int
    size_bytes: int
    arena_id: int
    offset_bytes: int
    def __init__(self, bucket_offset_bytes: _Optional[int] = ..., size_bytes: _Optional[int] = ..., arena_id: _Optional[int] = ..., offset_bytes: _Optional[int] = ...) -> None: ...

class BucketApplied(_message.Message):
    __slots__ = ("sequence", "size_bytes")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    size_bytes: int
    def __init__(self, sequence: _Optional[int] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class UpdateAborting(_message.Message):
    __slots__ = ("code", "reason", "message", "metadata")
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
    code: int
    reason: str
    message: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, code: _Optional[int] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class UpdateCommitted(_message.Message):
    __slots__ = ("version", "size_bytes", "duration")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DURATION_FIELD_NUMBER: _ClassVar[int]
    version: WeightVersion
    size_bytes: int
    duration: _duration_pb2.Duration
    def __init__(self, version: _Optional[_Union[WeightVersion, _Mapping]] = ..., size_bytes: _Optional[int] = ..., duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("ready", "bucket_applied", "aborting", "committed", "waiting")
    READY_FIELD_NUMBER: _ClassVar[int]
    BUCKET_APPLIED_FIELD_NUMBER: _ClassVar[int]
    ABORTING_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    ready: UpdateReady
    bucket_applied: BucketApplied
    aborting: UpdateAborting
    committed: UpdateCommitted
    waiting: PartsWaiting
    def __init__(self, ready: _Optional[_Union[UpdateReady, _Mapping]] = ..., bucket_applied: _Optional[_Union[BucketApplied, _Mapping]] = ..., aborting: _Optional[_Union[UpdateAborting, _Mapping]] = ..., committed: _Optional[_Union[UpdateCommitted, _Mapping]] = ..., waiting: _Optional[_Union[PartsWaiting, _Mapping]] = ...) -> None: ...

class PartsWaiting(_message.Message):
    __slots__ = ("joining", "sending")
    JOINING_FIELD_NUMBER: _ClassVar[int]
    SENDING_FIELD_NUMBER: _ClassVar[int]
    joining: _containers.RepeatedScalarFieldContainer[int]
    sending: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, joining: _Optional[_Iterable[int]] = ..., sending: _Optional[_Iterable[int]] = ...) -> None: ...

class GetTensorChecksumsRequest(_message.Message):
    __slots__ = ("names", "boxes")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    BOXES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    boxes: _containers.RepeatedCompositeFieldContainer[TensorBoxRef]
    def __init__(self, names: _Optional[_Iterable[str]] = ..., boxes: _Optional[_Iterable[_Union[TensorBoxRef, _Mapping]]] = ...) -> None: ...

class TensorBoxRef(_message.Message):
    __slots__ = ("name", "box")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BOX_FIELD_NUMBER: _ClassVar[int]
    name: str
    box: _tensor_pb2.TensorBox
    def __init__(self, name: _Optional[str] = ..., box: _Optional[_Union[_tensor_pb2.TensorBox, _Mapping]] = ...) -> None: ...

class BoxChecksum(_message.Message):
    __slots__ = ("name", "box", "checksum")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BOX_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    name: str
    box: _tensor_pb2.TensorBox
    checksum: _tensor_pb2.Checksum
    def __init__(self, name: _Optional[str] = ..., box: _Optional[_Union[_tensor_pb2.TensorBox, _Mapping]] = ..., checksum: _Optional[_Union[_tensor_pb2.Checksum, _Mapping]] = ...) -> None: ...

class TensorChecksum(_message.Message):
    __slots__ = ("name", "dtype", "shape", "checksum")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: _tensor_pb2.Dtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    checksum: _tensor_pb2.Checksum
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[_tensor_pb2.Dtype, str]] = ..., shape: _Optional[_Iterable[int]] = ..., checksum: _Optional[_Union[_tensor_pb2.Checksum, _Mapping]] = ...) -> None: ...

class WorkerChecksums(_message.Message):
    __slots__ = ("worker_index", "tensors")
    WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    worker_index: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorChecksum]
    def __init__(self, worker_index: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorChecksum, _Mapping]]] = ...) -> None: ...

class GetTensorChecksumsResponse(_message.Message):
    __slots__ = ("version", "store_state", "workers", "tensors", "not_stored", "boxes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STORE_STATE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NOT_STORED_FIELD_NUMBER: _ClassVar[int]
    BOXES_FIELD_NUMBER: _ClassVar[int]
    version: WeightVersion
    store_state: StoreState
    workers: _containers.RepeatedCompositeFieldContainer[WorkerChecksums]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorChecksum]
    not_stored: _containers.RepeatedScalarFieldContainer[str]
    boxes: _containers.RepeatedCompositeFieldContainer[BoxChecksum]
    def __init__(self, version: _Optional[_Union[WeightVersion, _Mapping]] = ..., store_state: _Optional[_Union[StoreState, str]] = ..., workers: _Optional[_Iterable[_Union[WorkerChecksums, _Mapping]]] = ..., tensors: _Optional[_Iterable[_Union[TensorChecksum, _Mapping]]] = ..., not_stored: _Optional[_Iterable[str]] = ..., boxes: _Optional[_Iterable[_Union[BoxChecksum, _Mapping]]] = ...) -> None: ...

class WatchWeightsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchWeightsResponse(_message.Message):
    __slots__ = ("version", "store_state", "event_time", "engines")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STORE_STATE_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIME_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    version: WeightVersion
    store_state: StoreState
    event_time: _timestamp_pb2.Timestamp
    engines: _containers.RepeatedCompositeFieldContainer[EngineStatus]
    def __init__(self, version: _Optional[_Union[WeightVersion, _Mapping]] = ..., store_state: _Optional[_Union[StoreState, str]] = ..., event_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., engines: _Optional[_Iterable[_Union[EngineStatus, _Mapping]]] = ...) -> None: ...
