"""Host → device copies that never wait for the device.

The engine lays out step n+1 while the GPU still runs step n. A copy from pageable host
memory waits for the stream (torch synchronises after it), so it would wait for step n and
undo the overlap: step inputs are staged in pinned memory and copied asynchronously. Torch's
caching host allocator keeps a staging block from reuse until its copy has run.
"""

from __future__ import annotations

import torch
from torch import Tensor


def to_device(host: Tensor, device: torch.device | str) -> Tensor:
    """`host` (a CPU tensor) on `device`, without a host sync on CUDA."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    staged = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    staged.copy_(host)
    return staged.to(device, non_blocking=True)
