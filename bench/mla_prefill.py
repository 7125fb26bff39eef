"""MLA prefill attention: one varlen Triton launch vs torch SDPA per sequence.

The per-sequence way is what the model ran before `kernels.mla_prefill`: for each prefill
sequence, K = k_nope ⊕ the rope key broadcast to every head, V zero-padded to K's width
(flash SDPA needs one head width), SDPA (causal, or with an explicit mask on a cached
prefix), then the output copied into the step's rows. Both ways read the same strided
views of one expanded K/V tensor (DeepSeek-V2-Lite heads: 16 × (128 nope + 64 rope), v
128), and every case checks the two agree.

Two figures per case and way: `gpu_ms`, CUDA-event time with the launches captured in a
CUDA graph (the kernels alone), and `host_ms`, the wall time of issuing the launches
eagerly (time.perf_counter around the calls, then a sync outside the timed region) — the
cost that made eager prefill steps host-bound.

    python3 -m bench.mla_prefill --out bench/results/mla_prefill.json
    python -m bench.mla_prefill --out /tmp/mla_prefill.json --smoke  # CPU, interpreted
"""

from __future__ import annotations

import functools
import time

import torch

from bench.gpu_timing import bar_plot, graphed, kernel_bench_args, run_meta, time_ms, write_json
from kernels.mla_prefill import mla_prefill_varlen, mla_prefill_varlen_ref

WAYS = ("varlen", "per_sequence")


def sdpa_per_sequence(q_nope, q_rope, k_nope, k_rope, v, out, q_starts, k_starts, contexts, scale):  # type: ignore[no-untyped-def]
    """The model's former prefill attention: torch SDPA once per sequence (host lists)."""
    heads, v_dim, width = q_nope.shape[1], v.shape[-1], q_nope.shape[-1] + q_rope.shape[-1]
    for b, context in enumerate(contexts):
        q0, q1, k0 = q_starts[b], q_starts[b + 1], k_starts[b]
        q = torch.cat([q_nope[q0:q1], q_rope[q0:q1]], dim=-1)  # [q, H, n+R]
        k = torch.cat(
            [k_nope[k0 : k0 + context], k_rope[k0 : k0 + context, None].expand(-1, heads, -1)],
            dim=-1,
        )  # [ctx, H, n+R]
        v_own = torch.nn.functional.pad(v[k0 : k0 + context], (0, width - v_dim))
        qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v_own))  # [1, H, T, n+R]
        if q1 - q0 == context:
            o = torch.nn.functional.scaled_dot_product_attention(
                qh, kh, vh, is_causal=True, scale=scale
            )
        else:
            offset = context - (q1 - q0)
            allowed = torch.arange(context, device=q.device)[None, :] <= (
                offset + torch.arange(q1 - q0, device=q.device)[:, None]
            )
            o = torch.nn.functional.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=allowed, scale=scale
            )
        out[q0:q1] = o[0].transpose(0, 1)[..., :v_dim]


def make_case(query_lens, context_lens, heads, nope, rope, v_dim, latent, device, dtype):  # type: ignore[no-untyped-def]
    rows, keys = sum(query_lens), sum(context_lens)
    q = torch.randn(rows, heads, nope + rope, device=device).to(dtype)
    kv = torch.randn(keys, heads, nope + v_dim, device=device).to(dtype)
    cache_rows = torch.randn(keys, latent + rope, device=device).to(dtype)
    q_nope, q_rope = q.split([nope, rope], dim=-1)
    k_nope, v = kv.split([nope, v_dim], dim=-1)
    k_rope = cache_rows[:, latent:]
    q_starts = [0, *torch.tensor(query_lens).cumsum(0).tolist()]
    k_starts = [0, *torch.tensor(context_lens).cumsum(0).tolist()]
    meta = (
        torch.tensor(q_starts, dtype=torch.int32, device=device),
        torch.tensor(k_starts, dtype=torch.int32, device=device),
        torch.tensor(context_lens, dtype=torch.int32, device=device),
    )
    out = torch.empty(rows, heads, v_dim, device=device, dtype=dtype)
    tensors = (q_nope, q_rope, k_nope, k_rope, v)
    return tensors, meta, out, (q_starts, k_starts, list(context_lens))


