"""Matrix-vector product for decode steps of one token: y[1, N] = x[1, K] · W[N, K]ᵀ.

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

from kernels.host_math import cdiv, next_power_of_2
from kernels.launch import fast
from kernels.pdl import grid_dependency_control

MAX_K = 4096


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, y_ptr, N, K, stride_wn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """y[n-block] = Σ_k x[k] · W[n, k], float32 accumulation."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n, mask_k = offs_n < N, offs_k < K
    w = tl.load(
        w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
        mask=mask_n[:, None] & mask_k[None, :],
        other=0.0,
    )  # [n, k]: weights, read before the wait (no kernel of a step writes them)
    grid_dependency_control()
    x = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0)  # [k]
    y = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)  # [n]
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)


def gemv_fits(x: Tensor, weight: Tensor) -> bool:
    """Whether `gemv` takes this matmul: one row, K within one tile, contiguous rows."""
    return (
        x.dim() == 2
        and x.shape[0] == 1
        and weight.shape[1] <= MAX_K
        and x.dtype == weight.dtype
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
    )


def gemv(x: Tensor, weight: Tensor) -> Tensor:
    """Semantics: x [1, K] @ weight [N, K]ᵀ → [1, N] in x's dtype (K ≤ MAX_K)."""
    if not gemv_fits(x, weight):
        raise ValueError(
            f"gemv takes one row, K ≤ {MAX_K}, matching dtypes and contiguous rows: "
            f"x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}"
        )
    k_dim = x.shape[1]
    n_dim = weight.shape[0]
    y = torch.empty(1, n_dim, dtype=x.dtype, device=x.device)
    block_k = next_power_of_2(max(k_dim, 16))
    # ~16K weight elements per program (64 per thread at 8 warps): all programs resident.
    block_n = max(1, min(64, 16384 // block_k))
    fast(_gemv_kernel)[(cdiv(n_dim, block_n),)](
        x, weight, y, n_dim, k_dim, weight.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=8,
    )  # fmt: skip
    return y
