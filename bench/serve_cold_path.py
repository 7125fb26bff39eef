"""Cold adapter path on the CPU machine (issue 9): S3 → host time of a rank-16 all-module
DeepSeek-V2-Lite adapter, from SeaweedFS, p50/p99.

A real `redis-server`, `weed server -s3` and the store (`python -m adapter_store serve`) run
on loopback; the adapter (`bench.store_throughput`'s PEFT writer: MLA q/kv_a/kv_b/o, dense
MLP, shared experts and all 64 routed experts per expert, bf16) is uploaded once. Then,
alternating, `--repeats` times each:

  s3      `inference_svc.adapters.sources.S3Source` → `S3AdapterFetcher`: manifest GET, the
          weights by parallel ranged GETs of the manifest's 8 MiB parts (`--concurrency`),
          each part's sha256 checked on the thread that fetched it, parse; then insert
          into a `HostAdapterCache` (pinned when CUDA is there, not here)
  s3 whole  the same for a record without part digests (a version stored before them):
          GETs of `--part-mib`, one in-order sha256 of the whole file
  store   `StoreFetchSource`: the store's FetchAdapter stream (gRPC), sha256 check, parse;
          then the same host cache insert

i.e. what an inference replica does on a host-cache miss, up to the adapter sitting in host
memory; the host → GPU slot load is `bench.lora_slot_load` on the GPU.

    python -m bench.serve_cold_path --out docs/bench/serve_cold_path.json
    python -m bench.serve_cold_path --out /tmp/cold.json --smoke   # tiny adapter, 2 repeats
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from adapter_store.client import StoreClient
from adapter_store.format import CanonicalAdapter
from bench.provenance import provenance
from bench.serve_setup import percentiles_ms, save
from bench.store_throughput import V2_LITE, v2_lite_peft_folder
from inference_svc.adapters.host_cache import HostAdapterCache, HostCacheConfig
from inference_svc.adapters.owned_tensors import Consume, T
from inference_svc.adapters.s3_fetch import MIB, S3AdapterFetcher, S3FetchConfig
from inference_svc.adapters.sources import AdapterSource, S3Source, StoreFetchSource
from inference_svc.engine.sequence import AdapterBinding
from inference_svc.lora.pool import GIB
from tests.fixtures.servers import RedisServer, SeaweedS3Server
from tests.fixtures.services import ServiceProcess

BUCKET = "coldpath"
BASE_MODEL = "deepseek-v2-lite"
SMOKE_CONFIG = {
    **V2_LITE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "vocab_size": 512,
}


class EventLoopThread:
    """An asyncio loop on its own thread: the async store client lives there, as in the
    inference service (`StoreFetchSource` submits to it from worker threads)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


class WholeFileDigestSource:
    """`S3Source` for a record without part digests: the whole file's sha256 verifies."""

    tier = "s3"

    def __init__(self, fetcher: S3AdapterFetcher) -> None:
        self._source = S3Source(fetcher)

    def fetch(self, adapter: AdapterBinding) -> CanonicalAdapter:
        return self._source.fetch(replace(adapter, parts_sha256=""))

    def fetch_into(self, adapter: AdapterBinding, consume: Consume[T]) -> T:
        return self._source.fetch_into(replace(adapter, parts_sha256=""), consume)


async def open_client(address: str) -> StoreClient:
    """A client made on the loop that will run its calls (grpc.aio channels are bound to it)."""
    return StoreClient(address, timeout_s=600)


@dataclass
class StoredAdapter:
    """The stack of `stored_adapter` and the adapter it holds."""

    adapter: AdapterBinding
    s3_endpoint_url: str
    store_address: str
    client: StoreClient
    loop: EventLoopThread
    peft_bytes: int
    upload_s: float


@contextlib.contextmanager
def stored_adapter(
    root: Path, hf_config: dict[str, Any], routed: bool = True
) -> Iterator[StoredAdapter]:
    """A real `redis-server`, `weed server -s3` and the store on loopback, with a rank-16
    all-module PEFT adapter of `hf_config`'s shape (`routed` False: without the routed
    experts) uploaded (normalized into S3) as "cold"; all stopped on exit. SeaweedFS takes
    any credentials; the clients need some."""
    for key, value in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"),
                       ("AWS_DEFAULT_REGION", "us-east-1")):  # fmt: skip
        os.environ.setdefault(key, value)
    peft_bytes = v2_lite_peft_folder(root / "peft", hf_config, routed=routed)
    redis = RedisServer(root / "redis").start()
    s3 = SeaweedS3Server(root / "s3").start()
    store = ServiceProcess(
        "adapter_store",
        ["--redis-url", redis.url, "--s3-endpoint-url", s3.endpoint_url, "--s3-bucket", BUCKET],
        root / "store",
    ).start()
    loop = EventLoopThread()
    client = loop.run(open_client(store.address))
    try:
        loop.run(client.register_base_model(BASE_MODEL, json.dumps(hf_config)))
        started = time.perf_counter()
        record = loop.run(
            client.upload_dir(root / "peft", name="cold", base_model=BASE_MODEL, dtype="bfloat16")
        )
        upload_s = time.perf_counter() - started
        adapter = AdapterBinding(
            record.tenant, record.name, record.version, record.rank, record.sha256,
            record.size_bytes, record.base_model, record.parts_sha256,
        )  # fmt: skip
        yield StoredAdapter(
            adapter, s3.endpoint_url, store.address, client, loop, peft_bytes, upload_s
        )
    finally:
        loop.run(client.close())
        loop.stop()
        store.stop()
        s3.stop()
        redis.stop()


