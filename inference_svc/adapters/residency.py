"""Moves adapters down the tiers for the scheduler: source (S3 or the store) → host cache →
GPU slot. The scheduler decides *which* slot (it owns the slot allocator); this module does
the downloads and copies and remembers what it did.

Downloads run on worker threads and never block a step: the scheduler asks `host_state`,
starts a download with `start_fetch`, and later finds the adapter READY (or FAILED, with
the error its waiting requests get). A download is verified (sha256) and checked against
the pool's shapes before it is inserted into the host cache, so a corrupt or incompatible
adapter never reaches a slot. `load_into_slot` copies from the host cache (on a side CUDA
stream on the GPU) and keeps the host entry in use until the copy has completed.

Everything except the worker threads runs on the engine thread.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from adapter_store.errors import LoraserveError, Unavailable
from adapter_store.format import CanonicalAdapter
from inference_svc.adapters.host_cache import HostAdapterCache, HostCacheEntry
from inference_svc.adapters.sources import AdapterSource
from inference_svc.engine.sequence import AdapterBinding, AdapterKey
from inference_svc.lora.pool import LoraPool, SlotLoad
from inference_svc.metrics import InferenceMetrics

log = logging.getLogger("loraserve.residency")


class HostState(enum.Enum):
    ABSENT = "absent"
    FETCHING = "fetching"
    READY = "ready"  # in the host cache
    FAILED = "failed"  # the last download failed; `take_failure` gives the error


@dataclass(frozen=True)
class SlotCopy:
    """A copy into a GPU slot; the scheduler starts the adapter's requests once `load.done()`."""

    key: AdapterKey
    load: SlotLoad
    seconds: float  # host-side time to issue (CPU: complete) the copy


class AdapterResidency:
    def __init__(
        self,
        source: AdapterSource | None,
        host_cache: HostAdapterCache,
        pool: LoraPool,
        metrics: InferenceMetrics,
        on_fetched: Callable[[], None] = lambda: None,
        fetch_workers: int = 4,
    ) -> None:
        self.source = source
        self.host_cache = host_cache
        self.pool = pool
        self.metrics = metrics
        self._on_fetched = on_fetched  # wakes the engine loop
        self._workers = ThreadPoolExecutor(fetch_workers, thread_name_prefix="adapter-fetch")
        self._lock = threading.Lock()
        self._fetching: set[AdapterKey] = set()
        self._failed: dict[AdapterKey, LoraserveError] = {}
        self._copies: list[SlotCopy] = []  # in flight; their host entries are in use
        self.bindings: dict[AdapterKey, AdapterBinding] = {}
        self.last_used: dict[AdapterKey, float] = {}  # wall clock, for ListLoadedAdapters

    def close(self) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)

    def host_state(self, key: AdapterKey) -> HostState:
        with self._lock:
            if key in self._failed:
                return HostState.FAILED
            if key in self._fetching:
                return HostState.FETCHING
        return HostState.READY if key in self.host_cache else HostState.ABSENT

    def is_fetching(self, key: AdapterKey) -> bool:
        with self._lock:
            return key in self._fetching

    def has_free_host_room(self, adapter: AdapterBinding) -> bool:
        """Whether `adapter` fits the host cache beside its entries and the downloads in
        flight without evicting anything (a download made ahead of need must not push out
        an entry that a nearer request is about to use)."""
        stats = self.host_cache.metrics()
        with self._lock:
            fetching = sum(self.bindings[key].size_bytes for key in self._fetching)
        return stats.bytes_used + fetching + adapter.size_bytes <= stats.capacity_bytes

    def take_failure(self, key: AdapterKey) -> LoraserveError | None:
        """The error of `key`'s failed download (cleared: the next request retries)."""
        with self._lock:
            return self._failed.pop(key, None)

    def start_fetch(self, adapter: AdapterBinding) -> None:
        """Download `adapter` into the host cache in the background (once)."""
        key = adapter.key
        self.bindings[key] = adapter
        with self._lock:
            if key in self._fetching:
                return
            self._fetching.add(key)
        self.metrics.host_cache_misses.inc()
        self._workers.submit(self._fetch, adapter)

    def _fetch(self, adapter: AdapterBinding) -> None:
        started = time.perf_counter()
        error: LoraserveError | None = None
        try:
            if self.source is None:
                raise Unavailable(
                    f"adapter {adapter.label}: this replica has no adapter source configured"
                )

            def insert(canonical: CanonicalAdapter, lent: bool) -> None:
                self.pool.check_compatible(canonical)
                # Lent tensors view the source's download buffer: the cache copies them.
                self.host_cache.insert(adapter.key, canonical, borrowed=lent)

            self.source.fetch_into(adapter, insert)
            self.host_cache.release(adapter.key)
            self.metrics.adapter_load_seconds.labels(self.source.tier).observe(
                time.perf_counter() - started
            )
            log.info(
                "adapter %s/%s fetched into the host cache in %.1f ms",
                adapter.tenant,
                adapter.label,
                (time.perf_counter() - started) * 1000,
            )
        except LoraserveError as exc:
            error = exc
        except Exception as exc:  # a bug or an unexpected library error: fail the adapter
            log.exception("fetching adapter %s failed", adapter.label)
            error = Unavailable(f"adapter {adapter.label}: fetch failed ({type(exc).__name__})")
        if error is not None:
            log.warning("adapter %s/%s: %s", adapter.tenant, adapter.label, error)
            self.metrics.adapter_load_failures.labels(error.code.name).inc()
        with self._lock:
            self._fetching.discard(adapter.key)
            if error is not None:
                self._failed[adapter.key] = error
        self._on_fetched()

    def load_into_slot(self, slot: int, key: AdapterKey) -> SlotCopy | None:
        """Copy `key` from the host cache into `slot`; None if it left the host cache since
        (the caller fetches it again). Raises FailedPrecondition if it does not fit."""
        adapter = self.host_cache.acquire(key)
        if adapter is None:
            return None
        started = time.perf_counter()
        try:
            load = self.pool.load(slot, adapter)
        except BaseException:
            self.host_cache.release(key)
            raise
        copy = SlotCopy(key, load, time.perf_counter() - started)
        self._copies.append(copy)
        self.metrics.host_cache_hits.inc()
        self.metrics.adapter_load_seconds.labels("host").observe(copy.seconds)
        self.touch(key)
        self.poll()
        return copy

    def poll(self) -> None:
        """Release the host entries of copies that have completed."""
        pending = []
        for copy in self._copies:
            if copy.load.done():
                self.host_cache.release(copy.key)
            else:
                pending.append(copy)
        self._copies = pending

    def unload_slot(self, slot: int) -> None:
        self.pool.unload(slot)

    def touch(self, key: AdapterKey) -> None:
        self.last_used[key] = time.time()

    def host_entries(self) -> list[HostCacheEntry]:
        return self.host_cache.entries()

    def fetching(self) -> list[AdapterKey]:
        with self._lock:
            return list(self._fetching)

    def update_gauges(self) -> None:
        stats = self.host_cache.metrics()
        self.metrics.host_cache_bytes.set(stats.bytes_used)
        self.metrics.host_cache_evictions.set(stats.evictions)
