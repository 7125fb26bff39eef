"""Do a step's small host→device copies wait behind an adapter's slot-load copy?

The offline N=1000 scenario (107 slot loads of a 582 MB adapter) spends ~1.9 s more in
prefill steps than N=8, more than its LoRA kernels explain. Suspect: every step starts
with a small host→device copy of its batch metadata (`build_batch`, blocking, pageable
source), and host→device copies share the GPU's copy engines: if the engine serves the
slot load's copies first, each step waits up to the load's remaining transfer time.

This times a 64 KB pageable copy (what a step does) while a 582 MB pinned copy is in flight
on another stream, issued as one copy or in chunks of several sizes (the pool stages a
packed adapter in 64 MB halves), against the same copy on an idle link.

    python3 -m bench.copy_contention --out bench/results/copy_contention.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.gpu_timing import bar_plot, device_name, write_json
from bench.provenance import provenance

MIB = 1 << 20
LOAD_BYTES = 582 * MIB  # one rank-16 all-module V2-Lite adapter
SMALL_BYTES = 64 * 1024  # a step's metadata, generously
CHUNKS_MIB = (582, 64, 8, 2)


def small_copy_ms(small: torch.Tensor) -> float:
    began = time.perf_counter()
    small.to("cuda")  # pageable source: returns once the copy is done
    return (time.perf_counter() - began) * 1e3


def under_load(source: torch.Tensor, target: torch.Tensor, chunk: int, small: torch.Tensor):
    """Small-copy latencies (ms) from the moment a chunked load is queued until it ends,
    and the load's own duration (ms)."""
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    began = time.perf_counter()
    with torch.cuda.stream(side):
        for start in range(0, source.numel(), chunk):
            target[start : start + chunk].copy_(source[start : start + chunk], non_blocking=True)
        done = side.record_event()
    latencies = []
    while not done.query():
        latencies.append(small_copy_ms(small))
    load_ms = (time.perf_counter() - began) * 1e3
    torch.cuda.synchronize()
    return latencies, load_ms


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    source = torch.empty(LOAD_BYTES, dtype=torch.uint8, pin_memory=True).fill_(1)
    target = torch.empty(LOAD_BYTES, dtype=torch.uint8, device="cuda")
    small = torch.ones(SMALL_BYTES // 8, dtype=torch.int64)
    for _ in range(20):
        small_copy_ms(small)
    idle = [small_copy_ms(small) for _ in range(200)]
    rows = [{"load": "none", "small_copy_p50_ms": statistics.median(idle), "max_ms": max(idle)}]
    print(f"idle link: small copy p50 {rows[0]['small_copy_p50_ms']:.3f} ms")
    for chunk_mib in CHUNKS_MIB:
        latencies, loads = [], []
        for _ in range(args.reps):
            measured, load_ms = under_load(source, target, chunk_mib * MIB, small)
            latencies += measured
            loads.append(load_ms)
        row = {
            "load": f"{LOAD_BYTES // MIB} MB in {chunk_mib} MB copies",
            "chunk_mib": chunk_mib,
            "load_ms": statistics.median(loads),
            "small_copies": len(latencies),
            "small_copy_p50_ms": statistics.median(latencies) if latencies else None,
            "max_ms": max(latencies) if latencies else None,
            "first_ms": latencies[0] if latencies else None,
        }
        rows.append(row)
        print(
            f"{row['load']:28s} load {row['load_ms']:6.1f} ms; small copies during it: "
            f"{row['small_copies']:4d}, first {row['first_ms']:.2f} ms, p50 "
            f"{row['small_copy_p50_ms']:.3f}, max {row['max_ms']:.2f} ms"
        )
    meta = {
        "benchmark": "copy_contention",
        "device": device_name(torch.device("cuda")),
        **provenance("copy_contention", argv),
    }
    write_json(args.out, meta, rows)
    bar_plot(
        args.out.with_suffix(".png"),
        "64 KB host→device copy while a slot load is in flight",
        [row["load"] for row in rows],
        {
            "p50": [row["small_copy_p50_ms"] or 0.0 for row in rows],
            "max": [row["max_ms"] or 0.0 for row in rows],
        },
        "ms",
    )


if __name__ == "__main__":
    main()
