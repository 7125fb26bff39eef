"""Measure this GPU's two ceilings: device-to-device copy bandwidth (bytes read + written)
and bf16 matrix-product rate. Every roofline figure in docs/benchmarks.md divides by these.

    python3 -m bench.ceilings --out results/ceilings.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.provenance import provenance


def measure_copy_bandwidth(n_bytes: int = 2 * 1024**3, reps: int = 20) -> float:
    """Bytes/s of `dst.copy_(src)` counting read + write."""
    src = torch.randn(n_bytes // 4, device="cuda")  # random data, never zeros
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2 * src.numel() * 4 / times[len(times) // 2]


def measure_bf16_matmul(n: int = 8192, reps: int = 20) -> float:
    """FLOP/s of an n×n×n bf16 matrix product on random data."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2 * n**3 / times[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result = {
        "device": torch.cuda.get_device_name(),
        **provenance("ceilings"),
        "copy_bytes_per_s": measure_copy_bandwidth(),
        "bf16_flops_per_s": measure_bf16_matmul(),
        "torch": torch.__version__,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(
        f"{result['device']}: copy {result['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
        f"bf16 {result['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s"
    )


if __name__ == "__main__":
    main()
