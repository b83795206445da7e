from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Dtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[Dtype]
    DTYPE_FLOAT32: _ClassVar[Dtype]
    DTYPE_FLOAT16: _ClassVar[Dtype]
    DTYPE_BFLOAT16: _ClassVar[Dtype]
    DTYPE_FLOAT64: _ClassVar[Dtype]
    DTYPE_FLOAT8_E4M3FN: _ClassVar[Dtype]
    DTYPE_FLOAT8_E5M2: _ClassVar[Dtype]
    DTYPE_INT8: _ClassVar[Dtype]
    DTYPE_UINT8: _ClassVar[Dtype]
    DTYPE_INT16: _ClassVar[Dtype]
    DTYPE_INT32: _ClassVar[Dtype]
    DTYPE_INT64: _ClassVar[Dtype]
    DTYPE_BOOL: _ClassVar[Dtype]

class ChecksumAlgorithm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHECKSUM_ALGORITHM_UNSPECIFIED: _ClassVar[ChecksumAlgorithm]
    CHECKSUM_ALGORITHM_WS64: _ClassVar[ChecksumAlgorithm]

class TensorEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TENSOR_ENCODING_UNSPECIFIED: _ClassVar[TensorEncoding]
    TENSOR_ENCODING_DENSE: _ClassVar[TensorEncoding]
    TENSOR_ENCODING_PATCH_POSITIONS: _ClassVar[TensorEncoding]
    TENSOR_ENCODING_PATCH_GAPS: _ClassVar[TensorEncoding]
    TENSOR_ENCODING_PATCH_BITMASK: _ClassVar[TensorEncoding]
    TENSOR_ENCODING_PATCH_XOR: _ClassVar[TensorEncoding]
DTYPE_UNSPECIFIED: Dtype
DTYPE_FLOAT32: Dtype
DTYPE_FLOAT16: Dtype
DTYPE_BFLOAT16: Dtype
DTYPE_FLOAT64: Dtype
DTYPE_FLOAT8_E4M3FN: Dtype
DTYPE_FLOAT8_E5M2: Dtype
DTYPE_INT8: Dtype
DTYPE_UINT8: Dtype
DTYPE_INT16: Dtype
DTYPE_INT32: Dtype
DTYPE_INT64: Dtype
DTYPE_BOOL: Dtype
CHECKSUM_ALGORITHM_UNSPECIFIED: ChecksumAlgorithm
CHECKSUM_ALGORITHM_WS64: ChecksumAlgorithm
TENSOR_ENCODING_UNSPECIFIED: TensorEncoding
TENSOR_ENCODING_DENSE: TensorEncoding
TENSOR_ENCODING_PATCH_POSITIONS: TensorEncoding
TENSOR_ENCODING_PATCH_GAPS: TensorEncoding
TENSOR_ENCODING_PATCH_BITMASK: TensorEncoding
TENSOR_ENCODING_PATCH_XOR: TensorEncoding

class Checksum(_message.Message):
    __slots__ = ("algorithm", "value")
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    algorithm: ChecksumAlgorithm
    value: int
    def __init__(self, algorithm: _Optional[_Union[ChecksumAlgorithm, str]] = ..., value: _Optional[int] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset_bytes", "size_bytes", "checksum", "encoding", "patch_count", "piece", "box")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    PATCH_COUNT_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    BOX_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: Dtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset_bytes: int
    size_bytes: int
    checksum: Checksum
    encoding: TensorEncoding
    patch_count: int
    piece: TensorPiece
    box: TensorBox
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[Dtype, str]] = ..., shape: _Optional[_Iterable[int]] = ..., offset_bytes: _Optional[int] = ..., size_bytes: _Optional[int] = ..., checksum: _Optional[_Union[Checksum, _Mapping]] = ..., encoding: _Optional[_Union[TensorEncoding, str]] = ..., patch_count: _Optional[int] = ..., piece: _Optional[_Union[TensorPiece, _Mapping]] = ..., box: _Optional[_Union[TensorBox, _Mapping]] = ...) -> None: ...

class TensorBox(_message.Message):
    __slots__ = ("offsets", "sizes")
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, offsets: _Optional[_Iterable[int]] = ..., sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class TensorPiece(_message.Message):
    __slots__ = ("offset_bytes",)
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    offset_bytes: int
    def __init__(self, offset_bytes: _Optional[int] = ...) -> None: ...

class BucketSpec(_message.Message):
    __slots__ = ("size_bytes", "tensors", "deferred")
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_FIELD_NUMBER: _ClassVar[int]
    size_bytes: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    deferred: bool
    def __init__(self, size_bytes: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., deferred: _Optional[bool] = ...) -> None: ...

class WeightPlan(_message.Message):
    __slots__ = ("buckets",)
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    buckets: _containers.RepeatedCompositeFieldContainer[BucketSpec]
    def __init__(self, buckets: _Optional[_Iterable[_Union[BucketSpec, _Mapping]]] = ...) -> None: ...
