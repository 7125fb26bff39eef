"""Online serving latency (issue 9): Poisson arrivals at fixed rates, the engine in-process
on its own thread (`EngineLoop`, as the service runs it), on the GPU.

Same model and requests as `bench.serve_offline` (random V2-Lite shape with `q_lora_rank`
1536, bf16; input `--prompt-len` random tokens, `--output-len` generated, greedy). For each
rate in `--rates` (requests/s) two runs of `--duration` s: every request on the base model,
and every request on one of `--adapters` rank-`--rank` adapters (uniform), already in GPU
slots (loaded and pinned through the LoadAdapter path first). Reported: time to first token
(from the request's arrival) and inter-token latency (gaps between a request's consecutive
tokens), p50/p99, and the generated tokens/s achieved. With `--cycling-adapters N` each
rate gets a third run: every request on one of N adapters drawn zipf(1.1), all in the host
cache and none in a GPU slot at the start, so with more of them than the slots the pinned
ones leave they cycle host cache → slots (slot copies, evictions and the scheduler's
breadth-first admission under load; `--no-breadth-first-admission` for its A/B).

Cold adapters: a run at `--cold-rate` with the adapter background load (0: none, the probes
alone on an idle engine, which isolates what the adapter's load adds from queueing), into
which probe requests are injected every `--probe-interval` s, cycling three kinds:
  warm       its adapter is in a GPU slot;
  host-cold  its adapter is in the host cache but in no slot (host → GPU slot load);
  file-cold  its adapter is in neither: read from local canonical files (read + parse +
             pinned copy; the S3 download and its sha256 check are timed on the CPU machine
             by `bench.serve_cold_path`), then loaded into a slot.
TTFT added by a cold adapter = p50 (p99) of its kind − p50 (p99) of warm. Goal ≤ 100 ms.

    python3 -m bench.serve_online --out bench/results/serve_online.json
    python3 -m bench.serve_online --out … --rates --cold-rate 0   # cold probes only, idle
    python -m bench.serve_online --out /tmp/serve_online.json --smoke   # CPU setup check
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.gpu_timing import device_name
from bench.provenance import provenance
from bench.serve_offline import compiled_kernel_names, triton_cache_entries, warm_up
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
    percentiles_ms,
    save,
)
from inference_svc.engine.engine import LLMEngine
from inference_svc.engine.engine_loop import EngineLoop
from inference_svc.engine.scheduler import PrefetchTicket
from inference_svc.engine.sequence import AdapterBinding, SequenceOutput

GOAL_COLD_TTFT_ADDED_MS = 100.0
COLD_KINDS = ("warm", "host-cold", "file-cold")


@dataclass
class Arrival:
    at_s: float  # after the run's start
    kind: str  # "base", "lora" or one of COLD_KINDS
    adapter: AdapterBinding | None


@dataclass
class Trace:
    """One request's timeline, filled by the engine thread through `sink`."""

    kind: str
    sent_s: float  # its Poisson arrival time (monotonic), even if the driver ran late
    token_s: list[float] = field(default_factory=list)
    finished: bool = False
    failed: bool = False

    def sink(self, output: SequenceOutput) -> None:
        now = time.monotonic()
        self.token_s.extend([now] * len(output.token_ids))
        if output.finish_reason is not None:
            self.failed = output.error is not None
            self.finished = True

    @property
    def ttft_s(self) -> float | None:
        return self.token_s[0] - self.sent_s if self.token_s else None

    @property
    def gaps_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_s, self.token_s[1:], strict=False)]


# A step at least this long is logged with the kernels compiled so far (a listing of
# Triton's cache: too slow to take after every step).
SLOW_STEP_S = 0.1