def time_fetches(
    sources: dict[str, AdapterSource], adapter: AdapterBinding, repeats: int
) -> dict[str, list[float]]:
    """Seconds from a host-cache miss to the adapter in host memory, per source; the
    sources take turns so drift hits both alike. The first round is a warm-up."""
    seconds: dict[str, list[float]] = {name: [] for name in sources}
    for round_index in range(repeats + 1):
        for name, source in sources.items():
            cache = HostAdapterCache(HostCacheConfig(capacity_bytes=4 * GIB))
            started = time.perf_counter()
            source.fetch_into(  # as the replica's residency does
                adapter,
                lambda canonical, lent, cache=cache: cache.insert(
                    adapter.key, canonical, borrowed=lent
                ),
            )
            elapsed = time.perf_counter() - started
            cache.release(adapter.key)
            if round_index:
                seconds[name].append(elapsed)
            print(f"{name:18s} round {round_index}: {elapsed * 1e3:8.1f} ms")
    return seconds


def plot(results: dict[str, Any], path: Path) -> None:
    box_plot(
        path,
        results["seconds"],
        "ms from host-cache miss to adapter in host memory",
        f"cold path S3 → host, {results['adapter_bytes'] / 1e6:.0f} MB adapter, "
        f"{results['repeats']} runs each ({results['machine']})",
    )


def box_plot(path: Path, seconds: dict[str, list[float]], ylabel: str, title: str) -> None:
    """One box per named list of durations (seconds, drawn in ms), saved to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(seconds)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.boxplot([[s * 1e3 for s in seconds[n]] for n in names], tick_labels=names)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="JSON; the PNG goes beside it")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--part-mib", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="tiny adapter, 2 repeats")
    parser.add_argument(
        "--no-routed",
        action="store_true",
        help="an adapter on every module but the routed experts (what most MoE fine-tunes train)",
    )
    args = parser.parse_args(argv)
    repeats = 2 if args.smoke else args.repeats
    hf_config = SMOKE_CONFIG if args.smoke else V2_LITE
    routed = not args.no_routed

    with (
        tempfile.TemporaryDirectory() as tmp,
        stored_adapter(Path(tmp), hf_config, routed) as stored,
    ):
        fetchers: list[S3AdapterFetcher] = []
        try:
            sources: dict[str, AdapterSource] = {}
            for concurrency in args.concurrency:
                fetcher = S3AdapterFetcher(
                    S3FetchConfig(
                        BUCKET,
                        stored.s3_endpoint_url,
                        part_size=args.part_mib * MIB,
                        concurrency=concurrency,
                    )
                )
                fetchers.append(fetcher)
                sources[f"s3 x{concurrency}"] = S3Source(fetcher)
                sources[f"s3 x{concurrency} whole"] = WholeFileDigestSource(fetcher)
            sources["store FetchAdapter"] = StoreFetchSource(
                stored.client, stored.store_address, stored.loop.loop
            )
            seconds = time_fetches(sources, stored.adapter, repeats)
        finally:
            for fetcher in fetchers:
                fetcher.close()
    adapter, peft_bytes, upload_s = stored.adapter, stored.peft_bytes, stored.upload_s
    modules = (
        f"all modules, per-expert routed experts ({hf_config['n_routed_experts']})"
        if routed
        else "every module but the routed experts"
    )

    results = {
        "benchmark": "serve_cold_path",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, no GPU",
        **provenance("serve_cold_path", argv, "python"),
        "adapter": f"rank 16, {modules}, {hf_config['num_hidden_layers']} layers, bf16",
        "peft_bytes": peft_bytes,
        "adapter_bytes": adapter.size_bytes,
        "upload_s": upload_s,
        "part_mib": args.part_mib,
        "repeats": repeats,
        "seconds": seconds,
        "stats": {name: percentiles_ms(values) for name, values in seconds.items()},
        "MB_per_s_p50": {
            name: adapter.size_bytes / 1e6 / (stats["p50_ms"] / 1e3)
            for name, stats in ((n, percentiles_ms(v)) for n, v in seconds.items())
        },
    }
    save(args.out, results)
    plot(results, args.out.with_suffix(".png"))
    for name, stats in results["stats"].items():
        print(
            f"{name:18s} p50 {stats['p50_ms']:8.1f} ms  p99 {stats['p99_ms']:8.1f} ms  "
            f"{results['MB_per_s_p50'][name]:6.0f} MB/s"
        )


if __name__ == "__main__":
    main()
