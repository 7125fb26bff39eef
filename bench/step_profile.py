"""Where a decode step's GPU time goes: torch-profiler kernel records grouped by class.

Classes are our Triton kernels by name and torch/cuBLAS kernels by family, so the
summary answers "how many launches of what, and how many µs each class takes per step".
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

# (substring of the kernel name, class); the first match wins.
TORCH_KERNEL_CLASSES = [
    ("gemm", "cublas_gemm"),
    ("gemv", "cublas_gemm"),
    ("cutlass", "cublas_gemm"),
    ("nvjet", "cublas_gemm"),
    ("xmma", "cublas_gemm"),
    ("splitk", "cublas_gemm"),
    ("softmax", "torch_softmax"),
    ("topk", "torch_topk_sort"),
    ("sort", "torch_topk_sort"),
    ("radix", "torch_topk_sort"),
    ("scan", "torch_topk_sort"),
    ("reduce", "torch_reduce"),
    ("index", "torch_index_scatter"),
    ("scatter", "torch_index_scatter"),
    ("gather", "torch_index_scatter"),
    ("cat", "torch_cat_copy"),
    ("copy", "torch_cat_copy"),
    ("memcpy", "memcpy_memset"),
    ("memset", "memcpy_memset"),
    ("fill", "torch_elementwise"),
    ("elementwise", "torch_elementwise"),
]


def kernel_class(name: str) -> str:
    """Our Triton kernels keep their name (`_mla_decode_kernel`); torch's get a family."""
    if name.startswith("_") and "kernel" in name:
        return name.split("(")[0]
    lowered = name.lower()
    for needle, label in TORCH_KERNEL_CLASSES:
        if needle in lowered:
            return label
    return "other"


def profile_step(step: Callable[[], object], device: torch.device, steps: int = 5) -> dict:
    """Run `step` `steps` times under the profiler; per-step kernel counts and µs by class.

    On CPU (smoke runs) the records are aten operators, a proxy for launch counts.
    """
    step()  # warm
    with StepProfile(device) as recorded:
        for _ in range(steps):
            step()
    return recorded.summary(steps)


class StepProfile:
    """A torch-profiler window over some steps (CUDA kernels, or top-level aten ops on the
    CPU); `summary(steps)` gives per-step counts and µs by class, the GPU's busy time (the
    union of its kernels' intervals, so overlapping streams count once) and the wall time."""

    def __init__(self, device: torch.device):
        self.device = device
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profile = profile(activities=activities)
        self._wall_s = 0.0

    def start(self) -> StepProfile:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self._profile.start()
        self._began = time.perf_counter()
        return self

    def stop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self._wall_s = time.perf_counter() - self._began
        self._profile.stop()

    def __enter__(self) -> StepProfile:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def summary(self, steps: int) -> dict:
        on_cuda = self.device.type == "cuda"
        count: dict[str, float] = defaultdict(float)
        micros: dict[str, float] = defaultdict(float)
        names: dict[str, float] = defaultdict(float)
        records: list[tuple[str, float, float]] = []  # (class, start µs, end µs)
        for event in self._profile.events():
            on_device = event.device_type == torch.autograd.DeviceType.CUDA
            if on_cuda and not on_device:
                continue
            if not on_cuda and not event.name.startswith("aten::"):
                continue
            if not on_cuda and event.cpu_parent is not None:
                continue  # top-level aten ops only: nested ones are the same launch
            label = kernel_class(event.name) if on_device else event.name
            elapsed = event.time_range.elapsed_us()
            count[label] += 1 / steps
            micros[label] += elapsed / steps
            names[event.name[:80]] += elapsed / steps
            records.append((label, event.time_range.start, event.time_range.end))
        classes = {
            label: {
                "launches_per_step": round(count[label], 2),
                "us_per_step": round(micros[label], 1),
            }
            for label in sorted(micros, key=micros.get, reverse=True)
        }
        top = sorted(names.items(), key=lambda kv: kv[1], reverse=True)[:15]
        unions = busy_unions(records)
        return {
            "launches_per_step": round(sum(count.values()), 1),
            "busy_us_per_step": round(sum(micros.values()), 1),
            "gpu_busy_union_us_per_step": round(unions["all"] / steps, 1),
            "kernel_union_us_per_step": round(unions["kernels"] / steps, 1),
            "copy_union_us_per_step": round(unions["copies"] / steps, 1),
            "copy_under_kernels_us_per_step": round(unions["copies_under_kernels"] / steps, 1),
            "wall_us_per_step": round(self._wall_s * 1e6 / steps, 1),
            "classes": classes,
            "top_kernels_us": {name: round(us, 1) for name, us in top},
        }


# Classes that are copies and fills (copy engines or tiny kernels), not compute.
COPY_CLASSES = frozenset({"memcpy_memset"})


def busy_unions(records: list[tuple[str, float, float]]) -> dict[str, float]:
    """Covered µs of (class, start, end) records: "all", "kernels" (every class but
    COPY_CLASSES), "copies", and "copies_under_kernels" (kernels + copies − all: how much
    of the copies ran while some kernel ran; a host → GPU transfer that truly overlaps the
    step's kernels has it equal to "copies")."""
    spans = {
        "all": [(start, end) for _, start, end in records],
        "kernels": [(start, end) for label, start, end in records if label not in COPY_CLASSES],
        "copies": [(start, end) for label, start, end in records if label in COPY_CLASSES],
    }
    unions = {key: interval_union(value) for key, value in spans.items()}
    unions["copies_under_kernels"] = unions["kernels"] + unions["copies"] - unions["all"]
    return unions


def interval_union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by [start, end) intervals (overlaps counted once)."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        covered += end - max(start, reach)
        reach = end
    return covered
