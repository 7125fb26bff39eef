"""Tile plans of the routed experts' grouped GEMM at prefill shapes, side by side.

A serving prefill step of 8192 tokens spent 99 of its 161 GPU ms in `_grouped_gemm_kernel`
(H100, 27-layer V2-Lite shape): ≈ 22 TFLOP at ≈ 220 TFLOP/s, a quarter of the tensor
cores' rate, with the decode-sized tiles (64 × 64 × 64, 4 warps). This times candidate
plans (row tile × `GemmTiles`) on the two expert GEMMs of V2-Lite (gate_up: N 2816, K 2048;
down: N 2048, K 1408; 64 experts, top-6 routing) at 8192 and 512 tokens, bf16 and FP8
block-scaled (bf16 activations, and e4m3 activations per 128-group: fp8_a8), checks every
plan's output against the model's own plan's (`moe_block_m` and `default_tiles`, timed
first and marked `model_plan`; the "current" of the row fields), and reports TFLOP/s and
the speed-up over that plan. No model, no engine.

`--lora` also times each prefill plan with the routed experts' LoRA in its epilogue
(`grouped_gemm(lora=moe_lora_epilogue(...))`, LORA_ADAPTERS rank-16 adapters over runs of
tokens, as serving's prompt steps have them): a prompt tile is one program an SM, so the
epilogue's cost depends on the plan (per column tile), and a plan can win with LoRA
where it does not without (the model's plan for GEMMs with the epilogue,
`default_tiles(with_lora=True)`, is timed second where it differs, and marked
`model_plan_with_lora`). Each row then adds `lora_ms`, `lora_overhead`, the LoRA
output's difference from the current plan's and the LoRA's share of the output.

`--decode` times decode batches instead (64, 128 and 256 tokens, the row tile the model
picks for bf16 experts and half of it, which FP8 experts take at these sizes; column/K tile
plans around 64 × 64) and adds each row's
achieved weight bandwidth: the distinct experts' weight bytes (and FP8 scales) over the
time, against the device's measured copy bandwidth — a decode GEMM's floor is that read.

    python3 -m bench.grouped_gemm_tiles --out bench/results/grouped_gemm_tiles.json
    python3 -m bench.grouped_gemm_tiles --lora --out bench/results/grouped_gemm_tiles_lora.json
    python3 -m bench.grouped_gemm_tiles --decode --out bench/results/grouped_gemm_decode.json
    python -m bench.grouped_gemm_tiles --out /tmp/tiles.json --smoke   # CPU, interpreted
"""

from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass

import torch

from bench.gpu_timing import (
    bar_plot,
    copy_bandwidth,
    kernel_bench_args,
    run_meta,
    time_ms,
    write_json,
)
from kernels import fused_moe as fm
from kernels.fp8 import block_quant_ref
from kernels.moe_lora import MoeLoraEpilogue, moe_lora_epilogue

FP8_BLOCK = (128, 128)
# The benches' expert weights → grouped_gemm's scheme (None: by the scale). fp8_a8 quantizes
# the activations too (e4m3 × e4m3 MMAs, DeepSeek-V3's own scheme).
GEMM_SCHEMES = {"bf16": None, "fp8": "block", "fp8_a8": "block_a8"}
# `--lora`: distinct adapters over a prompt step's tokens (serving's steps: 16 prompts).
LORA_ADAPTERS = 16


@dataclass(frozen=True)
class ExpertShapes:
    experts: int = 64  # V2-Lite
    top_k: int = 6
    hidden: int = 2048
    inter: int = 1408

    def gemms(self) -> tuple[tuple[str, int, int, int], ...]:
        """(name, N, K, rows of the pair matrix per activation row) of both GEMMs."""
        return (
            ("gate_up", 2 * self.inter, self.hidden, self.top_k),
            ("down", self.hidden, self.inter, 1),
        )


SMOKE_SHAPES = ExpertShapes(8, 2, 64, 32)

# (row tile, tiles); the first is the plan the model runs today.
PLANS = [
    (64, fm.GemmTiles(64, 64, 4, 3)),
    (64, fm.GemmTiles(128, 64, 4, 3)),
    (64, fm.GemmTiles(128, 64, 8, 3)),
    (64, fm.GemmTiles(128, 64, 4, 4)),
    (64, fm.GemmTiles(128, 128, 8, 3)),
    (128, fm.GemmTiles(64, 64, 4, 3)),
    (128, fm.GemmTiles(128, 64, 8, 3)),
    (128, fm.GemmTiles(128, 64, 8, 4)),
    (128, fm.GemmTiles(128, 128, 8, 3)),
    (128, fm.GemmTiles(256, 64, 8, 3)),
    (128, fm.GemmTiles(256, 64, 8, 4)),  # FP8's and bf16 down's prompt-step plan
]


