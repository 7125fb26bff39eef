"""The inference service in-process on a background event loop (same wiring as `serve`), for
tests that look inside it (KV pages, slot references) while calling it over gRPC."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

import grpc

from inference_svc.app import AppConfig, InferenceApp
from inference_svc.engine.engine import EngineStats
from protos import inference_pb2_grpc

T = TypeVar("T")


class InProcessInference:
    def __init__(self, config: AppConfig) -> None:
        self.config = config
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
        future: Future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout)

    def start(self) -> InProcessInference:
        self._thread.start()
        self.run(self._start())
        return self

    async def _start(self) -> None:
        self.app = InferenceApp(self.config)
        await self.app.start()
        self.server = grpc.aio.server()
        inference_pb2_grpc.add_InferenceServicer_to_server(self.app.servicer, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()

    def on_engine(self, fn: Callable[[], T], timeout: float = 30.0) -> T:
        """Run `fn` on the engine thread between steps."""
        return self.app.loop.call(fn).result(timeout)

    def stats(self) -> EngineStats:
        return self.on_engine(self.app.runtime.engine.stats)

    def stop(self) -> None:
        self.run(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _stop(self) -> None:
        await self.server.stop(1.0)
        await self.app.stop()

    def stub(self, channel: grpc.Channel) -> inference_pb2_grpc.InferenceStub:
        return inference_pb2_grpc.InferenceStub(channel)
