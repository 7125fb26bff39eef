"""Base-model kernels vs measured ceilings: paged MLA decode, fused MoE (bf16, FP8
block-scaled, INT8 w8a8, 4-bit weight-only experts), FP8 block GEMM.

    python -m bench.kernels_base --json out.json --plot out.png          # GPU
    python -m bench.kernels_base --json out.json --plot out.png --smoke  # CPU setup check
    python -m bench.kernels_base --json out.json --plot out.png --mla-variants  # MLA v2 vs v3

Each row: one setup, provider `triton` (our launchers) and, where it is affordable,
`torch` (the `*_ref` the tests use). Achieved bandwidth = bytes the op must read + write ÷
time, next to the measured copy bandwidth; MoE/GEMM rows also give TFLOP/s next to the
measured bf16 matmul throughput.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.gpu_timing import (
    bar_plot,
    copy_bandwidth,
    device_name,
    graphed,
    matmul_flops,
    time_ms,
    write_json,
)
from bench.kernel_variants import block_m_v1
from bench.provenance import provenance
from kernels import fp8
from kernels import fused_moe as fm
from kernels import int_quant as iq
from kernels import mla_attention as mla
from kernels import mla_decode_v3 as v3


@dataclass(frozen=True)
class Case:
    """A setup: its name, what it moves and computes, and a callable per provider."""

    name: str
    bytes: float
    flops: float
    providers: dict[str, Callable[[], object]]


def mla_decode_case(
    batch, heads, context, dtype, device, with_ref, page_size=64, variants=False
) -> Case:
    """`variants`: also time v3 (its default plan and each named plan, `v3:<plan>`)."""
    latent, rope = 512, 64
    pages = batch * (context // page_size)
    kv = torch.randn(pages, page_size, latent + rope, device=device, dtype=dtype)
    table = torch.arange(pages, device=device, dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), context, device=device, dtype=torch.int32)
    q_lat = torch.randn(batch, heads, latent, device=device, dtype=dtype)
    q_rope = torch.randn(batch, heads, rope, device=device, dtype=dtype)
    args = (q_lat, q_rope, kv, table, lens, 0.1)
    providers = {}
    if device.type == "cuda":
        providers["triton"] = graphed(lambda: mla.mla_decode(*args, variant="v2"))
        v1 = mla.MLA_DECODE_CONFIGS[0]
        providers["triton_v1"] = graphed(lambda: mla.mla_decode(*args, config=v1, variant="v2"))
    if variants and device.type == "cuda":
        providers.update(mla_v3_providers(args, heads))
    if with_ref:
        providers["torch"] = lambda: mla.mla_decode_ref(*args)
    element = kv.element_size()
    moved = kv.numel() * element + 2 * q_lat.numel() * element + q_rope.numel() * element
    flops = 2 * batch * heads * context * (2 * latent + rope)
    name = f"mla_decode H{heads} B{batch} ctx{context}"
    return Case(name + (f" page{page_size}" if page_size != 64 else ""), moved, flops, providers)


def mla_v3_providers(args, heads) -> dict[str, Callable[[], object]]:
    """v3 with its default plan, then each plan whose head tile fits the head count."""
    providers = {"v3": graphed(lambda: mla.mla_decode(*args, variant="v3"))}
    for name, plan in v3.MLA_DECODE_V3_CONFIGS.items():
        if plan.kwargs["BLOCK_H"] <= max(16, heads):
            providers[f"v3:{name}"] = graphed(
                lambda plan=plan: mla.mla_decode(*args, variant="v3", config=plan)
            )
    return providers


def mla_variant_cases(smoke: bool, device: torch.device) -> Iterator[Case]:
    """v2 (as the model runs it) beside v3 at the model's page size 16: V2-Lite's 16 heads
    and V3 / Kimi-K2's 128, batch 1 / 64 / 256, context 512 / 4096."""
    if smoke:
        yield mla_decode_case(2, 16, 128, torch.float32, device, True, 16, variants=True)
        return
    for heads in (16, 128):
        for batch in (1, 64, 256):
            for context in (512, 4096):
                yield mla_decode_case(
                    batch, heads, context, torch.bfloat16, device, False, 16, variants=True
                )


