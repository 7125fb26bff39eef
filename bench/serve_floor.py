"""Ceilings of issue 9's serving ratios from the bytes floor (no GPU: counts only).

`bench.serve_offline` reports throughput with N adapters ÷ without LoRA (goal ≥ 0.90 at
N=32) and N=1000 zipf ÷ N=8 zipf (goal ≥ 0.95). Its decode steps are bandwidth-bound: each
reads the base weights and cache plus the LoRA weights of the batch's distinct adapters
(for the routed experts, of each distinct (adapter, expert) key: `bench.lora_floor`). A
decode batch of `--batch` sequences draws its adapters as the serving benchmark draws its
requests' (`serve_setup.draw_popularity`), so this counts, per scenario, the mean LoRA bytes
of such a batch ÷ the base step's bytes (`model_decode.step_bytes`, the model built on the
meta device): the decode overhead no kernel can go below.

The run-level ceiling assumes both runs at their floors and the prefill share unchanged
(`--decode-share` of the no-LoRA run is decode, the rest prefill, whose LoRA cost counts as
zero: a generous assumption for the run with more adapters):

    ceiling(a ÷ b) = (1 − d + d·(1 + floor_b)) ÷ (1 − d + d·(1 + floor_a))

    python -m bench.serve_floor --out bench/results/serve_floor_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from adapter_store.model_shapes import ModuleShape, model_lora_shapes
from bench.gpu_timing import bar_plot, write_json
from bench.lora_floor import lora_step_bytes, tokens_per_slot
from bench.model_decode import V2_LITE_Q_LORA, step_bytes
from bench.provenance import provenance
from bench.serve_setup import ADAPTER_MODULES, draw_popularity
from inference_svc.model.config import parse_config
from inference_svc.model.loader import build_model

# (adapters, popularity) as bench.serve_offline names its scenarios.
SCENARIOS = ((8, "zipf"), (8, "uniform"), (32, "uniform"), (32, "zipf"), (1000, "zipf"))


@dataclass(frozen=True)
class FloorRow:
    modules: str  # a key of serve_setup.ADAPTER_MODULES
    adapters: int
    popularity: str
    distinct_per_batch: float  # mean distinct adapters in one decode batch
    floor_overhead: float  # mean LoRA bytes ÷ base bytes of such a batch


def decode_floor(
    shapes: dict[str, ModuleShape],
    base_bytes: float,
    rank: int,
    element_size: int,
    top_k: int,
    batch: int,
    adapters: int,
    popularity: str,
    draws: int,
) -> tuple[float, float]:
    """(mean distinct adapters, mean floor overhead) over `draws` decode batches of `batch`
    sequences whose adapters are drawn like the serving benchmark's requests."""
    distinct, overheads = [], []
    for seed in range(draws):
        counts = tokens_per_slot(draw_popularity(adapters, popularity, batch, seed))
        lora = lora_step_bytes(shapes, rank, element_size, counts, top_k)
        distinct.append(len(counts))
        overheads.append(sum(lora.values()) / base_bytes)
    return statistics.fmean(distinct), statistics.fmean(overheads)


def run_ceiling(decode_share: float, floor_a: float, floor_b: float) -> float:
    """Throughput of run a ÷ run b, both at their decode floors, prefill alike."""
    prefill = 1.0 - decode_share
    return (prefill + decode_share * (1 + floor_b)) / (prefill + decode_share * (1 + floor_a))


def targeted_shapes(shapes: dict[str, ModuleShape], modules: str) -> dict[str, ModuleShape]:
    """The shapes of the modules an adapter set of serve_setup.ADAPTER_MODULES targets."""
    names = ADAPTER_MODULES[modules]
    return dict(shapes) if names is None else {k: v for k, v in shapes.items() if k in names}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="JSON; the PNG goes beside it")
    parser.add_argument("--batch", type=int, default=128, help="decode batch (max_num_seqs)")
    parser.add_argument("--context", type=int, default=576, help="mean cached tokens")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--draws", type=int, default=200, help="decode batches per scenario")
    parser.add_argument(
        "--decode-share", type=float, default=0.7, help="decode's share of the no-LoRA run"
    )
    args = parser.parse_args(argv)

    config = parse_config(V2_LITE_Q_LORA)
    model = build_model(config, torch.device("meta"), torch.bfloat16)
    base = sum(step_bytes(model, args.batch, args.context).values())
    all_shapes = model_lora_shapes(V2_LITE_Q_LORA)
    rows = []
    for modules in ADAPTER_MODULES:
        shapes = targeted_shapes(all_shapes, modules)
        for adapters, popularity in SCENARIOS:
            distinct, floor = decode_floor(
                shapes, base, args.rank, 2, config.routing.top_k, args.batch, adapters,
                popularity, args.draws,
            )  # fmt: skip
            rows.append(FloorRow(modules, adapters, popularity, distinct, floor))
            print(
                f"{modules:>9}  N={adapters:<5} {popularity:<7} distinct {distinct:5.1f}  "
                f"decode floor overhead {floor:+.1%}"
            )

    floors = {(r.modules, r.adapters, r.popularity): r.floor_overhead for r in rows}
    share = args.decode_share
    ceilings = {}
    for modules in ADAPTER_MODULES:
        ceilings[modules] = {
            "n32_uniform_vs_no_lora": run_ceiling(share, floors[modules, 32, "uniform"], 0.0),
            "n1000_zipf_vs_n8_zipf": run_ceiling(
                share, floors[modules, 1000, "zipf"], floors[modules, 8, "zipf"]
            ),
        }
        print(f"{modules:>9}  run ceilings (decode share {share}): {ceilings[modules]}")
    meta = {
        **vars(args),
        "out": str(args.out),
        **provenance("serve_floor", argv, "python"),
        "base_step_bytes": base,
        "ceilings": ceilings,
    }
    write_json(args.out, meta, [asdict(r) for r in rows])
    labels = [f"N={r.adapters} {r.popularity}" for r in rows if r.modules == "all"]
    series = {
        modules: [100 * r.floor_overhead for r in rows if r.modules == modules]
        for modules in ADAPTER_MODULES
    }
    title = f"Decode floor overhead, B={args.batch}, rank {args.rank} (V2-Lite q_lora 1536)"
    bar_plot(args.out.with_suffix(".png"), title, labels, series, "% over the base step's bytes")


if __name__ == "__main__":
    main()
