"""Programmatic dependent launch (PDL, Hopper and later): a kernel's launch and start-up
overlap the tail of the kernel before it on the stream.

Every Triton kernel of `kernels/` begins with `grid_dependency_control()`: it waits until
the previous kernel on the stream has finished and its writes are visible (so nothing it
reads can be stale), then lets the next kernel launch. `kernels.launch` launches them with
Triton's `launch_pdl` option when ENABLED, so the driver may schedule a kernel as soon as
every program of the one before has passed that point. A decode step of a few hundred
small kernels (batch 1: ~950 per 27-layer step, ~3.4 µs each) pays one launch latency per
kernel boundary otherwise (docs/model_perf_notes.md, "Next").

ENABLED is false under the CPU interpreter and on GPUs before compute capability 9, where
the instructions do not exist; `disable()` turns it off for A/B runs before any kernel is
compiled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


def _supported() -> bool:
    if knobs.runtime.interpret or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability()[0] >= 9


ENABLED = tl.constexpr(_supported())


def enabled() -> bool:
    """Whether kernels are launched with PDL (read at launch, so `disable()` shows)."""
    return bool(ENABLED.value)


def disable() -> None:
    """Launch without PDL; call before the first kernel compiles (Triton refuses a kernel
    whose global constants changed after it was compiled)."""
    global ENABLED
    ENABLED = tl.constexpr(False)


@triton.jit
def grid_dependency_control():
    """Wait for the previous kernel's writes, then let the next kernel launch."""
    if ENABLED:
        gdc_wait()
        gdc_launch_dependents()
