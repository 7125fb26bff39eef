"""Decode-step time of a random-weight DeepSeek-V2-Lite-shaped model vs its memory floor.

    python -m bench.model_decode --json out.json --plot out.png          # GPU (bf16, graphs)
    python -m bench.model_decode --json out.json --plot out.png --smoke  # CPU setup check
    python -m bench.model_decode --json out.json --plot out.png --variants v1 v2 --profile

`--variants` runs the step with each kernel variant (bench/kernel_variants.py: v1 = the
first measured code, v2 = now, v2-x = v2 with change x reverted), capturing graphs anew for
each. `--profile` adds, per variant and batch, a torch-profiler summary of the step's
kernels by class (launches and µs per step) for the graph replay and for an eager step.

The model is V2-Lite's shape with `q_lora_rank: 1536` (27 layers, 64 routed experts, top-6,
2 shared). Each batch size decodes one token per sequence against `--context` cached tokens.
`--experts fp8` block-quantizes the routed experts (bench/fp8_experts.py).
Floor = (bytes of weights the step reads + KV bytes read) ÷ measured copy bandwidth, where
routed experts count as the expected number of distinct experts a uniform router picks.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.fp8_experts import EXPERT_WEIGHTS, fp8_block, quantize_routed_experts
from bench.gpu_timing import bar_plot, copy_bandwidth, device_name, time_ms, write_json
from bench.kernel_variants import VARIANTS, kernel_variant
from bench.provenance import provenance
from bench.step_profile import profile_step
from inference_svc.engine.batch import SequenceStep, build_batch
from inference_svc.engine.kv_pages import pages_for
from inference_svc.engine.model_runner import ModelRunner, RunnerConfig
from inference_svc.model.config import ModelConfig, parse_config
from inference_svc.model.loader import build_model

V2_LITE_Q_LORA = {
    "model_type": "deepseek_v2",
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "n_shared_experts": 2,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "greedy",
    "first_k_dense_replace": 1,
    "norm_topk_prob": False,
    "rope_theta": 10000,
}
SMOKE_OVERRIDES = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "kv_lora_rank": 64,
    "q_lora_rank": 96,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
}


def random_model(config: ModelConfig, device: torch.device, dtype: torch.dtype):
    model = build_model(config, device, dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
    return model


def expected_distinct_experts(batch: int, experts: int, top_k: int) -> float:
    """E·(1 − (1 − k/E)^B): distinct experts a uniform router touches for B tokens."""
    return experts * (1 - (1 - top_k / experts) ** batch)


def step_bytes(model, batch: int, context: int) -> dict[str, float]:
    """Bytes one decode step must read: weights by kind, and the latent KV cache."""
    c = model.config
    routed, other = 0.0, 0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if ".moe.experts." in name:
            per_expert = size / c.routing.num_experts
            distinct = expected_distinct_experts(batch, c.routing.num_experts, c.routing.top_k)
            routed += per_expert * distinct
        elif name == "embed.weight":
            other += batch * c.hidden_size * p.element_size()  # only the batch's rows
        else:
            other += size
    element = model.embed.weight.element_size()
    kv = batch * context * c.num_layers * c.kv_cache_dim * element
    return {"weights_routed": routed, "weights_other": float(other), "kv": float(kv)}


def decode_batch(batch: int, context: int, page_size: int, device: torch.device):
    """One decode token per sequence, each sequence on its own run of pages."""
    per_seq = pages_for(context, page_size)
    steps = [
        SequenceStep(context - 1, 1, tuple(range(b * per_seq, (b + 1) * per_seq)))
        for b in range(batch)
    ]
    return build_batch(steps, page_size, device)


def measure(runner, variant, batch_size, context, page_size, bandwidth, with_profile) -> dict:
    """Time one decode step of `batch_size` sequences (graph replay on CUDA) vs its floor."""
    model, device = runner.model, runner.device
    config = model.config
    batch = decode_batch(batch_size, context, page_size, device)
    ids = torch.randint(0, config.vocab_size, (batch_size,), device=device)
    ms = time_ms(lambda: runner.execute(ids, batch), device)
    parts = step_bytes(model, batch_size, context)
    floor_ms = sum(parts.values()) / bandwidth * 1e3
    row = {
        "variant": variant,
        "batch": batch_size,
        "context": context,
        "step_ms": ms,
        "floor_ms": floor_ms,
        "ratio": ms / floor_ms,
        "tokens_per_s": batch_size / (ms * 1e-3),
        **{f"{k}_bytes": v for k, v in parts.items()},
    }
    if with_profile:
        if device.type == "cuda":
            row["profile_graph"] = profile_step(lambda: runner.execute(ids, batch), device)

        def eager():
            hidden = model(ids, batch, runner.kv_cache)
            return model.compute_logits(hidden[batch.logits_indices])

        row["profile_eager"] = profile_step(eager, device)
    print(f"{variant:>8s} B={batch_size:4d} step {ms:8.3f} ms  floor {floor_ms:8.3f} ms")
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--plot", type=Path, required=True)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, no graphs")
    parser.add_argument("--variants", nargs="+", default=["v2"], choices=sorted(VARIANTS))
    parser.add_argument("--profile", action="store_true", help="kernel-class summary per step")
    parser.add_argument(
        "--experts", choices=EXPERT_WEIGHTS, default="bf16", help="routed experts' weights"
    )
    args = parser.parse_args(argv)

    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    raw = {**V2_LITE_Q_LORA, **(SMOKE_OVERRIDES if args.smoke else {})}
    config = parse_config(raw)
    batch_sizes = sorted(
        {min(b, 4) for b in args.batch_sizes} if args.smoke else set(args.batch_sizes)
    )
    context = min(args.context, 64) if args.smoke else args.context
    page_size = 16
    model = random_model(config, device, dtype)
    if args.experts != "bf16":
        quantize_routed_experts(model, fp8_block(args.smoke), args.experts)
    max_batch = max(batch_sizes)
    runner = ModelRunner(
        model,
        RunnerConfig(
            num_pages=max_batch * pages_for(context, page_size),
            page_size=page_size,
            max_pages_per_seq=pages_for(context, page_size),
            cuda_graph_batch_sizes=tuple(sorted(set(batch_sizes))),
        ),
    )
    runner.kv_cache.pools.normal_()  # a full cache of random latents
    if device.type == "cuda":
        runner.capture_decode_graphs()
    bandwidth = copy_bandwidth(device)

    rows = []
    for variant in args.variants:
        with kernel_variant(variant):
            if device.type == "cuda":
                runner.release_decode_graphs()
                runner.capture_decode_graphs()
            rows += [
                measure(runner, variant, b, context, page_size, bandwidth, args.profile)
                for b in batch_sizes
            ]
    print(f"{'variant':>12s} {'B':>4s} {'step ms':>9s} {'floor ms':>9s} {'ratio':>6s} launches")
    for r in rows:
        launches = r.get("profile_eager", {}).get(
            "launches_per_step"
        )  # graph replays may hide them
        print(
            f"{r['variant']:>12s} {r['batch']:4d} {r['step_ms']:9.3f} {r['floor_ms']:9.3f} "
            f"{r['ratio']:6.2f} {launches}"
        )
    meta = {
        "device": device_name(device),
        **provenance("model_decode", argv),
        "dtype": str(dtype),
        "copy_bandwidth_bytes_per_s": bandwidth,
        "config": raw,
        "experts": args.experts,
        "cuda_graphs": device.type == "cuda",
    }
    write_json(args.json, meta, rows)
    labels = [f"B={b}" for b in batch_sizes]
    # Rows come variant by variant; a variant named twice (a noise check) gets two series.
    per_variant = len(batch_sizes)
    series = {
        f"step {v} ({i})": [r["step_ms"] for r in rows[i * per_variant : (i + 1) * per_variant]]
        for i, v in enumerate(args.variants)
    }
    series["floor"] = [r["floor_ms"] for r in rows[:per_variant]]
    bar_plot(
        args.plot,
        f"decode step, V2-Lite shape (q_lora 1536), {args.experts} experts, ctx {context}, "
        f"{meta['device']}",
        labels,
        series,
        "ms",
    )


if __name__ == "__main__":
    main()
