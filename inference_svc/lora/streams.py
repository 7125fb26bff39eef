"""The side CUDA stream the linear modules' LoRA shrinks run on, beside the base matmuls.

One stream per device, made on first use: every layer forks to it and joins back within
its own forward, so one is enough, and a CUDA graph captures the fork/join as two parallel
branches of the step.
"""

from __future__ import annotations

import functools

import torch


def lora_side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The side stream of `device` (None on the CPU: everything runs in order)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _stream(index)


@functools.cache
def _stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=index)