class StepTimeline:
    """Wraps `engine.step` (on the engine thread): every step's tokens and wall time, and
    for slow ones which kernels Triton had compiled since the last slow one — separating
    compile stalls from queueing when a latency is far above the step times."""

    def __init__(self, engine: LLMEngine) -> None:
        self._step = engine.step
        self.steps: list[tuple[float, int, float]] = []  # (start, tokens, seconds)
        self.slow: list[dict[str, Any]] = []
        self._compiled = triton_cache_entries()
        engine.step = self._timed_step  # type: ignore[method-assign]

    def _timed_step(self) -> int:
        began = time.monotonic()
        tokens = self._step()
        seconds = time.monotonic() - began
        self.steps.append((began, tokens, seconds))
        if seconds >= SLOW_STEP_S:
            compiled = triton_cache_entries()
            new = compiled_kernel_names(compiled - self._compiled)  # reads new entries only
            self.slow.append(
                {"tokens": tokens, "seconds": seconds, "compiled": len(new), "kernels": new}
            )
            self._compiled = compiled
        return tokens

    def summary(self, since: float) -> dict[str, Any]:
        """Steps that started at or after `since` (monotonic), and the slow ones logged."""
        steps = [(t, n, dt) for t, n, dt in self.steps if t >= since and n]
        slow, self.slow = self.slow, []
        return {
            "steps": len(steps),
            "step_ms": percentiles_ms([dt for _, _, dt in steps]),
            "slow_steps": slow,
            "kernels_compiled": sum(int(row["compiled"]) for row in slow),
        }


def poisson_times(rate: float, duration_s: float, seed: int) -> list[float]:
    """Arrival times of a Poisson process at `rate` per s (none at rate 0)."""
    if rate <= 0:
        return []
    rng = random.Random(seed)
    times, t = [], rng.expovariate(rate)
    while t < duration_s:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def drive(
    loop: EngineLoop,
    engine: LLMEngine,
    config: ServeBenchConfig,
    arrivals: list[Arrival],
    tag: str,
    drain_timeout_s: float,
) -> tuple[list[Trace], float]:
    """Submit each arrival at its time; wait for all to finish. Returns the traces and the
    seconds from the first arrival to the last token."""
    vocab = engine.runner.model.config.vocab_size
    traces = []
    start = time.monotonic()
    for i, arrival in enumerate(sorted(arrivals, key=lambda a: a.at_s)):
        delay = start + arrival.at_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        trace = Trace(arrival.kind, start + arrival.at_s)
        seq = make_request(f"{tag}-{i}", config, vocab, i, arrival.adapter, trace.sink)
        loop.call(lambda seq=seq: engine.add_request(seq))
        traces.append(trace)
    deadline = time.monotonic() + drain_timeout_s
    while not all(t.finished for t in traces) and time.monotonic() < deadline:
        time.sleep(0.01)
    for i, trace in enumerate(traces):
        if not trace.finished:
            loop.call(lambda rid=f"{tag}-{i}": engine.abort(rid)).result()
    last = max((t.token_s[-1] for t in traces if t.token_s), default=start)
    first = min((t.sent_s for t in traces), default=start)
    return traces, last - first


def summarize(traces: list[Trace], seconds: float) -> dict[str, Any]:
    done = [t for t in traces if t.finished and not t.failed and t.token_s]
    return {
        "requests": len(traces),
        "completed": len(done),
        "failed": sum(t.failed for t in traces),
        "unfinished": sum(not t.finished for t in traces),
        "ttft": percentiles_ms([t.ttft_s for t in done if t.ttft_s is not None]),
        "itl": percentiles_ms([gap for t in done for gap in t.gaps_s]),
        "output_tokens_per_s": sum(len(t.token_s) for t in done) / seconds if seconds else 0.0,
    }


def load_into_slots(loop: EngineLoop, engine: LLMEngine, adapters: list[AdapterBinding]) -> None:
    """LoadAdapter with pin: each adapter in a GPU slot before the runs start."""
    futures: list[Future] = []
    for adapter in adapters:
        ticket = PrefetchTicket(adapter, pin=True, future=Future())
        loop.call(lambda t=ticket: engine.prefetch(t)).result()
        futures.append(ticket.future)
    for future in futures:
        future.result(timeout=600)


