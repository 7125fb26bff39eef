"""Prometheus metrics of the store: per-RPC latency and status, upload outcomes and bytes.

Metrics live in a registry the caller owns (no import-time globals), served on
`--metrics-port` by `serve`. RPC latency and status come from one server interceptor, so
every method is covered without code in the handlers.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class StoreMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.rpc_seconds = Histogram(
            "loraserve_store_rpc_seconds",
            "RPC latency by method",
            ["method"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.rpcs = Counter(
            "loraserve_store_rpcs", "RPCs by method and status code", ["method", "code"], registry=r
        )
        self.uploads = Counter("loraserve_store_uploads", "adapter versions published", registry=r)
        self.upload_failures = Counter(
            "loraserve_store_upload_failures",
            "uploads refused or failed, by reason (status code)",
            ["reason"],
            registry=r,
        )
        self.upload_bytes = Counter(
            "loraserve_store_upload_received_bytes", "PEFT bytes received by uploads", registry=r
        )
        self.stored_bytes = Counter(
            "loraserve_store_upload_stored_bytes", "canonical weight bytes written", registry=r
        )
        self.fetch_bytes = Counter(
            "loraserve_store_fetch_bytes", "canonical weight bytes streamed out", registry=r
        )

    def observe_rpc(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        self.rpc_seconds.labels(method).observe(seconds)
        self.rpcs.labels(method, code.name).inc()


def _code_of(context: grpc.aio.ServicerContext, failed: bool) -> grpc.StatusCode:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    return grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Times every unary-response and server-streaming RPC and counts its status."""

    def __init__(self, metrics: StoreMetrics) -> None:
        self._metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method.rsplit("/", 1)[-1]
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._timed(method, handler.unary_unary))
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=self._timed(method, handler.stream_unary))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._timed_stream(method, handler.unary_stream))
        return handler

    def _timed(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def timed(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started, failed = time.perf_counter(), True
            try:
                response = await behavior(request, context)
                failed = False
                return response
            finally:
                elapsed = time.perf_counter() - started
                self._metrics.observe_rpc(method, _code_of(context, failed), elapsed)

        return timed

    def _timed_stream(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def timed(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            started, failed = time.perf_counter(), True
            try:
                async for item in behavior(request, context):
                    yield item
                failed = False
            finally:
                elapsed = time.perf_counter() - started
                self._metrics.observe_rpc(method, _code_of(context, failed), elapsed)

        return timed
