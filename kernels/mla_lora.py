"""MLA `attn.kv_b` LoRA in the absorbed decode path, without materialising B·A.

The absorbed path never forms k_nope / v: it folds kv_b's weight into the query
(q_lat = q_nope·W_UK, per head) and into the output (o = o_lat·W_UVᵀ). kv_b's LoRA
ΔW = B·A (A `[slots, R, kv_lora_rank]`, B `[slots, H*(nope+v), R]` with head h's rows
h*(nope+v) + [0:nope] = k part, + [nope:nope+v] = v part) is folded the same way:

    q_lat[t,h,:] += (q_nope[t,h,:] · B_k[slot,h]) · A[slot]        (before attention)
    o[t,h,:]     += (o_lat[t,h,:] · A[slot]ᵀ) · B_v[slot,h]ᵀ        (after attention)

Each correction is one launch (they sit on either side of the attention kernel), one
program per (segment, head): the rank-sized intermediate stays in registers. Where the
attention's split merge runs, the output correction is written by the merge itself
(`OutputCorrection`, `store_output_correction`): its programs hold whole o_lat rows. Shapes:
T tokens, H heads, D = qk_nope_head_dim, V = v_head_dim, C = kv_lora_rank, R pool rank.
Prefill runs the unabsorbed path, where kv_b LoRA is plain SGMV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.host_math import next_power_of_2
from kernels.launch import fast
from kernels.lora_segments import (
    LoraSegments,
    live_rank_columns,
    load_segment,
    rank_alignment,
    rank_load_bound,
)
from kernels.pdl import grid_dependency_control
from kernels.sgmv import dot_precision, num_sms

# v1: one program per (segment, head); planned: at most this many programs per SM walk the
# live (segment, head) items (see kernels/sgmv.py SgmvVariant and docs/kernel_notes.md);
# prefetch: as planned with whole weight tiles, a program reading its first item's segment
# and weights before its PDL wait, so they overlap the kernel before it (where the tiles
# fit: PREFETCH_MAX_TILE; "planned" otherwise). 4 programs per SM: a batch of 64 tokens
# over 32 adapters (512 items at 16 heads) is one item each, and fewer waiting programs
# hold an SM's slots while the kernel before runs.
MLA_VARIANTS = {"v1": None, "planned": 16, "prefetch": 4}
DEFAULT_MLA_VARIANT = "planned"
# Largest weight tile (elements) "prefetch" holds in registers: [512, 32] bf16 is 64 values
# a thread at 8 warps. DeepSeek's kv_b at pool rank ≤ 32 fits (C = 512); rank 64 does not.
PREFETCH_MAX_TILE = 16384


@triton.jit
def _mla_absorbed_lora_item(
    x_ptr,
    out_ptr,
    w1_ptr,
    w2_ptr,
    seg_indptr_ptr,
    seg_slot_ptr,
    slot_rank_ptr,
    seg,
    head,
    IN,
    OUT,
    stride_xt,
    stride_xh,
    stride_xi,
    stride_ot,
    stride_oh,
    stride_oo,
    stride_w1s,
    stride_w1h,
    stride_w1i,
    stride_w1r,
    stride_w2s,
    stride_w2h,
    stride_w2r,
    stride_w2o,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_IN: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
    W1_RANK_ALIGN: tl.constexpr,
    W2_RANK_ALIGN: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """out[t,h,:] += (x[t,h,:] · w1[slot,h]) · w2[slot,h] for one (segment, head): both
    corrections are this shape, with A and B's k / v part in the w1 / w2 roles. Without
    ACCUMULATE out is overwritten with the correction (zeros for a segment without work)."""
    slot, rank, t_start, t_end = load_segment(seg, seg_indptr_ptr, seg_slot_ptr, slot_rank_ptr)
    slot = tl.maximum(slot, 0)
    if (rank > 0) | (not ACCUMULATE):
        offs_t = t_start + tl.arange(0, BLOCK_T)
        mask_t = offs_t < t_end
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        w1 = w1_ptr + slot.to(tl.int64) * stride_w1s + head * stride_w1h
        x_head = x_ptr + head * stride_xh
        out_head = out_ptr + head * stride_oh
        z = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)  # [t, r]
        for i in range(0, IN, BLOCK_IN):
            offs_i = i + tl.arange(0, BLOCK_IN)
            mask_i = offs_i < IN
            x = tl.load(
                x_head + offs_t[:, None] * stride_xt + offs_i[None, :] * stride_xi,
                mask=mask_t[:, None] & mask_i[None, :] & (rank > 0),
                other=0.0,
            )  # [t, i]
            w = tl.load(
                w1 + offs_i[:, None] * stride_w1i + offs_r[None, :] * stride_w1r,
                mask=mask_i[:, None] & (offs_r < rank_load_bound(rank, W1_RANK_ALIGN))[None, :],
                other=0.0,
            )  # [i, r]
            w = tl.where(mask_r[None, :], w, 0.0)
            z = tl.dot(x, w, z, input_precision=DOT_PRECISION)
        w2 = w2_ptr + slot.to(tl.int64) * stride_w2s + head * stride_w2h
        for o in range(0, OUT, BLOCK_OUT):
            offs_o = o + tl.arange(0, BLOCK_OUT)
            mask_o = offs_o < OUT
            w = tl.load(
                w2 + offs_r[:, None] * stride_w2r + offs_o[None, :] * stride_w2o,
                mask=(offs_r < rank_load_bound(rank, W2_RANK_ALIGN))[:, None] & mask_o[None, :],
                other=0.0,
            )  # [r, o]
            w = tl.where(mask_r[:, None], w, 0.0)
            delta = tl.dot(z.to(w.dtype), w, input_precision=DOT_PRECISION)  # [t, o]
            out_ptrs = out_head + offs_t[:, None] * stride_ot + offs_o[None, :] * stride_oo
            _add_or_store(out_ptrs, delta, mask_t[:, None] & mask_o[None, :], ACCUMULATE)


@triton.jit
def _add_or_store(out_ptrs, delta, mask, ACCUMULATE: tl.constexpr):
    """out (+)= delta [t, o] float32, rounded once to out's dtype."""
    if ACCUMULATE:
        prev = tl.load(out_ptrs, mask=mask, other=0.0)
        tl.store(out_ptrs, (prev.to(tl.float32) + delta).to(prev.dtype), mask=mask)
    else:
        tl.store(out_ptrs, delta.to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _mla_absorbed_lora_kernel(
    x_ptr,
    out_ptr,
    w1_ptr,
    w2_ptr,
    seg_indptr_ptr,
    seg_slot_ptr,
    slot_rank_ptr,
    num_segments_ptr,
    H,
    IN,
    OUT,
    stride_xt,
    stride_xh,
    stride_xi,
    stride_ot,
    stride_oh,
    stride_oo,
    stride_w1s,
    stride_w1h,
    stride_w1i,
    stride_w1r,
    stride_w2s,
    stride_w2h,
    stride_w2r,
    stride_w2o,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_IN: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
    W1_RANK_ALIGN: tl.constexpr,
    W2_RANK_ALIGN: tl.constexpr,
    PLANNED: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """v1: one program per (segment, head) of the grid. planned: a fixed grid walks the
    (live segment, head) items, so a graph captured for 256 tokens does not start 256 × H
    programs when few segments are live."""
    grid_dependency_control()
    first, last, step = tl.program_id(0), tl.program_id(0) + 1, 1
    if PLANNED:
        last, step = tl.load(num_segments_ptr) * H, tl.num_programs(0)
    for item in range(first, last, step):
        _mla_absorbed_lora_item(
            x_ptr,
            out_ptr,
            w1_ptr,
            w2_ptr,
            seg_indptr_ptr,
            seg_slot_ptr,
            slot_rank_ptr,
            item // H,
            item % H,
            IN,
            OUT,
            stride_xt,
            stride_xh,
            stride_xi,
            stride_ot,
            stride_oh,
            stride_oo,
            stride_w1s,
            stride_w1h,
            stride_w1i,
            stride_w1r,
            stride_w2s,
            stride_w2h,
            stride_w2r,
            stride_w2o,
            BLOCK_T,
            BLOCK_R,
            BLOCK_IN,
            BLOCK_OUT,
            W1_RANK_ALIGN,
            W2_RANK_ALIGN,
            ACCUMULATE,
            DOT_PRECISION,
        )


@triton.jit
def _mla_absorbed_lora_prefetch_kernel(
    x_ptr,
    out_ptr,
    w1_ptr,
    w2_ptr,
    seg_indptr_ptr,
    seg_slot_ptr,
    slot_rank_ptr,
    num_segments_ptr,
    H,
    IN,
    OUT,
    stride_xt,
    stride_xh,
    stride_xi,
    stride_ot,
    stride_oh,
    stride_oo,
    stride_w1s,
    stride_w1h,
    stride_w1i,
    stride_w1r,
    stride_w2s,
    stride_w2h,
    stride_w2r,
    stride_w2o,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_IN: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
    W1_RANK_ALIGN: tl.constexpr,
    W2_RANK_ALIGN: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """`_mla_absorbed_lora_item` with whole tiles (BLOCK_IN ≥ IN, BLOCK_OUT ≥ OUT) over a
    fixed grid walking the live (segment, head) items, as "planned". A program's first item
    reads its segment and both weight tiles before the PDL wait: the batch's segments are
    copied in before the step and the pool's weights change only between steps, so these
    reads overlap the kernel before this one (in the model, the latent-cache write) instead
    of following it. Further items (more items than programs) read theirs after."""
    item, items = tl.program_id(0), tl.load(num_segments_ptr) * H
    w1, w2, rank, t_start, t_end = _absorbed_item_weights(
        w1_ptr, w2_ptr, seg_indptr_ptr, seg_slot_ptr, slot_rank_ptr,
        tl.where(item < items, item // H, 0), item % H, item < items, IN, OUT,
        stride_w1s, stride_w1h, stride_w1i, stride_w1r, stride_w2s, stride_w2h, stride_w2r,
        stride_w2o, BLOCK_R, BLOCK_IN, BLOCK_OUT, W1_RANK_ALIGN, W2_RANK_ALIGN,
    )  # fmt: skip
    grid_dependency_control()
    for next_item in range(item, items, tl.num_programs(0)):
        head = next_item % H
        if next_item != item:
            w1, w2, rank, t_start, t_end = _absorbed_item_weights(
                w1_ptr, w2_ptr, seg_indptr_ptr, seg_slot_ptr, slot_rank_ptr, next_item // H,
                head, True, IN, OUT, stride_w1s, stride_w1h, stride_w1i, stride_w1r, stride_w2s,
                stride_w2h, stride_w2r, stride_w2o, BLOCK_R, BLOCK_IN, BLOCK_OUT, W1_RANK_ALIGN,
                W2_RANK_ALIGN,
            )  # fmt: skip
        if (rank > 0) | (not ACCUMULATE):
            offs_t = t_start + tl.arange(0, BLOCK_T)
            mask_t = offs_t < t_end
            offs_i = tl.arange(0, BLOCK_IN)
            x = tl.load(
                x_ptr
                + head * stride_xh
                + offs_t[:, None] * stride_xt
                + offs_i[None, :] * stride_xi,
                mask=mask_t[:, None] & (offs_i < IN)[None, :] & (rank > 0),
                other=0.0,
            )  # [t, i]
            z = tl.dot(x, w1, input_precision=DOT_PRECISION)  # [t, r]
            delta = tl.dot(z.to(w2.dtype), w2, input_precision=DOT_PRECISION)  # [t, o]
            offs_o = tl.arange(0, BLOCK_OUT)
            out_ptrs = (
                out_ptr
                + head * stride_oh
                + offs_t[:, None] * stride_ot
                + offs_o[None, :] * stride_oo
            )
            out_mask = mask_t[:, None] & (offs_o < OUT)[None, :]
            _add_or_store(out_ptrs, delta, out_mask, ACCUMULATE)


@triton.jit
def _absorbed_item_weights(
    w1_ptr,
    w2_ptr,
    seg_indptr_ptr,
    seg_slot_ptr,
    slot_rank_ptr,
    seg,
    head,
    live,
    IN,
    OUT,
    stride_w1s,
    stride_w1h,
    stride_w1i,
    stride_w1r,
    stride_w2s,
    stride_w2h,
    stride_w2r,
    stride_w2o,
    BLOCK_R: tl.constexpr,
    BLOCK_IN: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
    W1_RANK_ALIGN: tl.constexpr,
    W2_RANK_ALIGN: tl.constexpr,
):
    """(w1 [i, r], w2 [r, o], rank, first token, end token) of item (seg, head): whole
    tiles, zeros past the slot's rank (all zeros without work, or when not `live`)."""
    slot, rank, t_start, t_end = load_segment(seg, seg_indptr_ptr, seg_slot_ptr, slot_rank_ptr)
    rank = tl.where(live, rank, 0)
    slot = tl.maximum(slot, 0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    offs_i = tl.arange(0, BLOCK_IN)
    offs_o = tl.arange(0, BLOCK_OUT)
    w1 = tl.load(
        w1_ptr
        + slot * stride_w1s
        + head * stride_w1h
        + offs_i[:, None] * stride_w1i
        + offs_r[None, :] * stride_w1r,
        mask=(offs_i < IN)[:, None] & (offs_r < rank_load_bound(rank, W1_RANK_ALIGN))[None, :],
        other=0.0,
    )  # [i, r]
    w1 = tl.where(mask_r[None, :], w1, 0.0)
    w2 = tl.load(
        w2_ptr
        + slot * stride_w2s
        + head * stride_w2h
        + offs_r[:, None] * stride_w2r
        + offs_o[None, :] * stride_w2o,
        mask=(offs_r < rank_load_bound(rank, W2_RANK_ALIGN))[:, None] & (offs_o < OUT)[None, :],
        other=0.0,
    )  # [r, o]
    w2 = tl.where(mask_r[:, None], w2, 0.0)
    return w1, w2, rank, t_start, t_end


# Rank rows `store_output_correction` takes at a time: [16, 512] of A is 64 values a thread
# at 4 warps, and a rank-64 pool walks four chunks rather than holding [64, 512].
OUTPUT_CORRECTION_RANK_CHUNK = 16


@dataclass(frozen=True)
class OutputCorrection:
    """kv_b's absorbed output correction for a kernel that holds whole o_lat rows (the
    attention's split merge) to write: o[t,h] = (o_lat[t,h] · A[slot]ᵀ) · B_v[slot,h]ᵀ,
    zeros for tokens without the adapter. The caller then adds o_lat · W_UVᵀ onto o."""

    o: Tensor  # [T, H, V], overwritten
    a: Tensor  # [slots, R, C] kv_b pool A
    b: Tensor  # [slots, H·(D+V), R] kv_b pool B
    segs: LoraSegments  # token_slot, and kv_b's own slot ranks (`LoraWeights.segments`)

    def check(self, o_lat_shape: torch.Size, dtype: torch.dtype) -> None:
        """Validate against the o_lat [T, H, C] the kernel will hold."""
        num_tokens, num_heads, v_dim = self.o.shape
        a, b, segs = self.a, self.b, self.segs
        head_rows = _check_kv_b(a, b, dtype, num_heads, o_lat_shape, segs, num_tokens)
        if head_rows <= v_dim or self.o.stride(-1) != 1:
            raise ValueError(f"o {tuple(self.o.shape)} does not fit kv_b's B {tuple(self.b.shape)}")

    def kernel_args(self) -> tuple[object, ...]:
        """Pointers, sizes and strides in `store_output_correction`'s order (after t, h)."""
        v_dim, pool_rank = self.o.shape[2], self.a.shape[1]
        head_rows = self.b.shape[1] // self.o.shape[1]
        b_v = self.b[:, head_rows - v_dim :]  # head h's v rows start at h · head_rows
        return (
            self.o, self.a, b_v, self.segs.token_slot, self.segs.slot_rank, v_dim,
            self.o.stride(0), self.o.stride(1), self.a.stride(0), self.a.stride(1),
            self.b.stride(0), head_rows * self.b.stride(1), self.b.stride(1),
            max(16, next_power_of_2(v_dim)), OUTPUT_CORRECTION_RANK_CHUNK,
            rank_alignment(pool_rank),
        )  # fmt: skip

    @staticmethod
    def unused_kernel_args(tensor: Tensor) -> tuple[object, ...]:
        """`kernel_args`' places filled for a launch without the correction (never read)."""
        return (tensor,) * 5 + (0,) * 8 + (16, OUTPUT_CORRECTION_RANK_CHUNK, 1)


@triton.jit
def store_output_correction(
    o_row, offs_c, mask_c, t, h,
    o_ptr, a_ptr, bv_ptr, token_slot_ptr, slot_rank_ptr, V,
    stride_ot, stride_oh, stride_as, stride_ar, stride_bs, stride_bh, stride_bv,
    BLOCK_V: tl.constexpr, RANK_CHUNK: tl.constexpr, B_RANK_ALIGN: tl.constexpr,
):  # fmt: skip
    """o[t, h, :V] = (o_row · A[slot]ᵀ) · B_v[slot, h]ᵀ, zeros when token t has no adapter.

    o_row [BLOCK_C] float32 is head h's whole o_lat row as it was stored (rounded to its
    dtype); A's columns are offs_c (contiguous). The rank walks RANK_CHUNK rows at a time:
    u = A_chunk · o_row in float32, rounded to the weights' dtype as the separate kernel's
    rank intermediate is, then o += B_v[:, chunk] · u. CUDA-core sums: per row a [≤16, C]
    and a [V, ≤16] product, too small for an MMA tile.
    """
    slot = tl.load(token_slot_ptr + t)
    rank = tl.where(slot >= 0, tl.load(slot_rank_ptr + tl.maximum(slot, 0)), 0)
    slot = tl.maximum(slot, 0).to(tl.int64)
    offs_v = tl.arange(0, BLOCK_V)
    mask_v = offs_v < V
    a_rows = a_ptr + slot * stride_as
    bv_rows = bv_ptr + slot * stride_bs + h * stride_bh + offs_v * stride_bv  # [v] row starts
    o = tl.zeros((BLOCK_V,), tl.float32)
    for r0 in range(0, rank, RANK_CHUNK):
        offs_r = r0 + tl.arange(0, RANK_CHUNK)
        mask_r = offs_r < rank
        a = tl.load(
            a_rows + offs_r[:, None] * stride_ar + offs_c[None, :],
            mask=mask_r[:, None] & mask_c[None, :],
            other=0.0,
        )  # [r, c]
        u = tl.sum(a.to(tl.float32) * o_row[None, :], axis=1)  # [r]
        u = u.to(a_ptr.dtype.element_ty).to(tl.float32)
        b = tl.load(
            bv_rows[:, None] + offs_r[None, :],
            mask=mask_v[:, None] & (offs_r < rank_load_bound(rank, B_RANK_ALIGN))[None, :],
            other=0.0,
        )  # [v, r]
        b = tl.where(mask_r[None, :], b.to(tl.float32), 0.0)
        o += tl.sum(b * u[None, :], axis=1)
    tl.store(
        o_ptr + t * stride_ot + h * stride_oh + offs_v,
        o.to(o_ptr.dtype.element_ty),
        mask=mask_v,
    )


def mla_kv_b_lora_q(
    q_nope: Tensor,
    q_lat: Tensor,
    A: Tensor,
    B: Tensor,
    segs: LoraSegments,
    *,
    variant: str = DEFAULT_MLA_VARIANT,
    accumulate: bool = True,
) -> Tensor:
    """Add kv_b LoRA's key part to the absorbed query, in place.

    Semantics: q_lat[t,h] += (q_nope[t,h] · B[slot, h*(D+V) : h*(D+V)+D, :rank]) · A[slot, :rank]
    (accumulate False: q_lat[t,h] = that correction, zeros for slot -1 tokens).

    Args:
        q_nope: [T, H, D] (may be a strided view of q), same dtype as A and B.
        q_lat: [T, H, C] absorbed query, written in place (any float dtype).
        A: [slots, R, C] kv_b pool A; B: [slots, H*(D+V), R] kv_b pool B.
        segs: segments of this batch; slot -1 tokens are left unchanged.
        variant: a key of MLA_VARIANTS (all compute the same correction).
    """
    num_tokens, num_heads, nope = q_nope.shape
    v_dim = _check_kv_b(A, B, q_nope.dtype, num_heads, q_lat.shape, segs, num_tokens) - nope
    if v_dim <= 0:
        raise ValueError(
            f"q_nope {tuple(q_nope.shape)} / q_lat {tuple(q_lat.shape)} do not fit A, B"
        )
    if num_tokens == 0:
        return q_lat
    head_rows = nope + v_dim
    # w1 = B's k part of head h as [D, R]; w2 = A as [R, C] (shared by all heads).
    _launch(
        q_nope,
        q_lat,
        (B, (B.stride(0), head_rows * B.stride(1), B.stride(1), B.stride(2))),
        (A, (A.stride(0), 0, A.stride(1), A.stride(2))),
        A.shape[1],
        segs,
        variant,
        accumulate,
    )
    return q_lat


def mla_kv_b_lora_o(
    o_lat: Tensor,
    o: Tensor,
    A: Tensor,
    B: Tensor,
    segs: LoraSegments,
    *,
    variant: str = DEFAULT_MLA_VARIANT,
) -> Tensor:
    """Add kv_b LoRA's value part to the absorbed attention output, in place.

    Semantics: o[t,h] += (o_lat[t,h] · A[slot, :rank]ᵀ) · B[slot, h*(D+V)+D : (h+1)*(D+V), :rank]ᵀ

    Args:
        o_lat: [T, H, C] attention output in latent space, same dtype as A and B.
        o: [T, H, V] per-head output (before o_proj), written in place (any float dtype).
        A: [slots, R, C] kv_b pool A; B: [slots, H*(D+V), R] kv_b pool B.
        segs: segments of this batch; slot -1 tokens are left unchanged.
        variant: a key of MLA_VARIANTS (all compute the same correction).
    """
    num_tokens, num_heads, v_dim = o.shape
    nope = _check_kv_b(A, B, o_lat.dtype, num_heads, o_lat.shape, segs, num_tokens) - v_dim
    if o_lat.shape[:2] != o.shape[:2] or nope <= 0:
        raise ValueError(f"o_lat {tuple(o_lat.shape)} / o {tuple(o.shape)} do not fit A, B")
    if num_tokens == 0:
        return o
    head_rows = nope + v_dim
    # w1 = Aᵀ as [C, R] (shared by all heads); w2 = B's v part of head h as [R, V].
    _launch(
        o_lat,
        o,
        (A, (A.stride(0), 0, A.stride(2), A.stride(1))),
        (B[:, nope:], (B.stride(0), head_rows * B.stride(1), B.stride(2), B.stride(1))),
        A.shape[1],
        segs,
        variant,
        accumulate=True,
    )
    return o


def mla_kv_b_lora_q_ref(
    q_nope: Tensor,
    q_lat: Tensor,
    A: Tensor,
    B: Tensor,
    segs: LoraSegments,
    *,
    accumulate: bool = True,
) -> Tensor:
    """Torch reference of `mla_kv_b_lora_q` (gather + einsum in A's dtype), in place."""
    if not accumulate:
        q_lat.zero_()
    num_tokens, num_heads, nope = q_nope.shape
    slot, keep, a = _gather_kv_b_A(A, segs, num_tokens)
    b = B[slot].unflatten(1, (num_heads, -1))[:, :, :nope]  # [T, H, D, R]
    b = torch.where(keep[:, None, None, :], b, 0)
    z = torch.einsum("thd,thdr->thr", q_nope.to(A.dtype), b)  # [T, H, R]
    q_lat += torch.einsum("thr,trc->thc", z, a).to(q_lat.dtype)
    return q_lat


def mla_kv_b_lora_o_ref(
    o_lat: Tensor, o: Tensor, A: Tensor, B: Tensor, segs: LoraSegments
) -> Tensor:
    """Torch reference of `mla_kv_b_lora_o` (gather + einsum in A's dtype), in place."""
    num_tokens, num_heads, v_dim = o.shape
    slot, keep, a = _gather_kv_b_A(A, segs, num_tokens)
    b = B[slot].unflatten(1, (num_heads, -1))[:, :, -v_dim:]  # [T, H, V, R]
    b = torch.where(keep[:, None, None, :], b, 0)
    z = torch.einsum("thc,trc->thr", o_lat.to(A.dtype), a)  # [T, H, R]
    o += torch.einsum("thr,thvr->thv", z, b).to(o.dtype)
    return o


def _gather_kv_b_A(A: Tensor, segs: LoraSegments, num_tokens: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per token: clamped slot [T], live rank columns [T, R], and A with dead rows zeroed."""
    token_slot = segs.token_slot[:num_tokens].long()  # [T]
    keep = live_rank_columns(segs.slot_rank, token_slot, A.shape[1])  # [T, R]
    slot = token_slot.clamp(min=0)
    a = torch.where(keep[:, :, None], A[slot], 0)  # [T, R, C]
    return slot, keep, a


def _launch(
    x: Tensor,
    out: Tensor,
    w1: tuple[Tensor, tuple[int, int, int, int]],
    w2: tuple[Tensor, tuple[int, int, int, int]],
    pool_rank: int,
    segs: LoraSegments,
    variant: str,
    accumulate: bool,
) -> None:
    """Run the absorbed kernel of `variant`; w1/w2 come with (slot, head, row, col) strides."""
    (w1_tensor, w1_strides), (w2_tensor, w2_strides) = w1, w2
    num_heads, in_dim, out_dim = x.shape[1], x.shape[2], out.shape[2]
    # One tile spans the whole pool rank: the rank-sized intermediate stays in registers.
    block_r = max(next_power_of_2(pool_rank), 16)
    whole_in, whole_out = (next_power_of_2(max(n, 16)) for n in (in_dim, out_dim))
    if variant == "prefetch" and max(whole_in, whole_out) * block_r > PREFETCH_MAX_TILE:
        variant = "planned"
    programs = segs.grid_segments() * num_heads
    args = (
        x, out, w1_tensor, w2_tensor, segs.seg_indptr, segs.seg_slot, segs.slot_rank,
    )  # fmt: skip
    dims = (num_heads, in_dim, out_dim, *x.stride(), *out.stride(), *w1_strides, *w2_strides)
    common = {
        "BLOCK_T": segs.max_seg_len,
        "BLOCK_R": block_r,
        # B's rows are rank-contiguous (w1 for the query side, w2 for the output side):
        # rounded loads there, the true rank for A's rows (rounding would read more rows).
        "W1_RANK_ALIGN": rank_alignment(pool_rank) if w1_strides[3] == 1 else 1,
        "W2_RANK_ALIGN": rank_alignment(pool_rank) if w2_strides[2] == 1 else 1,
        "ACCUMULATE": accumulate,
        "DOT_PRECISION": dot_precision(x.dtype),
    }
    programs_per_sm = MLA_VARIANTS[variant]
    if programs_per_sm is not None:
        programs = min(programs, programs_per_sm * num_sms(x.device))
    if variant == "prefetch":
        fast(_mla_absorbed_lora_prefetch_kernel)[(programs,)](
            *args, segs.num_segments, *dims, BLOCK_IN=whole_in, BLOCK_OUT=whole_out, **common,
            num_warps=4 if max(whole_in, whole_out) * block_r <= 8192 else 8,
        )  # fmt: skip
        return
    fast(_mla_absorbed_lora_kernel)[(programs,)](
        *args, segs.num_segments, *dims,
        BLOCK_IN=min(whole_in, 128), BLOCK_OUT=min(whole_out, 128),
        PLANNED=programs_per_sm is not None, **common,
    )  # fmt: skip


def _check_kv_b(
    A: Tensor,
    B: Tensor,
    dtype: torch.dtype,
    num_heads: int,
    lat_shape: torch.Size,
    segs: LoraSegments,
    num_tokens: int,
) -> int:
    """Validate the kv_b pool against the activations; returns B's rows per head (D + V)."""
    if A.dim() != 3 or B.dim() != 3 or A.dtype != dtype or B.dtype != dtype:
        raise ValueError(
            f"A, B must be 3-D {dtype}: {tuple(A.shape)} {A.dtype}, {tuple(B.shape)} {B.dtype}"
        )
    if A.shape[0] != B.shape[0] or A.shape[1] != B.shape[2] or B.shape[1] % num_heads:
        raise ValueError(
            f"A {tuple(A.shape)} and B {tuple(B.shape)} are not one kv_b pool of {num_heads} heads"
        )
    if A.stride(-1) != 1 or B.stride(-1) != 1:
        raise ValueError("A and B must be contiguous in their last dim")
    if tuple(lat_shape) != (num_tokens, num_heads, A.shape[2]):
        raise ValueError(f"latent {tuple(lat_shape)} != [{num_tokens}, {num_heads}, {A.shape[2]}]")
    segs.require_tokens(num_tokens)
    return B.shape[1] // num_heads
