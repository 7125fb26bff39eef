"""MLA `attn.kv_b` LoRA in the absorbed decode path, without materialising B·A.

The absorbed path never forms k_nope / v: it folds kv_b's weight into the query
(q_lat = q_nope·W_UK, per head) and into the output (o = o_lat·W_UVᵀ). kv_b's LoRA
ΔW = B·A (A `[slots, R, kv_lora_rank]`, B `[slots, H*(nope+v), R]` with head h's rows
h*(nope+v) + [0:nope] = k part, + [nope:nope+v] = v part) is folded the same way:

    q_lat[t,h,:] += (q_nope[t,h,:] · B_k[slot,h]) · A[slot]        (before attention)
    o[t,h,:]     += (o_lat[t,h,:] · A[slot]ᵀ) · B_v[slot,h]ᵀ        (after attention)

Each correction is one launch (they sit on either side of the attention kernel), one
program per (segment, head): the rank-sized intermediate stays in registers. Shapes:
T tokens, H heads, D = qk_nope_head_dim, V = v_head_dim, C = kv_lora_rank, R pool rank.
Prefill runs the unabsorbed path, where kv_b LoRA is plain SGMV.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.host_math import next_power_of_2
from kernels.launch import fast
from kernels.lora_segments import LoraSegments, live_rank_columns, load_segment
from kernels.pdl import grid_dependency_control
from kernels.sgmv import dot_precision, num_sms

# v1: one program per (segment, head); planned: at most this many programs per SM walk the
# live (segment, head) items (see kernels/sgmv.py SgmvVariant and docs/kernel_notes.md).
MLA_VARIANTS = {"v1": None, "planned": 16}
DEFAULT_MLA_VARIANT = "planned"


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
    DOT_PRECISION: tl.constexpr,
):
    """out[t,h,:] += (x[t,h,:] · w1[slot,h]) · w2[slot,h] for one (segment, head): both
    corrections are this shape, with A and B's k / v part in the w1 / w2 roles."""
    slot, rank, t_start, t_end = load_segment(seg, seg_indptr_ptr, seg_slot_ptr, slot_rank_ptr)
    if rank > 0:
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
                mask=mask_t[:, None] & mask_i[None, :],
                other=0.0,
            )  # [t, i]
            w = tl.load(
                w1 + offs_i[:, None] * stride_w1i + offs_r[None, :] * stride_w1r,
                mask=mask_i[:, None] & mask_r[None, :],
                other=0.0,
            )  # [i, r]
            z = tl.dot(x, w, z, input_precision=DOT_PRECISION)
        w2 = w2_ptr + slot.to(tl.int64) * stride_w2s + head * stride_w2h
        for o in range(0, OUT, BLOCK_OUT):
            offs_o = o + tl.arange(0, BLOCK_OUT)
            mask_o = offs_o < OUT
            w = tl.load(
                w2 + offs_r[:, None] * stride_w2r + offs_o[None, :] * stride_w2o,
                mask=mask_r[:, None] & mask_o[None, :],
                other=0.0,
            )  # [r, o]
            delta = tl.dot(z.to(w.dtype), w, input_precision=DOT_PRECISION)  # [t, o]
            out_ptrs = out_head + offs_t[:, None] * stride_ot + offs_o[None, :] * stride_oo
            out_mask = mask_t[:, None] & mask_o[None, :]
            prev = tl.load(out_ptrs, mask=out_mask, other=0.0)
            tl.store(out_ptrs, (prev.to(tl.float32) + delta).to(prev.dtype), mask=out_mask)


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
    PLANNED: tl.constexpr,
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
            DOT_PRECISION,
        )


def mla_kv_b_lora_q(
    q_nope: Tensor,
    q_lat: Tensor,
    A: Tensor,
    B: Tensor,
    segs: LoraSegments,
    *,
    variant: str = DEFAULT_MLA_VARIANT,
) -> Tensor:
    """Add kv_b LoRA's key part to the absorbed query, in place.

    Semantics: q_lat[t,h] += (q_nope[t,h] · B[slot, h*(D+V) : h*(D+V)+D, :rank]) · A[slot, :rank]

    Args:
        q_nope: [T, H, D] (may be a strided view of q), same dtype as A and B.
        q_lat: [T, H, C] absorbed query, written in place (any float dtype).
        A: [slots, R, C] kv_b pool A; B: [slots, H*(D+V), R] kv_b pool B.
        segs: segments of this batch; slot -1 tokens are left unchanged.
        variant: a key of MLA_VARIANTS (both compute the same correction).
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
        MLA_VARIANTS[variant],
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
        variant: a key of MLA_VARIANTS (both compute the same correction).
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
        MLA_VARIANTS[variant],
    )
    return o


def mla_kv_b_lora_q_ref(
    q_nope: Tensor, q_lat: Tensor, A: Tensor, B: Tensor, segs: LoraSegments
) -> Tensor:
    """Torch reference of `mla_kv_b_lora_q` (gather + einsum in A's dtype), in place."""
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
    programs_per_sm: int | None,
) -> None:
    """Run the absorbed kernel; w1/w2 come with (slot, head, row, col) strides;
    programs_per_sm None is v1's one program per (segment, head)."""
    (w1_tensor, w1_strides), (w2_tensor, w2_strides) = w1, w2
    num_heads = x.shape[1]
    programs = segs.grid_segments() * num_heads
    if programs_per_sm is not None:
        programs = min(programs, programs_per_sm * num_sms(x.device))
    fast(_mla_absorbed_lora_kernel)[(programs,)](
        x,
        out,
        w1_tensor,
        w2_tensor,
        segs.seg_indptr,
        segs.seg_slot,
        segs.slot_rank,
        segs.num_segments,
        num_heads,
        x.shape[2],
        out.shape[2],
        *x.stride(),
        *out.stride(),
        *w1_strides,
        *w2_strides,
        BLOCK_T=segs.max_seg_len,
        # One tile spans the whole pool rank: the rank-sized intermediate stays in registers.
        BLOCK_R=max(next_power_of_2(pool_rank), 16),
        BLOCK_IN=min(next_power_of_2(max(x.shape[2], 16)), 128),
        BLOCK_OUT=min(next_power_of_2(max(out.shape[2], 16)), 128),
        PLANNED=programs_per_sm is not None,
        DOT_PRECISION=dot_precision(x.dtype),
    )


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
