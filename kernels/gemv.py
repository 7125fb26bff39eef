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

The token's LoRA rides in the same launches (`GemvLora`): a linear's shrink is this kernel
over the slot's A rows (`gemv_lora_shrink`), launched just before the product, whose
epilogue adds y·Bᵀ; kv_b's absorbed corrections go into the per-head products' epilogues,
their first factor computed from the product's own input. H100, 8-layer V2-Lite step with
one rank-16 adapter (bench.lora_decode_overhead, set "one_token_cublas" for the cuBLAS
path with the separate LoRA kernels): 1160 → 1014 µs, LoRA overhead +25 % → +9 %.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.fused_moe import silu_times
from kernels.host_math import cdiv, next_power_of_2
from kernels.launch import fast
from kernels.lora_segments import rank_alignment, rank_load_bound
from kernels.pdl import grid_dependency_control
from kernels.rms_norm import ResidualSum, RoutedPairs, residual_sum_row, rms_normalize_row

MAX_K = 4096
# Weight elements one program holds (64 per thread at 8 warps): all programs resident.
TILE_ELEMENTS = 16384
# Programs a launch aims for at least, by narrowing the tile: a router's 64 rows in one
# or a few programs would stream its weights through a few SMs.
MIN_PROGRAMS = 128


# Epilogue modes of `_gemv_kernel` (GemvLora): none, u read from a shrink's output, u
# computed from the kernel's own input.
NO_LORA = tl.constexpr(0)
LORA_SHRUNK = tl.constexpr(1)
LORA_ABSORBED = tl.constexpr(2)
# A slice boundary no column reaches (the kernel's slice index of a missing boundary).
N_BOUND = 2**31 - 1


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, y_ptr, norm_w_ptr, N, K,
    stride_xb, stride_wb, stride_wn, stride_wk, stride_yb, eps,
    token_slot_ptr, slot_rank_ptr, lora_y_ptr, u_ptr, v_ptr, R, slice_1, slice_2,
    stride_us, stride_ub, stride_uk, stride_ur, stride_vs, stride_vb, stride_vn, stride_vr,
    a_ptr, b_ptr, pairs_ptr, pair_w_ptr, h_ptr, stride_a, stride_b, stride_pairs,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr,
    SHRINK: tl.constexpr, LORA: tl.constexpr, BLOCK_R: tl.constexpr, RANK_ALIGN: tl.constexpr,
    U_CHUNK: tl.constexpr, RESIDUAL: tl.constexpr, TOPK: tl.constexpr,
    TENSOR_ADDENDS: tl.constexpr,
):  # fmt: skip
    """y[b, n-block] = Σ_k x̂[b, k] · W[b, n, k], float32 accumulation; x̂ = x, with NORM
    x's RMSNorm, with GATED silu(x[:K]) · x[K:2K], each rounded to x's dtype as the
    kernel it replaces stores it (kernels.rms_norm, kernels.fused_moe.silu_mul). RESIDUAL
    (with NORM): x is the residual, the row normed is h = x + addends (a / b / pairs:
    `residual_sum_row`), and program 0 stores h (h_ptr, one row).

    One token's LoRA, its slot s = token_slot[0] (-1: none) and rank = slot_rank[s]:
    SHRINK: W is A[s] (batch s), rows whose index within their slice (of R) is ≥ rank are
    zeros. LORA adds Σ_{r<rank} u[b, r] · V[s, b, n, r] before the store, u = y[slice(n)·R
    + r] (LORA_SHRUNK: a SHRINK launch wrote y) or Σ_k U[s, b, k, r] · x̂[b, k]
    (LORA_ABSORBED). Slot, rank, W, V and U are read before the wait: the step's first
    kernel is preceded by the host copy of the slots, nothing in a step writes weights. A U
    tile over LORA_TILE_ELEMENTS is read after it instead, U_CHUNK columns at a time (x is
    then read again per piece: LORA_ABSORBED takes neither NORM nor GATED)."""
    batch = tl.program_id(1).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n, mask_k = offs_n < N, offs_k < K
    w_rows = w_ptr + batch * stride_wb
    load_n = mask_n
    if SHRINK or LORA != NO_LORA:
        slot = tl.load(token_slot_ptr)
        rank = tl.where(slot >= 0, tl.load(slot_rank_ptr + tl.maximum(slot, 0)), 0)
        slot = tl.maximum(slot, 0).to(tl.int64)
    if SHRINK:
        w_rows = w_ptr + slot * stride_wb
        load_n = mask_n & (offs_n % R < rank)
    w = tl.load(
        w_rows + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :] * stride_wk,
        mask=load_n[:, None] & mask_k[None, :],
        other=0.0,
    )  # [n, k]: weights, read before the wait (no kernel of a step writes them)
    # The LoRA tiles hold rank along dim 0 ([r, n], [r, k]): the delta is then a reduction
    # over dim 0, and only its [n] result changes layout to meet y's (rank along dim 1,
    # beside W's [n, k] tile, had the compiler replicate the tiles over W's layout).
    if LORA != NO_LORA:
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        v = tl.load(
            v_ptr + slot * stride_vs + batch * stride_vb
            + offs_r[:, None] * stride_vr + offs_n[None, :] * stride_vn,
            mask=(offs_r < rank_load_bound(rank, RANK_ALIGN))[:, None] & mask_n[None, :],
            other=0.0,
        )  # fmt: skip
        v = tl.where(mask_r[:, None], v, 0.0)  # [r, n]
    if LORA == LORA_ABSORBED:
        u_rows = u_ptr + slot * stride_us + batch * stride_ub + offs_r * stride_ur  # [r]
        if U_CHUNK == BLOCK_K:  # the whole tile, before the wait
            u_w = _u_columns(u_rows, offs_k, mask_r, mask_k, stride_uk)  # [r, k]
    grid_dependency_control()
    if RESIDUAL:
        x = residual_sum_row(
            x_ptr, a_ptr, b_ptr, pairs_ptr, pair_w_ptr, batch, offs_k, mask_k,
            stride_xb, stride_a, stride_b, stride_pairs, x_ptr.dtype.element_ty,
            TOPK, TENSOR_ADDENDS,
        )  # fmt: skip
        if tl.program_id(0) == 0:
            tl.store(h_ptr + offs_k, x, mask=mask_k)
    else:
        x = tl.load(x_ptr + batch * stride_xb + offs_k, mask=mask_k, other=0.0)  # [k]
    if NORM:
        x = rms_normalize_row(x, norm_w_ptr, offs_k, mask_k, K, eps).to(x.dtype)
    if GATED:
        up = tl.load(x_ptr + batch * stride_xb + K + offs_k, mask=mask_k, other=0.0)
        x = silu_times(x, up).to(x.dtype)
    y = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)  # [n]
    if LORA == LORA_SHRUNK:
        slice_idx = (offs_n >= slice_1).to(tl.int32) + (offs_n >= slice_2).to(tl.int32)
        u = tl.load(
            lora_y_ptr + slice_idx[None, :] * R + offs_r[:, None],
            mask=mask_r[:, None] & mask_n[None, :],
            other=0.0,
        )  # [r, n]: each column's slice of the shrink's output
        y += tl.sum(v.to(tl.float32) * u.to(tl.float32), axis=0)
    if LORA == LORA_ABSORBED:
        if U_CHUNK == BLOCK_K:
            u = tl.sum(u_w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)  # [r]
        else:  # a tile too large to hold: [r, U_CHUNK] pieces after the wait
            u = tl.zeros((BLOCK_R,), dtype=tl.float32)
            for k0 in tl.static_range(0, BLOCK_K, U_CHUNK):
                offs_c = k0 + tl.arange(0, U_CHUNK)
                mask_c = offs_c < K
                u_c = _u_columns(u_rows, offs_c, mask_r, mask_c, stride_uk)  # [r, c]
                x_c = tl.load(x_ptr + batch * stride_xb + offs_c, mask=mask_c, other=0.0)
                u += tl.sum(u_c.to(tl.float32) * x_c.to(tl.float32)[None, :], axis=1)
        y += tl.sum(v.to(tl.float32) * u[:, None], axis=0)
    tl.store(y_ptr + batch * stride_yb + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _u_columns(u_rows, cols, mask_r, mask_c, stride_uk):
    """[r, c] columns `cols` of the u weight rows `u_rows` (masked rows and columns 0)."""
    return tl.load(
        u_rows[:, None] + cols[None, :] * stride_uk,
        mask=mask_r[:, None] & mask_c[None, :],
        other=0.0,
    )


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


@dataclass(frozen=True)
class GemvLora:
    """One token's LoRA delta, added by `gemv` / `gemv_per_head` before they store: for the
    token's slot s = token_slot[0] (-1: nothing added) and rank = slot_rank[s],

        out[b, n] += Σ_{r < rank} u[b, r] · v[s, b, n, r]

    with u[b, r] = y[0, i·R + r] for column n in slice i (`y` given: a linear whose
    `gemv_lora_shrink` wrote y; `slice_offsets` the slices' interior column boundaries),
    or u[b, r] = Σ_k u_weight[s, b, k, r] · x[b, k] (`u_weight` given: the absorbed kv_b
    corrections, whose first factor multiplies the product's own input).

    v: [slots, B or 1, N, R] and u_weight: [slots, B or 1, K, R], any strides (views of
    pool buffers; a dim of 1 serves every b); y: float32 [1, S·R]; token_slot and
    slot_rank int32.
    """

    token_slot: Tensor
    slot_rank: Tensor
    v: Tensor
    y: Tensor | None = None
    slice_offsets: tuple[int, ...] = ()
    u_weight: Tensor | None = None

    def __post_init__(self) -> None:
        if (self.y is None) == (self.u_weight is None):
            raise ValueError("GemvLora takes exactly one of y and u_weight")
        if len(self.slice_offsets) > 2:
            raise ValueError(f"at most 3 slices, got boundaries {self.slice_offsets}")

    @property
    def pool_rank(self) -> int:
        """R: the pool's rank (each slot's own rank is `slot_rank[slot]` ≤ R)."""
        return self.v.shape[-1]

    def fits(self, batch: int, n_dim: int, k_dim: int) -> bool:
        """Whether it describes a product of `batch` rows, N `n_dim`, K `k_dim`."""
        v_ok = self.v.dim() == 4 and self.v.shape[1] in (1, batch) and self.v.shape[2] == n_dim
        if self.y is not None:
            slices = len(self.slice_offsets) + 1
            y = self.y
            return (
                v_ok
                and y.dtype == torch.float32
                and y.shape == (1, slices * self.pool_rank)
                and y.is_contiguous()
            )
        u = self.u_weight
        assert u is not None
        return (
            v_ok
            and u.dim() == 4
            and u.shape[1] in (1, batch)
            and u.shape[2:] == (k_dim, self.pool_rank)
        )

    @property
    def block_r(self) -> int:
        return next_power_of_2(max(self.pool_rank, 16))


@dataclass(frozen=True)
class ResidualAdd:
    """The decoder's residual add before a norm, done in `gemv`'s prologue instead of its
    own launch (`kernels.rms_norm.add_rms_norm`): gemv's x is the residual, the row normed
    is h = x + Σ addends (add_rms_norm's sums and rounding; the first addend may be
    RoutedPairs), and the launch stores h [1, K] into `h`."""

    addends: tuple[Tensor | RoutedPairs, ...]
    h: Tensor


# Elements of the absorbed corrections' [R, K] u weight tile a program holds beside its
# weight tile, read before the PDL wait (kv_b at rank 16: 16 × 512). A larger one (rank 64:
# 64 × 512) is read after the wait in pieces of this size.
LORA_TILE_ELEMENTS = 8192


def gemv(
    x: Tensor,
    weight: Tensor,
    norm_weight: Tensor | None = None,
    eps: float = 0.0,
    gated: bool = False,
    lora: GemvLora | None = None,
    residual: ResidualAdd | None = None,
) -> Tensor:
    """Semantics: x [1, K] @ weight [N, K]ᵀ → [1, N] in x's dtype (K ≤ MAX_K); with
    `norm_weight` [K], rms_norm(x, norm_weight, eps) @ weightᵀ (kernels.rms_norm's rounding);
    `gated`: x [1, 2K] = gate ⊕ up, and silu_mul(x) @ weightᵀ (kernels.fused_moe's);
    `lora`: plus its delta (GemvLora), rounded with the product once; `residual` (with
    `norm_weight`, without `lora`): h, y = add_rms_norm(x, residual.addends, norm_weight,
    eps), residual.h ← h, and y @ weightᵀ.
    """
    if not gemv_fits(x, weight, gated) or (gated and norm_weight is not None):
        raise ValueError(
            f"gemv takes one row, K ≤ {MAX_K}, matching dtypes and contiguous rows, x of "
            f"width 2K when gated (then no norm): x {tuple(x.shape)} {x.dtype}, weight "
            f"{tuple(weight.shape)} {weight.dtype}, gated {gated}"
        )
    if residual is not None and (
        norm_weight is None or lora is not None or not _fits_h(x, residual.h)
    ):
        raise ValueError(
            "a residual add rides in gemv before its norm, without LoRA, storing h like x: "
            f"norm {norm_weight is not None}, lora {lora is not None}, h "
            f"{tuple(residual.h.shape)} {residual.h.dtype}"
        )
    _check_lora(lora, 1, *weight.shape)
    y = torch.empty(1, weight.shape[0], dtype=x.dtype, device=x.device)
    _launch(x, weight.unsqueeze(0), y, norm_weight, eps, gated, lora, residual=residual)
    return y


def _fits_h(x: Tensor, h: Tensor) -> bool:
    return h.shape == x.shape and h.dtype == x.dtype and h.is_contiguous()


def gemv_lora_shrink(
    x: Tensor,
    a: Tensor,
    token_slot: Tensor,
    slot_rank: Tensor,
    num_slices: int,
    norm_weight: Tensor | None = None,
    eps: float = 0.0,
    gated: bool = False,
) -> Tensor:
    """Semantics: y[0, i·R + r] = A[s, i·R + r] · x̂ for r < rank (x̂ as `gemv` forms it),
    0 otherwise and for s = -1; s = token_slot[0], rank = slot_rank[s]. The one-token
    shrink of a linear's LoRA, whose expand rides in `gemv` (GemvLora with y).

    Args: x [1, K] (2K when gated); a: [slots, S·R, K] the pool's A buffer.
    Returns: y float32 [1, S·R].
    """
    if a.dim() != 3 or a.shape[1] % num_slices or not gemv_fits(x, a[0], gated):
        raise ValueError(
            f"gemv_lora_shrink takes x [1, K] (2K gated) and A [slots, S·R, K] of x's dtype: "
            f"x {tuple(x.shape)} {x.dtype}, A {tuple(a.shape)} {a.dtype}, {num_slices} slices"
        )
    y = torch.empty(1, a.shape[1], dtype=torch.float32, device=x.device)
    shrink = (token_slot, slot_rank, a.shape[1] // num_slices)
    _launch(x, a, y, norm_weight, eps, gated, None, shrink)
    return y


def gemv_per_head_fits(
    x: Tensor, weight: Tensor, out: Tensor, lora: GemvLora | None = None
) -> bool:
    """Whether `gemv_per_head` takes these: x [H, K] and out [H, N] with unit column
    stride, weight [H, N, K] with a unit stride along N or K, K within one tile (and
    `lora` of this product's shape)."""
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
        and (lora is None or lora.fits(*weight.shape))
    )


def gemv_per_head(x: Tensor, weight: Tensor, out: Tensor, lora: GemvLora | None = None) -> None:
    """Semantics: out[h] = weight[h] @ x[h] for every head h: x [H, K], weight [H, N, K],
    out [H, N], any row strides (the absorbed attention's bmm of one token, in one launch
    whose weight reads overlap the previous kernel); `lora`: plus its delta."""
    if not gemv_per_head_fits(x, weight, out, lora):
        raise ValueError(
            f"gemv_per_head takes x [H, K], weight [H, N, K] (unit stride along N or K), "
            f"out [H, N] of one dtype, K ≤ {MAX_K}, a GemvLora of that shape: x "
            f"{tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.stride()} "
            f"{weight.dtype}, out {tuple(out.shape)} {out.dtype}"
        )
    _launch(x, weight, out, None, 0.0, False, lora)


def _check_lora(lora: GemvLora | None, batch: int, n_dim: int, k_dim: int) -> None:
    if lora is not None and not lora.fits(batch, n_dim, k_dim):
        raise ValueError(
            f"GemvLora v {tuple(lora.v.shape)} does not fit a product of {batch} rows, "
            f"N {n_dim}, K {k_dim}"
        )


def _launch(
    x: Tensor,
    weight: Tensor,
    y: Tensor,
    norm_weight: Tensor | None,
    eps: float,
    gated: bool,
    lora: GemvLora | None,
    shrink: tuple[Tensor, Tensor, int] | None = None,
    residual: ResidualAdd | None = None,
) -> None:
    """x [B, K], weight [B, N, K] ([slots, N, K] with `shrink` = (token_slot, slot_rank,
    R)), y [B, N]: one program per (BLOCK_N rows, b)."""
    batch, n_dim, k_dim = x.shape[0], weight.shape[1], weight.shape[2]
    block_k = next_power_of_2(max(k_dim, 16))
    block_n = max(1, min(64, TILE_ELEMENTS // block_k))
    while block_n > 1 and batch * cdiv(n_dim, block_n) < MIN_PROGRAMS:
        block_n //= 2
    token_slot, slot_rank, pool_rank = shrink if shrink is not None else (y, y, 1)
    if lora is not None:
        token_slot, slot_rank, pool_rank = lora.token_slot, lora.slot_rank, lora.pool_rank
    pointers, bounds_and_strides, lora_meta = _lora_args(lora, y)
    if residual is not None:
        sums = ResidualSum.of(x, residual.addends)
        a, b, pairs, pair_weights = sums.pointers
        residual_args = (a, b, pairs, pair_weights, residual.h, a.stride(0), b.stride(0),
                         pairs.stride(0))  # fmt: skip
        residual_meta = {"RESIDUAL": True, **sums.constexprs}
    else:  # never read
        residual_args = (x, x, x, x, x, 0, 0, 0)
        residual_meta = {"RESIDUAL": False, "TOPK": 0, "TENSOR_ADDENDS": 0}
    fast(_gemv_kernel)[(cdiv(n_dim, block_n), batch)](
        x, weight, y, x if norm_weight is None else norm_weight, n_dim, k_dim,
        x.stride(0), weight.stride(0), weight.stride(1), weight.stride(2), y.stride(0), eps,
        token_slot, slot_rank, *pointers, pool_rank, *bounds_and_strides, *residual_args,
        BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm_weight is not None, GATED=gated,
        SHRINK=shrink is not None, **lora_meta, **residual_meta, num_warps=8,
    )  # fmt: skip


def _lora_args(
    lora: GemvLora | None, y: Tensor
) -> tuple[tuple[Tensor, Tensor, Tensor], tuple[int, ...], dict[str, int]]:
    """The kernel's LoRA arguments: the pointers (lora_y, u, v), the slice bounds and u, v
    strides, and the constants; placeholders (y, never read) without LoRA."""
    if lora is None:
        meta = {"LORA": NO_LORA.value, "BLOCK_R": 16, "RANK_ALIGN": 1, "U_CHUNK": 16}
        return (y, y, y), (N_BOUND, N_BOUND, *(0,) * 8), meta
    bounds = (*lora.slice_offsets, N_BOUND, N_BOUND)[:2]
    u = lora.u_weight if lora.u_weight is not None else lora.v
    strides = (*_broadcast_strides(u), *_broadcast_strides(lora.v))
    lora_y = lora.y if lora.y is not None else lora.v
    mode = LORA_SHRUNK if lora.y is not None else LORA_ABSORBED
    meta = {
        "LORA": mode.value,
        "BLOCK_R": lora.block_r,
        "RANK_ALIGN": rank_alignment(lora.pool_rank),
        "U_CHUNK": _u_chunk(u.shape[2], lora.block_r),
    }
    return (lora_y, u, lora.v), (*bounds, *strides), meta


def _u_chunk(k_dim: int, block_r: int) -> int:
    """Columns of the u weight tile read at a time: all of them (before the wait) where the
    tile fits LORA_TILE_ELEMENTS, else the widest power of two that does."""
    block_k = next_power_of_2(max(k_dim, 16))
    if block_k * block_r <= LORA_TILE_ELEMENTS:
        return block_k
    return max(16, LORA_TILE_ELEMENTS // block_r)


def _broadcast_strides(w: Tensor) -> tuple[int, int, int, int]:
    """[slots, B or 1, ·, R] strides, 0 along a batch dim of 1 (it serves every row)."""
    return (w.stride(0), w.stride(1) if w.shape[1] > 1 else 0, w.stride(2), w.stride(3))
