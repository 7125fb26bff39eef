"""Every performance target of TARGETS.md / issue 9 beside what a results folder measured.

Reads the JSON files `bench/run_all.sh` writes (and the CPU machine's cold-path file) and
prints one table: target, goal, measured, met. A benchmark that did not run shows
"not run"; nothing is filled in from elsewhere.

    python3 -m bench.summary bench/results/latest [--cold docs/bench/serve_cold_path.json]
        [--floor bench/results/serve_floor_cpu.json] [--queued docs/bench/queued_cold_adapter.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# TARGETS.md: (rank, tokens, adapters) -> (shrink µs, expand µs) goals.
SGMV_TARGETS = {
    (16, 1, 1): (4, 2),
    (16, 64, 32): (4, 4),
    (16, 256, 64): (7, 8),
    (64, 64, 32): (10, 11),
    (64, 256, 64): (20, 23),
}


@dataclass(frozen=True)
class Line:
    target: str
    goal: str
    measured: str
    met: bool | None  # None: not measured

    @property
    def verdict(self) -> str:
        return {True: "yes", False: "NO", None: "-"}[self.met]


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _missing(target: str, goal: str, why: str = "not run") -> Line:
    return Line(target, goal, why, None)


def _at_most(target: str, goal: float, value: float | None, unit: str = "") -> Line:
    if value is None:
        return _missing(target, f"≤ {goal:g}{unit}", "not measured")
    return Line(target, f"≤ {goal:g}{unit}", f"{value:.3g}{unit}", value <= goal)


def _at_least(target: str, goal: float, value: float | None) -> Line:
    if value is None:
        return _missing(target, f"≥ {goal:g}", "not measured")
    return Line(target, f"≥ {goal:g}", f"{value:.3f}", value >= goal)


def sgmv_lines(results: Path) -> Iterator[Line]:
    data = _load(results / "lora_kernels.json")
    for (rank, tokens, adapters), goals in SGMV_TARGETS.items():
        for kernel, goal in zip(("shrink", "expand"), goals, strict=True):
            name = f"SGMV {kernel} r{rank} B{tokens} N{adapters} (µs, best Triton variant)"
            if data is None:
                yield _missing(name, f"≤ {goal}")
                continue
            times = [
                row["us"]
                for row in data["rows"]
                if row["kernel"] == f"sgmv_{kernel}"
                and row.get("model") == "v3"
                and (row["rank"], row["tokens"], row["adapters"]) == (rank, tokens, adapters)
                and row["provider"].startswith("triton")
            ]
            yield _at_most(name, goal, min(times) if times else None)


# Decode-step results: file stem -> the routed experts' weights.
DECODE_RUNS = {
    "model_decode": "bf16",
    "model_decode_fp8": "FP8 experts",
    "model_decode_fp8_a8": "FP8 experts, e4m3 activations",
}


def decode_lines(results: Path) -> Iterator[Line]:
    for stem, label in DECODE_RUNS.items():
        data = _load(results / f"{stem}.json")
        for batch in (1, 64, 256):
            name = f"decode step ÷ floor, B={batch} (no LoRA, {label})"
            if data is None:
                yield _missing(name, "≤ 1.5")
                continue
            ratio = next((r["ratio"] for r in data["rows"] if r["batch"] == batch), None)
            yield _at_most(name, 1.5, ratio)
    data = _load(results / "lora_decode_overhead.json")
    # The defaults' kernel set ("new"), or the first one timed.
    variants = data["variants"] if data else {}
    measured = variants.get("new") or next(iter(variants.values()), None)
    name = "MoE LoRA cost ÷ base fused MoE, B=64, 8 adapters"
    if measured is None:
        yield _missing(name, "≤ 0.25")
    else:
        yield _at_most(name, 0.25, measured["moe"]["ratio"])
    layers = f" [{data['layers']} layers]" if data else ""
    rows = measured["decode"] if measured else []
    for batch in (1, 64, 256):
        row = next((r for r in rows if r["batch"] == batch), None)
        name = f"decode tok/s with {row['adapters'] if row else 32} r16 adapters ÷ no LoRA, "
        name += f"B={batch}{layers}"
        if row is None:
            yield _missing(name, "≥ 0.9")
            continue
        yield _at_least(name, 0.90, row["base_us"] / row["lora_us"])
        if "floor_overhead" in row:  # the ceiling its LoRA bytes allow (bench/lora_floor.py)
            ceiling = 1 / (1 + row["floor_overhead"])
            yield Line(f"  ceiling from the LoRA bytes, B={batch}", "-", f"{ceiling:.3f}", None)
        # Issue 9's decode step ÷ floor counts the batch's adapters' bytes in the floor.
        name = f"decode step ÷ floor, B={batch} ({row['adapters']} r16 adapters{layers})"
        yield _at_most(name, 1.5, row.get("lora_step_over_floor"))


def slot_load_lines(results: Path) -> Iterator[Line]:
    data = _load(results / "lora_slot_load.json")
    if data is None:
        yield _missing("host → GPU slot load, rank 16 (ms)", "≤ 5")
        return
    for row in data["rows"]:
        if row["pool_rank"] == 16:
            name = f"host → GPU slot load, r16, {row['scenario']} (ms)"
            yield _at_most(name, 5.0, row["load_ms_median"])


# Offline serving results run_all.sh writes: file stem -> what varies from the main run.
OFFLINE_RUNS = {
    "serve_offline_r16": "rank 16",
    "serve_offline_r64": "rank 64",
    "serve_offline_fp8": "rank 16, FP8 experts",
    "serve_offline_fp8_a8": "rank 16, FP8 experts, e4m3 activations",
    "serve_offline_noroute": "rank 16, adapters off the routed experts",
    "serve_offline_resident": "rank 16, adapters in GPU slots at the start",
}
# The CPU machine's queued-request probe (bench/queued_cold_adapter.py).
QUEUED_FILE = Path("docs/bench/queued_cold_adapter.json")
# Cold-adapter probes: file stem -> the load they ran under.
COLD_RUNS = {"serve_online": "under load", "serve_cold_idle": "idle engine"}


def serving_lines(results: Path, floor_file: Path) -> Iterator[Line]:
    for stem, label in OFFLINE_RUNS.items():
        data = _load(results / f"{stem}.json")
        name = f"offline tok/s N=32 uniform ÷ no LoRA, {label}"
        name_1000 = f"offline tok/s N=1000 zipf ÷ N=8 zipf, {label}"
        if data is None or "ratios" not in data:
            yield _missing(name, "≥ 0.9")
            yield _missing(name_1000, "≥ 0.95")
            continue
        layers = "" if data["meta"]["full_model"] else f" [{data['meta']['layers']} layers]"
        yield _at_least(name + layers, 0.90, data["ratios"]["n32_uniform_vs_no_lora"])
        yield _at_least(name_1000 + layers, 0.95, data["ratios"]["n1000_zipf_vs_n8_zipf"])
    yield from serving_ceiling_lines(floor_file)
    for stem, label in COLD_RUNS.items():
        data = _load(results / f"{stem}.json")
        for kind in ("host-cold", "file-cold"):
            name = f"TTFT added by a {kind} adapter, p50, {label} (ms)"
            if data is None or "cold" not in data:
                yield _missing(name, "≤ 100")
                continue
            yield _at_most(name, 100.0, data["cold"]["ttft_added"][kind]["p50_ms"])


def serving_ceiling_lines(floor_file: Path) -> Iterator[Line]:
    """The serving ratios' ceilings from the LoRA bytes (bench/serve_floor.py, CPU counts),
    per adapter target set: what no kernel work can exceed."""
    floor = _load(floor_file)
    if floor is None:
        yield _missing("  ceilings of the serving ratios from the LoRA bytes", "-")
        return
    names = {
        "n32_uniform_vs_no_lora": "N=32 uniform ÷ no LoRA",
        "n1000_zipf_vs_n8_zipf": "N=1000 zipf ÷ N=8 zipf",
    }
    rank = floor["meta"]["rank"]
    for modules, ceilings in floor["meta"]["ceilings"].items():
        for key, name in names.items():
            label = f"  ceiling from the LoRA bytes, {name}, rank {rank}, adapters on {modules}"
            yield Line(label, "-", f"{ceilings[key]:.3f}", None)


def cold_path_lines(cold_file: Path, results: Path) -> Iterator[Line]:
    """S3 → host (CPU machine) and the whole cold TTFT it implies with the GPU's host-cold
    figure: both measured, on different machines, so the sum is an estimate."""
    cold = _load(cold_file)
    online = _load(results / "serve_online.json")
    if cold is None:
        yield _missing("S3 → host of a rank-16 V2-Lite adapter, p50 (ms)", "-")
        return
    for source, stats in cold["stats"].items():
        yield Line(
            f"{source} → host p50 / p99 (ms, CPU machine)",
            "-",
            f"{stats['p50_ms']:.0f} / {stats['p99_ms']:.0f}",
            None,
        )
    if online and "cold" in online:
        # The replica's path (parts verified as they arrive); "… whole" is a record from
        # before part digests, measured beside it.
        s3 = min(
            s["p50_ms"]
            for name, s in cold["stats"].items()
            if name.startswith("s3") and not name.endswith(" whole")
        )
        added = s3 + online["cold"]["ttft_added"]["host-cold"]["p50_ms"]
        yield _at_most("TTFT added by a cold adapter from S3, p50 estimate (ms)", 100.0, added)


def queued_lines(queued_file: Path) -> Iterator[Line]:
    """A request queued behind a full batch whose adapter is cold in S3 (CPU machine,
    bench/queued_cold_adapter.py): its wait once its seat frees, with the scheduler's
    look-ahead downloading the adapter while it queues."""
    queued = _load(queued_file)
    name = "TTFT added by an S3-cold adapter to a queued request, after its seat, p50 (ms)"
    if queued is None:
        yield _missing(name, "≤ 100")
        return
    yield _at_most(name, 100.0, queued["stats"]["look-ahead after_seat_s"]["p50_ms"])


def lines(
    results: Path, cold_file: Path, floor_file: Path, queued_file: Path = QUEUED_FILE
) -> list[Line]:
    return [
        *sgmv_lines(results),
        *decode_lines(results),
        *slot_load_lines(results),
        *serving_lines(results, floor_file),
        *cold_path_lines(cold_file, results),
        *queued_lines(queued_file),
    ]


def render(rows: list[Line]) -> str:
    width = max(len(r.target) for r in rows)
    out = [f"{'target':{width}s}  {'goal':>8s}  {'measured':>12s}  met"]
    out += [f"{r.target:{width}s}  {r.goal:>8s}  {r.measured:>12s}  {r.verdict}" for r in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, nargs="?", default=Path("bench/results/latest"))
    parser.add_argument("--cold", type=Path, default=Path("docs/bench/serve_cold_path.json"))
    parser.add_argument("--floor", type=Path, default=Path("bench/results/serve_floor_cpu.json"))
    parser.add_argument("--queued", type=Path, default=QUEUED_FILE)
    args = parser.parse_args(argv)
    print(render(lines(args.results, args.cold, args.floor, args.queued)))


if __name__ == "__main__":
    main()