def moe_case(tokens, hidden, inter, experts, top_k, quant, device, with_ref) -> Case:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    ids = torch.stack([torch.randperm(experts, device=device)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, device=device)
    # Made in the compute dtype: V3's 256 experts are 22 GB in bf16 and would be 45 in fp32.
    w13 = torch.randn(experts, 2 * inter, hidden, device=device, dtype=dtype) * 0.02
    w2 = torch.randn(experts, hidden, inter, device=device, dtype=dtype) * 0.02
    s13 = s2 = block13 = block2 = None
    scheme = {"fp8": "block", "w8a8": "w8a8", "int4": "int4_group"}.get(quant)
    if quant == "fp8":
        block13 = block2 = (128, 128)
        q13 = [fp8.block_quant_ref(w13[e], block13) for e in range(experts)]
        q2 = [fp8.block_quant_ref(w2[e], block13) for e in range(experts)]
        w13, s13 = torch.stack([q for q, _ in q13]), torch.stack([s for _, s in q13])
        w2, s2 = torch.stack([q for q, _ in q2]), torch.stack([s for _, s in q2])
    elif quant == "w8a8":
        (w13, s13), (w2, s2) = iq.int8_channel_quant_ref(w13), iq.int8_channel_quant_ref(w2)
        block13, block2 = (1, hidden), (1, inter)
    elif quant == "int4":
        w13, s13 = iq.int4_group_quant_ref(w13)
        w2, s2 = iq.int4_group_quant_ref(w2)
        block13 = block2 = (1, iq.INT4_GROUP)
    else:
        w13, w2 = w13.to(dtype), w2.to(dtype)

    def staged(align_pairs, gemm, silu, combine, block_m=fm.moe_block_m):
        def run():
            align = align_pairs(ids, experts, block_m(ids.numel(), experts))
            gate_up = gemm(x, w13, align, top_k, s13, block13, scheme)
            down = gemm(silu(gate_up), w2, align, 1, s2, block2, scheme)
            return combine(down, weights)

        return run

    providers = {}
    if device.type == "cuda":
        new = staged(fm.moe_align, fm.grouped_gemm, fm.silu_mul, fm.moe_combine)
        providers["triton"] = graphed(new)  # as in the model's decode graphs
        providers["triton_eager"] = new  # as measured in v1 (host-launch bound)
        providers["triton_v1"] = graphed(
            staged(fm.moe_align_ref, fm.grouped_gemm, fm.silu_mul, fm.moe_combine, block_m_v1)
        )
    if with_ref:
        providers["torch"] = staged(
            fm.moe_align_ref, fm.grouped_gemm_ref, fm.silu_mul_ref, fm.moe_combine_ref
        )
    distinct = ids.unique().numel()
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    if s13 is not None:
        expert_bytes += (s13[0].numel() + s2[0].numel()) * s13.element_size()
    moved = distinct * expert_bytes + 2 * x.numel() * x.element_size()
    flops = 2 * tokens * top_k * 3 * hidden * inter
    name = f"moe {quant} T{tokens} E{experts} k{top_k} h{hidden} i{inter}"
    return Case(name, moved, flops, providers)


def fp8_linear_case(m, n, k, device, with_ref) -> Case:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    w, scale = fp8.block_quant_ref(torch.randn(n, k, device=device), (128, 128))
    x = torch.randn(m, k, device=device, dtype=dtype)
    providers = {}
    if device.type == "cuda":
        providers["triton"] = lambda: fp8.fp8_block_linear(x, w, scale, (128, 128))
        bf16_w = fp8.block_dequant_ref(w, scale, (128, 128), dtype)
        providers["torch_bf16_matmul"] = lambda: x @ bf16_w.T
    if with_ref:
        providers["torch"] = lambda: fp8.fp8_block_linear_ref(x, w, scale, (128, 128))
    moved = w.numel() + scale.numel() * 4 + (m * k + m * n) * x.element_size()
    return Case(f"fp8_linear M{m} N{n} K{k}", moved, 2 * m * n * k, providers)


def cases(smoke: bool, device: torch.device) -> Iterator[Case]:
    """Built one at a time, so only one case's weights are on the GPU at once."""
    if smoke:
        yield mla_decode_case(2, 4, 128, torch.float32, device, True)
        yield moe_case(4, 64, 32, 8, 2, "bf16", device, True)
        yield moe_case(4, 128, 128, 4, 2, "fp8", device, True)
        yield moe_case(4, 128, 96, 4, 2, "w8a8", device, True)
        yield moe_case(4, 128, 96, 4, 2, "int4", device, True)
        yield fp8_linear_case(2, 128, 256, device, True)
        return
    for heads in (16, 128):
        for batch in (1, 8, 64, 256):
            for context in (1024, 4096):
                yield mla_decode_case(batch, heads, context, torch.bfloat16, device, batch <= 8)
    for tokens in (1, 8, 64, 256):
        yield moe_case(tokens, 2048, 1408, 64, 6, "bf16", device, tokens <= 8)  # V2-Lite
    for tokens in (1, 64, 256):
        for quant in ("w8a8", "int4"):
            yield moe_case(tokens, 2048, 1408, 64, 6, quant, device, False)
    for tokens in (1, 64, 256):
        yield moe_case(tokens, 7168, 2048, 256, 8, "bf16", device, False)  # V3
        yield moe_case(tokens, 7168, 2048, 256, 8, "fp8", device, False)
    for m in (1, 64, 256, 2048):
        yield fp8_linear_case(m, 7168, 7168, device, m == 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--plot", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, torch refs, CPU")
    parser.add_argument(
        "--mla-variants",
        action="store_true",
        help="only the MLA decode rows, v2 vs v3 and each v3 plan (kernels/mla_decode_v3.py)",
    )
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    bandwidth, flops_ceiling = copy_bandwidth(device), matmul_flops(device)
    rows = []
    setups = mla_variant_cases if args.mla_variants else cases
    for case in setups(args.smoke, device):
        for provider, fn in case.providers.items():
            ms = time_ms(fn, device)
            gbps = case.bytes / (ms * 1e-3) / 1e9
            tflops = case.flops / (ms * 1e-3) / 1e12
            rows.append(
                {
                    "setup": case.name,
                    "provider": provider,
                    "ms": ms,
                    "bytes": case.bytes,
                    "flops": case.flops,
                    "GB_per_s": gbps,
                    "bandwidth_fraction": gbps * 1e9 / bandwidth,
                    "TFLOP_per_s": tflops,
                    "flops_fraction": tflops * 1e12 / flops_ceiling,
                }
            )
            if case.name.startswith("mla_decode") and provider == "triton":
                rows[-1]["config"] = str(mla._mla_decode_tuned.best_config)
            print(
                f"{case.name:42s} {provider:20s} {ms * 1e3:10.1f} µs  {gbps:8.1f} GB/s "
                f"({gbps * 1e9 / bandwidth:5.1%} of copy)  {tflops:7.2f} TFLOP/s"
            )
    meta = {
        "device": device_name(device),
        **provenance("kernels_base"),
        "copy_bandwidth_bytes_per_s": bandwidth,
        "bf16_matmul_flop_per_s": flops_ceiling,
    }
    write_json(args.json, meta, rows)
    plotted = ("torch",) if args.smoke else ("triton", "v3") if args.mla_variants else ("triton",)
    setups_run = list(dict.fromkeys(r["setup"] for r in rows))
    fraction = {(r["setup"], r["provider"]): r["bandwidth_fraction"] for r in rows}
    bar_plot(
        args.plot,
        f"base kernels: achieved fraction of copy bandwidth ({meta['device']})",
        setups_run,
        {p: [fraction.get((setup, p), 0.0) for setup in setups_run] for p in plotted},
        "fraction of measured copy bandwidth",
    )


if __name__ == "__main__":
    main()