def host_ms(fn, device: torch.device, reps: int = 20) -> float:  # type: ignore[no-untyped-def]
    """Median wall ms of issuing `fn`'s launches (the GPU drained before each call)."""
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return sorted(samples)[len(samples) // 2]


def run(cases, shape, device, dtype):  # type: ignore[no-untyped-def]
    heads, nope, rope, v_dim, latent = shape
    scale = (nope + rope) ** -0.5
    rows = []
    for label, query_lens, context_lens in cases:
        tensors, meta, out, host = make_case(
            query_lens, context_lens, heads, nope, rope, v_dim, latent, device, dtype
        )
        n = len(query_lens)
        ways = {
            "varlen": functools.partial(
                mla_prefill_varlen, *tensors, out, *meta, 0, n, scale,
                max_query_len=max(query_lens),
            ),
            "per_sequence": functools.partial(sdpa_per_sequence, *tensors, out, *host, scale),
        }  # fmt: skip
        ref = torch.empty_like(out)
        mla_prefill_varlen_ref(*tensors, ref, *meta, 0, n, scale, max_query_len=max(query_lens))
        row = {"case": label, "sequences": n, "query_rows": sum(query_lens)}
        for way, fn in ways.items():
            fn()
            diff = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            timed = graphed(fn) if device.type == "cuda" else fn
            row[f"{way}_gpu_ms"] = time_ms(timed, device)
            row[f"{way}_host_ms"] = host_ms(fn, device)
            row[f"{way}_max_rel_diff"] = diff
        # Score FLOPs: causal pairs × heads × (QK width + V width) × 2.
        pairs = sum(q * c - q * (q - 1) // 2 for q, c in zip(query_lens, context_lens, strict=True))
        row["tflops_varlen"] = (
            2 * pairs * heads * (nope + rope + v_dim) / row["varlen_gpu_ms"] / 1e9
        )
        row["gpu_speedup"] = row["per_sequence_gpu_ms"] / row["varlen_gpu_ms"]
        row["host_speedup"] = row["per_sequence_host_ms"] / row["varlen_host_ms"]
        rows.append(row)
        print(
            f"{label:24s} varlen gpu {row['varlen_gpu_ms']:.3f} ms host "
            f"{row['varlen_host_ms']:.3f} ms ({row['tflops_varlen']:.0f} TFLOP/s) | per-seq gpu "
            f"{row['per_sequence_gpu_ms']:.3f} host {row['per_sequence_host_ms']:.3f} | "
            f"diff {row['varlen_max_rel_diff']:.1e} / {row['per_sequence_max_rel_diff']:.1e}"
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    out_path, device = kernel_bench_args(__doc__, argv)
    started = time.perf_counter()
    if device.type == "cpu":
        shape = (2, 16, 16, 16, 24)
        cases = [("2 prompts", [9, 5], [9, 5]), ("chunk on prefix", [4], [11])]
        dtype = torch.float32
    else:
        shape = (16, 128, 64, 128, 512)  # DeepSeek-V2-Lite heads
        cases = [
            ("16 prompts × 512", [512] * 16, [512] * 16),
            ("4 prompts × 2048", [2048] * 4, [2048] * 4),
            ("8 chunks 512 on 1536", [512] * 8, [2048] * 8),
            ("64 prompts × 128", [128] * 64, [128] * 64),
        ]
        dtype = torch.bfloat16
    rows = run(cases, shape, device, dtype)
    heads, nope, rope, v_dim, _ = shape
    meta = run_meta(
        "mla_prefill", device, started, heads=heads, nope=nope, rope=rope, v_dim=v_dim,
        dtype=str(dtype),
    )  # fmt: skip
    write_json(out_path, meta, rows)
    bar_plot(
        out_path.with_suffix(".png"),
        "MLA prefill attention, one layer (host issue + GPU)",
        [r["case"] for r in rows],
        {
            f"{way} {kind}": [r[f"{way}_{kind}_ms"] for r in rows]
            for way in WAYS
            for kind in ("gpu", "host")
        },
        "ms",
    )


if __name__ == "__main__":
    main()
