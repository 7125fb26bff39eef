"""gRPC servicer of the inference service: proto → engine call → proto."""

from __future__ import annotations

from adapter_store.errors import Unimplemented
from adapter_store.rpc.handlers import rpc_method
from protos import inference_pb2_grpc

SERVICE_NAME = "loraserve.v1.Inference"


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """Every RPC of the contract; those not built yet answer UNIMPLEMENTED."""

    @rpc_method
    async def Generate(self, request, context):  # noqa: N802 - gRPC name
        raise Unimplemented("Generate is not implemented yet")
        yield  # makes this a server-streaming handler

    @rpc_method
    async def LoadAdapter(self, request, context):  # noqa: N802
        raise Unimplemented("LoadAdapter is not implemented yet")

    @rpc_method
    async def UnloadAdapter(self, request, context):  # noqa: N802
        raise Unimplemented("UnloadAdapter is not implemented yet")

    @rpc_method
    async def ListLoadedAdapters(self, request, context):  # noqa: N802
        raise Unimplemented("ListLoadedAdapters is not implemented yet")
