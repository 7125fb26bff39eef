"""Offline serving throughput with many adapters (issue 9), the engine in-process on the GPU.

Random-weight DeepSeek-V2-Lite shape with `q_lora_rank` 1536, bf16 (`bench.serve_setup`),
`--layers` decoder layers (27 = the whole model). Each scenario submits `--requests`
requests at once (input `--prompt-len` random tokens, exactly `--output-len` generated,
greedy) and runs the engine's step loop until all finish; throughput = generated tokens ÷
wall time from the first submission to the last token (prefill included: the engine
interleaves it with decodes). Scenarios: no LoRA, then N distinct adapters of rank
`--rank` on every module (MLA q_a/kv_a, q_b, kv_b, o, dense/shared MLP, routed experts
per expert) with uniform or zipf(1.1) popularity, N in {1, 8, 32, 128, 1000}. Every
scenario's adapters are new names, in the host cache but in no GPU slot at its start: more
names than slots cycle host cache → slots during the run (each slot load counted). With
`--resident` the scenario's most popular adapters, as many as there are slots, are loaded
into GPU slots before its clock starts, as in a server that has served them before: the
steady state without the start's slot copies (~0.6 GB each at rank 16 on every module).

Ratios, all from this one run (one engine, one process):
  throughput(N) ÷ throughput(no LoRA)           goal ≥ 0.90 at N=32, rank 16
  throughput(N=1000 zipf) ÷ throughput(N=8 zipf)  goal ≥ 0.95

Scenarios run in priority order (the goals' first) and the JSON is rewritten after each,
so `--time-budget` (skip what would not fit) or an outer `timeout` keeps what finished.
`--rounds K` runs them K times, round after round, and the ratios take each scenario's
median: a LoRA scenario's throughput has varied by up to 8 % from run to run (its eager
prefill steps are partly host-bound), no LoRA's by 0.2 %.

    python3 -m bench.serve_offline --out bench/results/serve_offline_r16.json --rank 16
    python -m bench.serve_offline --out /tmp/serve_offline.json --smoke   # CPU setup check
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.gpu_timing import device_name
from bench.host_profile import HostProfile
from bench.provenance import provenance
from bench.serve_setup import (
    AdapterLibrary,
    ServeBenchConfig,
    adapter_names,
    adapters_label,
    add_engine_args,
    build_engine,
    build_model,
    draw_popularity,
    host_bytes_note,
    make_request,
    model_label,
    save,
    synchronize,
)
from bench.step_profile import StepProfile
from inference_svc.engine.engine import LLMEngine
from inference_svc.engine.scheduler import PrefetchTicket
from inference_svc.engine.sequence import FinishReason
from kernels.launch import remembered_keys

GOAL_N32_VS_BASE = 0.90
GOAL_N1000_VS_N8 = 0.95


@dataclass(frozen=True)
class Scenario:
    adapters: int  # 0: no LoRA
    popularity: str = "uniform"

    @property
    def label(self) -> str:
        return "no LoRA" if self.adapters == 0 else f"N={self.adapters} {self.popularity}"


# Priority order: the two goals' scenarios first.
SCENARIOS = (
    Scenario(0),
    Scenario(32, "uniform"),
    Scenario(8, "zipf"),
    Scenario(1000, "zipf"),
    Scenario(8, "uniform"),
    Scenario(1, "uniform"),
    Scenario(32, "zipf"),
    Scenario(128, "uniform"),
    Scenario(128, "zipf"),
    Scenario(1000, "uniform"),
)


# Offline steps 0-7 admit 16 prompts each beside the earlier prompts' decodes; the first
# requests finish after ~128 decode-only steps (then later waves are admitted).
PROFILE_FROM = (4, 40)


def run_scenario(
    engine: LLMEngine,
    library: AdapterLibrary,
    config: ServeBenchConfig,
    scenario: Scenario,
    requests: int,
    tag: str,
    timeout_s: float,
    profile_steps: int = 0,
    profile_kind: str = "kernels",
    profile_from: tuple[int, int] = PROFILE_FROM,
    timeline: bool = False,
    resident: bool = False,
) -> dict[str, Any]:
    """Submit `requests` at once, step until all finish; one result row.

    profile_steps: K > 0 profiles steps [profile_from[0], +K) (by default prefill steps
    beside decodes) and [profile_from[1], +K) (decode-only) into the row's `profile`; the
    profiler's overhead is then inside the row's wall time. profile_kind: "kernels" (torch
    profiler, GPU time by kernel class) or "host" (cProfile, Python time by function).
    resident: the first names (the most popular), as many as there are slots, start in GPU
    slots (`make_resident`).
    """
    vocab = engine.runner.model.config.vocab_size
    names = adapter_names(tag, scenario.adapters)
    library.preload(engine, names)
    if resident:
        make_resident(engine, library, names[: engine.scheduler.slots.max_loras])
    picks = draw_popularity(max(1, scenario.adapters), scenario.popularity, requests, seed=7)
    seqs = [
        make_request(
            f"{tag}-{i}",
            config,
            vocab,
            seed=i,
            adapter=library.binding(names[pick]) if names else None,
        )
        for i, pick in enumerate(picks)
    ]
    slots = engine.scheduler.slots
    before = slots.metrics()
    compiled_before = triton_cache_entries()
    steps = 0
    # Wall time of the steps by kind: a step of at most max_num_seqs tokens holds decodes
    # only (every prompt chunk here is a whole prompt, longer than that). Each step ends in
    # the sampler's device→host copy, so its wall time is its GPU time.
    kinds = {"decode": [0, 0.0], "prefill": [0, 0.0]}
    complete = True
    windows = StepWindows(
        profile_steps, torch.device(config.device), config.max_num_seqs, profile_kind,
        profile_from,
    )  # fmt: skip
    synchronize(config)
    parts = StepParts(engine) if timeline else None
    start = time.perf_counter()
    for seq in seqs:
        engine.add_request(seq)
    entries: list[dict[str, Any]] = []
    while engine.has_work():
        began = time.perf_counter()
        loads_before = slots.metrics().loads if timeline else 0
        tokens = windows.step(engine, steps)
        if parts is not None:
            entry = timeline_entry(engine, began - start, began, tokens, loads_before)
            entries.append({**entry, **parts.take()})
        if tokens:
            steps += 1
            kind = kinds["decode" if tokens <= config.max_num_seqs else "prefill"]
            kind[0] += 1
            kind[1] += time.perf_counter() - began
        else:
            time.sleep(0.0005)  # adapters streaming into the host cache
        if time.perf_counter() - start > timeout_s:
            complete = False
            for seq in seqs:
                engine.abort(seq.request_id)
            break
    synchronize(config)
    seconds = time.perf_counter() - start
    if parts is not None:
        parts.close()
    after = slots.metrics()
    library.discard(engine, names)
    generated = sum(len(seq.output_token_ids) for seq in seqs)
    failed = sum(seq.finish_reason is FinishReason.ERROR for seq in seqs)
    return {
        "scenario": scenario.label,
        "rank": config.rank if scenario.adapters else 0,
        "adapters": scenario.adapters,
        "popularity": scenario.popularity if scenario.adapters else None,
        "distinct_used": len({names[p] for p in picks}) if names else 0,
        "requests": requests,
        "output_tokens": generated,
        "prompt_tokens": requests * config.prompt_len,
        "seconds": seconds,
        "output_tokens_per_s": generated / seconds,
        "total_tokens_per_s": (generated + requests * config.prompt_len) / seconds,
        "steps": steps,
        "kernels_compiled": len(compiled := triton_cache_entries() - compiled_before),
        "kernels_compiled_names": compiled_kernel_names(compiled),
        "decode_steps": kinds["decode"][0],
        "decode_step_seconds": kinds["decode"][1],
        "prefill_steps": kinds["prefill"][0],
        "prefill_step_seconds": kinds["prefill"][1],
        "slot_loads": after.loads - before.loads,
        "slot_evictions": after.evictions - before.evictions,
        "resident": resident,
        "complete": complete,
        "failed": failed,
        "valid": complete and failed == 0,
        **({"profile": windows.summaries()} if profile_steps else {}),
        **({"timeline": entries} if timeline else {}),
    }


def make_resident(engine: LLMEngine, library: AdapterLibrary, names: list[str]) -> None:
    """Load `names` from the host cache into GPU slots (unpinned, as LoadAdapter without
    pin does) and step the engine until every copy has landed."""
    tickets = [PrefetchTicket(library.binding(name), False, Future()) for name in names]
    for ticket in tickets:
        engine.prefetch(ticket)
    while not all(ticket.future.done() for ticket in tickets):
        if not engine.step():
            time.sleep(0.0005)
    for ticket in tickets:
        ticket.future.result()  # a failed load raises here, before anything is timed


def timeline_entry(
    engine: LLMEngine, at_s: float, began: float, tokens: int, loads_before: int
) -> dict[str, Any]:
    """One engine step call: when it began (s after the first submission), its wall time,
    the tokens it ran (0: nothing could run), and the state it left: running and waiting
    requests, slot copies in flight, slot loads it started, adapters among the running
    (`run_scenario` adds its `StepParts`)."""
    scheduler = engine.scheduler
    return {
        "at_s": at_s,
        "seconds": time.perf_counter() - began,
        "tokens": tokens,
        "running": scheduler.num_running,
        "waiting": scheduler.num_waiting,
        "loads_in_flight": scheduler.num_loads_in_flight,
        "loads_started": scheduler.slots.metrics().loads - loads_before,
        "adapters_running": len({seq.adapter_key for seq in scheduler.running} - {None}),
    }


class StepParts:
    """Splits each engine step call of a timeline: seconds in `_launch` (the host building
    and launching the step: its GPU work runs on) and in `_read_back` (waiting for the step
    before's tokens, then applying them). The launch is not host time alone: CUDA queues
    ~1020 launches ahead of the GPU and a launch past that waits for the GPU to take one
    (H200, bench/results/queue_depth_s41.py.txt), so a prompt step of ~1400 launches
    behind a busy GPU launches at the GPU's pace. A long launch followed by a read-back
    that waits on nothing is therefore either a slow host or a full queue; a kernel
    profile's GPU busy time against its wall time tells them apart."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._seconds = {"launch_s": 0.0, "read_back_s": 0.0}
        self._counts = allocator_counts()
        engine._launch = self._timed(engine._launch, "launch_s")  # type: ignore[method-assign]
        engine._read_back = self._timed(engine._read_back, "read_back_s")  # type: ignore[method-assign]

    def _timed(self, method: Any, key: str) -> Any:
        def run(*args: Any) -> Any:
            began = time.perf_counter()
            try:
                return method(*args)
            finally:
                self._seconds[key] += time.perf_counter() - began

        return run

    def take(self) -> dict[str, float]:
        """The seconds since the last take, by part, and the caching allocator's device
        allocations, frees and retries since then (a `cudaFree` waits for the device, so
        a step that makes one is no longer overlapped with the step before)."""
        taken, self._seconds = self._seconds, dict.fromkeys(self._seconds, 0.0)
        counts = allocator_counts()
        moved = {key: counts[key] - self._counts[key] for key in counts}
        self._counts = counts
        return {**taken, **moved}

    def close(self) -> None:
        """The engine's own methods again."""
        for name in ("_launch", "_read_back"):
            self._engine.__dict__.pop(name, None)


ALLOCATOR_COUNTS = {
    "device_allocs": "num_device_alloc",
    "device_frees": "num_device_free",
    "alloc_retries": "num_alloc_retries",
}


def allocator_counts() -> dict[str, int]:
    """The caching allocator's running counts of `ALLOCATOR_COUNTS` (zeros off CUDA)."""
    stats = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    return {name: int(stats.get(key, 0)) for name, key in ALLOCATOR_COUNTS.items()}


class StepWindows:
    """Profiles two windows of a scenario's steps (see `run_scenario`); each summary is
    labelled by the kind of step it held (prefill / decode / mixed kinds)."""

    def __init__(
        self,
        steps: int,
        device: torch.device,
        max_num_seqs: int,
        kind: str,
        starts: tuple[int, int] = PROFILE_FROM,
    ):
        self.steps, self.device, self.max_num_seqs = steps, device, max_num_seqs
        self.starts = starts if steps else ()
        self._recorder = {"kernels": StepProfile, "host": HostProfile}[kind]
        self._open: tuple[int, StepProfile | HostProfile, set[str]] | None = None
        self._done: dict[str, dict] = {}

    def step(self, engine: LLMEngine, index: int) -> int:
        """engine.step(), profiled when step `index` lies in a window."""
        if index in self.starts and self._open is None:
            self._open = (index, self._recorder(self.device).start(), set())
        if self._open is None:
            return engine.step()
        first, recorder, kinds = self._open
        tokens = engine.step()
        kinds.add("decode" if tokens <= self.max_num_seqs else "prefill")
        if index + 1 - first == self.steps or not engine.has_work():
            recorder.stop()
            label = "+".join(sorted(kinds))
            self._done[label] = {"steps": index + 1 - first, **recorder.summary(index + 1 - first)}
            self._open = None
        return tokens

    def summaries(self) -> dict[str, dict]:
        return self._done


def triton_cache_entries() -> set[str]:
    """Entry folders of Triton's on-disk cache (one per compiled kernel variant): a
    scenario that adds some compiled them while timed."""
    folder = _triton_cache_folder()
    return {entry.name for entry in folder.iterdir()} if folder.is_dir() else set()


def compiled_kernel_names(entries: set[str]) -> list[str]:
    """The kernels compiled into cache `entries` (from each entry's metadata file), so a
    stall can be traced to the kernel it compiled."""
    folder = _triton_cache_folder()
    names = []
    for entry in entries:
        metadata = (folder / entry).glob("*.json")
        found = [path.stem for path in metadata if not path.name.startswith("__grp__")]
        names.append(found[0] if found else "?")
    return sorted(names)


def _triton_cache_folder() -> Path:
    return Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))


def ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Every LoRA scenario ÷ no LoRA, and the two goal ratios when their rows are valid;
    with several rounds, of each scenario's median throughput over its valid rows."""
    runs: dict[str, list[float]] = {}
    for row in rows:
        if row["valid"]:
            runs.setdefault(row["scenario"], []).append(row["output_tokens_per_s"])
    by_label = {label: statistics.median(values) for label, values in runs.items()}

    def ratio(top: str, bottom: str) -> float | None:
        if top in by_label and bottom in by_label:
            return by_label[top] / by_label[bottom]
        return None

    out: dict[str, Any] = {
        "vs_no_lora": {label: ratio(label, "no LoRA") for label in by_label if label != "no LoRA"},
        "n32_uniform_vs_no_lora": ratio("N=32 uniform", "no LoRA"),
        "n32_zipf_vs_no_lora": ratio("N=32 zipf", "no LoRA"),
        "n1000_zipf_vs_n8_zipf": ratio("N=1000 zipf", "N=8 zipf"),
        "n1000_zipf_vs_n8_uniform": ratio("N=1000 zipf", "N=8 uniform"),
        "goals": {"n32_vs_no_lora": GOAL_N32_VS_BASE, "n1000_zipf_vs_n8": GOAL_N1000_VS_N8},
        "tokens_per_s_range": {label: [min(v), max(v)] for label, v in runs.items()},
    }
    return out


