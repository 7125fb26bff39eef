"""Host → GPU slot load time of a canonical adapter (TARGETS.md: rank 16 of a 16B MoE
≤ 5 ms), on DeepSeek-V2-Lite shapes, bf16, from pinned host memory.

For each adapter layout it reports the wall time from `LoraPool.load` to its event's
completion (median), the host time `load` takes to return (what the scheduler thread
pays), the bytes crossing PCIe and the GB/s achieved, beside one big pinned host→device
copy as the link's ceiling.

    python3 -m bench.lora_slot_load --out results/lora_slot_load.json
    python3 -m bench.lora_slot_load --out /tmp/smoke.json --device cpu --layers 2 --reps 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from adapter_store.format import CanonicalAdapter, model_lora_shapes
from adapter_store.synthetic import random_adapter
from inference_svc.adapters.host_cache import adapter_bytes
from inference_svc.lora.pool import LoraPool, LoraPoolConfig

# DeepSeek-V2-Lite (15.7B total, MoE): the "16B MoE" of TARGETS.md.
V2_LITE = {
    "model_type": "deepseek_v2",
    "hidden_size": 2048,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
}
NON_EXPERT = ["attn.qkv_a", "attn.q", "attn.kv_b", "attn.o", "mlp.gate_up", "mlp.down"]
SCENARIOS = {
    "attention+dense+shared (no routed experts)": {"modules": NON_EXPERT},
    "all modules, shared_outer experts": {"moe_layout": "shared_outer"},
    "all modules, per-expert": {"moe_layout": "per_expert"},
}


@dataclass
class Row:
    scenario: str
    rank: int
    pool_rank: int
    bytes_h2d: int
    load_ms_median: float
    issue_ms_median: float
    gb_per_s: float


def pinned(adapter: CanonicalAdapter, dtype: torch.dtype, pin: bool) -> CanonicalAdapter:
    tensors = {name: t.to(dtype).contiguous() for name, t in adapter.tensors.items()}
    if pin:
        tensors = {name: t.pin_memory() for name, t in tensors.items()}
    return CanonicalAdapter(adapter.manifest, tensors)


def time_load(pool: LoraPool, adapter: CanonicalAdapter, reps: int) -> tuple[float, float]:
    """Median (wall ms to completion, host ms for `load` to return) over reps loads."""
    walls, issues = [], []
    for rep in range(reps + 1):  # the first is a warm-up
        sync(pool.device)
        start = time.perf_counter()
        load = pool.load(rep % pool.num_slots, adapter)
        issued = time.perf_counter()
        if load.event is not None:
            load.event.synchronize()
        done = time.perf_counter()
        if rep:
            walls.append((done - start) * 1e3)
            issues.append((issued - start) * 1e3)
    return statistics.median(walls), statistics.median(issues)


def link_ceiling_gb_s(device: torch.device, n_bytes: int = 512 << 20) -> float | None:
    """One big pinned host → device copy, GB/s."""
    if device.type != "cuda":
        return None
    src = torch.empty(n_bytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return n_bytes / statistics.median(times[1:]) / 1e9


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{row.scenario}\nr={row.rank} in R={row.pool_rank}" for row in rows]
    ax.barh(labels, [row.load_ms_median for row in rows], color="tab:blue", label="to completion")
    ax.barh(labels, [row.issue_ms_median for row in rows], color="tab:orange", label="host issue")
    ax.axvline(5.0, color="red", linestyle="--", label="target 5 ms")
    ax.set_xlabel("ms per slot load (median)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True, help="JSON path; the plot beside it")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=V2_LITE["num_hidden_layers"])
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()

    device = torch.device(args.device)
    hf_config = {**V2_LITE, "num_hidden_layers": args.layers}
    shapes = model_lora_shapes(hf_config)
    rows: list[Row] = []
    for pool_rank in (16, 64):
        config = LoraPoolConfig(pool_rank, torch.bfloat16, args.device, max_loras=2)
        pool = LoraPool.from_config(shapes, config)
        for scenario, options in SCENARIOS.items():
            adapter = pinned(
                random_adapter(hf_config, 16, **options), torch.bfloat16, device.type == "cuda"
            )
            load_ms, issue_ms = time_load(pool, adapter, args.reps)
            size = adapter_bytes(adapter)
            rows.append(Row(scenario, 16, pool_rank, size, load_ms, issue_ms, size / load_ms / 1e6))
            print(
                f"{scenario:45s} r=16 R={pool_rank:3d} {size / 2**20:8.1f} MiB "
                f"{load_ms:8.2f} ms (host {issue_ms:6.2f} ms) {rows[-1].gb_per_s:6.1f} GB/s"
            )
        del pool
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": "DeepSeek-V2-Lite shapes",
        "layers": args.layers,
        "h2d_link_gb_s": link_ceiling_gb_s(device),
        "target_ms": 5.0,
        "rows": [asdict(row) for row in rows],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(rows, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
