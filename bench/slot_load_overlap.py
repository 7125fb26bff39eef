"""Do slot loads hide under the step that runs beside them? (issue 9: slot loads overlapped
with compute)

The engine issues a step's slot loads after launching the step before it and before
launching its own; `LoraPool.load` makes the pool's side stream wait for the forwards
queued so far (they may still read the slot being replaced). So the loads should run under
the next step's kernels. This times that order on the pool's own streams: compute alone
(cuBLAS GEMMs of a prompt step's shape, about `--compute-ms`), `--loads` packed per-expert
rank-16 V2-Lite slot loads alone, and compute → loads → compute, then reports the share of
the loads' time that the second compute phase hid; once more under the torch profiler, with
its copy-under-kernels figure (the serving profiles showed copies and kernels apart).

    python3 -m bench.slot_load_overlap --out bench/results/slot_load_overlap.json
    python -m bench.slot_load_overlap --out /tmp/o.json --device cpu --layers 2 --loads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from adapter_store.format import model_lora_shapes
from adapter_store.synthetic import random_adapter
from bench.gpu_timing import bar_plot, run_meta, write_json
from bench.lora_slot_load import RANK, V2_LITE, slots_equal, sync
from bench.step_profile import StepProfile
from inference_svc.lora.pool import LoraPool, LoraPoolConfig

# A prompt step's MoE-sized GEMM: 8192 tokens × hidden 2048 → 11264 (V2-Lite's dense MLP).
GEMM_SHAPE = (8192, 2048, 11264)
SMOKE_GEMM_SHAPE = (64, 32, 48)


def wall_ms(fn: Callable[[], object], device: torch.device) -> float:
    sync(device)
    began = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - began) * 1e3


def compute_phase(device: torch.device, target_ms: float, smoke: bool) -> Callable[[], None]:
    """GEMMs on the current stream, as many as take about `target_ms`."""
    m, k, n = SMOKE_GEMM_SHAPE if smoke else GEMM_SHAPE
    dtype = torch.float32 if smoke else torch.bfloat16
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype)

    def gemms(count: int) -> None:
        for _ in range(count):
            torch.matmul(x, w.t())

    wall_ms(lambda: gemms(10), device)  # warm (cuBLAS handles, workspaces)
    per_gemm = wall_ms(lambda: gemms(20), device) / 20
    count = max(1, round(target_ms / per_gemm))
    return lambda: gemms(count)


def measure(args: argparse.Namespace) -> tuple[dict, list[dict]]:
    device = torch.device(args.device)
    smoke = device.type == "cpu"
    started = time.perf_counter()
    hf_config = {**V2_LITE, "num_hidden_layers": args.layers}
    adapter = random_adapter(hf_config, RANK, dtype=torch.bfloat16)
    config = LoraPoolConfig(RANK, torch.bfloat16, args.device, max_loras=args.loads)
    pool = LoraPool(model_lora_shapes(hf_config), args.loads, config)
    packed = pool.packing.pack(adapter, pin=not smoke)
    compute = compute_phase(device, args.compute_ms, smoke)

    def loads() -> None:
        for slot in range(args.loads):
            pool.load(slot, packed)

    def engine_order() -> None:
        compute()
        loads()
        compute()

    wall_ms(engine_order, device)  # warm
    rows = []
    for rep in range(args.reps):
        row = {
            "rep": rep,
            "compute_ms": wall_ms(compute, device),
            "loads_ms": wall_ms(loads, device),
            "compute_loads_compute_ms": wall_ms(engine_order, device),
        }
        serial = 2 * row["compute_ms"] + row["loads_ms"]
        row["hidden_fraction"] = (serial - row["compute_loads_compute_ms"]) / row["loads_ms"]
        rows.append(row)
        print(
            f"compute {row['compute_ms']:7.1f} ms  {args.loads} loads {row['loads_ms']:7.1f} ms  "
            f"compute→loads→compute {row['compute_loads_compute_ms']:7.1f} ms  "
            f"loads hidden {row['hidden_fraction']:.0%}",
            flush=True,
        )
    with StepProfile(device) as profiled:
        engine_order()
    summary = profiled.summary(1)
    copies = summary["copy_union_us_per_step"]
    meta = run_meta(
        "slot_load_overlap",
        device,
        started,
        layers=args.layers,
        loads=args.loads,
        adapter_mib=packed.flat.numel() * packed.flat.element_size() / 2**20,
        gemm_shape=list(SMOKE_GEMM_SHAPE if smoke else GEMM_SHAPE),
        hidden_fraction_median=statistics.median(r["hidden_fraction"] for r in rows),
        profiled_wall_ms=summary["wall_us_per_step"] / 1e3,
        profiled_copy_ms=copies / 1e3,
        profiled_copy_under_kernels_fraction=(
            summary["copy_under_kernels_us_per_step"] / copies if copies else None
        ),
        loaded_slots_equal=all(slots_equal(pool, 0, slot) for slot in range(1, args.loads)),
    )
    return meta, rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="JSON path; the plot beside it")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=V2_LITE["num_hidden_layers"])
    parser.add_argument("--loads", type=int, default=8, help="slot loads (a prompt step's, v37)")
    parser.add_argument("--compute-ms", type=float, default=100.0, help="one compute phase")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    meta, rows = measure(args)
    write_json(args.out, meta, rows)
    last = rows[-1]
    bar_plot(
        args.out.with_suffix(".png"),
        f"{meta['device']}: {args.loads} slot loads between two compute phases",
        ["compute", "loads", "all three serially", "compute→loads→compute"],
        {
            "ms": [
                last["compute_ms"],
                last["loads_ms"],
                2 * last["compute_ms"] + last["loads_ms"],
                last["compute_loads_compute_ms"],
            ]
        },
        "ms",
    )
    return meta


if __name__ == "__main__":
    main()
