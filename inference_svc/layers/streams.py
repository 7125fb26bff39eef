"""Side CUDA streams the decoder runs independent work on, beside the step's own stream.

- "lora": the linear modules' LoRA shrinks, beside their base matmuls.
- "shared_experts": the shared experts' MLP (with its LoRA), beside the routed experts.

One stream per role and device, made on first use: every layer forks to it and joins back
within its own forward, so one is enough, and a CUDA graph captures each fork/join as
parallel branches of the step.
"""

from __future__ import annotations

import functools

import torch


def lora_side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The LoRA side stream of `device` (None on the CPU: everything runs in order)."""
    return _side_stream(device, "lora")


def shared_experts_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The shared experts' stream of `device` (None on the CPU)."""
    return _side_stream(device, "shared_experts")


def _side_stream(device: torch.device, role: str) -> torch.cuda.Stream | None:
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _stream(index, role)


@functools.cache
def _stream(index: int, role: str) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=index)
