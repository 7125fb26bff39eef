"""One inference replica assembled: runtime on its engine thread, adapter resolver following
the store's events, residency publisher, and the gRPC servicer. `serve` runs it behind the
shared server lifecycle; tests run it in-process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from adapter_store.client import StoreClient
from inference_svc.adapters.residency_publisher import (
    ResidencyEntry,
    ResidencyPublisher,
    ResidencyPublisherConfig,
)
from inference_svc.adapters.resolver import AdapterResolver, ResolverConfig
from inference_svc.adapters.s3_fetch import S3AdapterFetcher, S3FetchConfig
from inference_svc.adapters.sources import AdapterSource, S3Source, StoreFetchSource
from inference_svc.adapters.tenants import CallerTenants, TenantCacheConfig
from inference_svc.engine.engine_loop import EngineLoop
from inference_svc.metrics import InferenceMetrics
from inference_svc.runtime import Runtime, RuntimeConfig, build_runtime
from inference_svc.service import InferenceService
from inference_svc.servicer import InferenceServicer

log = logging.getLogger("loraserve.inference")


@dataclass(frozen=True)
class AppConfig:
    runtime: RuntimeConfig
    store_address: str
    replica_id: str
    advertise_address: str  # where a router reaches this replica (published with residency)
    redis_url: str | None = None  # store events + residency records; None: neither
    s3: S3FetchConfig | None = None  # None: weights come through the store's FetchAdapter
    store_tls_ca: str | None = None  # PEM to trust for a TLS store; None: plain TCP
    latest_ttl_s: float = 5.0  # how long `name` → version is trusted without events
    tenant_ttl_s: float = 10.0  # how long the store's key → tenant answer is trusted
    tenant_max_concurrent: int = 0  # Generate streams per tenant at this replica; 0: no limit
    residency_ttl_s: float = 15.0
    residency_interval_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.store_address:
            raise ValueError("store_address must be set")
        if self.tenant_max_concurrent < 0:
            raise ValueError(f"tenant_max_concurrent must be ≥ 0, got {self.tenant_max_concurrent}")


class InferenceApp:
    def __init__(self, config: AppConfig, metrics: InferenceMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or InferenceMetrics()
        # No key of its own: every store call carries its caller's key (adapters.caller).
        self.store = StoreClient(config.store_address, tls_ca=config.store_tls_ca)
        self.runtime: Runtime
        self.loop: EngineLoop
        self.resolver: AdapterResolver
        self.servicer: InferenceServicer
        self._fetcher: S3AdapterFetcher | None = None
        self._publisher: ResidencyPublisher | None = None
        self._residency: list[ResidencyEntry] = []  # the publisher's latest snapshot
        self._event_loop: asyncio.AbstractEventLoop | None = None

    def _source(self, loop: asyncio.AbstractEventLoop) -> AdapterSource:
        if self.config.s3 is not None:
            self._fetcher = S3AdapterFetcher(self.config.s3)
            return S3Source(self._fetcher)
        return StoreFetchSource(self.store, self.config.store_address, loop)

    async def start(self) -> None:
        c = self.config
        event_loop = asyncio.get_running_loop()
        source = self._source(event_loop)
        # The engine loop does not exist while the model loads; fetch completions wake it.
        self.runtime = await asyncio.to_thread(
            build_runtime, c.runtime, source, self.metrics, lambda: self.loop.wake()
        )
        self._start_publisher(event_loop)
        self.loop = EngineLoop(self.runtime.engine, on_residency_change=self._notify_residency)
        self.loop.start()
        self.resolver = AdapterResolver(
            ResolverConfig(
                base_model_name=c.runtime.base_model_name,
                max_lora_rank=c.runtime.max_lora_rank,
                store_address=c.store_address,
                redis_url=c.redis_url,
                latest_ttl_s=c.latest_ttl_s,
            ),
            self.store,
        )
        self.resolver.start()
        service = InferenceService(
            self.runtime.engine,
            self.loop,
            self.resolver,
            CallerTenants(TenantCacheConfig(c.store_address, c.tenant_ttl_s), self.store),
            self.runtime.tokenizer,
            int(self.runtime.hf_config["vocab_size"]),
            self.metrics,
            c.tenant_max_concurrent,
        )
        self.servicer = InferenceServicer(service, c.runtime.max_lora_rank)

    def _start_publisher(self, event_loop: asyncio.AbstractEventLoop) -> None:
        c = self.config
        if c.redis_url is None:
            return
        self._publisher = ResidencyPublisher(
            ResidencyPublisherConfig(
                redis_url=c.redis_url,
                replica_id=c.replica_id,
                address=c.advertise_address,
                ttl_s=c.residency_ttl_s,
                interval_s=c.residency_interval_s,
            ),
            lambda: self._residency,
        )
        self._event_loop = event_loop
        self._publisher.start()

    def _notify_residency(self) -> None:
        """Engine thread: residency changed; hand a snapshot to the publisher."""
        if self._publisher is None:
            return
        self._residency = self.runtime.engine.residency_entries()
        if self._event_loop is not None:
            self._event_loop.call_soon_threadsafe(self._publisher.notify)

    async def stop(self) -> None:
        await self.resolver.stop()
        if self._publisher is not None:
            # Bounded: a replica that cannot reach Redis still stops (its record expires).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._publisher.stop(delete=True), 5.0)
        self.loop.stop()
        self.runtime.residency.close()
        if self._fetcher is not None:
            self._fetcher.close()
        await self.store.close()