# Decode: the row tile is the model's (`moe_block_m`); column/K tiles, warps and stages
# vary. FP8 block scales need K tiles of at most the 128-wide scale block.
DECODE_TILES = [
    fm.GemmTiles(64, 64, 4, 3),
    fm.GemmTiles(64, 128, 4, 3),
    fm.GemmTiles(64, 128, 4, 4),
    fm.GemmTiles(128, 128, 4, 3),
    fm.GemmTiles(128, 128, 8, 4),
    fm.GemmTiles(32, 128, 4, 4),
    fm.GemmTiles(64, 64, 4, 5),
    fm.GemmTiles(128, 64, 4, 4),
]


def plan_label(block_m: int, tiles: fm.GemmTiles) -> str:
    t = tiles
    return f"m{block_m} n{t.block_n} k{t.block_k} w{t.num_warps} s{t.num_stages}"


def make_weights(experts: int, n: int, k: int, scheme: str, device: torch.device):
    """Expert weights [E, n, k] (bf16, or FP8 with block scales) and their scale args."""
    w = torch.randn(experts, n, k, device=device) * 0.02
    if scheme == "bf16":
        return w.to(torch.bfloat16 if device.type == "cuda" else torch.float32), None, None
    quantized = [block_quant_ref(w[e], FP8_BLOCK) for e in range(experts)]
    weight = torch.stack([q for q, _ in quantized])
    scale = torch.stack([s for _, s in quantized])
    return weight, scale, FP8_BLOCK


def run(
    shapes: ExpertShapes,
    tokens_list: list[int],
    schemes: list[str],
    plans_for,
    device,
    rep,
    lora_adapters: int = 0,
):
    """plans_for(tokens): the [(row tile, tiles)] plans to time at that token count;
    lora_adapters > 0: each plan also with that many adapters' LoRA in its epilogue."""
    rows = []
    for scheme in schemes:
        for name, n, k, rows_per_a in shapes.gemms():
            weight, scale, block = make_weights(shapes.experts, n, k, scheme, device)
            for tokens in tokens_list:
                case = {"scheme": scheme, "gemm": name, "tokens": tokens}
                rows += time_plans(
                    shapes, case, weight, scale, block, rows_per_a, plans_for(tokens), device,
                    rep, lora_adapters,
                )  # fmt: skip
    return rows


