"""The store's gRPC server in-process on a background event loop, for tests that need to
reach inside it (fault injection) or start many stores cheaply. Same wiring as `serve`."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any

import grpc

from adapter_store.auth import Authenticator, Principal
from adapter_store.maintenance import keep_index_ready
from adapter_store.metrics import MetricsInterceptor, StoreMetrics
from adapter_store.service import AdapterStoreService, StoreConfig
from adapter_store.servicer import AdapterStoreServicer
from adapter_store.storage.metadata import MetadataConfig, MetadataStore
from adapter_store.storage.objects import ObjectStore, ObjectStoreConfig
from protos import adapter_store_pb2_grpc


class InProcessStore:
    def __init__(
        self,
        redis_url: str,
        s3_endpoint_url: str,
        bucket: str,
        *,
        config: StoreConfig | None = None,
        principals: dict[str, Principal] | None = None,
        index_check_s: float = 0.3,
    ) -> None:
        self.objects = ObjectStore(ObjectStoreConfig(bucket=bucket, endpoint_url=s3_endpoint_url))
        self.metadata_config = MetadataConfig(url=redis_url, command_timeout_s=2.0)
        self.config = config or StoreConfig()
        self.principals = principals or {}
        self.index_check_s = index_check_s
        self.metrics = StoreMetrics()
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        """Run `coro` on the server's loop and wait for its result."""
        future: Future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout)

    def start(self) -> InProcessStore:
        self._thread.start()
        self.run(self._start())
        return self

    async def _start(self) -> None:
        self.metadata = MetadataStore(self.metadata_config)
        self.service = AdapterStoreService(self.objects, self.metadata, self.config)
        servicer = AdapterStoreServicer(self.service, Authenticator(self.principals), self.metrics)
        self.server = grpc.aio.server(interceptors=[MetricsInterceptor(self.metrics)])
        adapter_store_pb2_grpc.add_AdapterStoreServicer_to_server(servicer, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self._watcher = asyncio.create_task(
            keep_index_ready(self.objects, self.metadata, self.index_check_s)
        )
        for _ in range(200):
            if await self.metadata.index_ready():
                return
            await asyncio.sleep(0.05)
        raise TimeoutError("the store's index never became ready")

    def stop(self) -> None:
        self.run(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _stop(self) -> None:
        self._watcher.cancel()
        await self.server.stop(1.0)
        await self.metadata.close()
