"""gRPC servicer of the adapter store: proto → domain call → proto, nothing else."""

from __future__ import annotations

from adapter_store.errors import Unimplemented
from adapter_store.rpc.handlers import rpc_method
from protos import adapter_store_pb2_grpc

SERVICE_NAME = "loraserve.v1.AdapterStore"


class AdapterStoreServicer(adapter_store_pb2_grpc.AdapterStoreServicer):
    """Every RPC of the contract; those not built yet answer UNIMPLEMENTED."""

    @rpc_method
    async def RegisterBaseModel(self, request, context):  # noqa: N802 - gRPC name
        raise Unimplemented("RegisterBaseModel is not implemented yet")

    @rpc_method
    async def GetBaseModel(self, request, context):  # noqa: N802
        raise Unimplemented("GetBaseModel is not implemented yet")

    @rpc_method
    async def ListBaseModels(self, request, context):  # noqa: N802
        raise Unimplemented("ListBaseModels is not implemented yet")

    @rpc_method
    async def UploadAdapter(self, request_iterator, context):  # noqa: N802
        raise Unimplemented("UploadAdapter is not implemented yet")

    @rpc_method
    async def GetAdapter(self, request, context):  # noqa: N802
        raise Unimplemented("GetAdapter is not implemented yet")

    @rpc_method
    async def ListAdapters(self, request, context):  # noqa: N802
        raise Unimplemented("ListAdapters is not implemented yet")

    @rpc_method
    async def DeleteAdapter(self, request, context):  # noqa: N802
        raise Unimplemented("DeleteAdapter is not implemented yet")

    @rpc_method
    async def FetchAdapter(self, request, context):  # noqa: N802
        raise Unimplemented("FetchAdapter is not implemented yet")
        yield  # makes this a server-streaming handler
