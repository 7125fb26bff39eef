"""Benchmark the multi-LoRA kernels: Triton vs the torch reference vs a naive per-adapter loop.

Decode batches of 1/16/64/256 tokens with 1/8/32/64 distinct adapters (tokens grouped by
adapter, as the scheduler orders them) at rank 16 and 64, and 4k-token prefill, at
DeepSeek-V3 and V2-Lite shapes, bf16, a 64-slot pool (8 slots for MoE: the expert dim makes
its pool 256× larger). Decode times are CUDA-graph replays with the L2 flushed before every
call (a graph of [flush] is timed and subtracted); the median is kept. Prints the
TARGETS.md table with our µs beside SGLang, the floor and the target.

    python -m bench.lora_kernels --out bench/results/lora_kernels.json   # GPU: + .png
    python -m bench.lora_kernels --plot bench/results/lora_kernels.json  # PNG from JSON
    python -m bench.lora_kernels --smoke                                 # CPU: setups only
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kernels.lora_segments import LoraSegments, build_lora_segments
from kernels.mla_lora import (
    mla_kv_b_lora_o,
    mla_kv_b_lora_o_ref,
    mla_kv_b_lora_q,
    mla_kv_b_lora_q_ref,
)
from kernels.moe_lora import (
    moe_lora_down,
    moe_lora_down_ref,
    moe_lora_gate_up,
    moe_lora_gate_up_ref,
)
from kernels.sgmv import sgmv_expand, sgmv_expand_ref, sgmv_shrink, sgmv_shrink_ref

Provider = Callable[[], object]


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    heads: int
    nope: int
    v_dim: int
    kv_lora_rank: int
    moe_inter: int
    experts: int
    top_k: int


MODELS = {
    "v3": ModelShape(7168, 128, 128, 128, 512, 2048, 256, 8),
    "v2_lite": ModelShape(2048, 16, 128, 128, 512, 1408, 64, 6),
}
DECODE = [(b, n) for b in (1, 16, 64, 256) for n in (1, 8, 32, 64) if n <= b]
PREFILL = [(4096, 1), (4096, 8)]
RANKS = (16, 64)
SGMV_SLOTS, MOE_SLOTS = 64, 8
# TARGETS.md: (rank, tokens, adapters) -> SGLang shrink/expand µs, floor, target (H200).
TARGET_ROWS = {
    (16, 1, 1): ((12.6, 2.6), (0.1, 0.1), (4, 2)),
    (16, 64, 32): ((12.9, 10.0), (1.9, 2.1), (4, 4)),
    (16, 256, 64): ((13.0, 19.8), (4.3, 5.2), (7, 8)),
    (64, 64, 32): ((12.9, 44.0), (7.1, 7.3), (10, 11)),
    (64, 256, 64): ((22.8, 86.8), (14.6, 15.5), (20, 23)),
}
# Skip the torch/naive providers when their gathers would exceed this (MoE prefill).
_GATHER_LIMIT_BYTES = 8 * 1024**3


@dataclass
class Row:
    kernel: str
    model: str
    tokens: int
    adapters: int
    rank: int
    provider: str
    us: float | None
    bytes_moved: int
    floor_us: float | None = None
    gbps: float | None = None


@dataclass
class Setup:
    """One benchmark case: callables per provider and the bytes a perfect kernel moves."""

    providers: dict[str, Provider]
    bytes_moved: int


@dataclass
class Batch:
    slots: list[int]  # slot per token, grouped contiguously by slot
    segs: LoraSegments
    groups: list[tuple[int, torch.Tensor]]  # (slot, token indices) for the naive loop


def _batch(tokens: int, adapters: int, num_slots: int, rank: int, device: torch.device) -> Batch:
    """`adapters` distinct random slots of a pool whose adapters all have `rank`."""
    gen = torch.Generator().manual_seed(tokens * 1000 + adapters)
    chosen = torch.randperm(num_slots, generator=gen)[:adapters]
    slots = sorted(chosen[torch.arange(tokens) % adapters].tolist())
    segs = build_lora_segments(slots, [rank] * num_slots, device=device)
    groups = [
        (s, torch.tensor([t for t, v in enumerate(slots) if v == s], device=device))
        for s in sorted(set(slots))
    ]
    return Batch(slots, segs, groups)


def setup_sgmv(
    op: str, m: ModelShape, tokens: int, adapters: int, rank: int, device: torch.device
) -> Setup:
    """Shrink [T, hidden] -> [T, r] or expand [T, r] -> += [T, hidden], one slice."""
    bf16 = {"device": device, "dtype": torch.bfloat16}
    batch = _batch(tokens, adapters, SGMV_SLOTS, rank, device)
    segs, groups = batch.segs, batch.groups
    x = torch.randn(tokens, m.hidden, **bf16)
    y = torch.randn(tokens, rank, device=device)
    out = torch.zeros(tokens, m.hidden, **bf16)
    if op == "shrink":
        A = torch.randn(SGMV_SLOTS, rank, m.hidden, **bf16) / m.hidden**0.5

        def naive() -> None:
            for slot, idx in groups:
                y[idx] = (x[idx] @ A[slot].T).float()

        bytes_moved = adapters * rank * m.hidden * 2 + tokens * m.hidden * 2 + tokens * rank * 4
        return Setup(
            {
                "triton": lambda: sgmv_shrink(x, A, segs),
                "torch": lambda: sgmv_shrink_ref(x, A, segs),
                "naive": naive,
            },
            bytes_moved,
        )
    B = torch.randn(SGMV_SLOTS, m.hidden, rank, **bf16) / rank**0.5
    y_bf16 = y.to(torch.bfloat16)

    def naive_expand() -> None:
        for slot, idx in groups:
            out[idx] += y_bf16[idx] @ B[slot].T

    bytes_moved = adapters * rank * m.hidden * 2 + tokens * rank * 4 + 2 * tokens * m.hidden * 2
    return Setup(
        {
            "triton": lambda: sgmv_expand(y, B, out, segs, [0, m.hidden]),
            "torch": lambda: sgmv_expand_ref(y, B, out, segs, [0, m.hidden]),
            "naive": naive_expand,
        },
        bytes_moved,
    )


def setup_mla(
    op: str, m: ModelShape, tokens: int, adapters: int, rank: int, device: torch.device
) -> Setup:
    """Absorbed kv_b correction: `q` (q_lat += …) or `o` (o += …)."""
    bf16 = {"device": device, "dtype": torch.bfloat16}
    batch = _batch(tokens, adapters, SGMV_SLOTS, rank, device)
    segs, groups = batch.segs, batch.groups
    head_rows = m.nope + m.v_dim
    A = torch.randn(SGMV_SLOTS, rank, m.kv_lora_rank, **bf16) / m.kv_lora_rank**0.5
    B = torch.randn(SGMV_SLOTS, m.heads * head_rows, rank, **bf16) / rank**0.5
    B_heads = B.view(SGMV_SLOTS, m.heads, head_rows, rank)
    lat = torch.randn(tokens, m.heads, m.kv_lora_rank, **bf16)
    small = torch.randn(tokens, m.heads, m.nope, **bf16)  # q_nope, or o (v_dim == nope)
    part_rows = m.nope if op == "q" else m.v_dim
    bytes_moved = adapters * rank * (m.kv_lora_rank + m.heads * part_rows) * 2
    bytes_moved += tokens * m.heads * (m.kv_lora_rank * (2 if op == "q" else 1) + part_rows) * 2
    if op == "q":

        def naive_q() -> None:
            for slot, idx in groups:
                z = torch.einsum("thd,hdr->thr", small[idx], B_heads[slot, :, : m.nope])
                lat[idx] += z @ A[slot]

        return Setup(
            {
                "triton": lambda: mla_kv_b_lora_q(small, lat, A, B, segs),
                "torch": lambda: mla_kv_b_lora_q_ref(small, lat, A, B, segs),
                "naive": naive_q,
            },
            bytes_moved + tokens * m.heads * m.kv_lora_rank * 2,
        )

    def naive_o() -> None:
        for slot, idx in groups:
            z = lat[idx] @ A[slot].T  # [t, H, r]
            small[idx] += torch.einsum("thr,hvr->thv", z, B_heads[slot, :, m.nope :])

    return Setup(
        {
            "triton": lambda: mla_kv_b_lora_o(lat, small, A, B, segs),
            "torch": lambda: mla_kv_b_lora_o_ref(lat, small, A, B, segs),
            "naive": naive_o,
        },
        bytes_moved + tokens * m.heads * m.v_dim * 2,
    )


def setup_moe(
    op: str, m: ModelShape, tokens: int, adapters: int, rank: int, device: torch.device
) -> Setup:
    """Routed-expert LoRA `gate_up` (2 slices) or `down` over T*top_k pairs."""
    gen = torch.Generator().manual_seed(2)
    bf16 = {"device": device, "dtype": torch.bfloat16}
    batch = _batch(tokens, min(adapters, MOE_SLOTS), MOE_SLOTS, rank, device)
    slots, segs = batch.slots, batch.segs
    chosen = torch.rand(tokens, m.experts, generator=gen).topk(m.top_k, dim=1).indices.flatten()
    order = torch.argsort(chosen, stable=True)
    pair_token = torch.arange(tokens).repeat_interleave(m.top_k)[order].int().to(device)
    pair_expert = chosen[order].int().to(device)
    num_pairs = pair_token.shape[0]
    slices, in_dim, out_dim = (
        (2, m.hidden, 2 * m.moe_inter) if op == "gate_up" else (1, m.moe_inter, m.hidden)
    )
    A = torch.randn(MOE_SLOTS, m.experts, slices * rank, in_dim, **bf16) / in_dim**0.5
    B = torch.randn(MOE_SLOTS, m.experts, out_dim, rank, **bf16) / rank**0.5
    x = torch.randn(tokens if op == "gate_up" else num_pairs, in_dim, **bf16)
    out = torch.zeros(num_pairs, out_dim, **bf16)
    pair_slot = torch.tensor(slots)[pair_token.cpu().long()]
    keys = len(set(zip(pair_slot.tolist(), pair_expert.tolist(), strict=True)))
    bytes_moved = keys * rank * (slices * in_dim + out_dim) * 2
    bytes_moved += (x.numel() + 2 * out.numel()) * 2
    fused, ref = (
        (moe_lora_gate_up, moe_lora_gate_up_ref)
        if op == "gate_up"
        else (moe_lora_down, moe_lora_down_ref)
    )
    providers: dict[str, Provider] = {
        "triton": lambda: fused(x, out, A, B, pair_token, pair_expert, segs)
    }
    if num_pairs * (A.shape[2] * in_dim + out_dim * rank) * 2 <= _GATHER_LIMIT_BYTES:
        pair_groups = [
            (s, torch.nonzero(pair_slot.to(device) == s).flatten()) for s in sorted(set(slots))
        ]
        x_of_pair = pair_token.long() if op == "gate_up" else torch.arange(num_pairs, device=device)

        def naive() -> None:
            for slot, idx in pair_groups:
                e = pair_expert[idx].long()
                y = torch.bmm(A[slot, e], x[x_of_pair[idx]].unsqueeze(2))  # [p, S*R, 1]
                for i in range(slices):
                    cols = slice(i * out_dim // slices, (i + 1) * out_dim // slices)
                    y_i = y[:, i * rank : (i + 1) * rank]
                    out[idx, cols] += torch.bmm(B[slot, e, cols], y_i).squeeze(2)

        providers["torch"] = lambda: ref(x, out, A, B, pair_token, pair_expert, segs)
        providers["naive"] = naive
    return Setup(providers, bytes_moved)


SETUPS: dict[str, Callable[..., Setup]] = {
    "sgmv_shrink": lambda *a: setup_sgmv("shrink", *a),
    "sgmv_expand": lambda *a: setup_sgmv("expand", *a),
    "mla_kv_b_q": lambda *a: setup_mla("q", *a),
    "mla_kv_b_o": lambda *a: setup_mla("o", *a),
    "moe_gate_up": lambda *a: setup_moe("gate_up", *a),
    "moe_down": lambda *a: setup_moe("down", *a),
}


def time_cold_us(fn: Provider, graph: bool, reps: int = 25, inner: int = 10) -> float:
    """Median µs of `fn` with a cold L2: [flush, fn]×inner minus [flush]×inner, each timed
    as one CUDA-graph replay (or eager launches when `graph` is False)."""
    flush = torch.empty(256 * 1024**2, dtype=torch.int8, device="cuda")

    def with_fn() -> None:
        for _ in range(inner):
            flush.zero_()
            fn()

    def flush_only() -> None:
        for _ in range(inner):
            flush.zero_()

    def median_ms(body: Callable[[], None]) -> float:
        body()  # warm-up: compiles and autotunes outside any capture
        run = body
        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                body()
            run = g.replay
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    return max(median_ms(with_fn) - median_ms(flush_only), 0.0) * 1e3 / inner


def measure(
    kernel: str, model: str, rank: int, tokens: int, adapters: int, copy_bw: float
) -> list[Row]:
    """Rows of one case, one per provider (µs None where the provider was skipped)."""
    setup = SETUPS[kernel](MODELS[model], tokens, adapters, rank, torch.device("cuda"))
    floor = setup.bytes_moved / copy_bw * 1e6
    rows = []
    for provider in ("triton", "torch", "naive"):
        fn = setup.providers.get(provider)
        us = time_cold_us(fn, graph=tokens <= 256) if fn else None
        gbps = setup.bytes_moved / us / 1e3 if us else None
        rows.append(
            Row(kernel, model, tokens, adapters, rank, provider, us, setup.bytes_moved, floor, gbps)
        )
        shown = f"{us:9.2f}" if us is not None else "  skipped"
        print(f"{kernel:12} {model:7} r{rank:<3} T{tokens:<5} N{adapters:<3} {provider:7}", end="")
        print(f" {shown} µs  floor {floor:7.2f} µs")
    return rows


def run(out_path: Path, models: list[str], kernels: list[str]) -> list[Row]:
    from bench.ceilings import measure_copy_bandwidth

    copy_bw = measure_copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    rows: list[Row] = []
    for kernel in kernels:
        for model in models:
            for rank in RANKS:
                for tokens, adapters in [*DECODE, *PREFILL]:
                    if kernel.startswith("mla") and tokens > 256:
                        continue  # prefill runs kv_b through SGMV, not the absorbed path
                    rows += measure(kernel, model, rank, tokens, adapters, copy_bw)
                    torch.cuda.empty_cache()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "device": torch.cuda.get_device_name(),
        "copy_bytes_per_s": copy_bw,
        "rows": [asdict(r) for r in rows],
    }
    out_path.write_text(json.dumps(payload, indent=1))
    return rows


def print_targets_table(rows: list[Row]) -> None:
    """TARGETS.md's decode table (V3 hidden 7168) with our cold-L2 µs and floor beside it."""
    ours = {
        (r.kernel, r.rank, r.tokens, r.adapters): r
        for r in rows
        if r.model == "v3" and r.provider == "triton"
    }
    print("\n| rank, B, N | SGLang shrink / expand | ours shrink / expand | floor here | target |")
    print("|---|---|---|---|---|")
    for (rank, tokens, adapters), (sglang, _, target) in TARGET_ROWS.items():
        s = ours.get(("sgmv_shrink", rank, tokens, adapters))
        e = ours.get(("sgmv_expand", rank, tokens, adapters))
        if not (s and e and s.us is not None and e.us is not None):
            continue
        print(
            f"| {rank}, {tokens}, {adapters} | {sglang[0]} / {sglang[1]} | {s.us:.1f} / {e.us:.1f}"
            f" | {s.floor_us:.1f} / {e.floor_us:.1f} | ≤ {target[0]} / ≤ {target[1]} |"
        )


