"""A short prompt step's wall time against its GPU work (issue 9, online latency).

Online, a request's first token waits for the step that runs its prompt, and every running
request's next token waits for it too: TTFT and the ITL tail are that step. This bench
builds the serving benchmarks' model (`bench.serve_setup`: random V2-Lite shape with
`q_lora_rank` 1536, bf16), keeps `--decodes` requests decoding, and then admits one
`--prompt-len` prompt a step, `--prompts` times per round, each prompt step timed with a
device sync before and after it (so it is the step's whole wall time: its launches, or its
GPU work, whichever ends later). Arms: every request on one of `--adapters` resident
adapters ("lora"), and on the base model ("base"), in turn, `--rounds` rounds in
alternating order (the host's timing drifts between rounds: compare arms within a round).
Within an arm the prompt steps take the `--paths` in turn, step by step (an A/B that the
host's drift does not blur): "graphs" replays the piecewise step graphs
(`inference_svc.engine.step_graphs`, captured up to `--step-graph-max-tokens`), "eager"
launches every kernel (`ModelRunner.use_step_graphs` off); each path's median is
reported. One more prompt step an arm and path runs under `torch.profiler` (CUDA
activity): the GPU busy time (the union of its kernels' and copies' spans) and their
count. wall ÷ busy well above 1 means the step is bound by its launches, not by its GPU
work.

    python3 -m bench.prompt_step --out bench/results/prompt_step.json
    python -m bench.prompt_step --out /tmp/prompt_step.json --smoke   # CPU setup check
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.gpu_timing import bar_plot, run_meta, write_json
from bench.serve_offline import make_resident, warm_up
from bench.serve_setup import (
    AdapterLibrary,
    ServeBenchConfig,
    adapter_names,
    adapters_label,
    add_engine_args,
    build_engine,
    build_model,
    make_request,
    model_label,
    synchronize,
)
from bench.step_profile import interval_union
from inference_svc.engine.engine import LLMEngine
from inference_svc.engine.sequence import AdapterBinding

ARMS = ("lora", "base")
PATHS = ("graphs", "eager")


class PromptSteps:
    """Runs one arm's prompt steps on the engine: `decodes` requests decoding, then one new
    prompt a step; every request of the arm on its `binding(i)` (None: the base model)."""

    def __init__(self, engine: LLMEngine, config: ServeBenchConfig, decodes: int) -> None:
        self.engine, self.config, self.decodes = engine, config, decodes
        self.vocab = engine.runner.model.config.vocab_size
        self._serial = 0

    def _add(self, seed: int, adapter: AdapterBinding | None) -> str:
        self._serial += 1
        request_id = f"r{self._serial}"
        self.engine.add_request(make_request(request_id, self.config, self.vocab, seed, adapter))
        return request_id

    def run(
        self, binding: Callable[[int], AdapterBinding | None], prompts: int, paths: list[str]
    ) -> dict[str, Any]:
        """`prompts` timed prompt steps (ms, synced), prompt step p on the path
        paths[p % len], a decode step after each (ms), then (on the GPU) the profiled GPU
        work of one more prompt step a path."""
        engine, runner = self.engine, self.engine.runner
        ids = [self._add(i, binding(i)) for i in range(self.decodes)]
        while engine.scheduler.num_waiting:
            engine.step()
        engine.step()  # every decode running: the next steps are one prompt + the decodes
        prompt_ms, decode_ms, tokens, taken = [], [], [], []
        result: dict[str, Any] = {"profiled": {}}
        try:
            for p in range(prompts):
                taken.append(paths[p % len(paths)])
                runner.use_step_graphs = taken[-1] == "graphs"
                ids.append(self._add(1000 + p, binding(p)))
                prompt_ms.append(self._timed_step(tokens))
                decode_ms.append(self._timed_step([]))
            for p, path in enumerate(paths if not self.config.smoke else []):
                runner.use_step_graphs = path == "graphs"
                ids.append(self._add(2000 + p, binding(prompts + p)))
                result["profiled"][path] = self._profiled_step()
        finally:
            runner.use_step_graphs = True
        result.update(
            prompt_step_tokens=tokens, prompt_step_ms=prompt_ms, path=taken,
            decode_step_ms=decode_ms,
        )  # fmt: skip
        for request_id in ids:
            engine.abort(request_id)
        while engine.has_work():
            engine.step()
        return result

    def _timed_step(self, tokens: list[int]) -> float:
        synchronize(self.config)
        began = time.perf_counter()
        scheduled = self.engine.step()
        synchronize(self.config)
        tokens.append(scheduled)
        return (time.perf_counter() - began) * 1e3

    def _profiled_step(self) -> dict[str, Any]:
        activity = torch.profiler.ProfilerActivity.CUDA
        synchronize(self.config)
        with torch.profiler.profile(activities=[activity]) as profiler:
            self.engine.step()
            synchronize(self.config)
        spans = sorted(
            (e.time_range.start, e.time_range.end)
            for e in profiler.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
        )
        return {"gpu_busy_ms": union_ms(spans), "gpu_events": len(spans)}


def union_ms(spans: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) µs spans, in ms (overlapping kernels of several
    streams count once)."""
    return interval_union(spans) / 1e3


