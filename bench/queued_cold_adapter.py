"""A request queued behind a full batch, its adapter cold in S3 (CPU machine): how long it
waits once its seat is free, with the scheduler's look-ahead and without it.

A real `redis-server`, `weed server -s3` and the store hold a rank-16 all-module adapter of
DeepSeek-V2-Lite's shape (582 MB; `bench.serve_cold_path.stored_adapter`). The scheduler is
the engine's (`inference_svc.engine.scheduler.Scheduler`) with the engine's residency:
`S3Source` downloads into a host cache, which copies into a LoRA pool of V2-Lite's shapes
(on the CPU, so the copy runs on the scheduling thread). No model runs: an engine step is a
sleep of `--step-ms` (the GPU's serving decode steps take ~10-13 ms), and the batch has one
seat, taken by a base-model request of `--run-steps` steps. The cold adapter's request
arrives in that request's first step. Per round, fresh host cache and pool (cold), each
arm in turn:

- look-ahead: the scheduler as it is;
- without: `Scheduler._load_ahead` a no-op, i.e. the scheduler before the thirty-eighth
  session, which began the download only once the request had its seat.

Measured: seconds from the seat freeing (the base request's last step) to the queued
request's admission, and from its arrival to its admission.

    python -m bench.queued_cold_adapter --out docs/bench/queued_cold_adapter.json
    python -m bench.queued_cold_adapter --out /tmp/queued.json --smoke   # tiny adapter
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from adapter_store.model_shapes import model_lora_shapes
from bench.provenance import provenance
from bench.serve_cold_path import BUCKET, SMOKE_CONFIG, box_plot, stored_adapter
from bench.serve_setup import percentiles_ms, save
from bench.store_throughput import V2_LITE
from inference_svc.adapters.host_cache import HostAdapterCache, HostCacheConfig
from inference_svc.adapters.residency import AdapterResidency
from inference_svc.adapters.s3_fetch import S3AdapterFetcher, S3FetchConfig
from inference_svc.adapters.sources import S3Source
from inference_svc.engine.lora_slots import LoraSlotAllocator
from inference_svc.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from inference_svc.engine.sequence import (
    AdapterBinding,
    FinishReason,
    GenerationParams,
    Sequence,
)
from inference_svc.lora.pool import GIB, LoraPool, LoraPoolConfig
from inference_svc.metrics import InferenceMetrics
from inference_svc.model.tokenizer import ByteTokenizer

ARMS = ("look-ahead", "without")
PROMPT = [65] * 8


def make_scheduler(source: S3Source, hf_config: dict[str, Any]) -> Scheduler:
    """One seat, one LoRA slot of rank 16 (bf16, CPU), a 2 GiB host cache: all empty."""
    metrics = InferenceMetrics()
    pool_config = LoraPoolConfig(16, dtype=torch.bfloat16, device="cpu", max_loras=1)
    pool = LoraPool(model_lora_shapes(hf_config), 1, pool_config)
    cache = HostAdapterCache(HostCacheConfig(capacity_bytes=2 * GIB))
    residency = AdapterResidency(source, cache, pool, metrics)
    config = SchedulerConfig(
        num_pages=64, page_size=16, max_model_len=1024, max_num_seqs=1, max_num_batched_tokens=64
    )
    return Scheduler(config, LoraSlotAllocator(1), residency, metrics)


def request(name: str, adapter: AdapterBinding | None, max_new: int) -> Sequence:
    tokenizer = ByteTokenizer(eos_token_ids=(1,))
    params = GenerationParams(max_new_tokens=max_new)
    return Sequence(name, PROMPT, params, tokenizer, (), adapter)


def advance(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """What the engine does after running `out`: a token for each finished prefill or
    decode, and the end of a request at its length."""
    for scheduled in out.scheduled:
        seq = scheduled.seq
        seq.num_computed += scheduled.query_len
        if seq.num_computed == seq.num_tokens:
            seq.output_token_ids.append(66)
            if len(seq.output_token_ids) >= seq.params.max_new_tokens:
                scheduler.finish(seq, FinishReason.LENGTH)


def queued_wait(
    scheduler: Scheduler, adapter: AdapterBinding, run_steps: int, step_s: float, tag: str
) -> dict[str, float]:
    """Run the base request for `run_steps` steps with the cold request queued behind it;
    the two waits of the queued request in seconds."""
    base = request(f"{tag}-base", None, run_steps)
    queued = request(f"{tag}-cold", adapter, 1)
    scheduler.add(base)
    arrived = freed = None
    while True:
        out = scheduler.schedule()
        now = time.perf_counter()
        if arrived is None:
            scheduler.add(queued)
            arrived = now
        if any(s.seq is queued for s in out.scheduled):
            admitted = now
            break
        advance(scheduler, out)
        if base.is_finished:
            freed = freed or time.perf_counter()
            time.sleep(0.001)  # nothing to run: poll for the download
        else:
            time.sleep(step_s)  # the step's GPU time
    scheduler.finish(queued, FinishReason.CANCELLED)
    return {"after_seat_s": admitted - freed, "from_arrival_s": admitted - arrived}


def plot(results: dict[str, Any], path: Path) -> None:
    box_plot(
        path,
        results["after_seat_s"],
        "ms from the seat freeing to admission",
        f"request queued behind a full batch, adapter cold in S3 "
        f"({results['adapter_bytes'] / 1e6:.0f} MB), {results['rounds']} rounds",
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="JSON; the PNG goes beside it")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--run-steps", type=int, default=150, help="steps of the base request")
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--smoke", action="store_true", help="tiny adapter, 2 rounds")
    args = parser.parse_args(argv)
    rounds = 2 if args.smoke else args.rounds
    hf_config = SMOKE_CONFIG if args.smoke else V2_LITE
    waits: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    load_ahead = Scheduler._load_ahead
    with tempfile.TemporaryDirectory() as tmp, stored_adapter(Path(tmp), hf_config) as stored:
        fetcher = S3AdapterFetcher(S3FetchConfig(BUCKET, stored.s3_endpoint_url))
        try:
            source = S3Source(fetcher)
            for round_index in range(rounds + 1):  # round 0 warms the connections up
                for arm in ARMS:
                    Scheduler._load_ahead = load_ahead if arm == "look-ahead" else _no_load_ahead
                    scheduler = make_scheduler(source, hf_config)
                    wait = queued_wait(
                        scheduler, stored.adapter, args.run_steps, args.step_ms / 1e3,
                        f"r{round_index}-{arm}",
                    )  # fmt: skip
                    scheduler.residency.close()
                    print(
                        f"round {round_index} {arm:10s} after the seat "
                        f"{wait['after_seat_s'] * 1e3:8.1f} ms, from arrival "
                        f"{wait['from_arrival_s'] * 1e3:8.1f} ms"
                    )
                    if round_index:
                        waits[arm].append(wait)
        finally:
            Scheduler._load_ahead = load_ahead
            fetcher.close()
    results = {
        "benchmark": "queued_cold_adapter",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, no GPU",
        **provenance("queued_cold_adapter", argv, "python"),
        "adapter_bytes": stored.adapter.size_bytes,
        "rounds": rounds,
        "run_steps": args.run_steps,
        "step_ms": args.step_ms,
        "after_seat_s": {arm: [w["after_seat_s"] for w in waits[arm]] for arm in ARMS},
        "from_arrival_s": {arm: [w["from_arrival_s"] for w in waits[arm]] for arm in ARMS},
    }
    results["stats"] = {
        f"{arm} {kind}": percentiles_ms(results[kind][arm])
        for arm in ARMS
        for kind in ("after_seat_s", "from_arrival_s")
    }
    save(args.out, results)
    plot(results, args.out.with_suffix(".png"))
    for name, stats in results["stats"].items():
        print(f"{name:26s} p50 {stats['p50_ms']:8.1f} ms  p99 {stats['p99_ms']:8.1f} ms")


def _no_load_ahead(self: Scheduler, wanted: set) -> None:
    """The scheduler without its look-ahead (the "without" arm)."""


if __name__ == "__main__":
    main()
