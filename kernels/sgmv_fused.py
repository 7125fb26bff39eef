"""SGMV shrink and expand in one launch: `out += (x·Aᵀ)·Bᵀ` per segment, no y buffer.

Same function as `sgmv_shrink` followed by `sgmv_expand` (kernels/sgmv.py), for decode
steps, where the two-launch path costs a memset of the float32 y buffer, a split-K shrink
with atomics and an expand: three launches of ~2.6 µs each per module and layer, while
the bytes of a decode step's LoRA weights take well under a microsecond (H100 profile in
docs/benchmarks.md).

Work items are (live segment, slice, group of output column blocks). An item computes its
segment's rank-r intermediate of its slice in registers (`tl.dot` over all of K) and adds
y·Bᵀ into each column block of its group. A segment's shrink is thus repeated once per
group; the groups per segment are planned on the device from the live segment count so
that there are about `programs_per_sm × SMs` items: one segment (batch 1) spreads its
columns over the whole GPU, many segments take wide groups and re-read A (from L2) a few
times only. The grid is fixed, so a CUDA graph captured for any batch replays correctly
with any number of live segments.

The intermediate stays in registers, so the pool rank must fit one rank tile (≤ 64,
`FUSED_MAX_RANK`); wider pools take the two-launch path. Only the first `slot_rank[slot]`
rank rows of A and columns of B are read.

Shapes: T tokens, K in features, N = out_total, S stacked slices, R pool rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import triton
import triton.language as tl
from torch import Tensor

from kernels.lora_segments import LoraSegments, load_segment
from kernels.sgmv import (
    MAX_SLICES,
    UNUSED_OFFSET,
    check_pool,
    dot_precision,
    num_sms,
    rank_block,
    sgmv_expand_ref,
    sgmv_shrink_ref,
)

# One rank tile held in registers (tl.dot's N for the shrink, K for the expand).
FUSED_MAX_RANK = 64
# Batches up to this many tokens (the decode graphs' sizes) take the fused kernel.
FUSED_MAX_TOKENS = 256


@triton.jit
def _sgmv_fused_kernel(
    x_ptr, a_ptr, b_ptr, out_ptr,
    seg_indptr_ptr, seg_slot_ptr, slot_rank_ptr, num_segments_ptr,
    K, R, N, slice1_col, slice2_col, slice0_blocks, slice1_blocks, slice2_blocks,
    target_items,
    stride_xt, stride_xk, stride_as, stride_ar, stride_ak,
    stride_bs, stride_bn, stride_br, stride_ot, stride_on,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr, COLS_ALIGNED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    num_segments = tl.load(num_segments_ptr)
    # Groups of column blocks, planned from the live segment count (not the capture's).
    total_blocks = slice0_blocks + slice1_blocks + slice2_blocks
    wanted = tl.maximum(target_items // tl.maximum(num_segments, 1), 1)
    per_group = tl.cdiv(total_blocks, tl.minimum(wanted, total_blocks))
    groups0 = tl.cdiv(slice0_blocks, per_group)
    groups01 = groups0 + tl.cdiv(slice1_blocks, per_group)
    groups = groups01 + tl.cdiv(slice2_blocks, per_group)
    offs_r = tl.arange(0, BLOCK_R)
    for item in range(tl.program_id(0), num_segments * groups, tl.num_programs(0)):
        seg, group = item // groups, item % groups
        slot, rank, t_start, t_end = load_segment(seg, seg_indptr_ptr, seg_slot_ptr, slot_rank_ptr)
        if rank > 0:
            in_s1 = group >= groups0
            in_s2 = group >= groups01
            slice_idx = in_s1.to(tl.int32) + in_s2.to(tl.int32)
            col_lo = tl.where(in_s2, slice2_col, tl.where(in_s1, slice1_col, 0))
            col_hi = tl.where(in_s2, N, tl.minimum(tl.where(in_s1, slice2_col, slice1_col), N))
            if COLS_ALIGNED:
                # Lets the out tile load/store as 16-byte vectors (scalar 2-byte ones otherwise).
                col_lo = tl.multiple_of(col_lo, 8)
                col_hi = tl.multiple_of(col_hi, 8)
            slice_blocks = tl.where(
                in_s2, slice2_blocks, tl.where(in_s1, slice1_blocks, slice0_blocks)
            )
            block_lo = (group - tl.where(in_s2, groups01, tl.where(in_s1, groups0, 0))) * per_group
            block_hi = tl.minimum(block_lo + per_group, slice_blocks)

            offs_t = t_start + tl.arange(0, BLOCK_T)
            mask_t = offs_t < t_end
            mask_r = offs_r < rank
            # Shrink: y [t, r] = x[t, :] · A[slot, slice·R + r, :]ᵀ, only the slot's rank rows.
            a_rows = a_ptr + slot.to(tl.int64) * stride_as + (slice_idx * R + offs_r) * stride_ar
            y = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
            for k in range(0, K, BLOCK_K):
                offs_k = k + tl.arange(0, BLOCK_K)
                mask_k = offs_k < K
                x = tl.load(
                    x_ptr + offs_t[:, None] * stride_xt + offs_k[None, :] * stride_xk,
                    mask=mask_t[:, None] & mask_k[None, :],
                    other=0.0,
                )  # [t, k]
                a = tl.load(
                    a_rows[None, :] + offs_k[:, None] * stride_ak,
                    mask=mask_r[None, :] & mask_k[:, None],
                    other=0.0,
                )  # [k, r]
                y = tl.dot(x, a, y, input_precision=DOT_PRECISION)

            # Expand: out[t, n] += y · B[slot, n, :rank]ᵀ over this group's column blocks.
            b_slot = b_ptr + slot.to(tl.int64) * stride_bs
            y = y.to(b_ptr.dtype.element_ty)
            for block in range(block_lo, block_hi):
                offs_n = col_lo + block * BLOCK_N + tl.arange(0, BLOCK_N)
                mask_n = offs_n < col_hi
                out_ptrs = out_ptr + offs_t[:, None] * stride_ot + offs_n[None, :] * stride_on
                out_mask = mask_t[:, None] & mask_n[None, :]
                prev = tl.load(out_ptrs, mask=out_mask, other=0.0)
                b = tl.load(
                    b_slot + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br,
                    mask=mask_n[None, :] & mask_r[:, None],
                    other=0.0,
                )  # [r, n]
                delta = tl.dot(y, b, input_precision=DOT_PRECISION)  # [t, n]
                tl.store(out_ptrs, (prev.to(tl.float32) + delta).to(prev.dtype), mask=out_mask)


@dataclass(frozen=True)
class FusedPlan:
    """Tile sizes and grid of the fused launcher (bench/lora_kernels.py times each)."""

    block_k: int = 128
    block_n: int = 64
    programs_per_sm: int = 4
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_k", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.programs_per_sm < 1:
            raise ValueError(f"programs_per_sm must be >= 1, got {self.programs_per_sm}")


FUSED_PLANS = {
    "k128_n64": FusedPlan(),
    "k256_n64": FusedPlan(block_k=256),
    "k128_n128": FusedPlan(block_n=128),
    "k128_n64_p8": FusedPlan(programs_per_sm=8),
}
DEFAULT_FUSED_PLAN = "k128_n64"


def fused_applies(pool_rank: int, max_tokens: int | None = None) -> bool:
    """Whether to take `sgmv_fused`: a pool of at most one rank tile (the intermediate is
    held in registers) and, given `max_tokens` (the segment buffers' capacity), a batch of
    decode size; longer batches repeat each segment's shrink per column group for little
    gain over the two-launch path, whose launches are amortised there."""
    fits = pool_rank <= FUSED_MAX_RANK
    return fits and (max_tokens is None or max_tokens <= FUSED_MAX_TOKENS)


def sgmv_fused(
    x: Tensor,
    A: Tensor,
    B: Tensor,
    out: Tensor,
    segs: LoraSegments,
    slice_offsets: Sequence[int],
    *,
    plan: str = DEFAULT_FUSED_PLAN,
) -> Tensor:
    """Add every token's LoRA delta into `out` in place, in one launch.

    Semantics: out[t, o_i + n] += Σ_{r < rank(slot(t))} B[slot(t), o_i + n, r] ·
    (x[t] · A[slot(t), i·R + r]) for each slice i, o_i = slice_offsets[i]; tokens with
    slot -1 are untouched.

    Args:
        x: [T, K] activations, fp16/bf16/fp32, the dtype of A.
        A: [slots, S·R, K] pool A buffer, R ≤ FUSED_MAX_RANK.
        B: [slots, N, R] pool B buffer.
        out: [T, N] written in place (may be a strided view).
        segs: segments of this batch.
        slice_offsets: S+1 ascending column offsets, 0 first and N last (S ≤ 3).
        plan: a key of FUSED_PLANS (all compute the same out).
    """
    num_slices = len(slice_offsets) - 1
    num_tokens, k_dim = x.shape
    check_pool(A, x.dtype, 3, "A")
    check_pool(B, B.dtype, 3, "B")
    pool_rank = B.shape[2]
    if pool_rank > FUSED_MAX_RANK:
        raise ValueError(f"pool rank {pool_rank} > {FUSED_MAX_RANK}: use sgmv_shrink/expand")
    if not 1 <= num_slices <= MAX_SLICES:
        raise ValueError(f"{num_slices} slices, supported 1..{MAX_SLICES}")
    if A.shape[1:] != (num_slices * pool_rank, k_dim):
        raise ValueError(f"A {tuple(A.shape)} does not fit x {tuple(x.shape)}, B {tuple(B.shape)}")
    if slice_offsets[0] != 0 or slice_offsets[-1] != out.shape[1] or B.shape[1] != out.shape[1]:
        raise ValueError(f"slice_offsets {list(slice_offsets)} must span out {tuple(out.shape)}")
    if any(lo >= hi for lo, hi in zip(slice_offsets, slice_offsets[1:], strict=False)):
        raise ValueError(f"slice_offsets {list(slice_offsets)} must ascend strictly")
    if out.shape[0] != num_tokens:
        raise ValueError(f"out has {out.shape[0]} rows, x {num_tokens}")
    segs.require_tokens(num_tokens)
    if num_tokens == 0:
        return out
    tiles = FUSED_PLANS[plan]
    block_k = min(tiles.block_k, max(16, triton.next_power_of_2(k_dim)))
    widths = [hi - lo for lo, hi in zip(slice_offsets, slice_offsets[1:], strict=False)]
    slice_blocks = [triton.cdiv(w, tiles.block_n) for w in widths]
    slice_blocks += [0] * (MAX_SLICES - num_slices)
    slice_cols = [*slice_offsets[1:-1], *[UNUSED_OFFSET] * (MAX_SLICES - num_slices)]
    target_items = tiles.programs_per_sm * num_sms(x.device)
    programs = min(target_items, segs.grid_segments() * sum(slice_blocks))
    _sgmv_fused_kernel[(programs,)](
        x, A, B, out, segs.seg_indptr, segs.seg_slot, segs.slot_rank, segs.num_segments,
        k_dim, pool_rank, out.shape[1], *slice_cols[:2], *slice_blocks, target_items,
        *x.stride(), *A.stride(), *B.stride(), *out.stride(),
        BLOCK_T=segs.max_seg_len, BLOCK_R=rank_block(pool_rank), BLOCK_K=block_k,
        BLOCK_N=tiles.block_n, COLS_ALIGNED=all(o % 8 == 0 for o in slice_offsets),
        DOT_PRECISION=dot_precision(x.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return out


def sgmv_fused_ref(
    x: Tensor, A: Tensor, B: Tensor, out: Tensor, segs: LoraSegments, slice_offsets: Sequence[int]
) -> Tensor:
    """Torch reference of `sgmv_fused`: the shrink and expand references, in place."""
    y = sgmv_shrink_ref(x, A, segs, len(slice_offsets) - 1)
    return sgmv_expand_ref(y, B, out, segs, slice_offsets)
