"""Host → GPU slot load time of a canonical adapter (TARGETS.md: rank 16 of a 16B MoE
≤ 5 ms), on DeepSeek-V2-Lite shapes, bf16, from pinned host memory: the per-tensor path
("old": one copy per layer × module × slice) beside the packed path ("new": one pinned
buffer, staged in chunks, one device scatter per run), in one run.

Per adapter layout and pool rank it reports the bytes that cross the link, the wall time
from `LoraPool.load` to its event's completion (median), the host time `load` takes to
return, GB/s and the share of the measured link ceiling (one big pinned host→device copy),
the floor (bytes ÷ ceiling), and for the new path the host time to pack (what the host
cache pays once per insert, pinned allocation included). Every row checks that the new
path's slot equals the old path's, element for element.

    python3 -m bench.lora_slot_load --out results/lora_slot_load.json
    python3 -m bench.lora_slot_load --out /tmp/smoke.json --device cpu --layers 3 --reps 2
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
from bench.provenance import provenance
from inference_svc.adapters.host_cache import adapter_bytes
from inference_svc.lora.pool import MIB, LoraPool, LoraPoolConfig

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
RANK = 16
TARGET_MS = 5.0


@dataclass
class Row:
    scenario: str
    rank: int
    pool_rank: int
    path: str  # "old" (per tensor) | "new" (packed)
    bytes_h2d: int
    load_ms_median: float
    load_ms_spread: float  # max - min over the reps
    issue_ms_median: float
    gb_per_s: float
    link_fraction: float | None  # of the measured pinned H2D ceiling
    floor_ms: float | None  # bytes_h2d ÷ ceiling
    pack_ms: float | None  # new path: host time to pack (and pin) once, at host-cache insert
    equal_to_old: bool | None  # new path: slot contents equal the old path's


def pinned_tensors(adapter: CanonicalAdapter, pin: bool) -> CanonicalAdapter:
    """The old host-cache form: each tensor bf16, contiguous, pinned on its own."""
    tensors = {name: t.to(torch.bfloat16).contiguous() for name, t in adapter.tensors.items()}
    if pin:
        tensors = {name: t.pin_memory() for name, t in tensors.items()}
    return CanonicalAdapter(adapter.manifest, tensors)


def time_load(
    pool: LoraPool, adapter: CanonicalAdapter, reps: int, slot: int
) -> tuple[list[float], list[float]]:
    """(wall ms to completion, host ms for `load` to return) of each of `reps` loads into
    `slot`, after one warm-up load."""
    walls, issues = [], []
    for rep in range(reps + 1):
        sync(pool.device)
        start = time.perf_counter()
        load = pool.load(slot, adapter)
        issued = time.perf_counter()
        if load.event is not None:
            load.event.synchronize()
        done = time.perf_counter()
        if rep:
            walls.append((done - start) * 1e3)
            issues.append((issued - start) * 1e3)
    return walls, issues


def h2d_gb_s(device: torch.device, n_bytes: int, reps: int = 8) -> float | None:
    """One pinned host → device copy of `n_bytes` (random data), median GB/s by events."""
    if device.type != "cuda":
        return None
    src = torch.randint(0, 255, (n_bytes,), dtype=torch.uint8).pin_memory()
    dst = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return n_bytes / statistics.median(times) / 1e9


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def slots_equal(pool: LoraPool, slot_a: int, slot_b: int) -> bool:
    return all(
        torch.equal(pool.lora_a(*key)[slot_a], pool.lora_a(*key)[slot_b])
        and torch.equal(pool.lora_b(*key)[slot_a], pool.lora_b(*key)[slot_b])
        for key in pool.module_instances()
    )


def measure(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    pin = device.type == "cuda"
    hf_config = {**V2_LITE, "num_hidden_layers": args.layers}
    shapes = model_lora_shapes(hf_config)
    links = {size: h2d_gb_s(device, size * MIB) for size in (32, 64, 512)}
    ceiling = links[512]
    adapters = {
        scenario: random_adapter(hf_config, RANK, dtype=torch.bfloat16, **options)
        for scenario, options in SCENARIOS.items()
    }
    rows: list[Row] = []
    for pool_rank in args.pool_ranks:
        config = LoraPoolConfig(
            pool_rank,
            torch.bfloat16,
            args.device,
            max_loras=2,
            staging_bytes=args.staging_mib * MIB,
        )
        pool = LoraPool(shapes, 2, config)
        for scenario, adapter in adapters.items():
            old = pinned_tensors(adapter, pin)
            started = time.perf_counter()
            new = pool.packing.pack(adapter, pin=pin)
            pack_ms = (time.perf_counter() - started) * 1e3
            for path, host, slot in (("old", old, 0), ("new", new, 1)):
                walls, issues = time_load(pool, host, args.reps, slot)
                size = adapter_bytes(host)
                load_ms = statistics.median(walls)
                gb_s = size / load_ms / 1e6
                rows.append(
                    Row(
                        scenario,
                        RANK,
                        pool_rank,
                        path,
                        size,
                        load_ms,
                        max(walls) - min(walls),
                        statistics.median(issues),
                        gb_s,
                        None if ceiling is None else gb_s / ceiling,
                        None if ceiling is None else size / ceiling / 1e6,
                        pack_ms if path == "new" else None,
                        slots_equal(pool, 0, 1) if path == "new" else None,
                    )
                )
                print_row(rows[-1])
            del old, new
        del pool
        sync(device)
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": "DeepSeek-V2-Lite shapes",
        "layers": args.layers,
        "staging_mib": args.staging_mib,
        "h2d_gb_s_by_copy_mib": links,
        "h2d_link_gb_s": ceiling,
        "target_ms": TARGET_MS,
        "rows": [asdict(row) for row in rows],
    }


def print_row(row: Row) -> None:
    link = "" if row.link_fraction is None else f"{100 * row.link_fraction:5.1f}% of link"
    floor = "" if row.floor_ms is None else f"floor {row.floor_ms:6.2f} ms"
    pack = "" if row.pack_ms is None else f"pack {row.pack_ms:7.1f} ms"
    equal = "" if row.equal_to_old is None else f"equal={row.equal_to_old}"
    print(
        f"{row.scenario[:34]:34s} R={row.pool_rank:3d} {row.path} "
        f"{row.bytes_h2d / MIB:7.1f} MiB {row.load_ms_median:8.2f} ms "
        f"(host {row.issue_ms_median:6.2f}) {row.gb_per_s:6.1f} GB/s {link} {floor} {pack} "
        f"{equal}",
        flush=True,
    )


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    keys = sorted({(r["scenario"], r["pool_rank"]) for r in rows}, key=lambda k: (k[1], k[0]))
    fig, ax = plt.subplots(figsize=(10, 0.8 * len(keys) + 1.5))
    for i, (scenario, pool_rank) in enumerate(keys):
        by_path = {
            r["path"]: r for r in rows if (r["scenario"], r["pool_rank"]) == (scenario, pool_rank)
        }
        for offset, load_path, color in ((-0.2, "old", "tab:gray"), (0.2, "new", "tab:blue")):
            ax.barh(
                i + offset,
                by_path[load_path]["load_ms_median"],
                0.38,
                color=color,
                label=f"{load_path} path" if i == 0 else None,
            )
        if by_path["new"]["floor_ms"] is not None:
            ax.plot(
                [by_path["new"]["floor_ms"]] * 2,
                [i - 0.4, i + 0.4],
                color="black",
                label="bytes ÷ link" if i == 0 else None,
            )
    ax.set_yticks(range(len(keys)), [f"{s}\nr={RANK} in R={R}" for s, R in keys], fontsize=8)
    ax.axvline(result["target_ms"], color="red", linestyle="--", label="target 5 ms")
    ax.set_xscale("log")
    ax.set_xlabel("ms per slot load, to completion (median)")
    link = result["h2d_link_gb_s"]
    ax.set_title(
        f"{result['device']}: host → GPU slot load"
        + ("" if link is None else f" (pinned H2D ceiling {link:.1f} GB/s)"),
        fontsize=9,
    )
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True, help="JSON path; the plot beside it")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=V2_LITE["num_hidden_layers"])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--pool-ranks", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--staging-mib", type=int, default=128)
    args = parser.parse_args(argv)
    result = {**provenance("lora_slot_load", argv), **measure(args)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))
    return result


if __name__ == "__main__":
    main()
