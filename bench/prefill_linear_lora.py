"""A prompt-length step's linear modules with LoRA: the expand after the base product
(read-modify-write of the output) against the expand written first and the product added
onto it (cuBLAS with beta = 1, `inference_svc.lora.apply.EXPAND_FIRST_MIN_TOKENS`).

    python3 -m bench.prefill_linear_lora --out bench/results/prefill_linear_lora_h100.json
    python -m bench.prefill_linear_lora --out /tmp/p.json --smoke    # CPU setup check

Shapes: the dense modules of one layer of the serving benchmark's model (V2-Lite with
q_lora_rank 1536), a step of 16 prompts × 512 tokens, one adapter per prompt, rank 16.
The shrink is the same on both paths and left out. Per module, µs (CUDA-graph replays,
L2 flushed) of: the product alone; product then expand; expand (written) then product; and
the expand alone both ways, beside its floor (bytes of out ÷ measured copy bandwidth).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from bench.gpu_timing import (
    bar_plot,
    copy_bandwidth,
    graphed,
    kernel_bench_args,
    run_meta,
    time_ms,
    write_json,
)
from kernels.lora_segments import build_lora_segments
from kernels.sgmv import sgmv_expand

# (module, in features, output slices) of one V2-Lite layer with q_lora_rank 1536.
MODULES = [
    ("attn.qkv_a", 2048, [1536, 576]),
    ("attn.q_b", 1536, [3072]),
    ("attn.kv_b", 512, [4096]),
    ("attn.o", 2048, [2048]),
    ("mlp.shared.gate_up", 2048, [2816, 2816]),
    ("mlp.shared.down", 2816, [2048]),
]
PROMPTS, PROMPT_LEN, RANK, SLOTS = 16, 512, 16, 32
SMOKE_SCALE = 64  # CPU: every width and the prompt length ÷ this


@dataclass
class Row:
    module: str
    tokens: int
    in_features: int
    out_features: int
    product_us: float
    after_us: float
    first_us: float
    expand_rmw_us: float
    expand_write_us: float
    expand_rmw_floor_us: float
    expand_write_floor_us: float
    max_rel_diff: float  # between the two paths' outputs, relative to the largest entry


def measure_module(
    name: str, in_dim: int, slices: list[int], prompt_len: int, device: torch.device, bw: float
) -> Row:
    """One module's timings (see the module docstring)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens, out_dim = PROMPTS * prompt_len, sum(slices)
    offsets = [sum(slices[:i]) for i in range(len(slices) + 1)]
    slots = [p for p in range(PROMPTS) for _ in range(prompt_len)]
    segs = build_lora_segments(slots, [RANK] * SLOTS, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, in_dim, device=device, dtype=dtype, generator=gen)  # [T, in]
    w = torch.randn(out_dim, in_dim, device=device, dtype=dtype, generator=gen) * 0.02
    b = torch.randn(SLOTS, out_dim, RANK, device=device, dtype=dtype, generator=gen) * 0.02
    y = torch.randn(tokens, len(slices) * RANK, device=device, generator=gen)  # shrink output
    out = torch.empty(tokens, out_dim, device=device, dtype=dtype)

    def after() -> torch.Tensor:
        return sgmv_expand(y, b, F.linear(x, w), segs, offsets)

    def first() -> torch.Tensor:
        return sgmv_expand(y, b, out, segs, offsets, accumulate=False).addmm_(x, w.t())

    expected = after().float()
    max_rel_diff = ((first().float() - expected).abs().max() / expected.abs().max()).item()

    def timed(fn) -> float:  # type: ignore[no-untyped-def]
        return 1e3 * time_ms(graphed(fn) if device.type == "cuda" else fn, device)

    out_bytes = tokens * out_dim * dtype.itemsize
    return Row(
        module=name,
        tokens=tokens,
        in_features=in_dim,
        out_features=out_dim,
        product_us=timed(lambda: F.linear(x, w)),
        after_us=timed(after),
        first_us=timed(first),
        expand_rmw_us=timed(lambda: sgmv_expand(y, b, out, segs, offsets)),
        expand_write_us=timed(lambda: sgmv_expand(y, b, out, segs, offsets, accumulate=False)),
        expand_rmw_floor_us=1e6 * 2 * out_bytes / bw,
        expand_write_floor_us=1e6 * out_bytes / bw,
        max_rel_diff=max_rel_diff,
    )


def main(argv: list[str] | None = None) -> None:
    out_path, device = kernel_bench_args(__doc__, argv)
    started = time.perf_counter()
    scale = 1 if device.type == "cuda" else SMOKE_SCALE
    bw = copy_bandwidth(device)
    rows = []
    for name, in_dim, slices in MODULES:
        row = measure_module(
            name, in_dim // scale, [s // scale for s in slices], PROMPT_LEN // scale, device, bw
        )
        rows.append(row)
        print(
            f"{name:20} product {row.product_us:7.1f}  after {row.after_us:7.1f}  first "
            f"{row.first_us:7.1f} µs | expand rmw {row.expand_rmw_us:6.1f} (floor "
            f"{row.expand_rmw_floor_us:5.1f})  write {row.expand_write_us:6.1f} (floor "
            f"{row.expand_write_floor_us:5.1f})  max rel diff {row.max_rel_diff:.1e}"
        )
    after_total = sum(r.after_us for r in rows)
    first_total = sum(r.first_us for r in rows)
    print(f"layer: after {after_total:.1f} µs, first {first_total:.1f} µs")
    meta = run_meta(
        "prefill_linear_lora", device, started, copy_bandwidth_gbps=bw / 1e9,
        prompts=PROMPTS, prompt_len=PROMPT_LEN // scale, rank=RANK,
    )  # fmt: skip
    write_json(out_path, meta, [asdict(r) for r in rows])
    bar_plot(
        out_path.with_suffix(".png"),
        f"Linear + LoRA expand, {PROMPTS}×{PROMPT_LEN // scale} tokens, rank {RANK}",
        [r.module for r in rows],
        {
            "product alone": [r.product_us for r in rows],
            "product, then expand": [r.after_us for r in rows],
            "expand written, then product": [r.first_us for r in rows],
        },
        "µs",
    )


if __name__ == "__main__":
    main()
