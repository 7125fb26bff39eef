"""Benchmark the multi-LoRA kernels: Triton vs the torch reference vs a naive per-adapter loop.

Decode batches of 1/16/64/256 tokens with 1/8/32/64 distinct adapters (tokens grouped by
adapter, as the scheduler orders them) at rank 16 and 64, and 4k-token prefill, at
DeepSeek-V3 and V2-Lite shapes, bf16, a 64-slot pool (8 slots for MoE: the expert dim makes
its pool 256× larger). Decode times are CUDA-graph replays with the L2 flushed before every
call (a graph of [flush] is timed and subtracted); the median is kept. Prints the
TARGETS.md table with our µs beside SGLang, the floor and the target.

Every launcher variant (kernels/sgmv.py SHRINK_VARIANTS / EXPAND_VARIANTS) is its own
provider `triton:<variant>`, so one run prints old vs new per case; the table shows the best.
The `copy` provider times a device copy of the case's floor bytes (half read, half written)
under the same cold-L2 method: what a perfect kernel could reach here.

    python -m bench.lora_kernels --models v3 --out DIR/lora_kernels.json  # GPU: + .png
    python -m bench.lora_kernels --targets --out DIR/targets.json         # TARGETS rows only
    python -m bench.lora_kernels --plot bench/results/lora_kernels.json   # PNG from JSON
    python -m bench.lora_kernels --smoke                                  # CPU: setups only
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.provenance import provenance
from kernels.lora_segments import LoraSegments, build_lora_segments
from kernels.mla_lora import (
    MLA_VARIANTS,
    mla_kv_b_lora_o,
    mla_kv_b_lora_o_ref,
    mla_kv_b_lora_q,
    mla_kv_b_lora_q_ref,
)
from kernels.moe_lora import (
    MOE_VARIANTS,
    moe_lora_down,
    moe_lora_down_ref,
    moe_lora_gate_up,
    moe_lora_gate_up_ref,
)
from kernels.sgmv import (
    EXPAND_VARIANTS,
    SHRINK_VARIANTS,
    sgmv_expand,
    sgmv_expand_ref,
    sgmv_shrink,
    sgmv_shrink_ref,
)

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
        shrinks: dict[str, Provider] = {
            f"triton:{v}": functools.partial(sgmv_shrink, x, A, segs, variant=v)
            for v in SHRINK_VARIANTS
        }
        return Setup(
            {**shrinks, "torch": lambda: sgmv_shrink_ref(x, A, segs), "naive": naive},
            bytes_moved,
        )
    B = torch.randn(SGMV_SLOTS, m.hidden, rank, **bf16) / rank**0.5
    y_bf16 = y.to(torch.bfloat16)

    def naive_expand() -> None:
        for slot, idx in groups:
            out[idx] += y_bf16[idx] @ B[slot].T

    bytes_moved = adapters * rank * m.hidden * 2 + tokens * rank * 4 + 2 * tokens * m.hidden * 2
    expands: dict[str, Provider] = {
        f"triton:{v}": functools.partial(sgmv_expand, y, B, out, segs, [0, m.hidden], variant=v)
        for v in EXPAND_VARIANTS
    }
    return Setup(
        {
            **expands,
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
                **{
                    f"triton:{v}": functools.partial(
                        mla_kv_b_lora_q, small, lat, A, B, segs, variant=v
                    )
                    for v in MLA_VARIANTS
                },
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
            **{
                f"triton:{v}": functools.partial(mla_kv_b_lora_o, lat, small, A, B, segs, variant=v)
                for v in MLA_VARIANTS
            },
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
        f"triton:{variant}": functools.partial(
            fused, x, out, A, B, pair_token, pair_expert, segs, variant=variant
        )
        for variant in MOE_VARIANTS
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


_FLUSH_BYTES = 256 * 1024**2


def _median_replay_ms(body: Callable[[], None], graph: bool, reps: int) -> float:
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


@functools.cache
def _flush_buffer() -> torch.Tensor:
    return torch.empty(_FLUSH_BYTES, dtype=torch.int8, device="cuda")


@functools.cache
def _flush_only_ms(graph: bool, reps: int, inner: int) -> float:
    """Median of [flush]×inner, measured once per process: every case subtracts it."""
    flush = _flush_buffer()

    def flush_only() -> None:
        for _ in range(inner):
            flush.zero_()

    return _median_replay_ms(flush_only, graph, reps)


def time_cold_us(fn: Provider, graph: bool, reps: int = 25, inner: int = 10) -> float:
    """Median µs of `fn` with a cold L2: [flush, fn]×inner minus [flush]×inner, each timed
    as one CUDA-graph replay (or eager launches when `graph` is False)."""
    flush = _flush_buffer()

    def with_fn() -> None:
        for _ in range(inner):
            flush.zero_()
            fn()

    with_ms = _median_replay_ms(with_fn, graph, reps)
    return max(with_ms - _flush_only_ms(graph, reps, inner), 0.0) * 1e3 / inner


def copy_provider(bytes_moved: int) -> Provider:
    """A device copy moving `bytes_moved` (half read, half written): the cold-L2 time a
    kernel at copy bandwidth would take for this case."""
    src = torch.randn(max(bytes_moved // 4, 1) // 2, device="cuda")
    dst = torch.empty_like(src)
    return functools.partial(dst.copy_, src)


def measure(
    kernel: str,
    model: str,
    rank: int,
    tokens: int,
    adapters: int,
    copy_bw: float,
    providers: set[str] | None,
) -> list[Row]:
    """Rows of one case, one per provider (`providers` filters by name or `triton:` prefix;
    µs None where the provider was skipped)."""
    setup = SETUPS[kernel](MODELS[model], tokens, adapters, rank, torch.device("cuda"))
    floor = setup.bytes_moved / copy_bw * 1e6
    candidates = {**setup.providers, "copy": copy_provider(setup.bytes_moved)}
    rows = []
    for provider, fn in candidates.items():
        if providers is not None and not ({provider, provider.split(":")[0]} & providers):
            continue
        us = time_cold_us(fn, graph=tokens <= 256)
        gbps = setup.bytes_moved / us / 1e3 if us else None
        rows.append(
            Row(kernel, model, tokens, adapters, rank, provider, us, setup.bytes_moved, floor, gbps)
        )
        print(f"{kernel:12} {model:7} r{rank:<3} T{tokens:<5} N{adapters:<3} {provider:20}", end="")
        print(f" {us:9.2f} µs  floor {floor:7.2f} µs")
    for provider in set(SETUP_PROVIDERS[kernel]) - set(candidates):
        rows.append(Row(kernel, model, tokens, adapters, rank, provider, None, setup.bytes_moved))
    return rows


# Providers a setup may leave out (MoE prefill: gathers too large); recorded as skipped.
SETUP_PROVIDERS = {kernel: ("torch", "naive") for kernel in SETUPS}


def cases(kernels: list[str], models: list[str], targets_only: bool) -> list[tuple]:
    """(kernel, model, rank, tokens, adapters) to measure."""
    if targets_only:
        return [
            (kernel, "v3", rank, tokens, adapters)
            for (rank, tokens, adapters) in TARGET_ROWS
            for kernel in ("sgmv_shrink", "sgmv_expand")
        ]
    return [
        (kernel, model, rank, tokens, adapters)
        for kernel in kernels
        for model in models
        for rank in RANKS
        for tokens, adapters in [*DECODE, *PREFILL]
        # prefill runs kv_b through SGMV, not the absorbed path
        if not (kernel.startswith("mla") and tokens > 256)
    ]


def run(
    out_path: Path,
    models: list[str],
    kernels: list[str],
    providers: set[str] | None,
    targets_only: bool,
) -> list[Row]:
    from bench.ceilings import measure_copy_bandwidth

    copy_bw = measure_copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    rows: list[Row] = []
    for case in cases(kernels, models, targets_only):
        rows += measure(*case, copy_bw, providers)
        torch.cuda.empty_cache()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "device": torch.cuda.get_device_name(),
        **provenance("lora_kernels"),
        "copy_bytes_per_s": copy_bw,
        "rows": [asdict(r) for r in rows],
    }
    out_path.write_text(json.dumps(payload, indent=1))
    return rows


def best_triton(rows: list[Row]) -> dict[tuple, Row]:
    """Fastest `triton:*` row per (kernel, model, rank, tokens, adapters)."""
    best: dict[tuple, Row] = {}
    for r in rows:
        if not r.provider.startswith("triton") or r.us is None:
            continue
        key = (r.kernel, r.model, r.rank, r.tokens, r.adapters)
        if key not in best or r.us < best[key].us:  # type: ignore[operator]
            best[key] = r
    return best


def print_variant_table(rows: list[Row]) -> None:
    """Per case: µs of every triton variant, the copy calibration and the floor."""
    variants = sorted({r.provider for r in rows if r.provider.startswith("triton")})
    by_case: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        by_case.setdefault((r.kernel, r.model, r.rank, r.tokens, r.adapters), {})[r.provider] = r
    print("\n| kernel | model | r | T | N | " + " | ".join(variants) + " | copy | floor |")
    print("|---" * (len(variants) + 7) + "|")
    for key, provs in by_case.items():
        cells = [provs[v].us if v in provs else None for v in variants]
        copy = provs["copy"].us if "copy" in provs else None
        floor = next(iter(provs.values())).floor_us
        shown = " | ".join(f"{u:.1f}" if u is not None else "-" for u in [*cells, copy, floor])
        print(f"| {' | '.join(map(str, key))} | {shown} |")


def print_targets_table(rows: list[Row]) -> None:
    """TARGETS.md's decode table (V3 hidden 7168) with our best cold-L2 µs and floor."""
    best = best_triton(rows)
    copies = {
        (r.kernel, r.rank, r.tokens, r.adapters): r.us
        for r in rows
        if r.model == "v3" and r.provider == "copy"
    }
    print(
        "\n| rank, B, N | SGLang shrink / expand | ours shrink / expand (variant)"
        " | copy here | floor here | target |"
    )
    print("|---|---|---|---|---|---|")
    for (rank, tokens, adapters), (sglang, _, target) in TARGET_ROWS.items():
        s = best.get(("sgmv_shrink", "v3", rank, tokens, adapters))
        e = best.get(("sgmv_expand", "v3", rank, tokens, adapters))
        if not (s and e and s.us is not None and e.us is not None):
            continue
        cs = copies.get(("sgmv_shrink", rank, tokens, adapters))
        ce = copies.get(("sgmv_expand", rank, tokens, adapters))
        copy = f"{cs:.1f} / {ce:.1f}" if cs is not None and ce is not None else "-"
        met = "met" if s.us <= target[0] and e.us <= target[1] else "missed"
        print(
            f"| {rank}, {tokens}, {adapters} | {sglang[0]} / {sglang[1]} | {s.us:.1f} / {e.us:.1f}"
            f" ({s.provider[7:]} / {e.provider[7:]}) | {copy} | {s.floor_us:.1f} /"
            f" {e.floor_us:.1f} | ≤ {target[0]} / ≤ {target[1]} {met} |"
        )


