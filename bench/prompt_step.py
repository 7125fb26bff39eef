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
One more prompt step an arm runs under `torch.profiler` (CUDA activity): the GPU busy
time (the union of its kernels' and copies' spans) and their count. wall ÷ busy well above
1 means the step is bound by its launches, not by its GPU work. `--shrink-variants A B`:
the LoRA arm's prompt steps take the linear shrinks' plans on the step's stream
(`inference_svc.lora.apply.STEP_STREAM_SHRINK_VARIANT`) in turn, step by step (an A/B that
the host's drift between runs does not blur); each plan's median is reported.

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
from inference_svc.engine.engine import LLMEngine
from inference_svc.engine.sequence import AdapterBinding
from inference_svc.lora import apply as lora_apply
from kernels.sgmv import SHRINK_VARIANTS

ARMS = ("lora", "base")


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
        self,
        binding: Callable[[int], AdapterBinding | None],
        prompts: int,
        profile: bool,
        shrink_variants: list[str],
    ) -> dict[str, Any]:
        """`prompts` timed prompt steps (ms, synced), prompt step p with the shrink plan
        shrink_variants[p % len] (the profiled one with the first), a decode step after
        each (ms), and with `profile` the profiled GPU work of one more prompt step."""
        engine = self.engine
        ids = [self._add(i, binding(i)) for i in range(self.decodes)]
        while engine.scheduler.num_waiting:
            engine.step()
        engine.step()  # every decode running: the next steps are one prompt + the decodes
        prompt_ms, decode_ms, tokens, variants = [], [], [], []
        saved = lora_apply.STEP_STREAM_SHRINK_VARIANT
        try:
            for p in range(prompts):
                variants.append(shrink_variants[p % len(shrink_variants)])
                lora_apply.STEP_STREAM_SHRINK_VARIANT = variants[-1]
                ids.append(self._add(1000 + p, binding(p)))
                prompt_ms.append(self._timed_step(tokens))
                decode_ms.append(self._timed_step([]))
            result: dict[str, Any] = {
                "prompt_step_tokens": tokens,
                "prompt_step_ms": prompt_ms,
                "shrink_variant": variants,
                "decode_step_ms": decode_ms,
            }
            if profile and not self.config.smoke:  # the profiler's CUDA activity
                lora_apply.STEP_STREAM_SHRINK_VARIANT = shrink_variants[0]
                ids.append(self._add(2000, binding(prompts)))
                result.update(self._profiled_step())
        finally:
            lora_apply.STEP_STREAM_SHRINK_VARIANT = saved
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
    """Length of the union of sorted (start, end) µs spans, in ms (overlapping kernels of
    several streams count once)."""
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy / 1e3


def summary(arm: str, round_index: int, result: dict[str, Any]) -> dict[str, Any]:
    prompt = result["prompt_step_ms"]
    by_variant: dict[str, list[float]] = {}
    for variant, ms in zip(result["shrink_variant"], prompt, strict=True):
        by_variant.setdefault(variant, []).append(ms)
    row = {
        "arm": arm,
        "round": round_index,
        "prompt_step_ms_median": statistics.median(prompt),
        "prompt_step_ms_min": min(prompt),
        "prompt_step_ms_median_by_shrink_variant": {
            variant: statistics.median(times) for variant, times in by_variant.items()
        },
        "decode_step_ms_median": statistics.median(result["decode_step_ms"]),
        **result,
    }
    if "gpu_busy_ms" in result:
        row["wall_over_busy"] = row["prompt_step_ms_median"] / result["gpu_busy_ms"]
    return row


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
        "--shrink-variants",
        nargs="+",
        choices=sorted(SHRINK_VARIANTS),
        default=[lora_apply.STEP_STREAM_SHRINK_VARIANT],
        help="the LoRA arm's shrink plans on the step's stream, in turn step by step",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.decodes, args.prompts, args.rounds, args.adapters = 2, 1, 1, 2
    started = time.perf_counter()
    config = ServeBenchConfig.from_args(args, smoke_max_batch_tokens=64, smoke_max_loras=6)
    # The decodes make their third token in the first prompt step and two more an arm's
    # prompt: they must still be running at its last one.
    if config.output_len < 2 * args.prompts + 1:
        parser.error(
            f"--output-len {config.output_len} ends the decodes before prompt step "
            f"{args.prompts}: it must be at least {2 * args.prompts + 1}"
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
                # The base arm runs no LoRA shrink: one plan is enough.
                variants = args.shrink_variants if arm == "lora" else [args.shrink_variants[0]]
                result = steps.run(bindings[arm], args.prompts, round_index == 0, variants)
                rows.append(summary(arm, round_index, result))
                medians = rows[-1]["prompt_step_ms_median_by_shrink_variant"]
                print(
                    f"round {round_index} {arm}: prompt step median "
                    + ", ".join(f"{v} {ms:.1f}" for v, ms in medians.items())
                    + f" ms (min "
                    f"{rows[-1]['prompt_step_ms_min']:.1f}), decode step "
                    f"{rows[-1]['decode_step_ms_median']:.1f} ms"
                    + (
                        f", GPU busy {result['gpu_busy_ms']:.1f} ms in "
                        f"{result['gpu_events']} kernels and copies"
                        if "gpu_busy_ms" in result
                        else ""
                    ),
                    flush=True,
                )
    device = torch.device(config.device)
    meta = run_meta(
        "prompt_step", device, started, model=model_label(config), layers=config.layers,
        rank=config.rank, adapters=args.adapters, adapter_modules=adapters_label(config),
        prompt_len=config.prompt_len, decodes=args.decodes, prompts=args.prompts,
        shrink_variants=args.shrink_variants,
    )  # fmt: skip
    write_json(args.out, meta, rows)
    labels = [f"{row['arm']} r{row['round']}" for row in rows]
    series = {"prompt step (wall)": [row["prompt_step_ms_median"] for row in rows]}
    if all("gpu_busy_ms" in row for row in rows[: len(ARMS)]):
        busy = {row["arm"]: row["gpu_busy_ms"] for row in rows[: len(ARMS)]}
        series["GPU busy (profiled step)"] = [busy[row["arm"]] for row in rows]
    bar_plot(
        args.out.with_suffix(".png"),
        f"{config.prompt_len}-token prompt beside {args.decodes} decodes, {meta['device']}",
        labels, series, "ms",
    )  # fmt: skip


if __name__ == "__main__":
    main()
