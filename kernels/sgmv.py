"""SGMV: multi-LoRA shrink `y = x·Aᵀ` and expand `out += y·Bᵀ` over segments of one slot.

Pool layout (per module and layer): A `[slots, S*R, in]`, B `[slots, out_total, R]`, R the
pool's max rank, S stacked slices (qkv_a: q_a|kv_a; gate_up: gate|up). Slice i of y is
columns i*R:(i+1)*R and feeds out columns slice_offsets[i]:slice_offsets[i+1].

Both kernels read only the first `slot_rank[slot]` rank rows/columns of a slot, so a rank-8
adapter in a rank-64 pool costs rank-8 traffic. One program handles one segment (at most
`max_seg_len` tokens, one tl.dot tile) and one block of output columns; the shrink also
splits K across programs, because a decode batch of one token otherwise leaves one program
walking all 7168 inputs alone (SGLang's ~12.7 µs floor, TARGETS.md).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.host_math import cdiv, next_power_of_2
from kernels.launch import fast
from kernels.lora_segments import (
    LoraSegments,
    live_rank_columns,
    load_segment,
    rank_alignment,
    rank_load_bound,
)
from kernels.pdl import grid_dependency_control

# Expand supports this many stacked slices (DeepSeek needs 2: qkv_a, gate_up).
MAX_SLICES = 3
# Launchers size grids to about this many programs (2 waves on an H100's 132 SMs).
_TARGET_PROGRAMS = 264
_UNUSED = 2**30


@triton.jit
def shrink_rows(pid_sr, R, BLOCK_R: tl.constexpr, STACKED: tl.constexpr):
    """Rank tile `pid_sr` of a shrink whose A has S slices of R rows: (rows [r] of A, which
    are y's columns too; each row's rank index, R for a padding row, so `< rank` masks
    both; the tile's first rank index, to skip a tile wholly past a slot's rank).
    STACKED: 0 (tiles of BLOCK_R rows within one slice), or S: one tile of all S·R rows,
    row j being rank j % R of slice j // R."""
    if STACKED:
        rows = tl.arange(0, BLOCK_R)
        return rows, tl.where(rows < STACKED * R, rows % R, R), 0
    rank_blocks = tl.cdiv(R, BLOCK_R)
    r_start = (pid_sr % rank_blocks) * BLOCK_R
    offs_r = r_start + tl.arange(0, BLOCK_R)
    return (pid_sr // rank_blocks) * R + offs_r, offs_r, r_start


@triton.jit
def shrink_loop(
    x_ptr, x_rows, row_mask, a_cols, mask_c, k_lo, k_len, K, stride_xm, stride_xk, stride_ak,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """float32 [BLOCK_M, BLOCK_C]: x[x_rows, k_lo:k_lo+k_len] · A over the K loop, A's
    column c at pointers a_cols[c] (+ k · stride_ak); rows outside `row_mask` and columns
    outside `mask_c` read nothing (zeros)."""
    acc = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)  # [m, c]
    for k in range(k_lo, k_lo + k_len, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(
            x_ptr + x_rows[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=row_mask[:, None] & mask_k[None, :],
            other=0.0,
        )  # [m, k]
        a = tl.load(
            a_cols[None, :] + offs_k[:, None] * stride_ak,
            mask=mask_c[None, :] & mask_k[:, None],
            other=0.0,
        )  # [k, c]
        acc = tl.dot(x, a, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _shrink_item(
    x_ptr,
    a_ptr,
    y_ptr,
    seg_indptr_ptr,
    seg_slot_ptr,
    slot_rank_ptr,
    seg,
    pid_sr,
    k_lo,
    k_len,
    atomic,
    K,
    R,
    stride_xt,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_yt,
    stride_yr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STACKED: tl.constexpr,
    ATOMIC_SEM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """y[seg's tokens, slice/rank block pid_sr] (+)= x[:, k_lo:k_lo+k_len] · A[slot]ᵀ;
    STACKED as in `shrink_rows` (pid_sr is 0 when it is set)."""
    slot, rank, t_start, t_end = load_segment(seg, seg_indptr_ptr, seg_slot_ptr, slot_rank_ptr)
    rows, rank_index, r_start = shrink_rows(pid_sr, R, BLOCK_R, STACKED)
    mask_r = rank_index < rank
    if r_start < rank:
        offs_t = t_start + tl.arange(0, BLOCK_T)
        mask_t = offs_t < t_end
        a_rows = a_ptr + slot.to(tl.int64) * stride_as + rows * stride_ar
        acc = shrink_loop(
            x_ptr, offs_t, mask_t, a_rows, mask_r, k_lo, k_len, K, stride_xt, stride_xk,
            stride_ak, BLOCK_T, BLOCK_R, BLOCK_K, DOT_PRECISION,
        )  # fmt: skip
        y_ptrs = y_ptr + offs_t[:, None] * stride_yt + rows[None, :] * stride_yr
        y_mask = mask_t[:, None] & mask_r[None, :]
        if atomic:
            tl.atomic_add(y_ptrs, acc, mask=y_mask, sem=ATOMIC_SEM)
        else:
            tl.store(y_ptrs, acc, mask=y_mask)


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr,
    a_ptr,
    y_ptr,
    seg_indptr_ptr,
    seg_slot_ptr,
    slot_rank_ptr,
    K,
    R,
    k_per_split,
    stride_xt,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_yt,
    stride_yr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ATOMIC: tl.constexpr,
    STACKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """v1: one program per (segment, slice/rank block, K split), split planned on the host
    (acq_rel atomics: each one fences, MEMBAR.ALL.GPU + CCTL.IVALL in SASS)."""
    grid_dependency_control()
    _shrink_item(
        x_ptr,
        a_ptr,
        y_ptr,
        seg_indptr_ptr,
        seg_slot_ptr,
        slot_rank_ptr,
        tl.program_id(0),
        tl.program_id(1),
        tl.program_id(2) * k_per_split,
        k_per_split,
        ATOMIC,
        K,
        R,
        stride_xt,
        stride_xk,
        stride_as,
        stride_ar,
        stride_ak,
        stride_yt,
        stride_yr,
        BLOCK_T,
        BLOCK_R,
        BLOCK_K,
        STACKED,
        "acq_rel",
        DOT_PRECISION,
    )


@triton.jit
def _sgmv_shrink_planned_kernel(
    x_ptr,
    a_ptr,
    y_ptr,
    seg_indptr_ptr,
    seg_slot_ptr,
    slot_rank_ptr,
    num_segments_ptr,
    K,
    R,
    rank_programs,
    target_items,
    stride_xt,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_yt,
    stride_yr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STACKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """planned: a fixed grid walks (live segment, slice/rank block, K split) items; the split
    is planned here from the live segment count, so a graph captured for 256 tokens and
    replayed with one adapter still spreads K over the GPU (relaxed atomics: no fences)."""
    grid_dependency_control()
    seg_items = tl.load(num_segments_ptr) * rank_programs
    k_blocks = tl.cdiv(K, BLOCK_K)
    split = tl.minimum(tl.maximum(target_items // tl.maximum(seg_items, 1), 1), k_blocks)
    k_per_split = tl.cdiv(k_blocks, split) * BLOCK_K
    split = tl.cdiv(K, k_per_split)
    for item in range(tl.program_id(0), seg_items * split, tl.num_programs(0)):
        _shrink_item(
            x_ptr,
            a_ptr,
            y_ptr,
            seg_indptr_ptr,
            seg_slot_ptr,
            slot_rank_ptr,
            item // (rank_programs * split),
            (item // split) % rank_programs,
            (item % split) * k_per_split,
            k_per_split,
            split > 1,
            K,
            R,
            stride_xt,
            stride_xk,
            stride_as,
            stride_ar,
            stride_ak,
            stride_yt,
            stride_yr,
            BLOCK_T,
            BLOCK_R,
            BLOCK_K,
            STACKED,
            "relaxed",
            DOT_PRECISION,
        )


@triton.jit
def _expand_place(
    item, n_blocks, seg_indptr_ptr, seg_slot_ptr, slot_rank_ptr, N, slice1_col, slice2_col,
    slice1_block, slice2_block, BLOCK_N: tl.constexpr, COLS_ALIGNED: tl.constexpr,
):  # fmt: skip
    """Where item `item` (segment item // n_blocks, column block item % n_blocks) works:
    (slot, rank, first token, end token) as `load_segment`, then (slice index, columns
    [BLOCK_N], their mask)."""
    slot, rank, t_start, t_end = load_segment(
        item // n_blocks, seg_indptr_ptr, seg_slot_ptr, slot_rank_ptr
    )
    slice_idx, offs_n, mask_n = _column_place(
        item % n_blocks, N, slice1_col, slice2_col, slice1_block, slice2_block, BLOCK_N,
        COLS_ALIGNED,
    )  # fmt: skip
    return slot, rank, t_start, t_end, slice_idx, offs_n, mask_n


@triton.jit
def _column_place(
    pid_n, N, slice1_col, slice2_col, slice1_block, slice2_block, BLOCK_N: tl.constexpr,
    COLS_ALIGNED: tl.constexpr,
):  # fmt: skip
    """(slice index, columns [BLOCK_N], their mask) of column block pid_n."""
    # Column blocks never straddle a slice: blocks [sliceI_block, ...) belong to slice I.
    in_s1 = pid_n >= slice1_block
    in_s2 = pid_n >= slice2_block
    slice_idx = in_s1.to(tl.int32) + in_s2.to(tl.int32)
    col_lo = tl.where(in_s2, slice2_col, tl.where(in_s1, slice1_col, 0))
    col_hi = tl.where(in_s2, N, tl.minimum(tl.where(in_s1, slice2_col, slice1_col), N))
    if COLS_ALIGNED:
        # Lets the out tile load/store as 16-byte vectors (scalar 2-byte ones otherwise).
        col_lo = tl.multiple_of(col_lo, 8)
        col_hi = tl.multiple_of(col_hi, 8)
    block_lo = tl.where(in_s2, slice2_block, tl.where(in_s1, slice1_block, 0))
    offs_n = col_lo + (pid_n - block_lo) * BLOCK_N + tl.arange(0, BLOCK_N)
    return slice_idx, offs_n, offs_n < col_hi


@triton.jit
def _b_block(
    b_ptr, slot, rank, offs_n, mask_n, offs_r, stride_bs, stride_bn, stride_br,
    RANK_ALIGN: tl.constexpr,
):  # fmt: skip
    """B[slot] [r, n] at rank rows `offs_r`, columns `offs_n`, as loaded: what lies past the
    slot's rank in its rounded-up columns (`rank_load_bound`) is the caller's to zero, where
    it uses the block (zeroing it here would make the load's latency a stall right here)."""
    return tl.load(
        b_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bs + offs_n[None, :] * stride_bn
        + offs_r[:, None] * stride_br,
        mask=mask_n[None, :] & (offs_r < rank_load_bound(rank, RANK_ALIGN))[:, None],
        other=0.0,
    )  # fmt: skip


@triton.jit
def _expand_item(
    y_ptr,
    b_ptr,
    out_ptr,
    slot,
    rank,
    t_start,
    t_end,
    slice_idx,
    offs_n,
    mask_n,
    b_first,
    R,
    stride_yt,
    stride_ys,
    stride_yr,
    stride_bs,
    stride_bn,
    stride_br,
    stride_ot,
    stride_on,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    B_FIRST: tl.constexpr,
    RANK_ALIGN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    Y_EVERY_SLOT: tl.constexpr,
):
    """out[tokens t_start..t_end, columns offs_n] += y · B[slot]ᵀ over their slice. B_FIRST:
    b_first is B's first rank block, which the caller loaded (before its PDL wait); without
    it b_first is not read and every block loads here, after out (a block held from before
    out's load was slower: docs/kernel_notes.md §18)."""
    if rank > 0:
        # out is loaded before y and B so that its latency overlaps theirs.
        offs_t, mask_t, out_ptrs, out_mask, prev = _out_tile(
            out_ptr, t_start, t_end, offs_n, mask_n, stride_ot, stride_on, BLOCK_T
        )
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)  # [t, n]
        first_r = 0
        if B_FIRST:
            offs_r = tl.arange(0, BLOCK_R)
            y = _y_block(
                y_ptr, offs_t, mask_t, slot, slice_idx, R, offs_r, rank, stride_yt, stride_ys,
                stride_yr, Y_EVERY_SLOT,
            )  # fmt: skip
            acc = _add_rank_block(acc, y, b_first, offs_r, rank, DOT_PRECISION)
            first_r = BLOCK_R
        for r in range(first_r, rank, BLOCK_R):
            offs_r = r + tl.arange(0, BLOCK_R)
            y = _y_block(
                y_ptr, offs_t, mask_t, slot, slice_idx, R, offs_r, rank, stride_yt, stride_ys,
                stride_yr, Y_EVERY_SLOT,
            )  # fmt: skip
            b = _b_block(
                b_ptr, slot, rank, offs_n, mask_n, offs_r, stride_bs, stride_bn, stride_br,
                RANK_ALIGN,
            )  # fmt: skip
            acc = _add_rank_block(acc, y, b, offs_r, rank, DOT_PRECISION)
        tl.store(out_ptrs, (prev.to(tl.float32) + acc).to(prev.dtype), mask=out_mask)


@triton.jit
def _out_tile(out_ptr, t_start, t_end, offs_n, mask_n, stride_ot, stride_on, BLOCK_T: tl.constexpr):
    """(token offsets, their mask, out pointers [t, n], their mask, out's values) of the
    tokens [t_start, t_end) and columns offs_n."""
    offs_t = t_start + tl.arange(0, BLOCK_T)
    mask_t = offs_t < t_end
    out_ptrs = out_ptr + offs_t[:, None] * stride_ot + offs_n[None, :] * stride_on
    out_mask = mask_t[:, None] & mask_n[None, :]
    return offs_t, mask_t, out_ptrs, out_mask, tl.load(out_ptrs, mask=out_mask, other=0.0)


@triton.jit
def _add_rank_block(acc, y, b, offs_r, rank, DOT_PRECISION: tl.constexpr):
    """acc [t, n] + y [t, r] · b [r, n], b's rows from the slot's rank on zeroed first (a
    `_b_block` leaves what its rounded-up load read there)."""
    b = tl.where((offs_r < rank)[:, None], b, 0.0)
    return tl.dot(y.to(b.dtype), b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _y_block(
    y_ptr, offs_t, mask_t, slot, slice_idx, R, offs_r, rank, stride_yt, stride_ys, stride_yr,
    Y_EVERY_SLOT: tl.constexpr,
):  # fmt: skip
    """y [t, r] of tokens `offs_t` in slice `slice_idx`, rank columns `offs_r`: zero past the
    slot's rank. Y_EVERY_SLOT: y holds every slot's columns, slot s's stride_ys apart (else
    only the token's own slot's)."""
    if Y_EVERY_SLOT:
        y_ptr += tl.maximum(slot, 0).to(tl.int64) * stride_ys
    return tl.load(
        y_ptr + offs_t[:, None] * stride_yt + (slice_idx * R + offs_r)[None, :] * stride_yr,
        mask=mask_t[:, None] & (offs_r < rank)[None, :],
        other=0.0,
    )


@triton.jit
def _sgmv_expand_kernel(
    y_ptr,
    b_ptr,
    out_ptr,
    seg_indptr_ptr,
    seg_slot_ptr,
    slot_rank_ptr,
    num_segments_ptr,
    n_blocks,
    R,
    N,
    slice1_col,
    slice2_col,
    slice1_block,
    slice2_block,
    stride_yt,
    stride_yr,
    stride_bs,
    stride_bn,
    stride_br,
    stride_ot,
    stride_on,
    stride_ys,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PLANNED: tl.constexpr,
    SEGS_PER_ITEM: tl.constexpr,
    COLS_ALIGNED: tl.constexpr,
    RANK_ALIGN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    Y_EVERY_SLOT: tl.constexpr,
):
    """v1: one program per (segment, column block) of the grid. planned: a fixed grid walks
    the (live segment, column block) items, so padding segments of a graph captured for more
    tokens cost no programs.

    A program's first item is item program_id whatever the live count (the grid covers at
    most the capacity's segments, and those past the live ones are empty), so its segment,
    rank and first B block are read before the PDL wait: nothing of the step writes them,
    and their chain of dependent loads (segment, rank, B) then overlaps the launch and the
    kernel before. y and out come after the wait. Later items load theirs in turn.

    SEGS_PER_ITEM > 1 (long steps, planned): a fixed grid walks the (group of SEGS_PER_ITEM
    consecutive live segments, column block) items, and an item keeps its slot's B block
    while the slot repeats (a prompt is one slot over many segments), so B is read once per
    run and column block, not once per 16 tokens. Needs BLOCK_R ≥ R (one rank tile). The
    first item's reads before the wait are then unused.

    Y_EVERY_SLOT: y is the tail of a product with a carried weight (every slot's shrink of
    every token, slot s's columns stride_ys apart); each token reads its own slot's. Its
    stride_ys comes last among the runtime arguments, so that without it the kernel
    compiles exactly as before."""
    pid = tl.program_id(0)
    slot, rank, t_start, t_end, slice_idx, offs_n, mask_n = _expand_place(
        pid, n_blocks, seg_indptr_ptr, seg_slot_ptr, slot_rank_ptr, N, slice1_col, slice2_col,
        slice1_block, slice2_block, BLOCK_N, COLS_ALIGNED,
    )  # fmt: skip
    b_first = _b_block(
        b_ptr, slot, rank, offs_n, mask_n, tl.arange(0, BLOCK_R), stride_bs, stride_bn,
        stride_br, RANK_ALIGN,
    )  # fmt: skip
    grid_dependency_control()
    if SEGS_PER_ITEM > 1:
        _expand_runs(
            y_ptr, b_ptr, out_ptr, seg_indptr_ptr, seg_slot_ptr, slot_rank_ptr,
            num_segments_ptr, n_blocks, R, N, slice1_col, slice2_col, slice1_block,
            slice2_block, stride_yt, stride_ys, stride_yr, stride_bs, stride_bn, stride_br,
            stride_ot, stride_on, BLOCK_T, BLOCK_N, BLOCK_R, SEGS_PER_ITEM, COLS_ALIGNED,
            RANK_ALIGN, DOT_PRECISION, Y_EVERY_SLOT,
        )  # fmt: skip
    else:
        _expand_item(
            y_ptr, b_ptr, out_ptr, slot, rank, t_start, t_end, slice_idx, offs_n, mask_n,
            b_first, R, stride_yt, stride_ys, stride_yr, stride_bs, stride_bn, stride_br, stride_ot,
            stride_on, BLOCK_T, BLOCK_N, BLOCK_R, True, RANK_ALIGN, DOT_PRECISION, Y_EVERY_SLOT,
        )  # fmt: skip
        if PLANNED:
            last, step = tl.load(num_segments_ptr) * n_blocks, tl.num_programs(0)
            for item in range(pid + step, last, step):
                slot, rank, t_start, t_end, slice_idx, offs_n, mask_n = _expand_place(
                    item, n_blocks, seg_indptr_ptr, seg_slot_ptr, slot_rank_ptr, N, slice1_col,
                    slice2_col, slice1_block, slice2_block, BLOCK_N, COLS_ALIGNED,
                )  # fmt: skip
                _expand_item(
                    y_ptr, b_ptr, out_ptr, slot, rank, t_start, t_end, slice_idx, offs_n, mask_n,
                    b_first, R, stride_yt, stride_ys, stride_yr, stride_bs, stride_bn, stride_br,
                    stride_ot, stride_on, BLOCK_T, BLOCK_N, BLOCK_R, False, RANK_ALIGN,
                    DOT_PRECISION, Y_EVERY_SLOT,
                )  # fmt: skip


@triton.jit
def _expand_runs(
    y_ptr, b_ptr, out_ptr, seg_indptr_ptr, seg_slot_ptr, slot_rank_ptr, num_segments_ptr,
    n_blocks, R, N, slice1_col, slice2_col, slice1_block, slice2_block, stride_yt, stride_ys,
    stride_yr, stride_bs, stride_bn, stride_br, stride_ot, stride_on, BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SEGS_PER_ITEM: tl.constexpr,
    COLS_ALIGNED: tl.constexpr, RANK_ALIGN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    Y_EVERY_SLOT: tl.constexpr,
):  # fmt: skip
    """`_sgmv_expand_kernel` with SEGS_PER_ITEM > 1: the items of consecutive segments."""
    num_segments = tl.load(num_segments_ptr)
    last = tl.cdiv(num_segments, SEGS_PER_ITEM) * n_blocks
    offs_r = tl.arange(0, BLOCK_R)
    for item in range(tl.program_id(0), last, tl.num_programs(0)):
        slice_idx, offs_n, mask_n = _column_place(
            item % n_blocks, N, slice1_col, slice2_col, slice1_block, slice2_block, BLOCK_N,
            COLS_ALIGNED,
        )  # fmt: skip
        first = (item // n_blocks) * SEGS_PER_ITEM
        held = -1  # the slot whose B block b holds
        b = tl.zeros((BLOCK_R, BLOCK_N), dtype=b_ptr.dtype.element_ty)
        for seg in range(first, tl.minimum(first + SEGS_PER_ITEM, num_segments)):
            slot, rank, t_start, t_end = load_segment(
                seg, seg_indptr_ptr, seg_slot_ptr, slot_rank_ptr
            )
            if rank > 0:
                offs_t, mask_t, out_ptrs, out_mask, prev = _out_tile(
                    out_ptr, t_start, t_end, offs_n, mask_n, stride_ot, stride_on, BLOCK_T
                )
                if slot != held:
                    b = _b_block(
                        b_ptr, slot, rank, offs_n, mask_n, offs_r, stride_bs, stride_bn,
                        stride_br, RANK_ALIGN,
                    )  # fmt: skip
                    b = tl.where((offs_r < rank)[:, None], b, 0.0)
                    held = slot
                y = _y_block(
                    y_ptr, offs_t, mask_t, slot, slice_idx, R, offs_r, rank, stride_yt,
                    stride_ys, stride_yr, Y_EVERY_SLOT,
                )  # fmt: skip
                # Onto the stored values in float32, rounded once (as `_expand_item` rounds).
                acc = tl.dot(y.to(b.dtype), b, prev.to(tl.float32), input_precision=DOT_PRECISION)
                tl.store(out_ptrs, acc.to(prev.dtype), mask=out_mask)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs must not silently drop to tf32; half types are exact either way."""
    return "ieee" if dtype == torch.float32 else "tf32"


def plan_split_k(k_dim: int, programs: int) -> tuple[int, int, int]:
    """(BLOCK_K, K per program, K splits) so that `programs` × splits fills the GPU: a
    decode step of one token would otherwise leave one program walking all of K."""
    if k_dim < 64:
        block_k = next_power_of_2(max(k_dim, 16))
    elif k_dim < 128 or programs * cdiv(k_dim, 128) < _TARGET_PROGRAMS:
        block_k = 64  # B=1 at hidden 7168: 112 programs instead of 56
    else:
        block_k = 128
    k_blocks = cdiv(k_dim, block_k)
    split_k = max(1, min(k_blocks, _TARGET_PROGRAMS // programs))
    k_per_split = cdiv(k_blocks, split_k) * block_k
    return block_k, k_per_split, cdiv(k_dim, k_per_split)


def planned_split(seg_items: int, target_items: int, k_blocks: int) -> int:
    """K splits of the planned shrink for `seg_items` live (segment, rank block) items: the
    host's copy of the kernel's own rule (it must match: the split decides whether y needs
    zeros for its atomic adds)."""
    return min(max(target_items // max(seg_items, 1), 1), k_blocks)


def rank_block(pool_rank: int) -> int:
    """Rank tile: the pool rank rounded up to a power of two, within tl.dot's 16..64."""
    return min(max(next_power_of_2(pool_rank), 16), 64)


# Widest shrink tile that takes every stacked slice at once (tl.dot's N ≤ 64 here).
STACKED_MAX_ROWS = 64


def shrink_rank_tile(num_slices: int, pool_rank: int) -> tuple[int, int]:
    """(BLOCK_R, STACKED) of a shrink: the S·R rows of a stacked module (qkv_a, gate_up) in
    one tile where they fit STACKED_MAX_ROWS (STACKED = S: half the items of one tile per
    slice, each as long), else per slice (`rank_block`, STACKED 0)."""
    rows = num_slices * pool_rank
    if num_slices > 1 and rows <= STACKED_MAX_ROWS:
        return max(16, next_power_of_2(rows)), num_slices
    return rank_block(pool_rank), 0


@dataclass(frozen=True)
class SgmvVariant:
    """How a launcher maps the work onto programs (see docs/kernel_notes.md).

    planned False is v1: one program per work item of the grid, split-K planned on the host
    from the segment count it sees (the capacity while a CUDA graph is captured).
    planned True: min(items, programs_per_sm × SMs) programs walk the live items; the
    shrink's split-K is planned on the device from the live segment count.
    """

    planned: bool
    programs_per_sm: int = 8
    # Shrink BLOCK_K / expand BLOCK_N; None keeps v1's rule.
    block: int | None = None
    # Software-pipelining depth of the launch; None keeps Triton's default.
    num_stages: int | None = None
    # Expand only: consecutive segments an item covers, keeping a slot's B block across
    # them (`_sgmv_expand_kernel`'s SEGS_PER_ITEM; pool ranks of one rank tile, others 1).
    segments_per_item: int = 1

    def __post_init__(self) -> None:
        if self.programs_per_sm < 1:
            raise ValueError(f"programs_per_sm must be >= 1, got {self.programs_per_sm}")
        if self.segments_per_item < 1 or (self.segments_per_item > 1 and not self.planned):
            raise ValueError(
                f"segments_per_item must be >= 1 (above 1 only planned), got "
                f"{self.segments_per_item}"
            )
        if self.block is not None and (self.block < 16 or self.block & (self.block - 1)):
            raise ValueError(f"block must be a power of two >= 16, got {self.block}")


SHRINK_VARIANTS = {
    "v1": SgmvVariant(planned=False),
    "planned": SgmvVariant(planned=True, programs_per_sm=8, block=128),
    "planned_k64": SgmvVariant(planned=True, programs_per_sm=16, block=64),
    # Fewer, longer K splits: a quarter / an eighth of planned's float32 atomics per token.
    "planned_p2": SgmvVariant(planned=True, programs_per_sm=2, block=128),
    "planned_p1": SgmvVariant(planned=True, programs_per_sm=1, block=128),
}
EXPAND_VARIANTS = {
    "v1": SgmvVariant(planned=False),
    # Unpipelined: a pool rank ≤ 64 is one rank tile, so the loop over rank runs once and
    # pipelining it only staged B through shared memory (H100, V3 shapes, cold L2: rank 16
    # at 64 / 256 tokens 10.5 → 9.0, 17.0 → 14.4 µs; rank 64 23.4 → 20.0, 42.3 → 37.2;
    # lora_kernels_v13_stages_h100.json).
    "planned": SgmvVariant(planned=True, programs_per_sm=16, block=128, num_stages=1),
    "planned_n64": SgmvVariant(planned=True, programs_per_sm=16, block=64),
    # Wider tiles, more programs in flight: a prompt chunk's read-modify-write of out nearer
    # copy bandwidth (H100, 8192 tokens × 16 adapters, expand_tiles_h100.json: q_b 68.0 →
    # 58.3 µs, gate_up 129.5 → 96.6, o 45.1 → 42.4; floors 34.2 / 62.7 / 22.8).
    # Unpipelined as "planned" (4096 tokens, 1 / 8 adapters, lora_kernels_v13_expand_stages_
    # all_h100.json: V3 rank 16 57.9 → 53.6 / 58.4 → 55.4 µs, rank 64 113.0 → 91.4 /
    # 113.8 → 95.6; V2-Lite rank 64 37.1 → 32.3 / 36.8 → 32.4).
    "planned_n256_p32": SgmvVariant(planned=True, programs_per_sm=32, block=256, num_stages=1),
    # Long steps: a slot's B block kept across an item's 4 consecutive segments (a prompt
    # is one slot over many), 8 programs an SM. H200, 8192 tokens × 16 adapters, V2-Lite's
    # five prompt-step expands summed (runs_expand_plans_s39_h200.json): rank 16 185.9 →
    # 178.2 µs, rank 64 338.0 → 292.3; 4096 tokens rank 16 117.4 → 114.4.
    "runs_n256_p8_g4": SgmvVariant(
        planned=True, programs_per_sm=8, block=256, num_stages=1, segments_per_item=4
    ),
}
# What the launchers use unless told otherwise: the prediction of docs/kernel_notes.md,
# to be replaced by the measured best.
DEFAULT_VARIANT = "planned"
# Steps of at least this many tokens (eager prompt chunks) expand with LONG_STEP_EXPAND
# unless a variant is named; decode steps (and their graphs) keep DEFAULT_VARIANT.
LONG_STEP_TOKENS = 4096
LONG_STEP_EXPAND = "runs_n256_p8_g4"


def expand_variant(num_tokens: int) -> str:
    """The expand variant a launch of `num_tokens` tokens takes when none is named."""
    return LONG_STEP_EXPAND if num_tokens >= LONG_STEP_TOKENS else DEFAULT_VARIANT


def num_sms(device: torch.device) -> int:
    """Multiprocessors of the GPU; 1 under the CPU interpreter, so that the planned kernels'
    program loops run several items per program in the CPU tests."""
    if device.type != "cuda":
        return 1
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sgmv_shrink(
    x: Tensor,
    A: Tensor,
    segs: LoraSegments,
    num_slices: int = 1,
    out: Tensor | None = None,
    *,
    variant: str = DEFAULT_VARIANT,
    zero_unused: bool = True,
) -> Tensor:
    """Shrink every token by its segment's adapter.

    Semantics: y[t, i*R + r] = x[t] · A[slot(t), i*R + r] for r < rank(slot(t)), else 0;
    tokens with slot -1 get 0. With zero_unused False the "else 0" entries of `out` are
    left as they were (the expand never reads them), and `out` is zeroed only when the
    launch adds split-K partial sums into it.

    Args:
        x: [T, in] activations, fp16/bf16/fp32, same dtype as A.
        A: [slots, num_slices * R, in] pool A buffer.
        segs: segments of this batch (T = segs.num_tokens rows of x are read).
        num_slices: stacked slices S in A.
        out: optional float32 [T, S*R] buffer; it is written (and zeroed, see zero_unused).
        variant: a key of SHRINK_VARIANTS (all compute the same y).
        zero_unused: zero `out` first (the default); False skips that memset wherever the
            launch stores each live entry once (an eager step whose segments fill the GPU).
    Returns:
        y: float32 [T, S*R] (float32 so split-K partial sums add up exactly once by
        atomics and the expand reads full precision).
    """
    num_tokens, k_dim = x.shape
    plan = SHRINK_VARIANTS[variant]
    _check_pool(A, x.dtype, 3, "A")
    if A.shape[2] != k_dim or A.shape[1] % num_slices:
        raise ValueError(f"A {tuple(A.shape)} does not fit x {tuple(x.shape)}, {num_slices} slices")
    pool_rank = A.shape[1] // num_slices
    segs.require_tokens(num_tokens)
    if out is None:
        out = torch.zeros(num_tokens, num_slices * pool_rank, dtype=torch.float32, device=x.device)
        zero_unused = False
    elif out.shape != (num_tokens, num_slices * pool_rank) or out.dtype != torch.float32:
        raise ValueError(f"out must be float32 [{num_tokens}, {num_slices * pool_rank}]")
    if num_tokens == 0:
        if zero_unused:
            out.zero_()
        return out
    block_r, stacked = shrink_rank_tile(num_slices, pool_rank)
    rank_programs = 1 if stacked else num_slices * cdiv(pool_rank, block_r)
    grid_segments = segs.grid_segments()
    meta = (segs.seg_indptr, segs.seg_slot, segs.slot_rank)
    strides = (*x.stride(), *A.stride(), *out.stride())
    common = {
        "BLOCK_T": segs.max_seg_len,
        "BLOCK_R": block_r,
        "STACKED": stacked,
        "DOT_PRECISION": dot_precision(x.dtype),
    }
    if not plan.planned:
        block_k, k_per_split, split_k = plan_split_k(k_dim, grid_segments * rank_programs)
        if zero_unused or split_k > 1:
            out.zero_()
        fast(_sgmv_shrink_kernel)[(grid_segments, rank_programs, split_k)](
            x, A, out, *meta, k_dim, pool_rank, k_per_split, *strides,
            BLOCK_K=block_k, ATOMIC=split_k > 1, **common,
        )  # fmt: skip
        return out
    block_k = plan.block if k_dim >= (plan.block or 0) else next_power_of_2(max(k_dim, 16))
    target_items = plan.programs_per_sm * num_sms(x.device)
    k_blocks = cdiv(k_dim, block_k)
    max_items = grid_segments * rank_programs * k_blocks
    programs = min(max_items, max(target_items, grid_segments * rank_programs))
    # The kernel plans its split from the live segment count, which the host knows too
    # unless a graph is captured (its replays see other counts). The capture query (a host
    # call) comes last: a split > 1 settles the answer without it.
    live_items = segs.num_live_segments * rank_programs
    if zero_unused or planned_split(live_items, target_items, k_blocks) > 1 or segs.capturing():
        out.zero_()
    fast(_sgmv_shrink_planned_kernel)[(programs,)](
        x, A, out, *meta, segs.num_segments, k_dim, pool_rank, rank_programs, target_items,
        *strides, BLOCK_K=block_k, **common,
    )  # fmt: skip
    return out


def sgmv_expand(
    y: Tensor,
    B: Tensor,
    out: Tensor,
    segs: LoraSegments,
    slice_offsets: Sequence[int],
    *,
    variant: str | None = None,
    y_every_slot: bool = False,
) -> Tensor:
    """Expand every token by its segment's adapter and add into `out` in place.

    Semantics: out[t, o_i + n] += Σ_{r < rank(slot(t))} y[t, i*R + r] · B[slot(t), o_i + n, r]
    for each slice i with o_i = slice_offsets[i], n < slice_offsets[i+1] - o_i.

    Args:
        y: [T, S*R] shrink output (float32 or the B dtype); with `y_every_slot`
            [T, slots·S*R], every slot's shrink of every token, token t's own at columns
            slot(t)·S*R onwards (a product whose weight carries the pool's A rows), rows
            may be strided.
        B: [slots, out_total, R] pool B buffer, fp16/bf16/fp32.
        out: [T, out_total] written in place (any float dtype, may be a strided view).
        segs: segments of this batch.
        slice_offsets: S+1 ascending column offsets, 0 first and out_total last (S <= 3).
        variant: a key of EXPAND_VARIANTS (all compute the same out); None: by the step's
            length (`expand_variant`).
    """
    num_slices = len(slice_offsets) - 1
    num_tokens, out_total = out.shape
    plan = EXPAND_VARIANTS[variant or expand_variant(num_tokens)]
    _check_pool(B, B.dtype, 3, "B")
    pool_rank = B.shape[2]
    if not 1 <= num_slices <= MAX_SLICES:
        raise ValueError(f"expand supports 1..{MAX_SLICES} slices, got {num_slices}")
    if slice_offsets[0] != 0 or slice_offsets[-1] != out_total or B.shape[1] != out_total:
        raise ValueError(f"slice_offsets {list(slice_offsets)} must span out {tuple(out.shape)}")
    if any(lo >= hi for lo, hi in zip(slice_offsets, slice_offsets[1:], strict=False)):
        raise ValueError(f"slice_offsets {list(slice_offsets)} must ascend strictly")
    y_width = num_slices * pool_rank * (B.shape[0] if y_every_slot else 1)
    if y.shape != (num_tokens, y_width):
        raise ValueError(f"y {tuple(y.shape)} != [{num_tokens}, {y_width}]")
    segs.require_tokens(num_tokens)
    if num_tokens == 0:
        return out
    grid_segments = segs.grid_segments()
    if plan.block is None:
        # Wide tiles for wide outputs unless that leaves SMs idle (B=1: 112 programs, not 56).
        wide = grid_segments * cdiv(out_total, 128) >= _TARGET_PROGRAMS
        block_n = 128 if wide else 64
    else:
        block_n = plan.block
    block_cols = [0] * (MAX_SLICES + 1)
    slice_cols = [*slice_offsets[1:-1], *[_UNUSED] * (MAX_SLICES - num_slices)]
    for i in range(num_slices):
        width = slice_offsets[i + 1] - slice_offsets[i]
        block_cols[i + 1] = block_cols[i] + cdiv(width, block_n)
    slice_blocks = [*block_cols[1:num_slices], *[_UNUSED] * (MAX_SLICES - num_slices)]
    n_blocks = block_cols[num_slices]
    block_r = rank_block(pool_rank)
    segs_per_item = plan.segments_per_item if block_r >= pool_rank else 1
    programs = cdiv(grid_segments, segs_per_item) * n_blocks
    if plan.planned:
        programs = min(programs, plan.programs_per_sm * num_sms(out.device))
    args = (
        y, B, out, segs.seg_indptr, segs.seg_slot, segs.slot_rank, segs.num_segments,
        n_blocks, pool_rank, out_total, *slice_cols[:2], *slice_blocks[:2],
        *y.stride(), *B.stride(), *out.stride(), num_slices * pool_rank * y.stride(1),
    )  # fmt: skip
    common = {
        "BLOCK_T": segs.max_seg_len,
        "BLOCK_N": block_n,
        "BLOCK_R": block_r,
        "COLS_ALIGNED": plan.planned and all(o % 8 == 0 for o in slice_offsets),
        "RANK_ALIGN": rank_alignment(pool_rank),
        "DOT_PRECISION": dot_precision(B.dtype),
        **({} if plan.num_stages is None else {"num_stages": plan.num_stages}),
    }
    fast(_sgmv_expand_kernel)[(programs,)](
        *args, PLANNED=plan.planned, SEGS_PER_ITEM=segs_per_item, Y_EVERY_SLOT=y_every_slot,
        **common,
    )  # fmt: skip
    return out


def sgmv_shrink_ref(x: Tensor, A: Tensor, segs: LoraSegments, num_slices: int = 1) -> Tensor:
    """Torch gather + bmm reference of `sgmv_shrink` in x's dtype (float32 accumulated in
    float64: this is also the CPU serving path, compared with transformers+peft ≤ 1e-4)."""
    num_tokens = x.shape[0]
    pool_rank = A.shape[1] // num_slices
    slot = segs.token_slot[:num_tokens].long()  # [T]
    keep = live_rank_columns(segs.slot_rank, slot, pool_rank).repeat(1, num_slices)  # [T, S*R]
    a = torch.where(keep[:, :, None], A[slot.clamp(min=0)], 0)  # [T, S*R, in]
    wide = _accumulation_dtype(x.dtype)
    return torch.bmm(a.to(wide), x.to(wide).unsqueeze(2)).squeeze(2).to(x.dtype)  # [T, S*R]


def sgmv_expand_ref(
    y: Tensor,
    B: Tensor,
    out: Tensor,
    segs: LoraSegments,
    slice_offsets: Sequence[int],
    y_every_slot: bool = False,
) -> Tensor:
    """Torch gather + bmm reference of `sgmv_expand` in B's dtype (float32 accumulated in
    float64, as `sgmv_shrink_ref`), in place."""
    num_tokens = out.shape[0]
    pool_rank = B.shape[2]
    slot = segs.token_slot[:num_tokens].long()  # [T]
    if y_every_slot:  # [T, slots, S·R] → each token's own slot's [T, S·R]
        y = y.reshape(num_tokens, B.shape[0], -1)[torch.arange(num_tokens), slot.clamp(min=0)]
    keep = live_rank_columns(segs.slot_rank, slot, pool_rank)  # [T, R]
    b = torch.where(keep[:, None, :], B[slot.clamp(min=0)], 0)  # [T, out_total, R]
    for i, (lo, hi) in enumerate(zip(slice_offsets, slice_offsets[1:], strict=False)):
        y_i = torch.where(keep, y[:, i * pool_rank : (i + 1) * pool_rank], 0).to(B.dtype)
        wide = _accumulation_dtype(B.dtype)
        delta = torch.bmm(b[:, lo:hi].to(wide), y_i.to(wide).unsqueeze(2)).squeeze(2)  # [T, out_i]
        out[:, lo:hi] += delta.to(out.dtype)
    return out


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float32 else dtype


def _check_pool(w: Tensor, dtype: torch.dtype, ndim: int, name: str) -> None:
    if w.dim() != ndim or w.dtype != dtype:
        raise ValueError(f"{name} must be {ndim}-D {dtype}, got {tuple(w.shape)} {w.dtype}")
    if w.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, strides {w.stride()}")
