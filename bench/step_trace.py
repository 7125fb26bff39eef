"""The kernel timeline of graphed decode steps: every launch's name, start, duration and
stream, to read which chain of kernels is a step's critical path (the class totals of
`bench.step_profile` cannot say which kernels overlapped).

The model and pool are bench.lora_decode_overhead's (V2-Lite shape, q_lora_rank 1536,
random bf16 weights, `--adapters` distinct rank-16 adapters; 0: the base model). Writes
{"meta": ..., "events": [[name, start µs, duration µs, stream], ...]} for `--steps`
replays after a warm-up; `--print` lists the last step's launches.

    python -m bench.step_trace --batch 64 --adapters 32 --layers 8 --out trace.json --print
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.gpu_timing import device_name
from bench.kernel_variants import VARIANTS, kernel_variant
from bench.lora_decode_overhead import decode_batch, make_setup, v2_lite_config
from bench.provenance import provenance

Event = tuple[str, float, float, int]


def trace(
    batch: int, adapters: int, layers: int, context: int, steps: int, variant: str = "v2"
) -> list[Event]:
    with kernel_variant(variant):  # the graph is captured inside it
        setup = make_setup(v2_lite_config(layers), "cuda", context, (batch,), graphs=True)
    input_ids, metadata = decode_batch(setup, batch, adapters)
    step = functools.partial(setup.runner.execute, input_ids, metadata)
    for _ in range(5):  # the graph's first replays upload it
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = [
        (e.name, e.time_range.start, e.time_range.end - e.time_range.start, e.device_resource_id)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    return sorted(events, key=lambda e: e[1])


def print_last_step(events: list[Event], steps: int) -> None:
    """The last of `steps` equal replays: time from its first launch, duration, stream."""
    last = events[len(events) - len(events) // steps :]
    streams = sorted({e[3] for e in last})
    start = last[0][1]
    for name, begin, duration, stream in last:
        print(f"{begin - start:9.1f} {duration:7.1f}  s{streams.index(stream):<3d} {name[:70]}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=0, help="distinct adapters (0: base)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3, help="replays traced")
    parser.add_argument("--print", action="store_true", help="list the last step's launches")
    parser.add_argument(
        "--variant", default="v2", choices=sorted(VARIANTS), help="bench.kernel_variants"
    )
    args = parser.parse_args()
    events = trace(args.batch, args.adapters, args.layers, args.context, args.steps, args.variant)
    keys = ("batch", "adapters", "layers", "context", "steps", "variant")
    meta = {key: getattr(args, key) for key in keys}
    meta["device"] = device_name(torch.device("cuda"))
    meta.update(provenance("step_trace"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "events": events}))
    print(f"{len(events)} launches in {args.steps} steps → {args.out}")
    if args.print:
        print_last_step(events, args.steps)


if __name__ == "__main__":
    main()
