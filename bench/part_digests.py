"""What per-part digests buy a replica's S3 fetch on a given host: sha256 of a 553 MiB
adapter-sized buffer as one in-order digest of the whole (what a record without part
digests needs) against its 8 MiB parts hashed on a pool of 1, 2, 4, … threads (what the
S3 fetcher's GET threads do; hashlib releases the GIL). CPU only, no S3: the hashing floor
of the fetch, on the CPU machine and on the GPU host alike.

    python -m bench.part_digests --out docs/bench/part_digests.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from adapter_store.format import DIGEST_PART_BYTES, part_views, sha256_hex
from bench.provenance import provenance
from bench.serve_setup import save

MIB = 1 << 20


def time_whole(view: memoryview, repeats: int) -> list[float]:
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        sha256_hex(view)
        seconds.append(time.perf_counter() - started)
    return seconds


def time_parts(view: memoryview, threads: int, repeats: int) -> list[float]:
    parts = part_views(view, DIGEST_PART_BYTES)
    seconds = []
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            started = time.perf_counter()
            list(pool.map(sha256_hex, parts))
            seconds.append(time.perf_counter() - started)
    return seconds


def thread_counts(cpus: int) -> list[int]:
    counts, threads = [], 1
    while threads < cpus:
        counts.append(threads)
        threads *= 2
    return [*counts, cpus]


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["parts"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["threads"] for r in rows], [r["GBps_p50"] for r in rows], "o-", label="8 MiB parts")
    ax.axhline(results["whole"]["GBps_p50"], color="black", linestyle="--", label="whole file")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("hashing threads")
    ax.set_ylabel("GB/s verified (median)")
    ax.set_title(f"sha256 of {results['MiB']} MiB, {results['machine']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON; the PNG goes beside it")
    parser.add_argument("--mib", type=int, default=553, help="the per-expert V2-Lite adapter")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    view = memoryview(os.urandom(args.mib * MIB))
    size = len(view)

    def summary(seconds: list[float]) -> dict[str, Any]:
        p50 = statistics.median(seconds)
        return {"seconds": seconds, "ms_p50": 1e3 * p50, "GBps_p50": size / p50 / 1e9}

    whole = summary(time_whole(view, args.repeats))
    print(f"whole file, one thread   {whole['ms_p50']:8.1f} ms  {whole['GBps_p50']:5.2f} GB/s")
    rows = []
    for threads in thread_counts(os.cpu_count() or 1):
        row = {"threads": threads, **summary(time_parts(view, threads, args.repeats))}
        rows.append(row)
        ms, rate = row["ms_p50"], row["GBps_p50"]
        print(f"8 MiB parts, {threads:3d} threads {ms:8.1f} ms  {rate:5.2f} GB/s")
    results = {
        "benchmark": "part_digests",
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs",
        **provenance("part_digests", argv, "python"),
        "MiB": args.mib,
        "part_bytes": DIGEST_PART_BYTES,
        "whole": whole,
        "parts": rows,
    }
    save(args.out, results)
    plot(results, args.out.with_suffix(".png"))
    return results


if __name__ == "__main__":
    main()
