"""Prometheus metrics of the inference service, in a registry the caller owns (no import-time
globals), served on `--metrics-port`.

Per-adapter series are labelled by adapter name (not version) to bound their number; the
base model is `adapter="-"`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

BASE_LABEL = "-"


class InferenceMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge(
            "loraserve_queue_depth", "requests waiting to be scheduled", registry=r
        )
        self.running = Gauge("loraserve_running_requests", "requests running", registry=r)
        self.batch_tokens = Histogram(
            "loraserve_batch_tokens", "tokens per engine step", buckets=_BATCH_BUCKETS, registry=r
        )
        self.batch_seqs = Histogram(
            "loraserve_batch_sequences",
            "sequences per engine step",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.batch_adapters = Histogram(
            "loraserve_batch_adapters",
            "distinct adapters per engine step (base model not counted)",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.prefill_tokens = Counter(
            "loraserve_prefill_tokens",
            "tokens run in prefill chunks (recomputes after preemption included)",
            registry=r,
        )
        self.generated_tokens = Counter(
            "loraserve_generated_tokens", "tokens generated (rate() gives tokens/s)", registry=r
        )
        self.ttft = Histogram(
            "loraserve_time_to_first_token_seconds",
            "arrival to first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "loraserve_inter_token_latency_seconds",
            "time between consecutive generated tokens of one request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "loraserve_requests",
            "finished requests by adapter and finish reason",
            ["adapter", "finish_reason"],
            registry=r,
        )
        self.adapter_tokens = Counter(
            "loraserve_adapter_generated_tokens",
            "tokens generated per adapter",
            ["adapter"],
            registry=r,
        )
        self.rejected = Counter(
            "loraserve_rejected_requests",
            "requests refused at admission, by status code",
            ["code"],
            registry=r,
        )
        self.preemptions = Counter(
            "loraserve_preemptions", "running requests preempted (KV pages ran out)", registry=r
        )
        self.adapter_load_seconds = Histogram(
            "loraserve_adapter_load_seconds",
            "adapter load time by source tier (s3|store: download into the host cache; "
            "host: copy into a GPU slot)",
            ["tier"],
            buckets=_LOAD_BUCKETS,
            registry=r,
        )
        self.adapter_load_failures = Counter(
            "loraserve_adapter_load_failures",
            "adapter downloads or slot loads that failed, by status code",
            ["code"],
            registry=r,
        )
        self.slot_hits = Counter(
            "loraserve_lora_slot_hits", "requests whose adapter was already in a slot", registry=r
        )
        self.slot_misses = Counter(
            "loraserve_lora_slot_misses", "requests whose adapter needed a slot load", registry=r
        )
        self.slot_evictions = Counter(
            "loraserve_lora_slot_evictions", "adapters evicted from GPU slots", registry=r
        )
        self.slots_used = Gauge(
            "loraserve_lora_slots_used", "GPU slots holding an adapter", registry=r
        )
        self.slots_total = Gauge("loraserve_lora_slots_total", "GPU slots in the pool", registry=r)
        self.host_cache_hits = Counter(
            "loraserve_host_cache_hits", "slot loads served from the host cache", registry=r
        )
        self.host_cache_misses = Counter(
            "loraserve_host_cache_misses", "adapters that had to be downloaded", registry=r
        )
        self.host_cache_evictions = Gauge(
            "loraserve_host_cache_evictions", "adapters evicted from the host cache", registry=r
        )
        self.host_cache_bytes = Gauge(
            "loraserve_host_cache_bytes", "bytes of adapters in the host cache", registry=r
        )
        self.kv_pages_used = Gauge("loraserve_kv_pages_used", "KV cache pages in use", registry=r)
        self.kv_pages_total = Gauge("loraserve_kv_pages_total", "KV cache pages", registry=r)
