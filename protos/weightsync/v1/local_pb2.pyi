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

class LocalRequest(_message.Message):
    __slots__ = ("attach_store", "acquire_version", "release_version", "open_ingress", "get_status", "open_store")
    ATTACH_STORE_FIELD_NUMBER: _ClassVar[int]
    ACQUIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    RELEASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    OPEN_INGRESS_FIELD_NUMBER: _ClassVar[int]
    GET_STATUS_FIELD_NUMBER: _ClassVar[int]
    OPEN_STORE_FIELD_NUMBER: _ClassVar[int]
    attach_store: AttachStoreRequest
    acquire_version: AcquireVersionRequest
    release_version: ReleaseVersionRequest
    open_ingress: OpenIngressRequest
    get_status: GetStatusRequest
    open_store: OpenStoreRequest
    def __init__(self, attach_store: _Optional[_Union[AttachStoreRequest, _Mapping]] = ..., acquire_version: _Optional[_Union[AcquireVersionRequest, _Mapping]] = ..., release_version: _Optional[_Union[ReleaseVersionRequest, _Mapping]] = ..., open_ingress: _Optional[_Union[OpenIngressRequest, _Mapping]] = ..., get_status: _Optional[_Union[GetStatusRequest, _Mapping]] = ..., open_store: _Optional[_Union[OpenStoreRequest, _Mapping]] = ...) -> None: ...

class LocalResponse(_message.Message):
    __slots__ = ("attach_store", "acquire_version", "release_version", "open_ingress", "error", "get_status", "open_store")
    ATTACH_STORE_FIELD_NUMBER: _ClassVar[int]
    ACQUIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    RELEASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    OPEN_INGRESS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    GET_STATUS_FIELD_NUMBER: _ClassVar[int]
    OPEN_STORE_FIELD_NUMBER: _ClassVar[int]
    attach_store: AttachStoreResponse
    acquire_version: AcquireVersionResponse
    release_version: ReleaseVersionResponse
    open_ingress: OpenIngressResponse
    error: LocalError
    get_status: GetStatusResponse
    open_store: OpenStoreResponse
    def __init__(self, attach_store: _Optional[_Union[AttachStoreResponse, _Mapping]] = ..., acquire_version: _Optional[_Union[AcquireVersionResponse, _Mapping]] = ..., release_version: _Optional[_Union[ReleaseVersionResponse, _Mapping]] = ..., open_ingress: _Optional[_Union[OpenIngressResponse, _Mapping]] = ..., error: _Optional[_Union[LocalError, _Mapping]] = ..., get_status: _Optional[_Union[GetStatusResponse, _Mapping]] = ..., open_store: _Optional[_Union[OpenStoreResponse, _Mapping]] = ...) -> None: ...

class LocalError(_message.Message):
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

class AttachStoreRequest(_message.Message):
    __slots__ = ("engine_name", "token")
    ENGINE_NAME_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    engine_name: str
    token: str
    def __init__(self, engine_name: _Optional[str] = ..., token: _Optional[str] = ...) -> None: ...

class AttachStoreResponse(_message.Message):
    __slots__ = ("version", "store_state")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STORE_STATE_FIELD_NUMBER: _ClassVar[int]
    version: _weight_sync_service_pb2.WeightVersion
    store_state: _weight_sync_service_pb2.StoreState
    def __init__(self, version: _Optional[_Union[_weight_sync_service_pb2.WeightVersion, _Mapping]] = ..., store_state: _Optional[_Union[_weight_sync_service_pb2.StoreState, str]] = ...) -> None: ...

class AcquireVersionRequest(_message.Message):
    __slots__ = ("generation", "wait")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    generation: int
    wait: _duration_pb2.Duration
    def __init__(self, generation: _Optional[int] = ..., wait: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class ArenaHandle(_message.Message):
    __slots__ = ("arena_id", "size_bytes", "fd_index")
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FD_INDEX_FIELD_NUMBER: _ClassVar[int]
    arena_id: int
    size_bytes: int
    fd_index: int
    def __init__(self, arena_id: _Optional[int] = ..., size_bytes: _Optional[int] = ..., fd_index: _Optional[int] = ...) -> None: ...

class StoredTensorLocation(_message.Message):
    __slots__ = ("name", "dtype", "shape", "arena_id", "offset_bytes", "size_bytes", "written_generation")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_GENERATION_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: _tensor_pb2.Dtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    arena_id: int
    offset_bytes: int
    size_bytes: int
    written_generation: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[_tensor_pb2.Dtype, str]] = ..., shape: _Optional[_Iterable[int]] = ..., arena_id: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., size_bytes: _Optional[int] = ..., written_generation: _Optional[int] = ...) -> None: ...

class AcquireVersionResponse(_message.Message):
    __slots__ = ("lease_id", "version", "arenas", "tensors")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ARENAS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    version: _weight_sync_service_pb2.WeightVersion
    arenas: _containers.RepeatedCompositeFieldContainer[ArenaHandle]
    tensors: _containers.RepeatedCompositeFieldContainer[StoredTensorLocation]
    def __init__(self, lease_id: _Optional[int] = ..., version: _Optional[_Union[_weight_sync_service_pb2.WeightVersion, _Mapping]] = ..., arenas: _Optional[_Iterable[_Union[ArenaHandle, _Mapping]]] = ..., tensors: _Optional[_Iterable[_Union[StoredTensorLocation, _Mapping]]] = ...) -> None: ...

class ReleaseVersionRequest(_message.Message):
    __slots__ = ("lease_id", "applied", "error")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    applied: bool
    error: str
    def __init__(self, lease_id: _Optional[int] = ..., applied: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class ReleaseVersionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OpenStoreRequest(_message.Message):
    __slots__ = ("arena_ids",)
    ARENA_IDS_FIELD_NUMBER: _ClassVar[int]
    arena_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, arena_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class OpenStoreResponse(_message.Message):
    __slots__ = ("arenas", "store_arena_ids")
    ARENAS_FIELD_NUMBER: _ClassVar[int]
    STORE_ARENA_IDS_FIELD_NUMBER: _ClassVar[int]
    arenas: _containers.RepeatedCompositeFieldContainer[ArenaHandle]
    store_arena_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, arenas: _Optional[_Iterable[_Union[ArenaHandle, _Mapping]]] = ..., store_arena_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class OpenIngressRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OpenIngressResponse(_message.Message):
    __slots__ = ("slot_bytes", "slot_count")
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOT_COUNT_FIELD_NUMBER: _ClassVar[int]
    slot_bytes: int
    slot_count: int
    def __init__(self, slot_bytes: _Optional[int] = ..., slot_count: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("version", "store_state")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STORE_STATE_FIELD_NUMBER: _ClassVar[int]
    version: _weight_sync_service_pb2.WeightVersion
    store_state: _weight_sync_service_pb2.StoreState
    def __init__(self, version: _Optional[_Union[_weight_sync_service_pb2.WeightVersion, _Mapping]] = ..., store_state: _Optional[_Union[_weight_sync_service_pb2.StoreState, str]] = ...) -> None: ...