def summary(arm: str, round_index: int, result: dict[str, Any]) -> dict[str, Any]:
    """One arm's round: its prompt steps' median by path, and each profiled path's wall
    (that path's median) over its GPU busy time."""
    by_path: dict[str, list[float]] = {}
    for path, ms in zip(result["path"], result["prompt_step_ms"], strict=True):
        by_path.setdefault(path, []).append(ms)
    medians = {path: statistics.median(times) for path, times in by_path.items()}
    wall_over_busy = {
        path: medians[path] / profiled["gpu_busy_ms"]
        for path, profiled in result["profiled"].items()
        if path in medians
    }
    return {
        "arm": arm,
        "round": round_index,
        "prompt_step_ms_median_by_path": medians,
        "prompt_step_ms_min": min(result["prompt_step_ms"]),
        "decode_step_ms_median": statistics.median(result["decode_step_ms"]),
        "wall_over_busy_by_path": wall_over_busy,
        **result,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_engine_args(parser)
    parser.add_argument("--decodes", type=int, default=32, help="requests decoding meanwhile")
    parser.add_argument("--prompts", type=int, default=16, help="prompt steps an arm a round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--adapters", type=int, default=8, help="resident adapters (lora arm)")
    parser.add_argument(
        "--paths", nargs="+", choices=PATHS, default=list(PATHS),
        help="how prompt steps run, in turn step by step",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.smoke:
        args.decodes, args.prompts, args.rounds, args.adapters = 2, 1, 1, 2
    started = time.perf_counter()
    config = ServeBenchConfig.from_args(args, smoke_max_batch_tokens=64, smoke_max_loras=6)
    # The decodes make their third token in the first prompt step and two more a prompt
    # step (and each profiled one, on the GPU): they must still be running at the last.
    needed = 2 * (args.prompts + (0 if args.smoke else len(args.paths))) + 1
    if config.output_len < needed:
        parser.error(
            f"--output-len {config.output_len} ends the decodes before the last prompt step: "
            f"it must be at least {needed}"
        )
    with tempfile.TemporaryDirectory() as tmp:
        library = AdapterLibrary((args.adapter_dir or Path(tmp)) / f"rank{config.rank}", config)
        engine = build_engine(build_model(config), config, library)
        warm_up(engine, library, config, max(4, config.max_batch_tokens // config.prompt_len))
        names = adapter_names("resident", args.adapters)
        library.preload(engine, names)
        make_resident(engine, library, names)
        bindings: dict[str, Callable[[int], AdapterBinding | None]] = {
            "lora": lambda i: library.binding(names[i % len(names)]),
            "base": lambda i: None,
        }
        steps = PromptSteps(engine, config, args.decodes)
        rows = []
        for round_index in range(args.rounds):
            order = ARMS if round_index % 2 == 0 else ARMS[::-1]
            for arm in order:
                result = steps.run(bindings[arm], args.prompts, args.paths)
                rows.append(summary(arm, round_index, result))
                print(f"round {round_index} {arm}: {_line(rows[-1])}", flush=True)
    device = torch.device(config.device)
    meta = run_meta(
        "prompt_step", device, started, model=model_label(config), layers=config.layers,
        rank=config.rank, adapters=args.adapters, adapter_modules=adapters_label(config),
        prompt_len=config.prompt_len, decodes=args.decodes, prompts=args.prompts,
        paths=args.paths, step_graph_max_tokens=config.step_graph_max_tokens,
    )  # fmt: skip
    write_json(args.out, meta, rows)
    labels = [f"{row['arm']} r{row['round']}" for row in rows]
    series = {
        f"{path} (wall)": [row["prompt_step_ms_median_by_path"][path] for row in rows]
        for path in args.paths
    }
    for path in args.paths:
        if all(path in row["profiled"] for row in rows):
            series[f"{path} (GPU busy)"] = [row["profiled"][path]["gpu_busy_ms"] for row in rows]
    bar_plot(
        args.out.with_suffix(".png"),
        f"{config.prompt_len}-token prompt beside {args.decodes} decodes, {meta['device']}",
        labels, series, "ms",
    )  # fmt: skip


def _line(row: dict[str, Any]) -> str:
    """A round's medians by path, its decode step and each profiled path's GPU work."""
    medians = ", ".join(f"{p} {ms:.1f}" for p, ms in row["prompt_step_ms_median_by_path"].items())
    busy = "".join(
        f", {p} GPU busy {prof['gpu_busy_ms']:.1f} ms in {prof['gpu_events']} kernels and copies"
        for p, prof in row["profiled"].items()
    )
    return (
        f"prompt step median {medians} ms (min {row['prompt_step_ms_min']:.1f}), "
        f"decode step {row['decode_step_ms_median']:.1f} ms{busy}"
    )


if __name__ == "__main__":
    main()