def plot(json_path: Path, png_path: Path) -> None:
    """One panel per kernel: µs vs decode tokens for each provider (V3, rank 16, max adapters)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [Row(**r) for r in json.loads(json_path.read_text())["rows"]]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, kernel in zip(axes.flat, SETUPS, strict=False):
        for provider in ("triton", "torch", "naive", "floor"):
            pts = sorted(
                (r.tokens, r.floor_us if provider == "floor" else r.us)
                for r in rows
                if r.kernel == kernel
                and r.model == "v3"
                and r.rank == 16
                and r.tokens <= 256
                and r.provider == ("triton" if provider == "floor" else provider)
                and r.adapters == min(r.tokens, 64 if not kernel.startswith("moe") else 8)
            )
            pts = [(t, u) for t, u in pts if u is not None]
            if pts:
                ax.plot(
                    *zip(*pts, strict=True),
                    marker="o",
                    label=provider,
                    linestyle="--" if provider == "floor" else "-",
                )
        ax.set(
            title=f"{kernel} (V3, r16, N=min(B,64))",
            xscale="log",
            yscale="log",
            xlabel="tokens",
            ylabel="µs",
        )
        ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    print(f"plot: {png_path}")


def smoke() -> None:
    """CPU check of every setup at tiny sizes: the torch and naive providers run once."""
    tiny = ModelShape(
        hidden=64, heads=2, nope=16, v_dim=16, kv_lora_rank=32, moe_inter=24, experts=4, top_k=2
    )
    for kernel, make in SETUPS.items():
        for tokens, adapters in [(1, 1), (16, 8)]:
            setup = make(tiny, tokens, adapters, 16, torch.device("cpu"))
            for provider in ("torch", "naive"):
                setup.providers[provider]()
        print(f"smoke ok: {kernel}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="results JSON (GPU run); the PNG goes beside it")
    parser.add_argument("--plot", type=Path, help="only draw the PNG from this results JSON")
    parser.add_argument("--smoke", action="store_true", help="CPU: run every setup at tiny sizes")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--kernels", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    args = parser.parse_args()
    if args.smoke:
        smoke()
    elif args.plot:
        plot(args.plot, args.plot.with_suffix(".png"))
    elif args.out:
        print_targets_table(run(args.out, args.models, args.kernels))
        plot(args.out, args.out.with_suffix(".png"))
    else:
        parser.error("give --out, --plot or --smoke")


if __name__ == "__main__":
    main()