def warm_up(
    engine: LLMEngine, library: AdapterLibrary, config: ServeBenchConfig, requests: int
) -> None:
    """Compile every kernel shape the scenarios use before anything is timed: whole
    scenarios (no LoRA, then two adapters) of `requests` requests at the full output
    length, so that the mixed prefill + decode steps, whose token counts vary step by step,
    are covered too. Triton compiles a kernel again for integer arguments of another
    divisibility class; a warm-up of short requests (prefill-only steps) left the first
    timed scenario's prefill steps 3× slower (H100, 2026-11-24: 11.8 s instead of 3.4 s)."""
    for scenario in (Scenario(0), Scenario(2)):
        run_scenario(engine, library, config, scenario, requests, f"warm{scenario.adapters}", 600)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in results["rows"] if row["valid"]]
    if not rows:
        return
    base = next((r["output_tokens_per_s"] for r in rows if r["adapters"] == 0), None)
    fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(rows)), 4.5))
    labels = [row["scenario"] for row in rows]
    values = [row["output_tokens_per_s"] for row in rows]
    bars = ax.bar(labels, values, color=["C7" if r["adapters"] == 0 else "C0" for r in rows])
    if base:
        for bar, value in zip(bars, values, strict=True):
            ax.annotate(f"{value / base:.2f}", (bar.get_x() + bar.get_width() / 2, value),
                        ha="center", va="bottom", fontsize=8)  # fmt: skip
        ax.axhline(GOAL_N32_VS_BASE * base, color="red", linestyle="--", label="0.90 × no LoRA")
        ax.legend()
    meta = results["meta"]
    ax.set_ylabel("generated tokens/s")
    ax.set_title(
        f"offline serving, rank {meta['rank']}, {meta['layers']} layers, "
        f"in {meta['prompt_len']} / out {meta['output_len']}, {meta['device']}",
        fontsize=9,
    )
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_engine_args(parser)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument(
        "--scenarios",
        nargs="+",
        choices=[s.label for s in SCENARIOS],
        help="labels to run, in this order, e.g. 'N=8 zipf' 'no LoRA'",
    )
    parser.add_argument("--time-budget", type=float, default=0, help="s; 0: no budget")
    parser.add_argument("--scenario-timeout", type=float, default=300)
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="K: profile K prefill and K decode steps per scenario (kernel classes, GPU "
        "busy vs wall); the profiler's overhead lands in that scenario's throughput",
    )
    parser.add_argument(
        "--profile-from",
        type=int,
        nargs=2,
        default=list(PROFILE_FROM),
        metavar=("FIRST", "SECOND"),
        help="the steps the two profile windows start at (default: a prefill window beside "
        "decodes, then a decode-only one)",
    )
    parser.add_argument(
        "--profile-kind",
        choices=["kernels", "host"],
        default="kernels",
        help="kernels: torch profiler (GPU time by kernel class); host: cProfile (Python "
        "time per function, the launches included)",
    )
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="each row lists every engine step call (time, tokens, queue, slot copies, and "
        "the seconds it spent launching its step and reading back the one before)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the scenarios this many times, round after round (fresh adapter names each "
        "time); the ratios take each scenario's median",
    )
    parser.add_argument(
        "--resident",
        action="store_true",
        help="each scenario's most popular adapters (as many as there are slots) start in GPU "
        "slots: steady-state throughput without the start's slot copies",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")

    config = ServeBenchConfig.from_args(args, smoke_max_batch_tokens=64, smoke_max_loras=2)
    requests = 6 if args.smoke else args.requests
    # Named scenarios run in the order given (e.g. the no-LoRA baseline after a warm one).
    by_label = {s.label: s for s in SCENARIOS}
    scenarios = [by_label[label] for label in args.scenarios] if args.scenarios else SCENARIOS
    if args.smoke:  # N > slots still cycles host cache → slots, at tiny sizes
        scenarios = [Scenario(0), Scenario(8, "zipf"), Scenario(2, "uniform")]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.adapter_dir or Path(tmp)
        model = build_model(config)
        library = AdapterLibrary(folder / f"rank{config.rank}", config)
        engine = build_engine(model, config, library)
        setup_s = time.perf_counter() - started
        warm_up(engine, library, config, requests)
        pool = engine.scheduler.residency.pool
        results: dict[str, Any] = {
            "meta": {
                "benchmark": "serve_offline",
                **provenance("serve_offline", argv),
                "device": device_name(torch.device(config.device)),
                "model": model_label(config),
                "experts": config.experts,
                "adapter_modules": adapters_label(config),
                "moe_lora_in_gemm": config.moe_lora_in_gemm,
                "overlap_steps": config.overlap_steps,
                "breadth_first_admission": config.breadth_first_admission,
                "resident": args.resident,
                "rounds": args.rounds,
                "layers": config.layers,
                "full_model": config.layers == 27,
                "dtype": config.dtype,
                "rank": config.rank,
                "gpu_slots": pool.num_slots,
                "slot_bytes": pool.bytes_per_slot,
                "adapter_bytes": library.adapter_bytes,
                "adapters_note": host_bytes_note(library),
                "prompt_len": config.prompt_len,
                "output_len": config.output_len,
                "requests": requests,
                "max_num_seqs": config.max_num_seqs,
                "max_batch_tokens": config.max_batch_tokens,
                "setup_and_capture_s": setup_s,
                "warm_up_s": time.perf_counter() - started - setup_s,
            },
            "rows": [],
            "skipped": [],
        }
        print(
            f"rank {config.rank}: {pool.num_slots} GPU slots, adapter "
            f"{library.adapter_bytes / 1e6:.0f} MB, {config.layers} layers, setup "
            f"{setup_s:.0f} s"
        )
        longest = 0.0
        rounds = [(r, i, s) for r in range(args.rounds) for i, s in enumerate(scenarios)]
        for round_index, index, scenario in rounds:
            elapsed = time.perf_counter() - started
            if args.time_budget and elapsed + 1.2 * longest > args.time_budget:
                results["skipped"].append(scenario.label)
                print(f"{scenario.label:18s} skipped: time budget ({elapsed:.0f} s used)")
                continue
            row = run_scenario(
                engine,
                library,
                config,
                scenario,
                requests,
                f"r{round_index}s{index}",
                args.scenario_timeout,
                args.profile_steps,
                args.profile_kind,
                tuple(args.profile_from),
                args.timeline,
                args.resident,
            )
            longest = max(longest, row["seconds"])
            row["round"] = round_index
            results["rows"].append(row)
            results["ratios"] = ratios(results["rows"])
            results["meta"]["seconds"] = time.perf_counter() - started
            save(args.out, results)
            base = results["ratios"]["vs_no_lora"].get(scenario.label)
            print(
                (f"[{round_index}] " if args.rounds > 1 else "")
                + f"{scenario.label:18s} {row['output_tokens_per_s']:9.0f} tok/s  "
                f"{row['seconds']:6.1f} s  slot loads {row['slot_loads']:4d}  "
                f"prefill steps {row['prefill_steps']} {row['prefill_step_seconds']:5.1f} s, "
                f"decode steps {row['decode_steps']} {row['decode_step_seconds']:5.1f} s  "
                f"compiled {row['kernels_compiled']}  "
                + (f"÷ no LoRA {base:.3f}" if base else "")
                + ("" if row["valid"] else "  INVALID (timed out or failed requests)")
            )
    results["meta"]["launch_keys"] = remembered_keys()
    save(args.out, results)
    plot(results, args.out.with_suffix(".png"))
    most = sorted(results["meta"]["launch_keys"].items(), key=lambda kv: -kv[1])[:4]
    print("remembered launch keys, most:", ", ".join(f"{k} {n}" for k, n in most))
    r = results.get("ratios", {})
    print(f"N=32 uniform ÷ no LoRA: {r.get('n32_uniform_vs_no_lora')} (goal ≥ {GOAL_N32_VS_BASE})")
    print(f"N=1000 zipf ÷ N=8 zipf: {r.get('n1000_zipf_vs_n8_zipf')} (goal ≥ {GOAL_N1000_VS_N8})")


if __name__ == "__main__":
    main()
