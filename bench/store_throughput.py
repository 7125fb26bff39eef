"""Upload and fetch throughput of the adapter store against SeaweedFS, on this machine.

The adapter has the size of a rank-16 all-module LoRA of DeepSeek-V2-Lite (27 layers, 64
routed experts with per-expert LoRA, shared experts, MLA q/kv_a/kv_b/o), as PEFT bf16
safetensors. A real `redis-server` and `weed server -s3` are started on free ports and the
store runs as its own process (`python -m adapter_store serve`).

    python -m bench.store_throughput --out-json results.json --out-png results.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from adapter_store.client import StoreClient  # noqa: E402
from adapter_store.normalize import normalize_peft  # noqa: E402
from bench.provenance import provenance  # noqa: E402
from tests.fixtures.servers import RedisServer, SeaweedS3Server  # noqa: E402
from tests.fixtures.services import ServiceProcess  # noqa: E402

# DeepSeek-V2-Lite's config.json, the fields that shape LoRA.
V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_shared_experts": 2,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 102400,
}
RANK = 16


def v2_lite_peft_folder(
    folder: Path, c: dict = V2_LITE, rank: int = RANK, routed: bool = True
) -> int:
    """Write a rank-16 all-module PEFT adapter of V2-Lite's shape (or of config `c`, rank
    `rank`; `routed` False: every module but the routed experts'); returns its byte size."""
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    attention = {
        "self_attn.q_proj": (hidden, heads * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"])),
        "self_attn.kv_a_proj_with_mqa": (hidden, c["kv_lora_rank"] + c["qk_rope_head_dim"]),
        "self_attn.kv_b_proj": (
            c["kv_lora_rank"],
            heads * (c["qk_nope_head_dim"] + c["v_head_dim"]),
        ),
        "self_attn.o_proj": (heads * c["v_head_dim"], hidden),
    }

    def mlp(prefix: str, inter: int) -> dict[str, tuple[int, int]]:
        return {
            f"{prefix}.gate_proj": (hidden, inter),
            f"{prefix}.up_proj": (hidden, inter),
            f"{prefix}.down_proj": (inter, hidden),
        }

    generator = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(c["num_hidden_layers"]):
        modules = dict(attention)
        if layer < c["first_k_dense_replace"]:
            modules |= mlp("mlp", c["intermediate_size"])
        else:
            shared = c["moe_intermediate_size"] * c["n_shared_experts"]
            modules |= mlp("mlp.shared_experts", shared)
            for expert in range(c["n_routed_experts"] if routed else 0):
                modules |= mlp(f"mlp.experts.{expert}", c["moe_intermediate_size"])
        for path, (fan_in, fan_out) in modules.items():
            key = f"base_model.model.model.layers.{layer}.{path}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(
                rank, fan_in, generator=generator, dtype=torch.bfloat16
            )
            tensors[f"{key}.lora_B.weight"] = torch.randn(
                fan_out, rank, generator=generator, dtype=torch.bfloat16
            )
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": [
            "q_proj",
            "kv_a_proj_with_mqa",
            "kv_b_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return sum(path.stat().st_size for path in folder.iterdir())


async def measure(address: str, folder: Path, repeats: int) -> dict:
    async with StoreClient(address, timeout_s=600) as client:
        await client.register_base_model("deepseek-v2-lite", json.dumps(V2_LITE))
        uploads, fetches, size = [], [], 0
        for i in range(repeats):
            started = time.perf_counter()
            adapter = await client.upload_dir(
                folder, name="bench", base_model="deepseek-v2-lite", dtype="bfloat16"
            )
            uploads.append(time.perf_counter() - started)
            assert adapter.version == i + 1
            started = time.perf_counter()
            fetched = await client.fetch_adapter(f"bench@{adapter.version}")
            fetches.append(time.perf_counter() - started)
            size = len(fetched.weights)
        return {"upload_s": uploads, "fetch_s": fetches, "canonical_bytes": size}


def normalize_seconds(folder: Path) -> float:
    """The CPU part of an upload alone: PEFT → canonical (in-process, same code)."""
    files = {path.name: path.read_bytes() for path in folder.iterdir()}
    started = time.perf_counter()
    normalize_peft(files, V2_LITE, base_model="deepseek-v2-lite", max_rank=256, dtype="bfloat16")
    return time.perf_counter() - started


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mbps, secs) = plt.subplots(1, 2, figsize=(10, 4))
    names = ["upload", "fetch"]
    mbps.bar(names, [results["upload_MBps_p50"], results["fetch_MBps_p50"]], color=["C0", "C1"])
    mbps.set_ylabel("MB/s (median)")
    mbps.set_title("throughput")
    secs.boxplot([results["upload_s"], results["fetch_s"]], tick_labels=names)
    secs.axhline(results["normalize_s"], color="C2", linestyle="--", label="normalize only")
    secs.set_ylabel("seconds per adapter")
    secs.set_title(f"latency ({results['repeats']} runs)")
    secs.legend()
    fig.suptitle(
        f"adapter store vs SeaweedFS: DeepSeek-V2-Lite rank-16 all-module adapter "
        f"({results['peft_bytes'] / 1e6:.0f} MB PEFT bf16)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-json", type=Path, required=True)
    parser.add_argument("--out-png", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = root / "peft"
        peft_bytes = v2_lite_peft_folder(folder)
        redis = RedisServer(root / "redis").start()
        s3 = SeaweedS3Server(root / "s3").start()
        store_args = ["--redis-url", redis.url, "--s3-endpoint-url", s3.endpoint_url]
        store = ServiceProcess(
            "adapter_store", [*store_args, "--s3-bucket", "bench"], root / "store"
        ).start()
        try:
            measured = asyncio.run(measure(store.address, folder, args.repeats))
        finally:
            store.stop()
            s3.stop()
            redis.stop()
        normalize_s = normalize_seconds(folder)
    upload_p50 = statistics.median(measured["upload_s"])
    fetch_p50 = statistics.median(measured["fetch_s"])
    results = {
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs",
        **provenance("store_throughput", interpreter="python"),
        "repeats": args.repeats,
        "peft_bytes": peft_bytes,
        "canonical_bytes": measured["canonical_bytes"],
        "upload_s": measured["upload_s"],
        "fetch_s": measured["fetch_s"],
        "upload_s_p50": upload_p50,
        "fetch_s_p50": fetch_p50,
        "upload_MBps_p50": peft_bytes / upload_p50 / 1e6,
        "fetch_MBps_p50": measured["canonical_bytes"] / fetch_p50 / 1e6,
        "normalize_s": normalize_s,
    }
    args.out_json.write_text(json.dumps(results, indent=1))
    plot(results, args.out_png)
    print(json.dumps({k: v for k, v in results.items() if not isinstance(v, list)}, indent=1))


if __name__ == "__main__":
    main()