def slot_loads(loop: EngineLoop, engine: LLMEngine) -> int:
    """Slot copies started since the engine began (read on the engine's thread)."""
    return loop.call(lambda: engine.scheduler.slots.metrics().loads).result()


def rate_arrivals(
    mode: str, times: list[float], warm: list[AdapterBinding], cycling: list[AdapterBinding]
) -> list[Arrival]:
    """One run's arrivals at `times`: "base" on the base model, "lora" on the pinned `warm`
    adapters (uniform), "cycling" on the `cycling` ones (zipf(1.1), none in a slot yet)."""
    if mode == "cycling":
        picks = draw_popularity(len(cycling), "zipf", len(times), seed=5)
        return [Arrival(t, mode, cycling[pick]) for t, pick in zip(times, picks, strict=True)]
    rng = random.Random(5)
    return [Arrival(t, mode, rng.choice(warm) if mode == "lora" else None) for t in times]


def cold_arrivals(
    rate: float,
    probes_per_kind: int,
    interval_s: float,
    warm: list[AdapterBinding],
    host_cold: list[AdapterBinding],
    file_cold: list[AdapterBinding],
) -> list[Arrival]:
    """Adapter background load at `rate` plus probes every `interval_s`, kinds in turn."""
    duration = interval_s * (len(COLD_KINDS) * probes_per_kind + 1)
    rng = random.Random(3)
    arrivals = [
        Arrival(t, "lora", rng.choice(warm)) for t in poisson_times(rate, duration, seed=11)
    ]
    fresh = {"host-cold": iter(host_cold), "file-cold": iter(file_cold)}
    for i in range(len(COLD_KINDS) * probes_per_kind):
        kind = COLD_KINDS[i % len(COLD_KINDS)]
        adapter = rng.choice(warm) if kind == "warm" else next(fresh[kind])
        arrivals.append(Arrival(interval_s * (i + 1), kind, adapter))
    return arrivals


