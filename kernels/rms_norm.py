"""RMSNorm in one launch (the torch form is 8 elementwise/reduction kernels on a GPU).

Rounding follows the reference exactly: normalise in float32, round to the input dtype,
then multiply by the weight (one product, rounded once), as transformers does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.host_math import next_power_of_2


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Semantics: y = w · (x / sqrt(mean(x², -1) + eps)).to(x.dtype), the reduction in fp32.

    Args:
        x: [T, D] (rows may be strided); weight: [D]. Returns [T, D] contiguous.
    """
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, y_ptr, D, stride_x, stride_y, eps, BLOCK_D: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / D + eps)
    normed = (x32 * inv_rms).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton version of `rms_norm_ref`: one program per row. x [T, D], unit stride in D."""
    rows, dim = x.shape
    if weight.shape != (dim,) or x.stride(-1) != 1:
        raise ValueError(f"x {tuple(x.shape)} (unit-stride rows) and weight {tuple(weight.shape)}")
    out = torch.empty((rows, dim), dtype=torch.promote_types(x.dtype, weight.dtype),
                      device=x.device)  # fmt: skip
    if rows:
        block = next_power_of_2(dim)
        _rms_norm_kernel[(rows,)](
            x, weight, out, dim, x.stride(0), out.stride(0), eps, BLOCK_D=block,
            num_warps=4 if block <= 2048 else 8,
        )  # fmt: skip
    return out
