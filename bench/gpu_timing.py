"""Timing, measured ceilings and result files shared by the base-model benchmarks.

GPU timings use `triton.testing.do_bench` (warm-up, L2 flush between runs, median); the
CPU path (`--smoke` runs) uses a plain median so the scripts' setup can be checked anywhere.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.provenance import provenance


def time_ms(fn: Callable[[], object], device: torch.device, rep: int = 50) -> float:
    """Median milliseconds of one call of `fn`."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median"))
    fn()
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """`fn` captured in a CUDA graph (after a warm-up call that compiles and tunes), as a
    replay callable: times the kernels without the host's per-launch cost."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written."""
    numel = (1 << 28) if device.type == "cuda" else (1 << 22)  # 512 MiB / 8 MiB of bf16
    src = torch.empty(numel, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def matmul_flops(device: torch.device) -> float:
    """bf16 matrix-product throughput in FLOP/s (8192³ on GPU)."""
    n = 8192 if device.type == "cuda" else 256
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, device)
    return 2 * n**3 / (ms * 1e-3)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def kernel_bench_args(
    doc: str | None, argv: list[str] | None, flags: dict[str, str] | None = None
) -> tuple:
    """`--out JSON` and `--smoke` (CPU, tiny, interpreted) of a kernel bench: (out, device),
    followed by the value of each extra boolean flag in `flags` ({"--name": help})."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny, interpreted")
    for flag, help_text in (flags or {}).items():
        parser.add_argument(flag, action="store_true", help=help_text)
    args = parser.parse_args(argv)
    extra = [getattr(args, flag.lstrip("-").replace("-", "_")) for flag in flags or {}]
    return (args.out, torch.device("cpu" if args.smoke else "cuda"), *extra)


def run_meta(benchmark: str, device: torch.device, started: float, **extra: object) -> dict:
    """The JSON meta of a bench run: name, device, its provenance, `extra`, seconds."""
    return {
        "benchmark": benchmark,
        "device": device_name(device),
        **provenance(benchmark),
        **extra,
        "seconds": time.perf_counter() - started,
    }


def write_json(path: Path, meta: dict, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


def bar_plot(path: Path, title: str, labels: list[str], series: dict[str, list[float]], unit: str):
    """Grouped bars: one group per label, one bar per series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, len(labels) * 0.9), 4))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=name)
    ax.set_xticks(
        [x + 0.4 - width / 2 for x in range(len(labels))], labels, rotation=30, ha="right"
    )
    ax.set_ylabel(unit)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
