"""Host time of one Triton launch: what an eager prefill step pays ~1000 times (GPU only).

An eager prefill step with 32 adapters issues about a thousand Triton launches; profiles
put the step's host time above its GPU time. This times, per launch of the LoRA SGMV
kernels at a prefill shape (8192 tokens, 16 adapters of rank 16, V2-Lite's q_a width):

- `wrapper`: the public call (`sgmv_shrink` / `sgmv_expand`: checks, plan, buffers, launch
  through `kernels.launch.fast`);
- `jit`: Triton's own launch, `kernel[grid](*args)` (argument binding, specialisation key
  and cache lookup, then the driver launch);
- `fast`: `FastLaunch(kernel)[grid](*args)`, what the launchers use (the compiled kernel
  remembered by an exact argument key);
- `compiled`: the same compiled kernel launched with Triton's `CompiledKernel[grid]` runner
  and its bound arguments (the driver launch, with Triton's empty launch-hook chains);
- `torch_zeros`: a small torch allocation + memset, for scale.

Each figure is wall time of `--launches` back-to-back calls (no sync inside; the queue
absorbs them) ÷ launches, the median of `--reps` repetitions.

    python3 -m bench.triton_launch --out bench/results/triton_launch.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.gpu_timing import bar_plot, run_meta, write_json
from kernels import sgmv
from kernels.launch import FastLaunch, fast
from kernels.lora_segments import build_lora_segments

TOKENS, ADAPTERS, RANK, SLOTS = 8192, 16, 16, 64
HIDDEN, Q_A, KV_A = 2048, 1536, 576
WAYS = ("wrapper", "jit", "fast", "compiled")


def host_us(call: Callable[[], object], launches: int, reps: int) -> float:
    """Median over `reps` of the wall µs per call of `launches` calls in a row."""
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(launches):
            call()
        samples.append((time.perf_counter() - began) / launches * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def recorded_launch(kernel, call: Callable[[], object]) -> dict:  # type: ignore[no-untyped-def]
    """Run `call` once and return the grid and arguments of its launch of `kernel`."""
    seen: dict = {}
    launcher = fast(kernel)
    original = launcher._launch

    def launch(grid, args, kwargs):  # type: ignore[no-untyped-def]
        seen.update(grid=grid, args=args, kwargs=kwargs)
        return original(grid, args, kwargs)

    launcher._launch = launch  # type: ignore[method-assign]
    try:
        call()
    finally:
        del launcher._launch  # the class's method again
    return seen


def launch_ways(kernel, wrapper: Callable[[], object]) -> dict[str, Callable[[], object]]:  # type: ignore[no-untyped-def]
    """The ways (WAYS) to launch what `wrapper` launches of `kernel`."""
    seen = recorded_launch(kernel, wrapper)
    args, grid, kwargs = seen["args"], seen["grid"], seen["kwargs"]
    compiled = kernel.run(*args, grid=grid, warmup=False, **kwargs)
    binder = kernel.device_caches[torch.cuda.current_device()][4]
    bound, _, _ = binder(*args, **kwargs)
    values = tuple(bound.values())
    direct = compiled[(*grid, 1, 1)[:3]]  # the compiled runner indexes all three dims
    remembered = FastLaunch(kernel)[grid]
    remembered(*args, **kwargs)  # the first call goes through Triton and is remembered
    return {
        "wrapper": wrapper,
        "jit": lambda: kernel[grid](*args, **kwargs),
        "fast": lambda: remembered(*args, **kwargs),
        "compiled": lambda: direct(*values),
    }


def cases(device: torch.device) -> dict[str, tuple]:  # type: ignore[type-arg]
    dtype = torch.bfloat16
    x = torch.randn(TOKENS, HIDDEN, device=device, dtype=dtype)
    a = torch.randn(SLOTS, 2 * RANK, HIDDEN, device=device, dtype=dtype) * 0.02
    b = torch.randn(SLOTS, Q_A + KV_A, RANK, device=device, dtype=dtype) * 0.02
    out = torch.zeros(TOKENS, Q_A + KV_A, device=device, dtype=dtype)
    slots = [i for i in range(ADAPTERS) for _ in range(TOKENS // ADAPTERS)]
    segs = build_lora_segments(slots, [RANK] * SLOTS, device=device)
    y = sgmv.sgmv_shrink(x, a, segs, 2)
    offsets = [0, Q_A, Q_A + KV_A]
    return {
        "sgmv_shrink": (sgmv._sgmv_shrink_planned_kernel, lambda: sgmv.sgmv_shrink(x, a, segs, 2)),
        "sgmv_expand": (
            sgmv._sgmv_expand_kernel,
            lambda: sgmv.sgmv_expand(y, b, out, segs, offsets),
        ),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="results JSON")
    parser.add_argument("--launches", type=int, default=200)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("GPU only: CPU launches run Triton's interpreter")
    started = time.perf_counter()
    device = torch.device("cuda")
    rows = []
    for name, (kernel, wrapper) in cases(device).items():
        for way, call in launch_ways(kernel, wrapper).items():
            us = host_us(call, args.launches, args.reps)
            rows.append({"kernel": name, "way": way, "host_us_per_launch": us})
            print(f"{name:12s} {way:9s} {us:7.1f} µs per launch")
    zeros = lambda: torch.zeros(TOKENS, 2 * RANK, device=device)  # noqa: E731
    zeros_us = host_us(zeros, args.launches, args.reps)
    rows.append({"kernel": "torch_zeros", "way": "torch", "host_us_per_launch": zeros_us})
    print(f"{'torch_zeros':12s} {'torch':9s} {zeros_us:7.1f} µs per launch")
    meta = run_meta("triton_launch", device, started, tokens=TOKENS, adapters=ADAPTERS, rank=RANK)
    write_json(args.out, meta, rows)
    kernels = list(dict.fromkeys(r["kernel"] for r in rows if r["way"] != "torch"))
    series = {
        way: [next(r["host_us_per_launch"] for r in rows if (r["kernel"], r["way"]) == (k, way))
              for k in kernels]
        for way in WAYS
    }  # fmt: skip
    bar_plot(
        args.out.with_suffix(".png"),
        f"host µs per launch (torch.zeros: {zeros_us:.1f} µs)",
        kernels,
        series,
        "µs",
    )


if __name__ == "__main__":
    main()
