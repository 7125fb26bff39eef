"""Async client of the adapter store, used by `loractl` and by the inference service.

Failures surface as `grpc.aio.AioRpcError` (status + the store's message), except a fetched
adapter whose bytes do not match its sha256, which raises `DataLoss`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from adapter_store.byte_pieces import HashedPieces
from adapter_store.errors import DataLoss
from adapter_store.rpc.tls import aio_channel
from protos import adapter_store_pb2 as pb
from protos import adapter_store_pb2_grpc

DEFAULT_CHUNK_BYTES = 1024 * 1024
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def _bearer(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


@dataclass(frozen=True)
class FetchedAdapter:
    """A verified canonical adapter: its record, manifest.json and weights.safetensors."""

    adapter: pb.Adapter
    manifest_json: bytes
    weights: bytes


@dataclass(frozen=True)
class FetchedPieces:
    """`FetchedAdapter` with the weights kept in the pieces they arrived in (to be read by
    `adapter_store.format.deserialize_pieces` without joining them)."""

    adapter: pb.Adapter
    manifest_json: bytes
    weights: HashedPieces


class StoreClient:
    """`async with StoreClient("host:port", api_key=...) as store: ...`

    `tls_ca`: PEM of the CA (or self-signed certificate) to trust; None for plain TCP.
    """

    def __init__(
        self,
        address: str,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        tls_ca: str | Path | None = None,
    ) -> None:
        self._channel = aio_channel(
            address,
            tls_ca,
            options=[
                ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
            ],
        )
        self._stub = adapter_store_pb2_grpc.AdapterStoreStub(self._channel)
        self._metadata = _bearer(api_key)
        self._timeout_s = timeout_s

    async def __aenter__(self) -> StoreClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    def _call_options(self, caller_key: str | None = None) -> dict:
        """`caller_key`: call as that key instead of the client's own (a service acting for
        its caller forwards the caller's key)."""
        metadata = self._metadata if caller_key is None else _bearer(caller_key)
        return {"metadata": metadata, "timeout": self._timeout_s}

    async def register_base_model(self, name: str, config_json: str) -> pb.BaseModel:
        request = pb.RegisterBaseModelRequest(name=name, config_json=config_json)
        return await self._stub.RegisterBaseModel(request, **self._call_options())

    async def get_base_model(self, name: str) -> pb.BaseModel:
        request = pb.GetBaseModelRequest(name=name)
        return await self._stub.GetBaseModel(request, **self._call_options())

    async def list_base_models(self) -> list[pb.BaseModel]:
        reply = await self._stub.ListBaseModels(pb.ListBaseModelsRequest(), **self._call_options())
        return list(reply.base_models)

    async def get_adapter(self, ref: str, caller_key: str | None = None) -> pb.Adapter:
        """`ref` is "name" (latest) or "name@N"."""
        request = pb.GetAdapterRequest(ref=ref)
        return await self._stub.GetAdapter(request, **self._call_options(caller_key))

    async def who_am_i(self, caller_key: str | None = None) -> str:
        """The tenant of the client's key (or of `caller_key`)."""
        reply = await self._stub.WhoAmI(pb.WhoAmIRequest(), **self._call_options(caller_key))
        return reply.tenant

    async def list_adapters(
        self,
        *,
        base_model: str = "",
        labels: Mapping[str, str] | None = None,
        all_versions: bool = False,
        page_size: int = 0,
    ) -> list[pb.Adapter]:
        """Every matching adapter, following the pages."""
        found: list[pb.Adapter] = []
        token = ""
        while True:
            request = pb.ListAdaptersRequest(
                page_size=page_size,
                page_token=token,
                base_model=base_model,
                label=dict(labels or {}),
                all_versions=all_versions,
            )
            reply = await self._stub.ListAdapters(request, **self._call_options())
            found += reply.adapters
            token = reply.next_page_token
            if not token:
                return found

    async def delete_adapter(self, ref: str) -> list[int]:
        reply = await self._stub.DeleteAdapter(
            pb.DeleteAdapterRequest(ref=ref), **self._call_options()
        )
        return list(reply.versions)

    async def fetch_adapter(
        self, ref: str, chunk_size: int = 0, caller_key: str | None = None
    ) -> FetchedAdapter:
        """Download the canonical adapter and verify its sha256 and size."""
        fetched = await self.fetch_adapter_pieces(ref, chunk_size, caller_key)
        return FetchedAdapter(fetched.adapter, fetched.manifest_json, fetched.weights.join())

    async def fetch_adapter_pieces(
        self, ref: str, chunk_size: int = 0, caller_key: str | None = None
    ) -> FetchedPieces:
        """`fetch_adapter`, the weights left in the stream's chunks."""
        stream = self._stub.FetchAdapter(
            pb.FetchAdapterRequest(ref=ref, chunk_size=chunk_size),
            **self._call_options(caller_key),
        )
        adapter: pb.Adapter | None = None
        manifest_json = b""
        weights = HashedPieces()
        async for message in stream:
            if adapter is None:
                adapter, manifest_json = message.adapter, message.manifest_json
            elif message.offset != weights.size:
                raise DataLoss(f"{ref}: chunk at offset {message.offset}, expected {weights.size}")
            weights.append(message.data)
        if adapter is None:
            raise DataLoss(f"{ref}: the store sent an empty stream")
        digest = weights.hexdigest()
        if digest != adapter.sha256 or weights.size != adapter.size_bytes:
            raise DataLoss(
                f"{ref}: weights have sha256 {digest} ({weights.size} bytes), the record says "
                f"{adapter.sha256} ({adapter.size_bytes} bytes)"
            )
        return FetchedPieces(adapter, manifest_json, weights)

    async def upload_dir(
        self,
        folder: Path | str,
        *,
        name: str,
        base_model: str,
        description: str = "",
        labels: Mapping[str, str] | None = None,
        dtype: str = "",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        progress: Callable[[int, int], None] | None = None,
    ) -> pb.Adapter:
        """Upload the files of a PEFT folder; `progress(sent, total)` after every chunk."""
        files = sorted(path for path in Path(folder).iterdir() if path.is_file())
        total = sum(path.stat().st_size for path in files)
        header = pb.UploadHeader(
            name=name,
            base_model=base_model,
            description=description,
            labels=dict(labels or {}),
            dtype=dtype,
        )

        async def requests() -> AsyncIterator[pb.UploadAdapterRequest]:
            yield pb.UploadAdapterRequest(header=header)
            sent = 0
            for path in files:
                with path.open("rb") as handle:
                    chunk = handle.read(chunk_bytes)  # an empty file still sends one chunk
                    while True:
                        yield pb.UploadAdapterRequest(
                            chunk=pb.FileChunk(filename=path.name, data=chunk)
                        )
                        sent += len(chunk)
                        if progress is not None:
                            progress(sent, total)
                        if not (chunk := handle.read(chunk_bytes)):
                            break

        return await self._stub.UploadAdapter(requests(), **self._call_options())
