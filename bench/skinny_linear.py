"""Few-row linears of a decode step: cuBLAS (F.linear) vs `kernels.skinny_linear`.

The dense projections of DeepSeek-V2-Lite with q_lora_rank 1536 (the serving benchmarks'
model) at 1-256 rows, bf16. For each case the Triton plans of a sweep (column tile, K tile,
K splits, pipeline stages; those that fit in shared memory) run beside cuBLAS. Each timing
is a CUDA graph of a chain of launches over distinct copies of the weight (more bytes than
the L2 holds), as a decode step runs its projections back to back: per-launch time = chain
time ÷ launches, the weight read from memory each time. Weight GB/s = the weight's bytes ÷
per-launch time, against the measured copy bandwidth. The row's `best` is the fastest plan;
`default` what `skinny_linear` takes without one.

    python3 -m bench.skinny_linear --out bench/results/skinny_linear.json
    python -m bench.skinny_linear --out /tmp/skinny_linear.json --smoke   # CPU, interpreted
"""

from __future__ import annotations

import functools
import itertools
import time

import torch

from bench.gpu_timing import (
    bar_plot,
    copy_bandwidth,
    graphed,
    kernel_bench_args,
    run_meta,
    time_ms,
    write_json,
)
from kernels.skinny_linear import (
    SkinnyTiles,
    default_skinny_tiles,
    skinny_linear,
    skinny_linear_ref,
)

# name → (N, K)
SHAPES = {
    "v2l_qkv_a": (1536 + 576, 2048),
    "v2l_q_b": (16 * 192, 1536),
    "v2l_o": (2048, 16 * 128),
    "v2l_shared_gate_up": (2 * 2816, 2048),
    "v2l_shared_down": (2048, 2816),
}
ROWS = (1, 64, 256)
L2_BYTES = 50 * 1024**2
SHARED_MEMORY_BYTES = 200 * 1024


def plans(rows: int) -> list[SkinnyTiles]:
    """The sweep: plans whose pipelined tiles fit in shared memory."""
    if rows <= 16:
        grid = itertools.product((16,), (16, 32, 64), (128, 256), (1, 2, 4), (4,))
    else:
        grid = itertools.product((64,), (32, 64, 128), (64, 128), (2, 4, 8), (3, 5))
    return [
        SkinnyTiles(block_m, block_n, block_k, split, num_stages=stages)
        for block_m, block_n, block_k, split, stages in grid
        if stages * (block_m + block_n) * block_k * 2 <= SHARED_MEMORY_BYTES
    ]


def chained(fn, weights: list[torch.Tensor]):
    """One call = `fn(w)` for each weight copy in turn."""

    def chain():
        for w in weights:
            fn(w)

    return chain


def run(shapes: dict[str, tuple[int, int]], rows_list, device, bandwidth, sweep: int) -> list[dict]:
    """One row per (shape, rows); `sweep` plans of `plans(rows)` beside the default."""
    out = []
    cuda = device.type == "cuda"
    for (name, (n, k)), rows in itertools.product(shapes.items(), rows_list):
        dtype = torch.bfloat16 if cuda else torch.float32
        x = torch.randn(rows, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
        weight_bytes = n * k * x.element_size()
        copies = [w] + [
            w.clone() for _ in range(min(31, 3 * L2_BYTES // weight_bytes) if cuda else 0)
        ]
        ref = skinny_linear_ref(x.float(), w.float())
        ways = {"cublas": functools.partial(lambda w, x: skinny_linear_ref(x, w), x=x)}
        candidates = [default_skinny_tiles(rows), *plans(rows)[:sweep]]
        for tiles in candidates:
            ways[str(tiles)] = functools.partial(
                lambda w, x, t: skinny_linear(x, w, t), x=x, t=tiles
            )
        errors = {key: float((call(w).float() - ref).abs().max()) for key, call in ways.items()}
        timed = {key: chained(call, copies) for key, call in ways.items()}
        if cuda:
            timed = {key: graphed(call) for key, call in timed.items()}
        ms = {key: time_ms(call, device) / len(copies) for key, call in timed.items()}
        default_key = str(candidates[0])
        best_key = min((key for key in ms if key != "cublas"), key=ms.get)
        row = {
            "shape": name, "n": n, "k": k, "rows": rows, "weight_bytes": weight_bytes,
            "chained_launches": len(copies),
            "cublas_ms": ms["cublas"], "default_ms": ms[default_key], "best_ms": ms[best_key],
            "best": best_key, "default": default_key, "max_abs_error": max(errors.values()),
            "cublas_weight_GBps": weight_bytes / ms["cublas"] / 1e6,
            "best_weight_GBps": weight_bytes / ms[best_key] / 1e6,
            "best_of_copy": weight_bytes / (ms[best_key] * 1e-3) / bandwidth,
            "all_ms": ms,
        }  # fmt: skip
        out.append(row)
        print(
            f"{name:20s} M{rows:4d}  cuBLAS {ms['cublas'] * 1e3:7.1f} µs "
            f"({row['cublas_weight_GBps']:6.0f} GB/s)  default {ms[default_key] * 1e3:7.1f}  "
            f"best {ms[best_key] * 1e3:7.1f} µs ({row['best_weight_GBps']:6.0f} GB/s) {best_key}"
        )
    return out


def main(argv: list[str] | None = None) -> None:
    out, device = kernel_bench_args(__doc__, argv)
    started = time.perf_counter()
    smoke = device.type == "cpu"
    shapes = {"tiny": (40, 64)} if smoke else SHAPES
    bandwidth = copy_bandwidth(device)
    rows = run(shapes, (1, 5) if smoke else ROWS, device, bandwidth, 2 if smoke else 10**6)
    meta = run_meta("skinny_linear", device, started, copy_bandwidth_GBps=bandwidth / 1e9)
    write_json(out, meta, rows)
    at_64 = [r for r in rows if r["rows"] == (5 if smoke else 64)]
    bar_plot(
        out.with_suffix(".png"),
        f"dense projections at {at_64[0]['rows']} rows (bf16)",
        [r["shape"] for r in at_64],
        {way: [r[f"{way}_ms"] * 1e3 for r in at_64] for way in ("cublas", "default", "best")},
        "µs",
    )


if __name__ == "__main__":
    main()
