"""RMSNorm in one launch (the torch form is 8 elementwise/reduction kernels on a GPU), and
the residual add that precedes it fused into the same launch.

Rounding follows the reference exactly: normalise in float32, round to the input dtype,
then multiply by the weight (one product, rounded once), as transformers does. The fused
add rounds each sum to the dtype, as torch's elementwise adds do one by one.
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


def add_rms_norm_ref(
    residual: torch.Tensor, addends: tuple[torch.Tensor, ...], weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: h = residual + (a₀ + a₁ + …) (each sum rounded); y = rms_norm(h).

    The decoder's `h + attn_out` / `h + (moe_out + shared_out)` before the next norm.
    Args:
        residual, addends: [T, D] of one dtype (one or two addends); weight [D].
        Returns h [T, D] and y [T, D].
    """
    total = addends[0]
    for addend in addends[1:]:
        total = total + addend
    h = residual + total
    return h, rms_norm_ref(h, weight, eps)


@triton.jit
def rms_normalize_row(x, w_ptr, cols, mask, D, eps):
    """One row x [BLOCK_D] (its storage dtype, masked lanes 0) → w · normalised x in fp32,
    to be rounded once by the caller's store. Shared by every kernel that norms a row, so
    they all round alike."""
    x32 = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / D + eps)
    normed = (x32 * inv_rms).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    return w.to(tl.float32) * normed.to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, y_ptr, D, stride_x, stride_y, eps, BLOCK_D: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    y = rms_normalize_row(x, w_ptr, cols, mask, D, eps)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(
    res_ptr, a_ptr, b_ptr, w_ptr, h_ptr, y_ptr, D,
    stride_res, stride_a, stride_b, stride_h, stride_y, eps,
    TWO_ADDENDS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    dtype = h_ptr.dtype.element_ty
    total = tl.load(a_ptr + row * stride_a + cols, mask=mask, other=0.0)
    if TWO_ADDENDS:
        b = tl.load(b_ptr + row * stride_b + cols, mask=mask, other=0.0)
        total = (total.to(tl.float32) + b.to(tl.float32)).to(dtype)
    res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
    h = (res.to(tl.float32) + total.to(tl.float32)).to(dtype)
    tl.store(h_ptr + row * stride_h + cols, h, mask=mask)
    y = rms_normalize_row(h, w_ptr, cols, mask, D, eps)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _num_warps(block: int) -> int:
    return 4 if block <= 2048 else 8


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
            num_warps=_num_warps(block),
        )  # fmt: skip
    return out


def add_rms_norm(
    residual: torch.Tensor, addends: tuple[torch.Tensor, ...], weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `add_rms_norm_ref`: the adds and the norm in one launch (the torch
    form is one launch per add plus the norm's), one program per row."""
    rows, dim = residual.shape
    tensors = (residual, *addends)
    if not 1 <= len(addends) <= 2:
        raise ValueError(f"one or two addends, got {len(addends)}")
    if any(t.shape != (rows, dim) or t.dtype != residual.dtype for t in tensors):
        raise ValueError(
            f"residual and addends must share shape and dtype: "
            f"{[(tuple(t.shape), t.dtype) for t in tensors]}"
        )
    if weight.shape != (dim,) or any(t.stride(-1) != 1 for t in tensors):
        raise ValueError(f"weight {tuple(weight.shape)} must be [D]; rows need unit stride")
    h = torch.empty((rows, dim), dtype=residual.dtype, device=residual.device)
    out = torch.empty(
        (rows, dim), dtype=torch.promote_types(residual.dtype, weight.dtype), device=h.device
    )
    if rows:
        a, b = addends[0], addends[-1]
        block = next_power_of_2(dim)
        _add_rms_norm_kernel[(rows,)](
            residual, a, b, weight, h, out, dim,
            residual.stride(0), a.stride(0), b.stride(0), h.stride(0), out.stride(0), eps,
            TWO_ADDENDS=len(addends) == 2, BLOCK_D=block, num_warps=_num_warps(block),
        )  # fmt: skip
    return h, out
