"""Where a replica downloads canonical adapters from: S3 directly (parallel ranged GETs, the
fast path) or the store's `FetchAdapter` stream (when the replica has no S3 access).

Both verify the weights' sha256 against the store's record before anything parses them, and
are called from worker threads (they block).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import grpc

from adapter_store.errors import FailedPrecondition, InvalidArgument
from adapter_store.format import CanonicalAdapter, Manifest, deserialize_pieces
from inference_svc.adapters.owned_tensors import Consume, OwnedTensorsSource, T
from inference_svc.adapters.s3_fetch import S3AdapterFetcher
from inference_svc.adapters.store_errors import from_store_error
from inference_svc.engine.sequence import AdapterBinding


class AdapterSource(Protocol):
    tier: str  # metrics label of the download ("s3" or "store")

    def fetch(self, adapter: AdapterBinding) -> CanonicalAdapter:
        """Download, verify and deserialize one adapter version (blocking)."""
        ...

    def fetch_into(self, adapter: AdapterBinding, consume: Consume[T]) -> T:
        """`fetch`, handing the adapter to `consume` with whether its tensors are only lent
        (they view a download buffer reused after the call: `consume` copies what it keeps)."""
        ...


class S3Source:
    tier = "s3"

    def __init__(self, fetcher: S3AdapterFetcher) -> None:
        self._fetcher = fetcher

    def fetch(self, adapter: AdapterBinding) -> CanonicalAdapter:
        return self._fetcher.fetch(
            adapter.tenant, adapter.name, adapter.version, adapter.sha256, adapter.parts_sha256
        ).adapter

    def fetch_into(self, adapter: AdapterBinding, consume: Consume[T]) -> T:
        return self._fetcher.fetch_into(adapter, lambda fetched: consume(fetched.adapter, True))


class StoreFetchSource(OwnedTensorsSource):
    """`FetchAdapter` through the async store client, which lives on the service's loop,
    as the caller who resolved the adapter (the store checks their tenant again)."""

    tier = "store"

    def __init__(self, client: Any, address: str, loop: asyncio.AbstractEventLoop) -> None:
        self._client = client
        self._address = address
        self._loop = loop

    def fetch(self, adapter: AdapterBinding) -> CanonicalAdapter:
        ref = f"{adapter.name}@{adapter.version}"
        call = asyncio.run_coroutine_threadsafe(
            self._client.fetch_adapter_pieces(ref, caller_key=adapter.caller_key), self._loop
        )
        try:
            fetched = call.result()
        except grpc.RpcError as error:
            raise from_store_error(error, self._address, f"fetching adapter {ref}") from None
        if fetched.adapter.sha256 != adapter.sha256:
            raise FailedPrecondition(
                f"adapter {ref}: the store sent weights with sha256 {fetched.adapter.sha256}, "
                f"its record said {adapter.sha256}"
            )
        try:
            manifest = Manifest.from_json(fetched.manifest_json)
        except InvalidArgument as exc:
            raise FailedPrecondition(f"adapter {ref}: fetched manifest unusable: {exc}") from None
        # The client hashed the bytes against the record: the manifest must name the same
        # digest and size (hashing 553 MB again would take ~0.3 s).
        if (manifest.sha256, manifest.size_bytes) != (adapter.sha256, fetched.weights.size):
            raise FailedPrecondition(
                f"adapter {ref}: its manifest names weights of sha256 {manifest.sha256} "
                f"({manifest.size_bytes} bytes), the store sent {adapter.sha256} "
                f"({fetched.weights.size} bytes)"
            )
        try:
            canonical = deserialize_pieces(fetched.weights, manifest)
        except InvalidArgument as exc:
            raise FailedPrecondition(f"adapter {ref}: fetched weights unusable: {exc}") from None
        return canonical
