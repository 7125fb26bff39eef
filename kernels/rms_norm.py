"""RMSNorm in one launch (the torch form is 8 elementwise/reduction kernels on a GPU), and
the residual adds that precede it (with the MoE's weighted combine) fused into the same
launch.

Rounding follows the reference exactly: normalise in float32, round to the input dtype,
then multiply by the weight (one product, rounded once), as transformers does. The fused
add rounds each sum to the dtype, as torch's elementwise adds do one by one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.fused_moe import moe_combine_ref, weighted_pair_sum
from kernels.host_math import next_power_of_2
from kernels.launch import fast
from kernels.pdl import grid_dependency_control


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Semantics: y = w · (x / sqrt(mean(x², -1) + eps)).to(x.dtype), the reduction in fp32.

    Args:
        x: [T, D] (rows may be strided); weight: [D]. Returns [T, D] contiguous.
    """
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RoutedPairs(NamedTuple):
    """The routed experts' output before its weighted combine: pair_out [T·k, D] (pair
    p = t·k + j) and topk_weights [T, k] float32. As an addend it stands for
    `moe_combine(pair_out, topk_weights)`, summed by the same jitted function."""

    pair_out: torch.Tensor
    topk_weights: torch.Tensor


def add_rms_norm_ref(
    residual: torch.Tensor,
    addends: tuple[torch.Tensor | RoutedPairs, ...],
    weight: torch.Tensor,
    eps: float,
    y_float: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: h = residual + (a₀ + a₁ + …) (each sum rounded); y = rms_norm(h).

    The decoder's `h + attn_out` / `h + (moe_out + shared_out)` before the next norm.
    Args:
        residual: [T, D]; addends: one or two [T, D] of its dtype, the first may be a
        RoutedPairs (the MoE output not yet combined); weight [D]; y_float: None, or
        [T, D] float32 that receives y.float() too (the router's input).
        Returns h [T, D] and y [T, D].
    """
    parts = [moe_combine_ref(*a) if isinstance(a, RoutedPairs) else a for a in addends]
    total = parts[0]
    for addend in parts[1:]:
        total = total + addend
    h = residual + total
    y = rms_norm_ref(h, weight, eps)
    if y_float is not None:
        y_float.copy_(y.float())
    return h, y


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
    grid_dependency_control()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    y = rms_normalize_row(x, w_ptr, cols, mask, D, eps)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def residual_sum_row(
    res_ptr, a_ptr, b_ptr, pairs_ptr, pair_w_ptr, row, cols, mask,
    stride_res, stride_a, stride_b, stride_pairs, dtype,
    TOPK: tl.constexpr, TENSOR_ADDENDS: tl.constexpr,
):  # fmt: skip
    """h = residual + (a₀ + a₁) of one row, each sum rounded to dtype (`add_rms_norm_ref`).
    The first addend is the routed pairs' combine (TOPK > 0, as moe_combine sums it) or a;
    then b (or a after the pairs) when there are two. Shared by every kernel that adds the
    residual, so they all round alike."""
    if TOPK > 0:
        acc = weighted_pair_sum(pairs_ptr, pair_w_ptr, row, cols, mask, stride_pairs, TOPK)
        total = acc.to(dtype)
        if TENSOR_ADDENDS == 1:
            a = tl.load(a_ptr + row * stride_a + cols, mask=mask, other=0.0)
            total = (total.to(tl.float32) + a.to(tl.float32)).to(dtype)
    else:
        total = tl.load(a_ptr + row * stride_a + cols, mask=mask, other=0.0)
        if TENSOR_ADDENDS == 2:
            b = tl.load(b_ptr + row * stride_b + cols, mask=mask, other=0.0)
            total = (total.to(tl.float32) + b.to(tl.float32)).to(dtype)
    res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
    return (res.to(tl.float32) + total.to(tl.float32)).to(dtype)


@triton.jit
def _add_rms_norm_kernel(
    res_ptr, a_ptr, b_ptr, pairs_ptr, pair_w_ptr, w_ptr, h_ptr, y_ptr, y_float_ptr, D,
    stride_res, stride_a, stride_b, stride_pairs, stride_h, stride_y, stride_yf, eps,
    TOPK: tl.constexpr, TENSOR_ADDENDS: tl.constexpr, FLOAT_COPY: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    grid_dependency_control()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    h = residual_sum_row(
        res_ptr, a_ptr, b_ptr, pairs_ptr, pair_w_ptr, row, cols, mask,
        stride_res, stride_a, stride_b, stride_pairs, h_ptr.dtype.element_ty,
        TOPK, TENSOR_ADDENDS,
    )  # fmt: skip
    tl.store(h_ptr + row * stride_h + cols, h, mask=mask)
    y = rms_normalize_row(h, w_ptr, cols, mask, D, eps).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * stride_y + cols, y, mask=mask)
    if FLOAT_COPY:
        tl.store(y_float_ptr + row * stride_yf + cols, y.to(tl.float32), mask=mask)


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
        fast(_rms_norm_kernel)[(rows,)](
            x, weight, out, dim, x.stride(0), out.stride(0), eps, BLOCK_D=block,
            num_warps=_num_warps(block),
        )  # fmt: skip
    return out


def add_rms_norm(
    residual: torch.Tensor,
    addends: tuple[torch.Tensor | RoutedPairs, ...],
    weight: torch.Tensor,
    eps: float,
    y_float: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `add_rms_norm_ref`: the combine, the adds, the norm and y's float32
    copy in one launch (the torch form is one launch per add plus the norm's, the
    combine's and the conversion's), one program per row."""
    rows, dim = residual.shape
    sums = ResidualSum.of(residual, addends)
    if weight.shape != (dim,):
        raise ValueError(f"weight {tuple(weight.shape)} must be [D]")
    if y_float is not None and (
        y_float.shape != (rows, dim) or y_float.dtype != torch.float32 or y_float.stride(-1) != 1
    ):
        raise ValueError(f"y_float {tuple(y_float.shape)} {y_float.dtype} must be [T, D] float32")
    h = torch.empty((rows, dim), dtype=residual.dtype, device=residual.device)
    out = torch.empty(
        (rows, dim), dtype=torch.promote_types(residual.dtype, weight.dtype), device=h.device
    )
    if rows:
        block = next_power_of_2(dim)
        y32 = y_float if y_float is not None else out  # never written without a copy
        a, b, pairs, pair_weights = sums.pointers
        fast(_add_rms_norm_kernel)[(rows,)](
            residual, a, b, pairs, pair_weights, weight, h, out, y32, dim,
            residual.stride(0), a.stride(0), b.stride(0), pairs.stride(0), h.stride(0),
            out.stride(0), y32.stride(0), eps, **sums.constexprs,
            FLOAT_COPY=y_float is not None, BLOCK_D=block, num_warps=_num_warps(block),
        )  # fmt: skip
    return h, out


class ResidualSum(NamedTuple):
    """`residual_sum_row`'s addend arguments for a residual [T, D] and one or two addends
    (the first may be RoutedPairs): pointers (a, b, pairs, pair weights; the residual where
    an addend is absent, never read) and constexprs (TOPK, TENSOR_ADDENDS)."""

    pointers: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    constexprs: dict[str, int]

    @staticmethod
    def of(residual: torch.Tensor, addends: tuple[torch.Tensor | RoutedPairs, ...]) -> ResidualSum:
        rows, dim = residual.shape
        if not 1 <= len(addends) <= 2 or any(isinstance(a, RoutedPairs) for a in addends[1:]):
            raise ValueError(f"one or two addends, only the first routed pairs; got {len(addends)}")
        routed = addends[0] if isinstance(addends[0], RoutedPairs) else None
        tensors = [a for a in addends if not isinstance(a, RoutedPairs)]
        if any(t.shape != (rows, dim) or t.dtype != residual.dtype for t in (residual, *tensors)):
            raise ValueError(
                f"residual and addends must share shape and dtype: "
                f"{[(tuple(t.shape), t.dtype) for t in (residual, *tensors)]}"
            )
        top_k = 0
        pairs, pair_weights = residual, residual  # never read without routed pairs
        if routed is not None:
            top_k = routed.topk_weights.shape[1]
            pairs, pair_weights = routed.pair_out, routed.topk_weights.float().contiguous()
            if pairs.shape != (rows * top_k, dim) or pairs.dtype != residual.dtype:
                raise ValueError(
                    f"routed pair_out {tuple(pairs.shape)} {pairs.dtype} is not [T·k, D] = "
                    f"[{rows * top_k}, {dim}] of {residual.dtype}"
                )
        if any(t.stride(-1) != 1 for t in (residual, pairs, *tensors)):
            raise ValueError("the residual and addend rows need unit stride")
        a = tensors[0] if tensors else residual
        b = tensors[-1] if tensors else residual
        constexprs = {"TOPK": top_k, "TENSOR_ADDENDS": len(tensors)}
        return ResidualSum((a, b, pairs, pair_weights), constexprs)
