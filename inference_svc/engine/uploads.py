"""Host → device copies that never wait for the device.

The engine lays out step n+1 while the GPU still runs step n. A copy from pageable host
memory waits for the stream (torch synchronises after it), so it would wait for step n and
undo the overlap: step inputs are staged in pinned memory and copied asynchronously. Torch's
caching host allocator keeps a staging block from reuse until its copy has run.
"""

from __future__ import annotations

import torch
from torch import Tensor


def staging_buffer(size: int, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """A host buffer [size] to fill and then move with `to_device`: pinned when `device` is
    CUDA, so the move needs no staging copy of its own."""
    return torch.empty(size, dtype=dtype, pin_memory=torch.device(device).type == "cuda")


def to_device(host: Tensor, device: torch.device | str) -> Tensor:
    """`host` (a CPU tensor) on `device`, without a host sync on CUDA (staged in pinned
    memory unless it is pinned already)."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    if not host.is_pinned():
        host = torch.empty(host.shape, dtype=host.dtype, pin_memory=True).copy_(host)
    return host.to(device, non_blocking=True)
