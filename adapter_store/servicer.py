"""gRPC servicer of the adapter store: proto → domain call → proto, nothing else."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

from adapter_store.auth import Authenticator, Principal
from adapter_store.errors import InvalidArgument, LoraserveError
from adapter_store.format import CANONICAL_MODULES
from adapter_store.metrics import StoreMetrics
from adapter_store.records import AdapterRecord, BaseModelRecord
from adapter_store.rpc.handlers import rpc_method
from adapter_store.service import AdapterQuery, AdapterStoreService
from adapter_store.tenant_limits import ConcurrencyGate
from adapter_store.upload import FilePiece, UploadSpec, collect_files
from protos import adapter_store_pb2 as pb
from protos import adapter_store_pb2_grpc

SERVICE_NAME = "loraserve.v1.AdapterStore"


def base_model_to_proto(record: BaseModelRecord) -> pb.BaseModel:
    return pb.BaseModel(
        name=record.name,
        config_json=record.config_json,
        architecture=record.architecture,
        lora_modules=record.lora_modules,
        created_at=record.created_at,
        config_sha256=record.config_sha256,
    )


def _layer_order(module_key: str) -> tuple[int, int]:
    """ "layers.L.module" sorts by layer, then by canonical module order."""
    _, layer, module = module_key.split(".", 2)
    return int(layer), CANONICAL_MODULES.index(module)


def adapter_to_proto(record: AdapterRecord) -> pb.Adapter:
    return pb.Adapter(
        name=record.name,
        version=record.version,
        base_model=record.base_model,
        rank=record.rank,
        target_modules=record.target_modules,
        sha256=record.sha256,
        parts_sha256=record.parts_sha256,
        size_bytes=record.size_bytes,
        created_at=record.created_at,
        description=record.description,
        labels=record.labels,
        tenant=record.tenant,
        dtype=record.dtype,
        moe_layout=record.moe_layout,
        module_ranks=[
            pb.ModuleRank(module=key, rank=record.module_ranks[key])
            for key in sorted(record.module_ranks, key=_layer_order)
        ],
        storage_prefix=record.storage_prefix,
        format_version=record.format_version,
    )


class AdapterStoreServicer(adapter_store_pb2_grpc.AdapterStoreServicer):
    def __init__(
        self, service: AdapterStoreService, auth: Authenticator, metrics: StoreMetrics
    ) -> None:
        self._service = service
        self._auth = auth
        self._metrics = metrics
        self._gate = ConcurrencyGate()

    @contextmanager
    def _caller(self, context) -> Iterator[Principal]:
        """The authenticated caller, holding one of its tenant's concurrency places."""
        principal = self._auth.principal(context.invocation_metadata())
        with self._gate.admit(principal.tenant, principal.limits.max_concurrent):
            yield principal

    @rpc_method
    async def RegisterBaseModel(self, request, context):  # noqa: N802 - gRPC name
        with self._caller(context) as caller:
            record = await self._service.register_base_model(
                caller, request.name, request.config_json
            )
        return base_model_to_proto(record)

    @rpc_method
    async def GetBaseModel(self, request, context):  # noqa: N802
        with self._caller(context) as caller:
            return base_model_to_proto(await self._service.get_base_model(caller, request.name))

    @rpc_method
    async def ListBaseModels(self, request, context):  # noqa: N802
        with self._caller(context) as caller:
            records = await self._service.list_base_models(caller)
        return pb.ListBaseModelsResponse(base_models=[base_model_to_proto(r) for r in records])

    @rpc_method
    async def UploadAdapter(self, request_iterator, context):  # noqa: N802
        try:
            with self._caller(context) as caller:
                record = await self._upload(caller, request_iterator)
        except LoraserveError as error:
            self._metrics.upload_failures.labels(error.code.name.lower()).inc()
            raise
        self._metrics.uploads.inc()
        self._metrics.stored_bytes.inc(record.size_bytes)
        return adapter_to_proto(record)

    async def _upload(self, caller: Principal, request_iterator) -> AdapterRecord:
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("item") != "header":
            raise InvalidArgument("an upload must start with its header message")
        header = first.header
        spec = UploadSpec(
            name=header.name,
            base_model=header.base_model,
            description=header.description,
            labels=dict(header.labels),
            dtype=header.dtype,
        )
        files = await collect_files(self._pieces(request_iterator), self._service.config.limits)
        return await self._service.upload(caller, spec, files)

    async def _pieces(self, request_iterator) -> AsyncIterator[FilePiece]:
        async for request in request_iterator:
            if request.WhichOneof("item") != "chunk":
                raise InvalidArgument("only file chunks may follow the upload header")
            self._metrics.upload_bytes.inc(len(request.chunk.data))
            yield FilePiece(request.chunk.filename, request.chunk.data)

    @rpc_method
    async def GetAdapter(self, request, context):  # noqa: N802
        with self._caller(context) as caller:
            return adapter_to_proto(await self._service.get_adapter(caller, request.ref))

    @rpc_method
    async def ListAdapters(self, request, context):  # noqa: N802
        query = AdapterQuery(
            page_size=request.page_size,
            page_token=request.page_token,
            base_model=request.base_model,
            labels=dict(request.label),
            all_versions=request.all_versions,
        )
        with self._caller(context) as caller:
            page = await self._service.list_adapters(caller, query)
        return pb.ListAdaptersResponse(
            adapters=[adapter_to_proto(r) for r in page.adapters],
            next_page_token=page.next_page_token,
        )

    @rpc_method
    async def DeleteAdapter(self, request, context):  # noqa: N802
        with self._caller(context) as caller:
            versions = await self._service.delete_adapter(caller, request.ref)
        return pb.DeleteAdapterResponse(versions=versions)

    @rpc_method
    async def FetchAdapter(self, request, context):  # noqa: N802
        with self._caller(context) as caller:
            download = await self._service.download(caller, request.ref, request.chunk_size)
            total = download.record.size_bytes
            yield pb.AdapterChunk(
                adapter=adapter_to_proto(download.record),
                manifest_json=download.manifest_json,
                total_size=total,
            )
            offset = 0
            async for data in download.chunks:
                yield pb.AdapterChunk(data=data, offset=offset, total_size=total)
                offset += len(data)
                self._metrics.fetch_bytes.inc(len(data))

    @rpc_method
    async def WhoAmI(self, request, context):  # noqa: N802
        # No concurrency place: it only reads the key table.
        return pb.WhoAmIResponse(tenant=self._auth.principal(context.invocation_metadata()).tenant)
