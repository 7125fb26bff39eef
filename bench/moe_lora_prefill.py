"""The routed experts' LoRA at prefill sizes: expand after the grouped GEMM vs in its epilogue.

The MoE stage of one layer (gate_up GEMM → SiLU·mul → down GEMM) is timed three ways on
V2-Lite expert shapes (64 experts, top-6, hidden 2048, inter 1408), bf16 and FP8
block-scaled experts (with bf16 activations, and with e4m3 activations: fp8_a8), with N
distinct rank-16 adapters over the tokens (contiguous runs of one slot, as the scheduler
orders a step):

- base:     no LoRA;
- after:    LoRA shrink + expand kernels ("runs") after each GEMM, which read and rewrite
            the per-pair intermediates ([P, 2816] and [P, 2048] bf16);
- in_gemm:  LoRA shrink, then the GEMM adds y·Bᵀ to its tile before storing
            (`grouped_gemm(lora=)`, what serving runs above PAIRS_MAX_PAIRS pairs).

Times are CUDA-event medians of the stage's kernels (triton.testing.do_bench, L2 flushed),
so host launch cost is not in them. Each row checks in_gemm's output against after's.

    python3 -m bench.moe_lora_prefill --out bench/results/moe_lora_prefill.json
    python -m bench.moe_lora_prefill --out /tmp/moe_lora_prefill.json --smoke  # CPU
"""

from __future__ import annotations

import functools
import time
from dataclasses import asdict

import torch

from bench.gpu_timing import bar_plot, kernel_bench_args, run_meta, time_ms, write_json
from bench.grouped_gemm_tiles import GEMM_SCHEMES, SMOKE_SHAPES, ExpertShapes, make_weights
from kernels import fused_moe as fm
from kernels.lora_segments import build_lora_segments
from kernels.moe_lora import moe_lora_down, moe_lora_epilogue, moe_lora_gate_up

RANK = 16
WAYS = ("base", "after", "in_gemm")


def moe_stage(x, experts, lora, way: str) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """gate_up → SiLU·mul → down over the routed pairs, with the LoRA added `way`."""
    (w13, s13, w2, s2, block, scheme), (align, top_k, pt, pe, segs), (a_gu, b_gu, a_d, b_d) = (
        experts,
        lora["routing"],
        lora["weights"],
    )
    order = align.sorted_pair_ids
    epilogue = None
    if way == "in_gemm":
        epilogue = moe_lora_epilogue(
            x, a_gu, b_gu, pt, pe, segs, x_per_pair=False, pair_order=order
        )
    inter = fm.grouped_gemm(x, w13, align, top_k, s13, block, scheme, lora=epilogue)
    if way == "after":
        moe_lora_gate_up(x, inter, a_gu, b_gu, pt, pe, segs, variant="runs", pair_order=order)
    act = fm.silu_mul(inter)
    if way == "in_gemm":
        epilogue = moe_lora_epilogue(act, a_d, b_d, pt, pe, segs, x_per_pair=True, pair_order=order)
    out = fm.grouped_gemm(act, w2, align, 1, s2, block, scheme, lora=epilogue, role="down")
    if way == "after":
        moe_lora_down(act, out, a_d, b_d, pt, pe, segs, variant="runs", pair_order=order)
    return out


def make_lora(shapes: ExpertShapes, tokens: int, adapters: int, device, dtype):  # type: ignore[no-untyped-def]
    """Routing, pairs, segments (`adapters` contiguous runs of tokens) and pool weights."""
    e, k, hidden, inter = shapes.experts, shapes.top_k, shapes.hidden, shapes.inter
    ids = torch.stack([torch.randperm(e, device=device)[:k] for _ in range(tokens)])
    align = fm.moe_align(ids, e, fm.moe_block_m(ids.numel(), e))
    slots = (torch.arange(tokens) * adapters // tokens).tolist()  # sorted runs
    segs = build_lora_segments(slots, [RANK] * adapters, device=device)
    pt = (torch.arange(tokens * k, device=device) // k).int()
    pe = ids.flatten().int()

    def pool(*shape: int) -> torch.Tensor:
        return (torch.randn(adapters, *shape, device=device) * 0.02).to(dtype)

    weights = (
        pool(e, 2 * RANK, hidden), pool(e, 2 * inter, RANK), pool(e, RANK, inter),
        pool(e, hidden, RANK),
    )  # fmt: skip
    return {"routing": (align, k, pt, pe, segs), "weights": weights}


def run(shapes: ExpertShapes, tokens_list, adapters_list, schemes, device, rep):  # type: ignore[no-untyped-def]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for scheme in schemes:
        w13, s13, block = make_weights(
            shapes.experts, 2 * shapes.inter, shapes.hidden, scheme, device
        )
        w2, s2, _ = make_weights(shapes.experts, shapes.hidden, shapes.inter, scheme, device)
        experts = (w13, s13, w2, s2, block, GEMM_SCHEMES[scheme])
        for tokens in tokens_list:
            x = (torch.randn(tokens, shapes.hidden, device=device) * 0.5).to(dtype)
            for adapters in adapters_list:
                lora = make_lora(shapes, tokens, adapters, device, dtype)
                stage = functools.partial(moe_stage, x, experts, lora)
                ms = {way: time_ms(functools.partial(stage, way), device, rep) for way in WAYS}
                after, fused = stage("after").float(), stage("in_gemm").float()
                diff = ((fused - after).abs().max() / after.abs().max()).item()
                row = {
                    "scheme": scheme, "tokens": tokens, "adapters": adapters, "rank": RANK,
                    **{f"{way}_ms": ms[way] for way in WAYS},
                    "after_overhead": ms["after"] / ms["base"] - 1,
                    "in_gemm_overhead": ms["in_gemm"] / ms["base"] - 1,
                    "in_gemm_speedup_vs_after": ms["after"] / ms["in_gemm"],
                    "max_rel_diff": diff,
                }  # fmt: skip
                rows.append(row)
                print(
                    f"{scheme:6s} T{tokens:5d} N={adapters:<3d} base {ms['base']:7.3f} ms  "
                    f"after {ms['after']:7.3f} (+{row['after_overhead']:.0%})  in_gemm "
                    f"{ms['in_gemm']:7.3f} (+{row['in_gemm_overhead']:.0%})  "
                    f"×{row['in_gemm_speedup_vs_after']:.2f}  diff {diff:.1e}"
                )
    return rows


def main(argv: list[str] | None = None) -> None:
    out, device = kernel_bench_args(__doc__, argv)
    smoke = device.type == "cpu"
    started = time.perf_counter()
    shapes = SMOKE_SHAPES if smoke else ExpertShapes()
    tokens = [40] if smoke else [8192, 2048]
    adapters = [1, 3] if smoke else [1, 8, 32]
    schemes = ["bf16"] if smoke else list(GEMM_SCHEMES)
    rows = run(shapes, tokens, adapters, schemes, device, rep=50)
    meta = run_meta("moe_lora_prefill", device, started, shapes=asdict(shapes), rank=RANK)
    write_json(out, meta, rows)
    big = [r for r in rows if r["tokens"] == max(tokens)]
    labels = [f"{r['scheme']} N={r['adapters']}" for r in big]
    series = {way: [r[f"{way}_ms"] for r in big] for way in WAYS}
    bar_plot(
        out.with_suffix(".png"),
        f"MoE stage with LoRA, {max(tokens)} tokens (one layer)",
        labels,
        series,
        "ms",
    )


if __name__ == "__main__":
    main()
