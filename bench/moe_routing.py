"""Expert selection from router logits: the torch ops vs the one-launch Triton kernel.

Times `select_experts_ref` (the reference's torch ops, run on the GPU) against
`select_experts` for the routers of DeepSeek-V2-Lite (greedy softmax, 64 experts, top-6),
Kimi-K2 (noaux_tc sigmoid, 384 experts, top-8) and DeepSeek-V3 (noaux_tc, 256 experts in 8
groups, top-8: the kernel's group limit), at decode and prefill token counts. Both run as
CUDA-graph replays, as a decode step does, so the figures are GPU time (kernels and the
gaps between them) without the host's launch cost. Each row checks that both pick the same experts.

    python3 -m bench.moe_routing --out bench/results/moe_routing.json
    python -m bench.moe_routing --out /tmp/moe_routing.json --smoke   # CPU, interpreted
"""

from __future__ import annotations

import functools
import time

import torch

from bench.gpu_timing import bar_plot, graphed, kernel_bench_args, run_meta, time_ms, write_json
from kernels.moe_routing import select_experts, select_experts_ref

# name → (experts, top_k, method, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
ROUTERS = {
    "v2_lite": (64, 6, "greedy", 1, 1, False, 1.0),
    "kimi_k2": (384, 8, "noaux_tc", 1, 1, True, 2.827),
    "v3": (256, 8, "noaux_tc", 8, 4, True, 2.5),
}


def same_experts(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.sort(dim=-1).values, b.sort(dim=-1).values)


def run(token_counts: list[int], device: torch.device) -> list[dict]:
    rows = []
    for name, (experts, top_k, method, *rest) in ROUTERS.items():
        for tokens in token_counts:
            logits = torch.randn(tokens, experts, device=device) * 2
            bias = torch.randn(experts, device=device) * 0.1 if method == "noaux_tc" else None
            args = (logits, top_k, method, *rest, bias)
            ref = functools.partial(select_experts_ref, *args)
            fused = functools.partial(select_experts, *args)
            same = same_experts(ref()[1], fused()[1])
            if device.type == "cuda":
                ref, fused = graphed(ref), graphed(fused)
            ms = {way: time_ms(call, device) for way, call in (("ref", ref), ("fused", fused))}
            row = {
                "router": name, "tokens": tokens, "experts": experts, "top_k": top_k,
                "method": method, "ref_ms": ms["ref"], "fused_ms": ms["fused"],
                "speedup": ms["ref"] / ms["fused"], "same_experts": same,
            }  # fmt: skip
            rows.append(row)
            print(
                f"{name:8s} T{tokens:5d}  torch ops {ms['ref'] * 1e3:8.1f} µs  one launch "
                f"{ms['fused'] * 1e3:8.1f} µs  ×{row['speedup']:.2f}  same experts {same}"
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    out, device = kernel_bench_args(__doc__, argv)
    started = time.perf_counter()
    token_counts = [4] if device.type == "cpu" else [1, 64, 128, 8192]
    rows = run(token_counts, device)
    write_json(out, run_meta("moe_routing", device, started), rows)
    decode = [r for r in rows if r["tokens"] == token_counts[min(1, len(token_counts) - 1)]]
    bar_plot(
        out.with_suffix(".png"),
        f"expert selection, {decode[0]['tokens']} tokens",
        [r["router"] for r in decode],
        {way: [r[f"{way}_ms"] * 1e3 for r in decode] for way in ("ref", "fused")},
        "µs",
    )


if __name__ == "__main__":
    main()
