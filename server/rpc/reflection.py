"""Server reflection in both protocols, and the descriptors our error details need.

grpcio-reflection implements only `grpc.reflection.v1alpha`. The v1 protocol,
which buf curl and grpcurl try first, has the same messages with the same
field numbers under another package, so the same servicer answers both: the
v1 method takes v1alpha's (wire-identical) messages, and the v1 file
descriptor, which clients may ask for, is v1alpha's with the package renamed.

Every error this server returns carries a `google.rpc.ErrorInfo` in a
`google.rpc.Status`; their files are put in the pool here, so a client that
resolves detail types through reflection (grpcurl does) can decode them.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
import grpc.aio
from google.protobuf import descriptor_pb2, descriptor_pool
from google.rpc import error_details_pb2, status_pb2
from grpc_reflection.v1alpha import reflection as v1alpha
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2
from grpc_reflection.v1alpha import reflection_pb2_grpc as v1alpha_grpc

V1_FILE = "grpc/reflection/v1/reflection.proto"
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE = f"{V1_PACKAGE}.ServerReflection"
V1ALPHA_SERVICE = v1alpha.SERVICE_NAME
ERROR_DETAIL_FILES = (status_pb2.DESCRIPTOR.name, error_details_pb2.DESCRIPTOR.name)


def _renamed(type_name: str, old: str, new: str) -> str:
    return new + type_name[len(old) :] if type_name.startswith(old) else type_name


def _rename_messages(messages: Iterable[descriptor_pb2.DescriptorProto], old: str, new: str) -> None:
    for message in messages:
        for field in message.field:
            if field.HasField("type_name"):
                field.type_name = _renamed(field.type_name, old, new)
        _rename_messages(message.nested_type, old, new)


def v1_file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """The v1 reflection file: v1alpha's, under the v1 name and package."""
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = f".{proto.package}.", f".{V1_PACKAGE}."
    proto.name, proto.package = V1_FILE, V1_PACKAGE
    proto.ClearField("options")  # v1alpha's language options name v1alpha packages
    _rename_messages(proto.message_type, old, new)
    for service in proto.service:
        for method in service.method:
            method.input_type = _renamed(method.input_type, old, new)
            method.output_type = _renamed(method.output_type, old, new)
    return proto


def _register_v1_descriptor() -> None:
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(V1_FILE)
    except KeyError:
        pool.Add(v1_file_descriptor())


def enable_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> None:
    """Serve reflection (v1 and v1alpha) listing `service_names` and both reflection services."""
    _register_v1_descriptor()
    servicer = v1alpha.aio.ReflectionServicer((*service_names, V1_SERVICE, V1ALPHA_SERVICE))
    v1alpha_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1_methods = {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
            response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1_SERVICE, v1_methods),))
