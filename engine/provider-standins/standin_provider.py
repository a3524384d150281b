"""What every test stand-in provider plugin shares: the provider protocol's plumbing.

A plugin the real Pulumi CLI starts prints the port its gRPC server listens on (127.0.0.1 only)
and serves pulumi/runtime/proto/provider.proto of the pinned SDK. A stand-in names the resource
types it implements; any other type is refused (UNIMPLEMENTED), so a program that grows a new
resource of that provider fails the tests instead of passing through a stand-in that does not
know it.
"""

from __future__ import annotations

import sys
from concurrent import futures

import grpc
from google.protobuf import empty_pb2, struct_pb2
from pulumi.runtime.proto import plugin_pb2, provider_pb2, provider_pb2_grpc

UNKNOWN = "04da6b54-80e4-46f7-96ec-b56ff0331ba9"  # the engine's unknown-value sentinel (rpc.py)
VERSION = "0.0.0-pdstack-test-standin"


def struct(values: dict) -> struct_pb2.Struct:
    out = struct_pb2.Struct()
    out.update(values)
    return out


class StandInProvider(provider_pb2_grpc.ResourceProviderServicer):
    """The calls every stand-in answers alike; subclasses implement Check, Diff, Create (and Update)."""

    name = "stand-in"
    types: tuple[str, ...] = ()

    def refuse_unknown(self, type_: str, context) -> None:
        if type_ not in self.types:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, f"the test stand-in for {self.name} has no {type_}")

    def GetPluginInfo(self, request, context):
        return plugin_pb2.PluginInfo(version=VERSION)

    def CheckConfig(self, request, context):
        return provider_pb2.CheckResponse(inputs=request.news)

    def DiffConfig(self, request, context):
        return provider_pb2.DiffResponse(changes=provider_pb2.DiffResponse.DIFF_NONE)

    def Configure(self, request, context):
        return provider_pb2.ConfigureResponse(acceptSecrets=True, supportsPreview=True)

    def Read(self, request, context):
        return provider_pb2.ReadResponse(id=request.id, properties=request.properties, inputs=request.inputs)

    def Delete(self, request, context):
        return empty_pb2.Empty()

    def Cancel(self, request, context):
        return empty_pb2.Empty()


def serve(provider: StandInProvider) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    provider_pb2_grpc.add_ResourceProviderServicer_to_server(provider, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    sys.stdout.write(f"{port}\n")
    sys.stdout.flush()
    server.wait_for_termination()