def plot(json_path: Path, png_path: Path) -> None:
    """One panel per kernel: µs vs decode tokens per provider (V3, rank 16, max adapters);
    `triton` is the best variant of each case (older files name it plainly `triton`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [Row(**r) for r in json.loads(json_path.read_text())["rows"]]
    best = best_triton(rows)
    rows = [r for r in rows if not r.provider.startswith("triton")]
    rows += [Row(**{**asdict(r), "provider": "triton"}) for r in best.values()]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, kernel in zip(axes.flat, SETUPS, strict=False):
        for provider in ("triton", "torch", "naive", "copy", "floor"):
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
                    linestyle="--" if provider in ("floor", "copy") else "-",
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
    """CPU check of every setup at tiny sizes: the torch and naive providers run once (the
    Triton ones are covered by tests/kernels), and the case list of each mode is built."""
    tiny = ModelShape(
        hidden=64, heads=2, nope=16, v_dim=16, kv_lora_rank=32, moe_inter=24, experts=4, top_k=2
    )
    for kernel, make in SETUPS.items():
        for tokens, adapters in [(1, 1), (16, 8)]:
            setup = make(tiny, tokens, adapters, 16, torch.device("cpu"))
            for provider, fn in setup.providers.items():
                if not provider.startswith("triton"):
                    fn()
        print(f"smoke ok: {kernel}")
    full = cases(list(SETUPS), ["v3"], targets_only=False)
    print(f"cases: default --models v3 {len(full)}, --targets {len(cases([], [], True))}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="results JSON (GPU run); the PNG goes beside it")
    parser.add_argument("--plot", type=Path, help="only draw the PNG from this results JSON")
    parser.add_argument("--smoke", action="store_true", help="CPU: run every setup at tiny sizes")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--kernels", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    parser.add_argument(
        "--targets", action="store_true", help="only the TARGETS.md rows (V3 SGMV), fast"
    )
    parser.add_argument(
        "--providers",
        nargs="+",
        help="only these providers: triton (all variants), triton:<variant>, torch, naive, copy",
    )
    args = parser.parse_args()
    if args.smoke:
        smoke()
    elif args.plot:
        plot(args.plot, args.plot.with_suffix(".png"))
    elif args.out:
        providers = set(args.providers) if args.providers else None
        rows = run(args.out, args.models, args.kernels, providers, args.targets)
        print_variant_table(rows)
        print_targets_table(rows)
        plot(args.out, args.out.with_suffix(".png"))
    else:
        parser.error("give --out, --plot or --smoke")


if __name__ == "__main__":
    main()
