"""Whether a float tensor holds only finite values, read from its bits.

`torch.isfinite(t).all()` ran at ~430 M elements/s on bf16 on the CPU machine, 1.5 s of a
2.3 s normalization of a 580 MB per-expert upload (two checks: the PEFT tensors, then the
canonical ones). With the sign bit masked off, a float's bits are below those of +inf
exactly when it is finite (inf has the exponent all ones and a zero mantissa, NaN a
non-zero one), so one integer max answers: ~5.6 G elements/s.
"""

from __future__ import annotations

import torch

# dtype -> (integer view of the same width, magnitude mask, bits of +inf)
_BITS = {
    torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80),
    torch.float16: (torch.int16, 0x7FFF, 0x7C00),
    torch.float32: (torch.int32, 0x7FFF_FFFF, 0x7F80_0000),
}


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN and no ±Inf in `tensor` (any float dtype; exact)."""
    bits = _BITS.get(tensor.dtype)
    if bits is None:
        return bool(torch.isfinite(tensor).all())
    if tensor.numel() == 0:
        return True
    as_int, magnitude, inf = bits
    return int(tensor.view(as_int).bitwise_and(magnitude).max()) < inf