def cold_summary(traces: list[Trace]) -> dict[str, Any]:
    by_kind = {
        kind: percentiles_ms([t.ttft_s for t in traces if t.kind == kind and t.ttft_s])
        for kind in COLD_KINDS
    }
    warm = by_kind["warm"]
    added = {
        kind: {
            "p50_ms": by_kind[kind]["p50_ms"] - warm["p50_ms"],
            "p99_ms": by_kind[kind]["p99_ms"] - warm["p99_ms"],
        }
        for kind in ("host-cold", "file-cold")
    }
    failed = sum(t.failed or not t.finished for t in traces if t.kind in COLD_KINDS)
    return {"ttft": by_kind, "ttft_added": added, "probes_failed": failed,
            "goal_added_p50_ms": GOAL_COLD_TTFT_ADDED_MS}  # fmt: skip


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    fig, (ax_ttft, ax_itl, ax_cold) = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, metric in ((ax_ttft, "ttft"), (ax_itl, "itl")):
        for mode, color in (("base", "C7"), ("lora", "C0"), ("cycling", "C1")):
            rows = [r for r in runs if r["mode"] == mode]
            if not rows:
                continue
            rates = [r["rate"] for r in rows]
            ax.plot(rates, [r[metric]["p50_ms"] for r in rows], "o-", color=color,
                    label=f"{mode} p50")  # fmt: skip
            ax.plot(rates, [r[metric]["p99_ms"] for r in rows], "s--", color=color,
                    label=f"{mode} p99")  # fmt: skip
        ax.set(xlabel="requests/s", ylabel="ms", title=metric.upper())
        ax.legend(fontsize=8)
    cold = results.get("cold")
    if cold:
        kinds = list(cold["ttft"])
        xs = range(len(kinds))
        ax_cold.bar([x - 0.2 for x in xs], [cold["ttft"][k]["p50_ms"] for k in kinds], 0.4,
                    label="p50")  # fmt: skip
        ax_cold.bar([x + 0.2 for x in xs], [cold["ttft"][k]["p99_ms"] for k in kinds], 0.4,
                    label="p99")  # fmt: skip
        warm = cold["ttft"]["warm"]["p50_ms"]
        ax_cold.axhline(warm + GOAL_COLD_TTFT_ADDED_MS, color="red", linestyle="--",
                        label="warm p50 + 100 ms")  # fmt: skip
        ax_cold.set(xticks=list(xs), xticklabels=kinds, ylabel="TTFT ms")
        load = f"at {cold['rate']:g} req/s" if cold["rate"] > 0 else "on an idle engine"
        ax_cold.set_title(f"cold adapters {load}", fontsize=9)
        ax_cold.legend(fontsize=8)
    meta = results["meta"]
    fig.suptitle(
        f"online serving, rank {meta['rank']}, {meta['adapters']} adapters, {meta['layers']} "
        f"layers, in {meta['prompt_len']} / out {meta['output_len']}, {meta['device']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_engine_args(parser)
    parser.add_argument("--adapters", type=int, default=32, help="warm adapters of the LoRA runs")
    parser.add_argument(
        "--rates", type=float, nargs="*", default=[4.0, 16.0], help="none: cold probes only"
    )
    parser.add_argument(
        "--duration", type=float, help="s of arrivals per run (default 20; 1 with --smoke)"
    )
    parser.add_argument(
        "--cold-rate",
        type=float,
        default=4.0,
        help="req/s of background load during the cold probes (0: probes on an idle engine)",
    )
    parser.add_argument("--probes", type=int, default=8, help="cold probes of each kind")
    parser.add_argument("--probe-interval", type=float, default=1.0)
    parser.add_argument(
        "--cold-passes",
        type=int,
        default=1,
        help="cold runs in a row, each with new cold adapters; `cold` is the last one's",
    )
    parser.add_argument("--drain-timeout", type=float, default=120.0)
    parser.add_argument(
        "--cycling-adapters",
        type=int,
        default=0,
        help="a third run per rate over this many zipf(1.1) adapters, none in a slot at the "
        "start (0: no such run)",
    )
    args = parser.parse_args(argv)
    if args.duration is None:
        args.duration = 1.0 if args.smoke else 20.0
    if args.smoke:
        args.rates = [min(rate, 2.0) for rate in args.rates[:1]]
        args.cold_rate = min(args.cold_rate, 1.0)
        args.probes, args.probe_interval, args.adapters = 1, 0.5, 2

    config = ServeBenchConfig.from_args(args, smoke_max_batch_tokens=64, smoke_max_loras=6)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        library = AdapterLibrary((args.adapter_dir or Path(tmp)) / f"rank{config.rank}", config)
        engine = build_engine(build_model(config), config, library)
        # One full prefill step's worth of prompts: the largest prefill shape online.
        warm_up(engine, library, config, max(4, config.max_batch_tokens // config.prompt_len))
        slots = engine.scheduler.residency.pool.num_slots
        # Leave slots for the cold probes (they are loaded while the warm ones stay pinned).
        num_warm = max(1, min(args.adapters, slots - 2))
        warm_names = adapter_names("warm", num_warm)
        host_names = adapter_names("hostcold", args.probes * args.cold_passes)
        cycling_names = adapter_names("cycling", args.cycling_adapters)
        library.preload(engine, warm_names + host_names + cycling_names)
        warm = [library.binding(n) for n in warm_names]
        results: dict[str, Any] = {
            "meta": {
                "benchmark": "serve_online",
                **provenance("serve_online", argv),
                "device": device_name(torch.device(config.device)),
                "model": model_label(config),
                "experts": config.experts,
                "adapter_modules": adapters_label(config),
                "layers": config.layers,
                "full_model": config.layers == 27,
                "dtype": config.dtype,
                "rank": config.rank,
                "adapters": num_warm,
                "cycling_adapters": args.cycling_adapters,
                "breadth_first_admission": config.breadth_first_admission,
                "gpu_slots": slots,
                "adapter_bytes": library.adapter_bytes,
                "adapters_note": host_bytes_note(library),
                "prompt_len": config.prompt_len,
                "output_len": config.output_len,
                "max_num_seqs": config.max_num_seqs,
                "duration_s": args.duration,
                "setup_s": time.perf_counter() - started,
            },
            "runs": [],
        }
        timeline = StepTimeline(engine)
        loop = EngineLoop(engine, idle_wait_s=0.002).start()
        try:
            load_into_slots(loop, engine, warm)
            cycling = [library.binding(n) for n in cycling_names]
            modes = ("base", "lora", "cycling") if cycling else ("base", "lora")
            for rate in args.rates:
                for mode in modes:
                    times = poisson_times(rate, args.duration, seed=int(rate * 1000))
                    arrivals = rate_arrivals(mode, times, warm, cycling)
                    tag = f"{mode}{rate:g}"
                    began = time.monotonic()
                    loads_before = slot_loads(loop, engine)
                    traces, seconds = drive(loop, engine, config, arrivals, tag, args.drain_timeout)
                    run = {"rate": rate, "mode": mode, **summarize(traces, seconds)}
                    run["slot_loads"] = slot_loads(loop, engine) - loads_before
                    run["distinct_adapters"] = len({a.adapter.key for a in arrivals if a.adapter})
                    run["timeline"] = timeline.summary(began)
                    results["runs"].append(run)
                    save(args.out, results)
                    print(
                        f"{rate:6g} req/s {mode:7s}: TTFT p50 {run['ttft']['p50_ms']:8.1f} "
                        f"p99 {run['ttft']['p99_ms']:8.1f} ms  ITL p50 "
                        f"{run['itl']['p50_ms']:7.2f} p99 {run['itl']['p99_ms']:7.2f} ms  "
                        f"{run['output_tokens_per_s']:7.0f} tok/s  "
                        f"({run['completed']}/{run['requests']} done, "
                        f"{run['distinct_adapters']} adapters, {run['slot_loads']} slot loads)"
                    )
            file_names = adapter_names("filecold", args.probes * args.cold_passes)
            results["cold_passes"] = []
            for index in range(args.cold_passes):
                fresh = slice(index * args.probes, (index + 1) * args.probes)
                host_cold = [library.binding(n) for n in host_names[fresh]]
                file_cold = [library.binding(n) for n in file_names[fresh]]
                arrivals = cold_arrivals(
                    args.cold_rate, args.probes, args.probe_interval, warm, host_cold, file_cold
                )
                began = time.monotonic()
                tag = f"cold{index}"
                traces, _ = drive(loop, engine, config, arrivals, tag, args.drain_timeout)
                cold_pass = {"rate": args.cold_rate, **cold_summary(traces)}
                cold_pass["timeline"] = timeline.summary(began)
                results["cold_passes"].append(cold_pass)
                save(args.out, results)
            results["cold"] = results["cold_passes"][-1]
        finally:
            loop.stop()
        results["meta"]["seconds"] = time.perf_counter() - started
        save(args.out, results)
    for index, cold in enumerate(results["cold_passes"]):
        line = cold["timeline"]
        print(
            f"cold pass {index}: {line['steps']} steps, step p50 {line['step_ms']['p50_ms']:.1f} "
            f"ms, {len(line['slow_steps'])} slow, {line['kernels_compiled']} kernels compiled"
        )
    cold = results["cold"]
    for kind, stats in cold["ttft"].items():
        added = cold["ttft_added"].get(kind)
        print(
            f"{kind:9s} TTFT p50 {stats['p50_ms']:8.1f} p99 {stats['p99_ms']:8.1f} ms"
            + (f"  added p50 {added['p50_ms']:8.1f} p99 {added['p99_ms']:8.1f} ms" if added else "")
        )
    plot(results, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
