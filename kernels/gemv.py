"""Matrix-vector products for decode steps of one token: y[1, N] = x[1, K] · W[N, K]ᵀ, per
head for the absorbed attention's per-head matrices, and with the RMSNorm of x or the
MLP's silu(gate)·up fused in (one launch fewer each).

At batch 1 a decode step's dense linears are weight streaming: ~48 MB per V2-Lite layer,
~16 µs at copy bandwidth, against ~70 µs of cuBLAS launches (docs/benchmarks.md, B=1
profile). This kernel loads its weight rows *before* `grid_dependency_control()`: nothing
in a step writes weights, so under programmatic dependent launch (kernels/pdl.py) the
weight read overlaps the previous kernel's tail, and only x waits for it. One program per
BLOCK_N output rows holds its whole [BLOCK_N, K] weight tile (K ≤ MAX_K), so every
program's loads are in flight at once.

One row only: measured on an H100 (`gemv_chain_h100.json`, V2-Lite linears in graphs),
one token took 2.5-3.1 µs per linear against cuBLAS's 4.3-5.3 (a 27-layer chain of them
979 → 612 µs), while 2 tokens were mixed and 4 slower than cuBLAS (the tile is multiplied
once per row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.fused_moe import silu_times
from kernels.host_math import cdiv, next_power_of_2
from kernels.launch import fast
from kernels.pdl import grid_dependency_control
from kernels.rms_norm import rms_normalize_row

MAX_K = 4096
# Weight elements one program holds (64 per thread at 8 warps): all programs resident.
TILE_ELEMENTS = 16384
# Programs a launch aims for at least, by narrowing the tile: a router's 64 rows in one
# or a few programs would stream its weights through a few SMs.
MIN_PROGRAMS = 128


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, y_ptr, norm_w_ptr, N, K,
    stride_xb, stride_wb, stride_wn, stride_wk, stride_yb, eps,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr,
):  # fmt: skip
    """y[b, n-block] = Σ_k x̂[b, k] · W[b, n, k], float32 accumulation; x̂ = x, with NORM
    x's RMSNorm, with GATED silu(x[:K]) · x[K:2K], each rounded to x's dtype as the
    kernel it replaces stores it (kernels.rms_norm, kernels.fused_moe.silu_mul)."""
    batch = tl.program_id(1).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n, mask_k = offs_n < N, offs_k < K
    w = tl.load(
        w_ptr
        + batch * stride_wb
        + offs_n[:, None].to(tl.int64) * stride_wn
        + offs_k[None, :] * stride_wk,
        mask=mask_n[:, None] & mask_k[None, :],
        other=0.0,
    )  # [n, k]: weights, read before the wait (no kernel of a step writes them)
    grid_dependency_control()
    x = tl.load(x_ptr + batch * stride_xb + offs_k, mask=mask_k, other=0.0)  # [k]
    if NORM:
        x = rms_normalize_row(x, norm_w_ptr, offs_k, mask_k, K, eps).to(x.dtype)
    if GATED:
        up = tl.load(x_ptr + batch * stride_xb + K + offs_k, mask=mask_k, other=0.0)
        x = silu_times(x, up).to(x.dtype)
    y = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)  # [n]
    tl.store(y_ptr + batch * stride_yb + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)


def gemv_fits(x: Tensor, weight: Tensor, gated: bool = False) -> bool:
    """Whether `gemv` takes this matmul: one row (2K wide when `gated`: gate ⊕ up), K within
    one tile, matching dtypes, contiguous rows."""
    return (
        x.dim() == 2
        and x.shape[0] == 1
        and x.shape[1] == weight.shape[1] * (2 if gated else 1)
        and weight.shape[1] <= MAX_K
        and x.dtype == weight.dtype
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
    )


def gemv(
    x: Tensor,
    weight: Tensor,
    norm_weight: Tensor | None = None,
    eps: float = 0.0,
    gated: bool = False,
) -> Tensor:
    """Semantics: x [1, K] @ weight [N, K]ᵀ → [1, N] in x's dtype (K ≤ MAX_K); with
    `norm_weight` [K], rms_norm(x, norm_weight, eps) @ weightᵀ (kernels.rms_norm's rounding);
    `gated`: x [1, 2K] = gate ⊕ up, and silu_mul(x) @ weightᵀ (kernels.fused_moe's).
    """
    if not gemv_fits(x, weight, gated) or (gated and norm_weight is not None):
        raise ValueError(
            f"gemv takes one row, K ≤ {MAX_K}, matching dtypes and contiguous rows, x of "
            f"width 2K when gated (then no norm): x {tuple(x.shape)} {x.dtype}, weight "
            f"{tuple(weight.shape)} {weight.dtype}, gated {gated}"
        )
    y = torch.empty(1, weight.shape[0], dtype=x.dtype, device=x.device)
    _launch(x, weight.unsqueeze(0), y, norm_weight, eps, gated)
    return y


def gemv_per_head_fits(x: Tensor, weight: Tensor, out: Tensor) -> bool:
    """Whether `gemv_per_head` takes these: x [H, K] and out [H, N] with unit column
    stride, weight [H, N, K] with a unit stride along N or K, K within one tile."""
    return (
        x.dim() == 2
        and weight.dim() == 3
        and out.dim() == 2
        and weight.shape[0] == x.shape[0] == out.shape[0]
        and weight.shape[2] == x.shape[1] <= MAX_K
        and weight.shape[1] == out.shape[1]
        and x.dtype == weight.dtype == out.dtype
        and x.stride(-1) == 1
        and out.stride(-1) == 1
        and 1 in (weight.stride(1), weight.stride(2))
    )


def gemv_per_head(x: Tensor, weight: Tensor, out: Tensor) -> None:
    """Semantics: out[h] = weight[h] @ x[h] for every head h: x [H, K], weight [H, N, K],
    out [H, N], any row strides (the absorbed attention's bmm of one token, in one launch
    whose weight reads overlap the previous kernel)."""
    if not gemv_per_head_fits(x, weight, out):
        raise ValueError(
            f"gemv_per_head takes x [H, K], weight [H, N, K] (unit stride along N or K), "
            f"out [H, N] of one dtype, K ≤ {MAX_K}: x {tuple(x.shape)} {x.dtype}, "
            f"weight {tuple(weight.shape)} {weight.stride()} {weight.dtype}, "
            f"out {tuple(out.shape)} {out.dtype}"
        )
    _launch(x, weight, out, None, 0.0, False)


def _launch(
    x: Tensor, weight: Tensor, y: Tensor, norm_weight: Tensor | None, eps: float, gated: bool
) -> None:
    """x [B, K], weight [B, N, K], y [B, N]: one program per (BLOCK_N rows, b)."""
    heads, n_dim, k_dim = weight.shape
    block_k = next_power_of_2(max(k_dim, 16))
    block_n = max(1, min(64, TILE_ELEMENTS // block_k))
    while block_n > 1 and heads * cdiv(n_dim, block_n) < MIN_PROGRAMS:
        block_n //= 2
    fast(_gemv_kernel)[(cdiv(n_dim, block_n), heads)](
        x, weight, y, x if norm_weight is None else norm_weight, n_dim, k_dim,
        x.stride(0), weight.stride(0), weight.stride(1), weight.stride(2), y.stride(0), eps,
        BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm_weight is not None, GATED=gated,
        num_warps=8,
    )  # fmt: skip
