"""Few-row linears of a decode step: cuBLAS (F.linear) vs `kernels.skinny_linear`.

The dense projections of DeepSeek-V2-Lite with q_lora_rank 1536 (the serving benchmarks'
model) and of DeepSeek-V3, at 1-256 rows, bf16. For each case the Triton plans of a small
sweep (column tile, K tile, K splits) run beside cuBLAS, all as CUDA-graph replays (the
kernels without the host's launch cost); weight GB/s = the weight's bytes ÷ time, against
the measured copy bandwidth. The row's `best` is the fastest plan; `default` what
`skinny_linear` takes without one.

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
    "v3_qkv_a": (1536 + 576, 7168),
    "v3_o": (7168, 128 * 128),
    "v3_shared_down": (7168, 2048),
}
ROWS = (1, 16, 64, 128, 256)


def plans(rows: int) -> list[SkinnyTiles]:
    block_m = 16 if rows <= 16 else 64
    return [
        SkinnyTiles(block_m, block_n, block_k, split)
        for block_n, block_k, split in itertools.product((16, 32, 64), (128, 256), (1, 2, 4, 8))
    ]


def run(shapes: dict[str, tuple[int, int]], rows_list, device, bandwidth, sweep: int) -> list[dict]:
    """One row per (shape, rows); `sweep` plans of `plans(rows)` beside the default."""
    out = []
    for (name, (n, k)), rows in itertools.product(shapes.items(), rows_list):
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16 if device.type == "cuda"
                        else torch.float32)  # fmt: skip
        w = torch.randn(n, k, device=device, dtype=x.dtype) / k**0.5
        ref = skinny_linear_ref(x.float(), w.float())
        timed = {"cublas": functools.partial(skinny_linear_ref, x, w)}
        candidates = [default_skinny_tiles(rows), *plans(rows)[:sweep]]
        for tiles in candidates:
            timed[str(tiles)] = functools.partial(skinny_linear, x, w, tiles)
        errors = {
            key: float((call().float() - ref).abs().max()) for key, call in timed.items()
        }  # fmt: skip
        if device.type == "cuda":
            timed = {key: graphed(call) for key, call in timed.items()}
        ms = {key: time_ms(call, device) for key, call in timed.items()}
        weight_bytes = n * k * x.element_size()
        default_key = str(candidates[0])
        best_key = min((key for key in ms if key != "cublas"), key=ms.get)
        row = {
            "shape": name, "n": n, "k": k, "rows": rows, "weight_bytes": weight_bytes,
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
    rows = run(shapes, (1, 5) if smoke else ROWS, device, bandwidth, 2 if smoke else 24)
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