def decode_plans(shapes: ExpertShapes, tiles: list[fm.GemmTiles], tokens: int) -> list:
    """Each of `tiles` at the model's row tile for bf16 experts and at half of it (fewer
    padded rows, more tiles re-reading an expert's weights when its pairs overflow one)."""
    block_m = fm.moe_block_m(tokens * shapes.top_k, shapes.experts)
    row_tiles = [block_m] + ([block_m // 2] if block_m > 16 else [])
    return [(m, t) for m in row_tiles for t in tiles]


def weight_bytes_read(ids: torch.Tensor, weight: torch.Tensor, scale) -> int:  # type: ignore[no-untyped-def]
    """Bytes of the experts the routing touches (each read once at best), scales included."""
    distinct = int(ids.unique().numel())
    per_expert = weight[0].numel() * weight.element_size()
    if scale is not None:
        per_expert += scale[0].numel() * scale.element_size()
    return distinct * per_expert


def lora_epilogue_of(
    case: dict, lora: dict, a: torch.Tensor, align: fm.MoEAlignment
) -> MoeLoraEpilogue:
    """The MoE LoRA epilogue of `case`'s GEMM over `align` (its shrink runs here)."""
    _, _, pair_token, pair_expert, segs = lora["routing"]
    a_gu, b_gu, a_d, b_d = lora["weights"]
    down = case["gemm"] == "down"
    return moe_lora_epilogue(
        a, a_d if down else a_gu, b_d if down else b_gu, pair_token, pair_expert, segs,
        x_per_pair=down, pair_order=align.sorted_pair_ids,
    )  # fmt: skip


def time_plans(
    shapes: ExpertShapes,
    case: dict,
    weight,
    scale,
    block,
    rows_per_a: int,
    plans,
    device,
    rep,
    lora_adapters: int = 0,
):
    """One row per plan for one GEMM at one token count (random top-k routing)."""
    tokens, (_, n, k) = case["tokens"], weight.shape
    experts, top_k = shapes.experts, shapes.top_k
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lora = None
    if lora_adapters:
        # Imported here: bench.moe_lora_prefill imports this module.
        from bench.moe_lora_prefill import make_lora

        lora = make_lora(shapes, tokens, lora_adapters, device, dtype)
        ids = lora["routing"][3].view(tokens, top_k).long()  # its pairs' experts
    else:
        ids = torch.stack([torch.randperm(experts, device=device)[:top_k] for _ in range(tokens)])
    a_rows = tokens if rows_per_a == top_k else tokens * top_k
    a = (torch.randn(a_rows, k, device=device) * 0.5).to(dtype)  # [rows, K]
    flops = 2 * tokens * top_k * n * k
    weight_bytes = weight_bytes_read(ids, weight, scale)
    scheme = fm.weight_scheme(GEMM_SCHEMES[case["scheme"]], scale)
    model_m = fm.moe_block_m(tokens * top_k, experts, scheme)
    model_plan = (model_m, fm.default_tiles(model_m, scheme, case["gemm"]))
    lora_plan = (model_m, fm.default_tiles(model_m, scheme, case["gemm"], with_lora=True))
    # The model's own plan first (then its plan for GEMMs with the LoRA epilogue, where that
    # differs): every other plan is checked and timed against the first.
    firsts = [model_plan] + ([lora_plan] if lora_adapters and lora_plan != model_plan else [])
    plans = [*firsts, *(plan for plan in plans if plan not in firsts)]
    rows, baseline, baseline_ms, lora_baseline = [], None, None, None
    for block_m, tiles in plans:
        align = fm.moe_align(ids, experts, block_m)
        call = functools.partial(
            fm.grouped_gemm, a, weight, align, rows_per_a, scale, block,
            GEMM_SCHEMES[case["scheme"]], tiles,
        )  # fmt: skip
        out = call().float()  # [P, N]
        baseline = out if baseline is None else baseline
        error = (out - baseline).abs().max().item() / baseline.abs().max().item()
        ms = time_ms(call, device, rep=rep)
        baseline_ms = baseline_ms or ms
        row = {
            **case,
            "plan": plan_label(block_m, tiles),
            "model_plan": (block_m, tiles) == model_plan,
            "block_m": block_m,
            **asdict(tiles),
            "ms": ms,
            "tflops": flops / (ms * 1e-3) / 1e12,
            "weight_gb_per_s": weight_bytes / (ms * 1e-3) / 1e9,
            "speedup_vs_current": baseline_ms / ms,
            "max_rel_diff_vs_current": error,
        }
        if lora is not None:
            with_lora = functools.partial(call, lora=lora_epilogue_of(case, lora, a, align))
            lora_out = with_lora().float()
            lora_baseline = lora_out if lora_baseline is None else lora_baseline
            row["lora_adapters"] = lora_adapters
            row["model_plan_with_lora"] = (block_m, tiles) == lora_plan
            row["lora_ms"] = time_ms(with_lora, device, rep=rep)
            row["lora_overhead"] = row["lora_ms"] / ms - 1
            row["lora_max_rel_diff_vs_current"] = (
                (lora_out - lora_baseline).abs().max() / lora_baseline.abs().max()
            ).item()
            # The LoRA's share of the output: zero would mean the epilogue added nothing.
            row["lora_rel_delta"] = ((lora_out - out).abs().max() / out.abs().max()).item()
        rows.append(row)
        print(
            f"{case['scheme']:6s} {case['gemm']:8s} T{tokens:5d} {row['plan']:24s} "
            f"{ms:8.3f} ms {row['tflops']:6.0f} TFLOP/s {row['weight_gb_per_s']:6.0f} GB/s "
            f"×{row['speedup_vs_current']:.2f} "
            f"diff {error:.1e}"
            + (f"  with LoRA {row['lora_ms']:8.3f} ms" if lora is not None else "")
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    out, device, decode, with_lora = kernel_bench_args(
        __doc__,
        argv,
        flags={"--decode": "decode batches", "--lora": "prefill plans with the LoRA epilogue too"},
    )
    if decode and with_lora:
        raise SystemExit("--lora times prefill plans; decode steps take the LoRA after the GEMM")
    smoke = device.type == "cpu"
    started = time.perf_counter()
    schemes = ["bf16"] if smoke else list(GEMM_SCHEMES)
    shapes = SMOKE_SHAPES if smoke else ExpertShapes()
    if decode:
        tokens = [4] if smoke else [64, 128, 256]
        tiles = DECODE_TILES[:2] if smoke else DECODE_TILES
        plans_for = functools.partial(decode_plans, shapes, tiles)
    else:
        tokens = [4] if smoke else [8192, 512]
        plans = [PLANS[0], PLANS[2], PLANS[6]] if smoke else PLANS  # both row tiles

        def plans_for(tokens: int) -> list:
            return plans  # the same plans at every size

    lora_adapters = (3 if smoke else LORA_ADAPTERS) if with_lora else 0
    rows = run(shapes, tokens, schemes, plans_for, device, 50, lora_adapters)
    extra = {"copy_gb_per_s": copy_bandwidth(device) / 1e9} if decode else {}
    meta = run_meta("grouped_gemm_tiles", device, started, shapes=asdict(shapes), **extra)
    if decode:
        for row in rows:
            row["fraction_of_copy_bw"] = row["weight_gb_per_s"] / extra["copy_gb_per_s"]
    write_json(out, meta, rows)
    # Prefill plans by FLOP rate; decode plans by the weight bandwidth they reach.
    measure, unit = ("weight_gb_per_s", "weight GB/s") if decode else ("tflops", "TFLOP/s")
    big = [r for r in rows if r["tokens"] == max(tokens)]
    labels = list(dict.fromkeys(r["plan"] for r in big))  # in the order the plans ran
    series = {
        f"{s} {g}": [
            next(r[measure] for r in big if r["plan"] == p and r["scheme"] == s and r["gemm"] == g)
            for p in labels
        ]
        for s in schemes
        for g in ("gate_up", "down")
    }
    bar_plot(
        out.with_suffix(".png"),
        f"grouped GEMM tile plans, {max(tokens)} tokens",
        labels,
        series,
        unit,
    )


if __name__ == "__main__":
    main()
